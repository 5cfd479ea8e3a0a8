"""``servesim compare``: paired runs on the same workloads, bootstrap CIs, and the CI exit status."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from servesim.sim.cli import main
from servesim.sim.scenario import ScenarioError, scenario_from_dict
from servesim.sim.verbs.compare import compare, paired_change, parse_fail_on

BASE = {
    "name": "base",
    "seed": 0,
    "model": "tiny",
    "hardware": "cpu-2core",
    "cost_model": {"type": "constant", "step_ms": 10.0, "per_token_ms": 0.01},
    "scheduler": {"type": "chunked", "max_num_seqs": 32, "max_num_batched_tokens": 2048},
    "kv_cache": {"num_blocks": 4000, "block_size": 16},
    "workload": {
        "num_requests": 60,
        "arrival": {"process": "poisson", "rate": 10.0},
        "prompt_len": {"dist": "uniform", "min": 64, "max": 512},
        "output_len": {"dist": "uniform", "min": 4, "max": 32},
    },
    "slo": {"ttft_ms": 100, "tpot_ms": 20},
}


def write(tmp_path: Path, name: str, **scheduler) -> Path:
    d = dict(BASE, name=name, scheduler={**BASE["scheduler"], **scheduler})
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def run_compare(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["compare", *argv, "--seeds", "6", "--workers", "1", "--quiet"])
    c = capsys.readouterr()
    return code, c.out, c.err


def test_a_far_too_small_token_budget_is_a_significant_regression_and_exits_1(capsys, tmp_path: Path):
    base, worse = write(tmp_path, "base"), write(tmp_path, "worse", max_num_batched_tokens=48)
    out = tmp_path / "cmp"
    code, stdout, err = run_compare(capsys, str(base), str(worse), "--fail-on", "p99_ttft_ms=+10%",
                                    "--fail-on", "request_goodput=-5%", "--out", str(out))
    assert code == 1, stdout + err
    assert "REGRESSION" in stdout and "p99_ttft_ms" in stdout
    rows = pd.read_csv(out / "compare.csv").set_index("metric")
    ttft = rows.loc["p99_ttft_ms"]
    assert ttft["flagged"] and ttft["ci_low_pct"] > 10 and ttft["change_pct"] > ttft["ci_low_pct"]
    assert rows.loc["request_goodput", "flagged"]
    summary = json.loads((out / "compare.json").read_text())
    assert summary["regression"] is True and summary["seeds"] == [0, 1, 2, 3, 4, 5]
    assert len(pd.read_csv(out / "compare_seeds.csv")) == 12


def test_a_candidate_identical_to_the_baseline_is_not_flagged_and_exits_0(capsys, tmp_path: Path):
    base, same = write(tmp_path, "base"), write(tmp_path, "same")
    out = tmp_path / "cmp"
    code, stdout, err = run_compare(capsys, str(base), str(same), "--fail-on", "p99_ttft_ms=+0%",
                                    "--fail-on", "p99_tpot_ms=+5%", "--out", str(out))
    assert code == 0, stdout + err
    assert "no significant regression" in stdout
    rows = pd.read_csv(out / "compare.csv")
    assert (rows["change_pct"] == 0).all() and (rows["ci_low_pct"] == 0).all() and (rows["ci_high_pct"] == 0).all()
    assert not rows["flagged"].any()


def test_an_improvement_is_not_a_regression(capsys, tmp_path: Path):
    # the far-too-small budget as the baseline: the sensible budget is better, so nothing is flagged
    worse, base = write(tmp_path, "worse", max_num_batched_tokens=48), write(tmp_path, "base")
    code, stdout, _ = run_compare(capsys, str(worse), str(base), "--fail-on", "p99_ttft_ms=+10%",
                                  "--out", str(tmp_path / "cmp"))
    assert code == 0 and "no significant regression" in stdout


def test_both_sides_run_the_baselines_workload_even_if_the_candidate_names_another():
    base = scenario_from_dict(BASE)
    other = scenario_from_dict(dict(BASE, workload={**BASE["workload"], "num_requests": 7}))
    res = compare(base, other, seeds=2, workers=1, progress=False)
    assert (res.per_seed["completed"] == 60).all()
    assert any("workload" in n for n in res.notes)


def test_paired_bootstrap_is_deterministic_and_covers_a_known_shift():
    rng = np.random.default_rng(1)
    b = rng.normal(100, 10, 12)
    c = b * 1.2 + rng.normal(0, 1, 12)  # a 20 % slowdown, paired by seed
    first, second = paired_change(b, c), paired_change(b, c)
    assert first == second
    change, lo, hi, method = first
    assert method == "BCa" and lo < 20 < hi and lo > 15 and hi < 25
    assert change == pytest.approx(100 * (c.mean() - b.mean()) / b.mean())


def test_noise_without_a_shift_gives_an_interval_around_zero():
    rng = np.random.default_rng(2)
    b = rng.normal(100, 10, 10)
    _, lo, hi, _ = paired_change(b, b + rng.normal(0, 3, 10))
    assert lo < 0 < hi


@pytest.mark.parametrize("item, mentions", [("p99_tpot_ms=5%", "METRIC=+X%"), ("p99_tpot=+5%", "did you mean"),
                                            ("p99_tpot_ms=+5", "METRIC=+X%")])
def test_bad_fail_on_rules_are_one_line_errors(item: str, mentions: str):
    with pytest.raises(ScenarioError, match=mentions.replace("+", r"\+")):
        parse_fail_on([item], ["p99_tpot_ms", "p99_ttft_ms"])


def test_bad_fail_on_through_the_cli_is_exit_2(capsys, tmp_path: Path):
    base = write(tmp_path, "base")
    code, _, err = run_compare(capsys, str(base), str(base), "--fail-on", "p99_tpot_ms=5%")
    assert code == 2 and len(err.strip().splitlines()) == 1
