"""``--iterations full|binned|off``: the iterations table shrinks, the summary does not change."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from servesim.sim.cli import main
from servesim.sim.iteration_bins import IterationBins
from servesim.sim.scenario import load_scenario
from servesim.sim.simulate import simulate

SCENARIOS_DIR = Path(__file__).resolve().parent.parent / "scenarios"


def same_summary(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])) for k in a
    )


@pytest.fixture(scope="module", params=["kv-pressure.yaml", "multi-replica.yaml"])
def runs(request):
    sc = load_scenario(SCENARIOS_DIR / request.param, ["workload.num_requests=300"])
    return {mode: simulate(sc, progress=False, iterations=mode) for mode in ("full", "binned", "off")}


def test_summary_and_requests_are_the_same_in_every_mode(runs):
    full = runs["full"]
    for mode in ("binned", "off"):
        assert same_summary(full.summary, runs[mode].summary), mode
        pd.testing.assert_frame_equal(full.requests_df, runs[mode].requests_df, check_exact=True)


def test_binned_rows_add_up_to_the_steps(runs):
    full, binned = runs["full"].iterations_df, runs["binned"].iterations_df
    assert len(binned) < len(full)
    assert binned["num_steps"].sum() == len(full)
    assert binned["num_preempted"].sum() == full["num_preempted"].sum()
    assert binned["busy_s"].sum() == pytest.approx(full["duration"].sum(), rel=1e-12)
    # a bin's level is the mean of its steps: weighted back, it gives the run's mean
    mean_batch = (binned["batch_size"] * binned["num_steps"]).sum() / binned["num_steps"].sum()
    assert mean_batch == pytest.approx(full["batch_size"].mean(), rel=1e-12)
    assert set(binned["replica"]) == set(full["replica"])


def test_off_keeps_no_rows(runs):
    assert len(runs["off"].iterations_df) == 0
    assert runs["off"].summary["num_iterations"] == len(runs["full"].iterations_df) > 0


def test_bins_widen_instead_of_growing():
    bins = IterationBins(num_replicas=1)
    for i in range(100_000):  # a step every 50 ms for 5000 s
        bins.add(0, (i * 0.05, 1, 0.05, 8, 0, 8, 8, 10, 100, 0, 8, 0, 0, 0, 0.0))
    frame = bins.frame()
    assert len(frame) <= 2048 and frame["num_steps"].sum() == 100_000
    assert bins.width >= 5000 / 2048
    assert frame["start"].is_monotonic_increasing
    assert np.allclose(frame["batch_size"], 8.0)
    assert bins.summary() == {"max_kv_usage": 0.1, "mean_batch_size": 8.0, "num_iterations": 100_000}


def test_cli_writes_a_binned_table_and_plots_it(tmp_path: Path):
    out = tmp_path / "run"
    rc = main(["run", str(SCENARIOS_DIR / "chunked.yaml"), "--set", "workload.num_requests=100", "--out", str(out),
               "--iterations", "binned", "--quiet"])
    assert rc == 0
    it = pd.read_parquet(out / "iterations.parquet")
    assert "num_steps" in it and it["num_steps"].sum() > len(it)
    assert (out / "timeline.png").stat().st_size > 0


def test_auto_keeps_every_step_for_a_small_run_and_bins_a_large_one(tmp_path, capsys, monkeypatch):
    from servesim.sim import simulate as simulate_module

    path = SCENARIOS_DIR / "quickstart.yaml"
    assert main(["run", str(path), "--set", "workload.num_requests=150", "--out", str(tmp_path / "small"),
                 "--no-plots", "--quiet"]) == 0
    assert "num_steps" not in pd.read_parquet(tmp_path / "small" / "iterations.parquet").columns
    assert "time bins" not in capsys.readouterr().err
    # a run at the threshold bins by default and says so; --iterations full still keeps every step
    monkeypatch.setattr(simulate_module, "AUTO_BINNED_REQUESTS", 150)
    assert main(["run", str(path), "--set", "workload.num_requests=150", "--out", str(tmp_path / "large"),
                 "--no-plots", "--quiet"]) == 0
    binned = pd.read_parquet(tmp_path / "large" / "iterations.parquet")
    assert binned["num_steps"].sum() > 150
    err = capsys.readouterr().err
    assert "iterations.parquet holds time bins (150 requests" in err and "--iterations full" in err
    assert main(["run", str(path), "--set", "workload.num_requests=150", "--out", str(tmp_path / "full"),
                 "--no-plots", "--quiet", "--iterations", "full"]) == 0
    assert len(pd.read_parquet(tmp_path / "full" / "iterations.parquet")) == binned["num_steps"].sum()
    assert "time bins" not in capsys.readouterr().err


def test_auto_keeps_every_step_for_a_disaggregated_cluster(monkeypatch):
    from servesim.sim import simulate as simulate_module

    monkeypatch.setattr(simulate_module, "AUTO_BINNED_REQUESTS", 1)
    sc = load_scenario(SCENARIOS_DIR / "cluster" / "disagg.yaml", ["workload.num_requests=60"])
    assert simulate_module.auto_iterations(sc, 10**6) == "full"
    assert simulate(sc, progress=False, iterations="auto").iterations == "full"


@pytest.mark.parametrize("name, fast_forward", [("kv-pressure.yaml", True), ("multi-replica.yaml", True),
                                                ("multi-replica.yaml", False)])
def test_auto_bins_a_long_run_from_its_step_limit_on(monkeypatch, name, fast_forward):
    """A run of few requests but many steps: ``auto`` keeps rows until AUTO_BINNED_STEPS (the switch
    comes when the row buffer would grow, here at 4,096 steps), then puts them into bins and bins
    the rest; the summary and requests are those of a full run, the bins those of a binned one."""
    from servesim.sim import simulate as simulate_module

    monkeypatch.setattr(simulate_module, "AUTO_BINNED_STEPS", 1)
    sc = load_scenario(SCENARIOS_DIR / name, ["workload.num_requests=300"])
    full = simulate(sc, progress=False, iterations="full", fast_forward=fast_forward)
    binned = simulate(sc, progress=False, iterations="binned", fast_forward=fast_forward)
    auto = simulate(sc, progress=False, iterations="auto", fast_forward=fast_forward)
    assert len(full.iterations_df) > 4096 and full.iterations == "full"
    assert auto.iterations == "binned"
    assert same_summary(full.summary, auto.summary)
    pd.testing.assert_frame_equal(full.requests_df, auto.requests_df, check_exact=True)
    got, want = auto.iterations_df, binned.iterations_df
    assert got["num_steps"].sum() == len(full.iterations_df)
    pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-9)


def test_auto_keeps_rows_below_the_step_limit(monkeypatch):
    from servesim.sim import simulate as simulate_module

    monkeypatch.setattr(simulate_module, "AUTO_BINNED_STEPS", 10**9)
    sc = load_scenario(SCENARIOS_DIR / "kv-pressure.yaml", ["workload.num_requests=300"])
    auto = simulate(sc, progress=False, iterations="auto")
    assert auto.iterations == "full" and "num_steps" not in auto.iterations_df


def test_cli_says_why_a_short_run_was_binned(tmp_path, capsys, monkeypatch):
    from servesim.sim import simulate as simulate_module

    monkeypatch.setattr(simulate_module, "AUTO_BINNED_STEPS", 1)
    out = tmp_path / "run"
    assert main(["run", str(SCENARIOS_DIR / "quickstart.yaml"), "--set", "workload.num_requests=300", "--out",
                 str(out), "--no-plots", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "iterations.parquet holds time bins (" in err and " steps, --iterations auto bins from step 1)" in err
    assert pd.read_parquet(out / "iterations.parquet")["num_steps"].sum() > 4096
