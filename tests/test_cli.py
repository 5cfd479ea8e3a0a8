"""``servesim run``: the run folder, determinism, and one-line errors (exit 2) for what a user gets wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from servesim.sim.cli import main

REPO = Path(__file__).resolve().parent.parent
CHUNKED = str(REPO / "scenarios" / "chunked.yaml")
TINY = ["--set", "workload.num_requests=40"]

SCENARIO = """\
name: cli-test
model: llama-3.1-8b
hardware: h100-sxm
scheduler: {type: chunked, max_num_batched_tokens: 2048}
workload:
  num_requests: 40
  arrival: {process: poisson, rate: 8.0}
  prompt_len: {dist: lognormal, mean: 500, std: 300, min: 16, max: 2048}
  output_len: {dist: uniform, min: 4, max: 64}
"""


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["run", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_line_error(code: int, err: str, *mentions: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {err!r}"
    for m in mentions:
        assert m in lines[0], f"{m!r} not named in: {lines[0]!r}"


@pytest.fixture
def scenario_file(tmp_path: Path) -> Path:
    p = tmp_path / "cli-test.yaml"
    p.write_text(SCENARIO)
    return p


# ---- the run folder ------------------------------------------------------------------------------
def test_run_writes_tables_summary_plots_and_resolved_scenario(capsys, tmp_path: Path):
    out = tmp_path / "run"
    code, stdout, err = _run(capsys, CHUNKED, *TINY, "--quiet", "--out", str(out))
    assert code == 0, err
    for name in ("requests.parquet", "iterations.parquet", "summary.json", "latency_cdf.png", "timeline.png",
                 "scenario.yaml"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 40
    assert len(pd.read_parquet(out / "requests.parquet")) == 40
    assert "TTFT" in stdout and str(out) in stdout
    assert "Traceback" not in err


def test_same_seed_gives_byte_identical_summary(capsys, tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        code, _, err = _run(capsys, CHUNKED, *TINY, "--quiet", "--no-plots", "--out", str(out))
        assert code == 0, err
    assert (a / "summary.json").read_bytes() == (b / "summary.json").read_bytes()


def test_different_seed_gives_different_arrivals(capsys, tmp_path: Path):
    a, b = tmp_path / "seed0", tmp_path / "seed1"
    assert _run(capsys, CHUNKED, *TINY, "--quiet", "--no-plots", "--out", str(a))[0] == 0
    assert _run(capsys, CHUNKED, *TINY, "--set", "seed=1", "--quiet", "--no-plots", "--out", str(b))[0] == 0
    ta = pd.read_parquet(a / "requests.parquet")["arrival_time"].to_numpy()
    tb = pd.read_parquet(b / "requests.parquet")["arrival_time"].to_numpy()
    assert len(ta) == len(tb) == 40
    assert (ta != tb).any()
    assert json.loads((b / "summary.json").read_text())["seed"] == 1


# ---- errors a user can make: exit 2, one line, no traceback -------------------------------------
def test_misspelled_section_is_one_line_error(capsys, scenario_file: Path, tmp_path: Path):
    bad = tmp_path / "typo.yaml"
    bad.write_text(scenario_file.read_text().replace("scheduler:", "schedular:"))
    code, _, err = _run(capsys, str(bad), "--quiet", "--no-plots", "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "schedular", "scheduler")


def test_misspelled_override_field_is_one_line_error(capsys, scenario_file: Path, tmp_path: Path):
    code, _, err = _run(capsys, str(scenario_file), "--set", "scheduler.max_num_seq=4", "--quiet", "--no-plots",
                        "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "max_num_seq", "max_num_seqs")


def test_negative_rate_is_one_line_error(capsys, scenario_file: Path, tmp_path: Path):
    code, _, err = _run(capsys, str(scenario_file), "--set", "workload.arrival.rate=-2", "--quiet", "--no-plots",
                        "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "rate", "-2")


def test_missing_trace_file_is_one_line_error(capsys, tmp_path: Path):
    bad = tmp_path / "trace.yaml"
    bad.write_text("name: t\nworkload:\n  trace: {format: csv, path: no-such-trace.csv}\n")
    code, _, err = _run(capsys, str(bad), "--quiet", "--no-plots", "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "no-such-trace.csv")


def test_missing_scenario_file_is_one_line_error(capsys, tmp_path: Path):
    code, _, err = _run(capsys, str(tmp_path / "nope.yaml"), "--quiet")
    _assert_one_line_error(code, err, "nope.yaml")


def test_unknown_model_preset_is_one_line_error(capsys, scenario_file: Path, tmp_path: Path):
    code, _, err = _run(capsys, str(scenario_file), "--set", "model=llama-9b", "--quiet", "--no-plots",
                        "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "llama-9b", "llama-3.1-8b")


@pytest.mark.parametrize("item", ["scheduler.max_num_seqs", "=4"])
def test_bad_set_syntax_is_one_line_error(capsys, scenario_file: Path, tmp_path: Path, item: str):
    code, _, err = _run(capsys, str(scenario_file), "--set", item, "--quiet", "--no-plots",
                        "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "--set", item)


@pytest.mark.parametrize("value, problem", [("[1", "not valid YAML"), ("!!python/object:os.system", "constructor")])
def test_set_value_that_is_not_safe_yaml_is_one_line_error(capsys, scenario_file: Path, tmp_path: Path,
                                                           value: str, problem: str):
    code, _, err = _run(capsys, str(scenario_file), "--set", f"seed={value}", "--quiet", "--no-plots",
                        "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "--set", value, problem)


@pytest.mark.parametrize("value", ["-1", "true", "1.5"])
def test_seed_that_is_not_a_non_negative_integer_is_one_line_error(capsys, scenario_file: Path, tmp_path: Path,
                                                                   value: str):
    code, _, err = _run(capsys, str(scenario_file), "--set", f"seed={value}", "--quiet", "--no-plots",
                        "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "seed")


def test_grid_value_that_is_not_yaml_is_one_line_error(capsys, scenario_file: Path, tmp_path: Path):
    code = main(["sweep", str(scenario_file), "--grid", "seed=1,[2", "--quiet", "--no-plots",
                 "--out", str(tmp_path / "o")])
    _assert_one_line_error(code, capsys.readouterr().err, "--grid seed", "[2", "not valid YAML")


@pytest.mark.parametrize("data", [b"\xff\xfe\x00\x01binary", "name: x\n".encode("utf-16")])
def test_scenario_file_that_is_not_utf8_text_is_one_line_error(capsys, tmp_path: Path, data: bytes):
    p = tmp_path / "odd.yaml"
    p.write_bytes(data)
    code, _, err = _run(capsys, str(p), "--quiet", "--no-plots", "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, str(p), "not UTF-8")


def test_out_naming_an_existing_file_is_one_line_error(capsys, scenario_file: Path, tmp_path: Path):
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    code, _, err = _run(capsys, str(scenario_file), "--quiet", "--no-plots", "--out", str(taken))
    _assert_one_line_error(code, err, "--out", str(taken), "not a folder")
    assert taken.read_text() == "keep me"


def test_every_slo_key_the_schema_accepts_runs_or_is_a_one_line_error(capsys, scenario_file: Path,
                                                                     tmp_path: Path):
    # the schema accepts slo.itl_ms; it must either count in goodput or be refused up front, not crash
    code, _, err = _run(capsys, str(scenario_file), "--set", "slo.itl_ms=100", "--quiet", "--no-plots",
                        "--out", str(tmp_path / "o"))
    if code != 0:
        _assert_one_line_error(code, err, "itl_ms")


def test_an_unknown_slo_key_names_the_accepted_ones_and_where_itl_targets_go(capsys, scenario_file: Path,
                                                                            tmp_path: Path):
    code, _, err = _run(capsys, str(scenario_file), "--set", "slo.itl_ms=100", "--quiet", "--no-plots",
                        "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "itl_ms", "ttft_ms, tpot_ms and e2el_ms", "p99_itl_ms")
    code, _, err = _run(capsys, str(scenario_file), "--set", "slo.ttft=100", "--quiet", "--no-plots",
                        "--out", str(tmp_path / "o"))
    _assert_one_line_error(code, err, "'ttft'", "did you mean 'ttft_ms'")


def test_prompt_longer_than_kv_cache_is_rejected_with_one_warning_line(capsys, scenario_file: Path,
                                                                      tmp_path: Path):
    out = tmp_path / "o"
    # 32 blocks x 16 = 512 tokens: prompts of up to 2048 tokens cannot all fit
    code, stdout, err = _run(capsys, str(scenario_file), "--set", "kv_cache.num_blocks=32", "--quiet",
                             "--no-plots", "--out", str(out))
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    n = summary["rejected"]
    assert 0 < n < 40
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one warning line, got: {err!r}"
    assert lines[0].startswith(f"warning: {n} requests rejected: request ")
    assert "kv_cache.num_blocks" in lines[0]
    assert f"{n} rejected" in stdout


def test_no_warning_when_nothing_is_rejected(capsys, scenario_file: Path, tmp_path: Path):
    code, _, err = _run(capsys, str(scenario_file), "--quiet", "--no-plots", "--out", str(tmp_path / "o"))
    assert code == 0
    assert err.strip() == ""


def test_installed_command_prints_one_line_and_no_traceback(scenario_file: Path, tmp_path: Path):
    bad = tmp_path / "typo.yaml"
    bad.write_text(scenario_file.read_text().replace("scheduler:", "schedular:"))
    proc = subprocess.run(
        [sys.executable, "-m", "servesim.sim.cli", "run", str(bad), "--quiet", "--no-plots",
         "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "schedular" in proc.stderr
    assert not (tmp_path / "o").exists()
