"""Results that could mislead say so: rejected requests next to throughput (run, sweep, compare),
compare's header names the overrides, and a calibration too noisy to use is flagged."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from servesim.sim.cli import build_parser, main
from servesim.sim.metrics import format_summary_table
from test_sweep import RAW

# continuous batching does not chunk prompts: with a 256-token budget, prompts up to 400 tokens are rejected
REJECTING = ["--set", "scheduler.type=continuous", "--set", "scheduler.max_num_batched_tokens=256"]


@pytest.fixture()
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(RAW))
    return path


def test_run_headlines_rejected_requests_next_to_throughput():
    line = next(x for x in format_summary_table({"completed": 1816, "rejected": 184, "request_throughput": 7.13})
                .splitlines() if x.startswith("throughput:"))
    assert line.startswith("throughput: 7.13 req/s (REJECTED 184 of 2000 requests),")
    clean = format_summary_table({"completed": 2000, "rejected": 0, "request_throughput": 7.85})
    assert "REJECTED" not in clean


def test_sweep_shows_a_rejected_column_and_flags_the_points_that_rejected(scenario, tmp_path, capsys):
    code = main(["sweep", str(scenario), "--grid", "scheduler.max_num_batched_tokens=256,1024", "--set",
                 "scheduler.type=continuous", "--workers", "1", "--quiet", "--no-plots", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    head = out[1].split()
    assert head[head.index("req/s") + 1] == "rejected"
    rejecting, admitting = out[3].split(), out[4].split()
    assert rejecting[head.index("rejected")].endswith("!") and int(rejecting[head.index("rejected")][:-1]) > 0
    assert admitting[head.index("rejected")] == "0"
    assert out[5].startswith("! rejected requests at point 0 (") and "count only the requests they admitted" in out[5]


def test_compare_names_its_overrides_and_rejected_requests_and_help_has_one_percent(scenario, tmp_path, capsys):
    code = main(["compare", str(scenario), str(scenario), "--seeds", "2", "--workers", "1", "--quiet",
                 "--set", "workload.num_requests=30", "--candidate-set", "scheduler.type=continuous",
                 "--candidate-set", "scheduler.max_num_batched_tokens=256", "--out", str(tmp_path / "c")])
    out = capsys.readouterr().out.splitlines()
    assert code in (0, 1)
    assert out[1] == ("overrides: both --set workload.num_requests=30; candidate --candidate-set "
                      "scheduler.type=continuous, scheduler.max_num_batched_tokens=256")
    assert any(x.startswith("REJECTED requests, mean per seed: baseline 0.0, candidate ") for x in out)
    sub = build_parser()._subparsers._group_actions[0].choices["compare"]
    assert "95% bootstrap CI" in sub.format_help() and "%%" not in sub.format_help()


def test_a_calibration_with_held_out_error_above_25_percent_is_flagged_unusable():
    pytest.importorskip("torch")
    from servesim.calibration.commands import unusable_fit_warning

    def profile(median: float) -> dict:
        return {"held_out_error": {"prefill": {"median_ape": 0.03}, "decode": {"median_ape": median}}}

    assert unusable_fit_warning(profile(0.05)) is None
    warning = unusable_fit_warning(profile(0.6))
    assert warning.startswith("warning: held-out median error above 25 % (decode 60 %): this fit is unusable")
