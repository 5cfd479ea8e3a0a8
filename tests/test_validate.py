"""servesim validate: thresholds, the error table, and a small live-vs-sim run end to end."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml
from servesim.calibration.validate import (
    METRICS,
    error_table,
    failures,
    format_table,
    parse_max_error,
    relative_error_pct,
    sim_scenario,
)
from servesim.sim.cli import main
from servesim.sim.cost_model import FEATURE_NAMES, save_profile, to_profile_dict
from servesim.sim.scenario import ScenarioError, load_scenario, scenario_from_dict
from servesim.sim.simulate import KVPlan, plan_kv


# ---- thresholds (fast) ----------------------------------------------------------------------------
def test_a_family_sets_its_p50_and_p90_and_a_full_key_wins_over_it_in_any_order():
    t = parse_max_error(["p90_tpot_ms=1,tpot=3", "e2e=5%", "p99_ttft_ms=8"])
    assert t == {"median_tpot_ms": 3.0, "p90_tpot_ms": 1.0, "p99_ttft_ms": 8.0, "median_e2el_ms": 5.0,
                 "p90_e2el_ms": 5.0}
    assert "mean_tpot_ms" not in t and "p99_tpot_ms" not in t


def test_p50_and_e2e_spellings_map_to_the_summary_keys():
    assert parse_max_error(["p50_ttft_ms=2, p90_e2e_ms=4,request_throughput=1.5"]) == {
        "median_ttft_ms": 2.0, "p90_e2el_ms": 4.0, "request_throughput": 1.5}
    assert parse_max_error([]) == {}
    assert parse_max_error(["itl=1e3,p99_itl_ms=.5%"]) == {"median_itl_ms": 1000.0, "p90_itl_ms": 1000.0,
                                                          "p99_itl_ms": 0.5}


@pytest.mark.parametrize("item, message", [
    ("tpot:3", "expected KEY=PCT"),
    ("tpot=", "expected KEY=PCT"),
    ("tpot=-3", "expected KEY=PCT"),
    ("tpot=abc", "expected KEY=PCT"),
    ("tpot=nan", "a finite number"),
    ("tpot=inf", "a finite number"),
    ("p90_tpot=3", "did you mean 'p90_tpot_ms'"),
    ("goodput=3", "unknown metric 'goodput'"),
])
def test_bad_thresholds_are_one_line_errors(item, message):
    with pytest.raises(ScenarioError, match=message) as e:
        parse_max_error([item])
    assert "\n" not in str(e.value)


# ---- the error table (fast) -------------------------------------------------------------------------
def synthetic_summary(scale: float) -> dict[str, float]:
    return {k: (i + 1) * 10.0 * scale for i, k in enumerate(METRICS)}


def test_error_table_has_every_metric_with_signed_relative_errors():
    live, sim = synthetic_summary(1.0), synthetic_summary(1.1)
    sim["p99_itl_ms"] = live["p99_itl_ms"] * 0.5
    table = error_table(live, sim, parse_max_error(["tpot=5,p99_itl_ms=60"]))
    assert table["metric"].tolist() == list(METRICS)
    by = table.set_index("metric")
    assert by.loc["mean_ttft_ms", "error_pct"] == pytest.approx(10.0)
    assert by.loc["p99_itl_ms", "error_pct"] == pytest.approx(-50.0)
    assert by.loc["request_throughput", "unit"] == "req/s"
    assert by.loc["median_tpot_ms", "status"] == "FAIL" and by.loc["p90_tpot_ms", "status"] == "FAIL"
    assert by.loc["p99_itl_ms", "status"] == "ok"  # |-50| <= 60: the sign does not matter
    assert by.loc["mean_tpot_ms", "status"] == ""  # no threshold
    assert [f.split(":")[0] for f in failures(table)] == ["median_tpot_ms", "p90_tpot_ms"]
    text = format_table(table)
    lines = text.splitlines()
    assert len(lines) == 1 + len(METRICS) and all(m in text for m in METRICS)
    assert len({line.index("error %") if i == 0 else None for i, line in enumerate(lines)} - {None}) == 1
    assert "+10.00" in text and "-50.00" in text


def test_an_undefined_error_fails_its_threshold_and_zero_live_is_undefined():
    assert math.isnan(relative_error_pct(0.0, 5.0))
    assert math.isnan(relative_error_pct(math.nan, 5.0))
    assert relative_error_pct(4.0, 5.0) == pytest.approx(25.0)
    live, sim = synthetic_summary(1.0), synthetic_summary(1.0)
    live["p90_itl_ms"] = math.nan
    by = error_table(live, sim, {"p90_itl_ms": 1000.0, "p90_ttft_ms": 0.0}).set_index("metric")
    assert by.loc["p90_itl_ms", "status"] == "FAIL"
    assert by.loc["p90_ttft_ms", "status"] == "ok"  # exactly equal passes a zero threshold


# ---- the simulated side's KV cache (fast) ----------------------------------------------------------
def tiny_raw(n: int = 12, cost_model: dict | None = None, dtype: str = "float32") -> dict:
    return {
        "name": "validate-test",
        "seed": 5,
        "model": "tiny",
        "hardware": "cpu-2core",
        "cost_model": cost_model or {"type": "roofline"},
        "scheduler": {"type": "chunked", "max_num_seqs": 8, "max_num_batched_tokens": 128},
        "kv_cache": {"block_size": 8, "swap_space_gb": 0.002},
        "live": {"threads": 2, "warmup_steps": 0, "kv_cache_memory_mb": 4, "dtype": dtype},
        "workload": {
            "num_requests": n,
            "arrival": {"process": "constant", "rate": 200.0},
            "prompt_len": {"dist": "uniform", "min": 9, "max": 40},
            "output_len": {"dist": "uniform", "min": 12, "max": 30},
        },
    }


@pytest.mark.parametrize("host_blocks", [0, 1, 7, 1638, 123_457])
@pytest.mark.parametrize("block_size", [8, 16])
def test_the_simulated_kv_plan_has_exactly_the_live_block_counts(host_blocks, block_size):
    sc = scenario_from_dict(tiny_raw())
    live_kv = KVPlan(num_blocks=321, block_size=block_size, block_bytes=12345, num_host_blocks=host_blocks,
                     source="kv_cache_memory_mb")
    planned = plan_kv(sim_scenario(sc, None, live_kv))
    assert (planned.num_blocks, planned.num_host_blocks, planned.block_size) == (321, host_blocks, block_size)


def test_profile_replaces_the_cost_model_only_on_the_simulated_side():
    sc = scenario_from_dict(tiny_raw())
    sim = sim_scenario(sc, "p.json")
    assert (sim.cost_model.type, sim.cost_model.path) == ("profile", "p.json")
    assert sc.cost_model.type == "roofline"
    assert sim_scenario(sc, None).cost_model == sc.cost_model


def test_bad_threshold_syntax_exits_2_before_running_anything(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(tiny_raw()))
    out = tmp_path / "out"
    assert main(["validate", str(path), "--out", str(out), "--max-error", "tpot~3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("servesim validate: error: --max-error 'tpot~3'")
    assert not out.exists()


def test_a_missing_profile_exits_2_before_the_live_run(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(tiny_raw()))
    assert main(["validate", str(path), "--out", str(tmp_path / "o"), "--profile", str(tmp_path / "no.json")]) == 2
    assert "not found" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# ---- live end to end (torch; a couple of seconds of live run each) ---------------------------------
@pytest.fixture(scope="module")
def slow_constant_run(tmp_path_factory):
    """A constant cost model of 20 s a step: the tiny model's steps take milliseconds on a CPU (and
    well under a second on a heavily shared one), so TPOT and TTFT errors are far beyond 100 %."""
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("validate")
    path = tmp / "s.yaml"
    path.write_text(yaml.safe_dump(tiny_raw(cost_model={"type": "constant", "step_ms": 20000.0})))
    out = tmp / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["validate", str(path), "--out", str(out), "--quiet", "--max-error", "tpot=100,p99_ttft_ms=100"])
    return rc, err.getvalue(), out, path


def test_a_cost_model_far_too_slow_fails_its_thresholds_naming_each_metric(slow_constant_run):
    rc, err, out, _ = slow_constant_run
    assert rc == 1
    failed = [line.split("FAIL ")[1].split(":")[0] for line in err.splitlines() if "FAIL" in line]
    assert failed == ["p99_ttft_ms", "median_tpot_ms", "p90_tpot_ms"]  # table order
    doc = json.loads((out / "validation.json").read_text())
    assert doc["passed"] is False and len(doc["failed"]) == 3
    by = {r["metric"]: r for r in doc["metrics"]}
    assert by["median_tpot_ms"]["error_pct"] > 100 and by["median_tpot_ms"]["sim"] == pytest.approx(20000.0)


def test_both_sides_saw_identical_arrivals_lengths_and_kv_blocks(slow_constant_run):
    _, _, out, path = slow_constant_run
    live, sim = pd.read_parquet(out / "live" / "requests.parquet"), pd.read_parquet(out / "sim" / "requests.parquet")
    cols = ["request_id", "arrival_time", "prompt_len", "output_len"]
    assert len(live) == 12 and live[cols].equals(sim[cols])
    assert (live["state"] == "finished").all() and (sim["state"] == "finished").all()
    # the simulation started from clean requests: every request generated exactly its output_len again
    assert (sim["num_output_tokens"] == sim["output_len"]).all()
    ls, ss = (json.loads((out / side / "summary.json").read_text()) for side in ("live", "sim"))
    assert ls["mode"] == "live" and ss["mode"] == "sim" and ss["cost_model"] == "constant"
    doc = json.loads((out / "validation.json").read_text())
    assert ls["kv_num_blocks"] == ss["kv_num_blocks"] == doc["provenance"]["kv_num_blocks"]
    assert ls["kv_blocks_from"] == "kv_cache_memory_mb" and ss["kv_blocks_from"] == "num_blocks"
    # the simulated scenario, as written, plans the live run's device and host blocks
    sim_kv = plan_kv(load_scenario(out / "sim" / "scenario.yaml"))
    assert (sim_kv.num_blocks, sim_kv.num_host_blocks) == (doc["provenance"]["kv_num_blocks"],
                                                           doc["provenance"]["kv_num_host_blocks"])
    assert sim_kv.num_host_blocks > 0
    p = doc["provenance"]
    assert (p["scenario"], p["seed"], p["num_requests"], p["scenario_file"]) == ("validate-test", 5, 12, str(path))
    assert p["live_wall_s"] > 0 and p["date"] and p["profile"] is None


def test_the_run_folder_holds_tables_plots_and_both_runs(slow_constant_run):
    _, _, out, _ = slow_constant_run
    for name in ("validation.json", "validation.csv", "validation.md", "cdf_ttft.png", "cdf_tpot.png", "cdf_itl.png",
                 "cdf_e2e.png", "live/summary.json", "sim/summary.json", "live/requests.parquet",
                 "sim/iterations.parquet"):
        assert (out / name).is_file(), name
    csv = pd.read_csv(out / "validation.csv")
    assert csv["metric"].tolist() == list(METRICS)
    assert csv["error_pct"].notna().all()
    md = (out / "validation.md").read_text()
    assert all(f"| {m} |" in md for m in METRICS) and "**failed**" in md


def test_a_generous_threshold_passes_and_the_profile_drives_the_simulation(tmp_path, capsys):
    pytest.importorskip("torch")
    # ~2 ms a step plus 0.05 ms a token: the tiny model's order of magnitude, not a fit
    coefs = {r: [5e-5, 0.0, 0.0, 0.0, 0.0, 0.0, 2e-3] + [0.0] * (len(FEATURE_NAMES) - 7)
             for r in ("decode", "prefill", "mixed")}
    profile = save_profile(tmp_path / "tiny.json", to_profile_dict(coefs, provenance={"model": "tiny"}))
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(tiny_raw()))
    out = tmp_path / "run"
    rc = main(["validate", str(path), "--out", str(out), "--quiet", "--no-plots", "--profile", str(profile),
               "--max-error", "ttft=1e6,tpot=1e6,itl=1e6,e2e=1e6"])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    assert all(m in stdout for m in METRICS) and "[1/2] live" in stdout and "[2/2] sim" in stdout
    ss = json.loads((out / "sim" / "summary.json").read_text())
    assert ss["cost_model"] == "profile"
    doc = json.loads((out / "validation.json").read_text())
    assert doc["passed"] is True and doc["provenance"]["profile"] == str(profile)
    assert not (out / "cdf_ttft.png").exists()
    # the step check re-predicts every live step from its own shape: here 2 ms + 0.05 ms per token
    it = pd.read_parquet(out / "live" / "iterations.parquet")
    check = doc["step_check"]["all"]
    assert check["steps"] == len(it)
    assert check["predicted_s"] == pytest.approx(float((2e-3 + 5e-5 * it["num_tokens"]).sum()), rel=1e-9)
    assert check["measured_s"] == pytest.approx(float(it["duration"].sum()), rel=1e-9)
    # ... split into the executor's own seconds and the engine loop around it (this profile has no loop term)
    fwd, loop = doc["step_check"]["forward"], doc["step_check"]["engine_loop"]
    assert fwd["steps"] == loop["steps"] == len(it)
    assert fwd["measured_s"] + loop["measured_s"] == pytest.approx(check["measured_s"], rel=1e-9)
    assert 0 < loop["measured_s"] < fwd["measured_s"]
    assert fwd["predicted_s"] == pytest.approx(check["predicted_s"], rel=1e-9) and loop["predicted_s"] == 0
    assert "step check" in stdout
    # the live steps' executor time and its host part, one per step: on a CPU the forward runs as it
    # is launched, so the host part is all but the greedy tokens' copy (<= the executor's time)
    assert it["forward_s"].sum() == pytest.approx(fwd["measured_s"], rel=1e-9)
    assert ((it["host_s"] > 0) & (it["host_s"] <= it["forward_s"])).all()
    share = doc["host_share"]
    assert share["steps"] == len(it) and 0.5 < share["total"] <= 1.0
    assert "live executor, host part" in stdout and "live executor, host part" in (out / "validation.md").read_text()


def test_host_share_reads_the_live_columns_and_says_when_they_are_missing():
    from types import SimpleNamespace

    from servesim.calibration.validate import format_host_share, host_share

    it = pd.DataFrame({"forward_s": [0.02, 0.04, 0.0], "host_s": [0.019, 0.01, 0.0]})
    share = host_share(SimpleNamespace(iterations_df=it))
    assert share["total"] == pytest.approx(0.029 / 0.06) and share["steps"] == 2  # a 0 s step has no ratio
    assert share["median_step"] == pytest.approx((0.95 + 0.25) / 2)
    assert "48 % of its time, median step 60 %" in format_host_share(share)
    assert host_share(SimpleNamespace(iterations_df=it.drop(columns="host_s"))) is None  # a simulated run
    assert format_host_share(None).endswith("not recorded")
    assert "graphs" not in format_host_share(share)
    graphed = host_share(SimpleNamespace(iterations_df=it.assign(graphed=[True, False, True])))
    assert graphed["graphed_steps"] == 2 and "; 2 of 3 steps ran a CUDA-graph path" in format_host_share(graphed)


def test_median_summary_and_spread_are_the_median_and_range_over_runs():
    from servesim.calibration.validate import median_summary, spread_pct

    runs = [{"median_tpot_ms": 10.0, "p90_tpot_ms": 20.0}, {"median_tpot_ms": 14.0, "p90_tpot_ms": None},
            {"median_tpot_ms": 11.0, "p90_tpot_ms": 22.0}]
    med = median_summary(runs)
    assert med["median_tpot_ms"] == 11.0 and med["p90_tpot_ms"] == 21.0 and math.isnan(med["p99_tpot_ms"])
    assert spread_pct([10.0, 14.0, 11.0]) == pytest.approx(100 * 4 / 11)
    assert math.isnan(spread_pct([5.0])) and math.isnan(spread_pct([0.0, 0.0]))


def test_repeated_live_runs_report_their_median_and_spread(tmp_path, capsys):
    pytest.importorskip("torch")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(tiny_raw()))
    out = tmp_path / "run"
    assert main(["validate", str(path), "--out", str(out), "--quiet", "--no-plots", "--repeats", "2"]) == 0
    stdout = capsys.readouterr().out
    assert "run 2 of 2" in stdout and "live spread %" in stdout
    doc = json.loads((out / "validation.json").read_text())
    assert doc["provenance"]["live_repeats"] == 2
    runs = [json.loads((out / d / "summary.json").read_text()) for d in ("live", "live-2")]
    by = {r["metric"]: r for r in doc["metrics"]}
    for m in ("median_tpot_ms", "p90_e2el_ms"):
        a, b = runs[0][m], runs[1][m]
        assert by[m]["live"] == pytest.approx((a + b) / 2)  # the median of two runs
        assert by[m]["live_spread_pct"] == pytest.approx(100 * abs(a - b) / ((a + b) / 2))
    assert len(doc["step_check"]["all"]["bias_pct_by_run"]) == 2
    assert main(["validate", str(path), "--out", str(tmp_path / "bad"), "--quiet", "--repeats", "0"]) == 2


def test_a_profile_calibrated_with_the_other_graph_setting_is_named_before_the_live_run():
    from servesim.calibration.validate import graphs_mismatch
    from servesim.sim.cost_model import load_profile

    graphed = load_profile(Path(__file__).resolve().parents[1] / "calibration/profiles/h200-llama-3.1-8b-triton-graphs.json")
    eager = load_profile(Path(__file__).resolve().parents[1] / "calibration/profiles/h200-llama-3.1-8b-triton.json")
    assert graphs_mismatch(graphed, True) is None and graphs_mismatch(eager, False) is None
    assert "calibrated with cuda_graphs on" in graphs_mismatch(graphed, False)
    assert "live.cuda_graphs is true" in graphs_mismatch(eager, True)
    assert "live.piecewise_graphs is true: its prefill and mixed steps" in graphs_mismatch(graphed, True, True)
    assert graphs_mismatch(object(), True) is None  # the roofline: nothing to compare
