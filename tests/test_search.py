"""servesim search: the closed-form cheapest deployment, pruning, budgets, bad input, Ray = local."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml
from servesim.sim import presets
from servesim.sim.cli import main
from servesim.sim.scenario import load_scenario

HAS_RAY = importlib.util.find_spec("ray") is not None
OUT_TOKENS = 10  # fixed output length: a request holds a batch slot for exactly this many steps


def closed_form(tmp_path: Path) -> Path:
    """Constant 10 ms steps (25 ms with --set), fixed lengths, constant arrivals, chunked steps that
    carry prefills and decodes together: one replica serves max_num_seqs / (10 steps x step) req/s."""
    path = tmp_path / "cf.yaml"
    path.write_text(yaml.safe_dump({
        "name": "cf", "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "cost_model": {"type": "constant", "step_ms": 10},
        "scheduler": {"type": "chunked", "max_num_seqs": 4, "max_num_batched_tokens": 512},
        "workload": {"num_requests": 50, "arrival": {"process": "constant", "rate": 10.0},
                     "prompt_len": {"dist": "fixed", "value": 16},
                     "output_len": {"dist": "fixed", "value": OUT_TOKENS}},
    }))
    return path


ARGS = ["--target-rate", "90", "--slo", "p99_ttft_ms=500", "--seeds", "1", "--duration", "20",
        "--min-requests", "20", "--gpu-cost", "h100-sxm=3,l40s=1", "--quiet", "--no-plots"]
SPACE = ["--space", "hardware=h100-sxm,l40s", "--space", "scheduler.max_num_seqs=2,4,8",
         "--space", "cost_model.step_ms=10,25", "--space", "tensor_parallel=1,2"]


def expected_replicas(seqs: int, step_ms: float, target: float = 90.0) -> int:
    return math.ceil(target / (seqs / (OUT_TOKENS * step_ms / 1e3)))


def test_search_finds_the_closed_form_cheapest_deployment(tmp_path, capsys):
    out = tmp_path / "s"
    with_plots = [a for a in ARGS if a != "--no-plots"]
    assert main(["search", str(closed_form(tmp_path)), *with_plots, *SPACE, "--out", str(out)]) == 0
    assert (out / "pareto.png").stat().st_size > 10_000
    df = pd.read_parquet(out / "search.parquet")
    assert len(df) == 24
    best = df[df["status"] == "best"]
    assert len(best) == 1
    b = best.iloc[0]
    # 8 slots / (10 steps x 10 ms) = 80 req/s per replica -> 2 replicas of one $1 L40S
    assert (b["hardware"], b["scheduler.max_num_seqs"], b["cost_model.step_ms"], b["tensor_parallel"]) == \
        ("l40s", 8, 10, 1)
    assert b["replicas"] == 2 and b["cost_per_hour"] == pytest.approx(2.0)
    # every point the search sized exactly has the closed-form replica count
    exact = df[df["status"].isin(["best", "feasible"])]
    assert len(exact) >= 1
    for _, r in exact.iterrows():
        assert r["replicas"] == expected_replicas(r["scheduler.max_num_seqs"], r["cost_model.step_ms"]), r.to_dict()
    # pruning spared simulations: most points never ran their replica search
    assert (df["status"] == "pruned").sum() >= 12
    assert "cheapest: hardware=l40s" in capsys.readouterr().out
    winner = load_scenario(out / "winner.yaml")
    assert winner.cluster.num_replicas == 2 and winner.workload.arrival.rate == 90.0
    assert winner.hardware == "l40s" and winner.scheduler.max_num_seqs == 8


def test_without_pruning_pressure_every_point_gets_the_closed_form_count(tmp_path):
    out = tmp_path / "s"
    space = ["--space", "scheduler.max_num_seqs=2,4,8", "--space", "cost_model.step_ms=10,25"]
    assert main(["search", str(closed_form(tmp_path)), *ARGS, *space, "--out", str(out), "--wave", "6"]) == 0
    df = pd.read_parquet(out / "search.parquet")
    # one wave holds every point: each is searched until it is sized or cannot beat the best
    for _, r in df[df["status"].isin(["best", "feasible"])].iterrows():
        assert r["replicas"] == expected_replicas(r["scheduler.max_num_seqs"], r["cost_model.step_ms"])
    b = df[df["status"] == "best"].iloc[0]
    assert (b["scheduler.max_num_seqs"], b["cost_model.step_ms"], b["replicas"]) == (8, 10, 2)


def test_a_model_that_does_not_fit_is_an_infeasible_row_not_an_error(tmp_path):
    out = tmp_path / "s"
    args = [a for a in ARGS if a != "h100-sxm=3,l40s=1"]
    args[args.index("--gpu-cost") + 1] = "l40s=1"
    assert main(["search", str(closed_form(tmp_path)), *args, "--set", "model=llama-3.1-70b",
                 "--space", "hardware=l40s", "--space", "tensor_parallel=1,4", "--space", "scheduler.max_num_seqs=8",
                 "--out", str(out)]) == 0
    df = pd.read_parquet(out / "search.parquet").set_index("tensor_parallel")
    assert df.loc[1, "status"] == "infeasible" and "does not fit" in df.loc[1, "reason"]
    assert df.loc[4, "status"] == "best"


def test_budget_stops_early_and_marks_the_best_so_far(tmp_path, capsys):
    out = tmp_path / "s"
    rc = main(["search", str(closed_form(tmp_path)), *ARGS, *SPACE, "--out", str(out), "--budget-s", "0.001"])
    text = capsys.readouterr().out
    df = pd.read_parquet(out / "search.parquet")
    assert (df["status"] == "unfinished").any() and not (df["status"] == "best").any()
    assert rc == 1 or "BEST SO FAR" in text


def test_nothing_meets_the_slo_exits_1_with_the_closest_miss(tmp_path, capsys):
    args = [a if a != "p99_ttft_ms=500" else "p99_ttft_ms=1" for a in ARGS]
    rc = main(["search", str(closed_form(tmp_path)), *args, "--max-replicas", "4",
               "--space", "scheduler.max_num_seqs=4,8", "--out", str(tmp_path / "s")])
    out = capsys.readouterr().out
    assert rc == 1
    assert "no deployment meets the SLO" in out and "closest miss: point" in out


@pytest.mark.parametrize("extra,message", [
    (["--space", "hardware=h100-sxm,h100-sx"], "--space hardware: unknown hardware 'h100-sx'"),
    (["--space", "hardware=l40s,gone.yaml"], "--space hardware: hardware file 'gone.yaml': no such file"),
    (["--space", "tensor_parallel=1", "--gpu-cost", "b200=4"], "--gpu-cost: unknown hardware 'b200'"),
    (["--space", "tensor_parallel=1", "--gpu-cost", "h100-sxm=free"], "price of h100-sxm must be a number"),
    (["--space", "tensor_parallel=1", "--gpu-cost", "h100-sxm=-1"], "must be > 0"),
    (["--space", "scheduler.max_num_seq=4,8"], "search: none of the 2 points is a valid scenario"),
    ([], "search needs at least one --space"),
    (["--space", "cluster.num_replicas=2,3"], "--space cluster.num_replicas: search chooses the replica count"),
    (["--space", "workload.arrival.rate=1,2"], "--space workload.arrival.rate: search tests each point"),
    (["--space", "cluster.disagg.link.preset=nvlink,pcie"], "a disaggregated deployment is not searched"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, extra, message):
    rc = main(["search", str(closed_form(tmp_path)), "--target-rate", "10", "--slo", "p99_ttft_ms=500", "--quiet",
               *extra, "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_gpu_in_the_space_without_a_price_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    from dataclasses import replace

    monkeypatch.setitem(presets.HARDWARE, "l40s", replace(presets.HARDWARE["l40s"], price_per_gpu_hour=None))
    rc = main(["search", str(closed_form(tmp_path)), "--target-rate", "10", "--slo", "p99_ttft_ms=500", "--quiet",
               "--space", "hardware=h100-sxm,l40s", "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert rc == 2 and "no $/GPU-hour for l40s: give one with --gpu-cost l40s=PRICE" in err


def test_gpu_cost_reads_a_yaml_file(tmp_path):
    from servesim.sim.verbs.prices import parse_gpu_costs

    f = tmp_path / "prices.yaml"
    f.write_text("h100-sxm: 2.5\nl40s: 0.9\n")
    assert parse_gpu_costs([str(f), "a100-80g=1.5"]) == {"h100-sxm": 2.5, "l40s": 0.9, "a100-80g": 1.5}


@pytest.mark.skipif(not HAS_RAY, reason="ray is an optional extra (pip install -e '.[ray]')")
def test_a_local_ray_cluster_gives_the_identical_table(tmp_path):
    import ray

    path = closed_form(tmp_path)
    space = ["--space", "hardware=h100-sxm,l40s", "--space", "scheduler.max_num_seqs=4,8"]
    assert main(["search", str(path), *ARGS, *space, "--out", str(tmp_path / "local"), "--workers", "2"]) == 0
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        assert main(["search", str(path), *ARGS, *space, "--ray", "--out", str(tmp_path / "ray")]) == 0
    finally:
        ray.shutdown()
    local, on_ray = (pd.read_parquet(tmp_path / d / "search.parquet") for d in ("local", "ray"))
    pd.testing.assert_frame_equal(local, on_ray)


def test_budget_stopping_mid_search_prints_the_best_so_far(tmp_path, capsys, monkeypatch):
    from servesim.sim.verbs import search as search_mod

    class Clock:  # each reading is one second later: the budget ends after a fixed number of steps
        now = 0.0

        @classmethod
        def perf_counter(cls) -> float:
            cls.now += 1.0
            return cls.now

    monkeypatch.setattr(search_mod, "time", Clock)
    out = tmp_path / "s"
    rc = main(["search", str(closed_form(tmp_path)), *ARGS, *SPACE, "--wave", "24", "--budget-s", "1.5",
               "--out", str(out)])
    text = capsys.readouterr().out
    df = pd.read_parquet(out / "search.parquet")
    assert rc == 0 and "BEST SO FAR" in text
    best = df[df["status"] == "best-so-far"]
    assert len(best) == 1 and (df["status"] == "unfinished").any()
    # the best so far passed at its replica count, which is never below the exact answer
    assert best.iloc[0]["replicas"] >= expected_replicas(best.iloc[0]["scheduler.max_num_seqs"],
                                                         best.iloc[0]["cost_model.step_ms"])


def test_a_configuration_that_rejects_requests_is_infeasible_after_one_run(tmp_path):
    out = tmp_path / "s"
    assert main(["search", str(closed_form(tmp_path)), *ARGS, "--set", "scheduler.type=continuous",
                 "--space", "scheduler.max_num_batched_tokens=8,512", "--out", str(out)]) == 0
    df = pd.read_parquet(out / "search.parquet").set_index("scheduler.max_num_batched_tokens")
    assert df.loc[8, "status"] == "infeasible" and "rejected" in df.loc[8, "reason"] and df.loc[8, "sims"] == 1
    assert df.loc[512, "status"] == "best"


def test_a_disaggregated_scenario_is_refused_not_priced_as_one_gpu(tmp_path, capsys):
    # a prefill + decode deployment is not "one replica x replicas": it was priced as 1 GPU
    root = Path(__file__).resolve().parent.parent
    rc = main(["search", str(root / "scenarios" / "cluster" / "disagg.yaml"), "--target-rate", "5",
               "--slo", "p99_ttft_ms=500", "--space", "seed=0,1", "--quiet", "--no-plots", "--out", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "cluster.disagg: search prices one replica" in err[0]
    assert "servesim plan" in err[0] and not (tmp_path / "d" / "search.json").exists()


def test_the_space_takes_a_hardware_file_priced_at_its_own_price(tmp_path, monkeypatch, capsys):
    # a file based on l40s at half its price: the same closed form, so the file's GPU wins at $0.5 each
    monkeypatch.chdir(tmp_path)
    Path("cheap.yaml").write_text("base: l40s\nprice_per_gpu_hour: 0.5\n")
    out = tmp_path / "s"
    assert main(["search", str(closed_form(tmp_path)), *ARGS, "--space", "hardware=l40s,cheap.yaml",
                 "--space", "scheduler.max_num_seqs=8", "--out", str(out)]) == 0
    b = pd.read_parquet(out / "search.parquet").query("status == 'best'").iloc[0]
    assert b["hardware"] == str(tmp_path / "cheap.yaml") and b["replicas"] == 2
    assert b["cost_per_hour"] == pytest.approx(1.0)
    assert "cheapest: hardware=cheap.yaml" in capsys.readouterr().out
    assert load_scenario(out / "winner.yaml").hardware == str(tmp_path / "cheap.yaml")
