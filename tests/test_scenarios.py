"""The shipped scenarios: every YAML validates, runs small, conserves requests, and shows its point.

Each run is cut to a few hundred requests with the same ``--set``-style overrides a user would
type, so the whole file stays within a few seconds per scenario.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from servesim.sim.scenario import Scenario, load_scenario
from servesim.sim.simulate import RunResult, simulate

SCENARIOS_DIR = Path(__file__).resolve().parent.parent / "scenarios"
ALL_YAML = sorted(SCENARIOS_DIR.rglob("*.yaml")) + sorted(SCENARIOS_DIR.rglob("*.yml"))
HAS_TORCH = importlib.util.find_spec("torch") is not None
SMALL = ["workload.num_requests=200"]


def _is_live(path: Path) -> bool:
    return path.name.startswith("live-")


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(SCENARIOS_DIR)) for p in paths]


# live-* scenarios are for `servesim live` (torch); `servesim run` simulates them too, so where torch
# is installed they are validated and run like the rest.
SCENARIOS = [p for p in ALL_YAML if not _is_live(p) or HAS_TORCH]


def _run(name: str, *overrides: str) -> RunResult:
    sc = load_scenario(SCENARIOS_DIR / name, [*SMALL, *overrides])
    return simulate(sc, progress=False)


def _assert_conserved(result: RunResult, num_requests: int) -> None:
    """Every request finished with all its tokens or was rejected with a reason, and the summary agrees."""
    df, s = result.requests_df, result.summary
    assert len(df) == num_requests
    finished = df[df["state"] == "finished"]
    rejected = df[df["state"] == "rejected"]
    assert len(finished) + len(rejected) == num_requests
    assert s["completed"] == len(finished)
    assert s["rejected"] == len(rejected)
    assert (finished["num_output_tokens"] == finished["output_len"]).all()
    assert s["total_output_tokens"] == int(finished["output_len"].sum())
    assert all(isinstance(r, str) and r for r in rejected["reject_reason"])
    assert np.isfinite(finished["finish_time"]).all()


EXAMPLES = ["static.yaml", "continuous.yaml", "chunked.yaml", "kv-pressure.yaml", "bursty-gamma.yaml",
            "multi-replica.yaml", "orca-varied-outputs.yaml", "sarathi-long-prompts.yaml"]


def test_scenarios_folder_holds_the_shipped_examples():
    names = {p.name for p in ALL_YAML}
    assert {"quickstart.yaml", *EXAMPLES} <= names


@pytest.mark.parametrize("path", SCENARIOS, ids=_ids(SCENARIOS))
def test_scenario_validates(path: Path):
    sc = load_scenario(path)
    assert isinstance(sc, Scenario)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_starts_with_a_comment_saying_how_to_run_it(name: str):
    lines = (SCENARIOS_DIR / name).read_text().splitlines()
    assert lines and lines[0].startswith("#"), f"{name}: start with a comment saying what it shows"
    comment = "\n".join(line for line in lines if line.startswith("#"))
    assert f"servesim run scenarios/{name}" in comment, f"{name}: the header should show the command that runs it"


@pytest.mark.parametrize("path", SCENARIOS, ids=_ids(SCENARIOS))
def test_scenario_runs_small_and_conserves_requests(path: Path):
    sc = load_scenario(path, SMALL)
    result = simulate(sc, progress=False)
    _assert_conserved(result, len(result.requests))
    assert result.summary["completed"] > 0


def test_scheduler_comparison_scenarios_share_their_traffic():
    loaded = [load_scenario(SCENARIOS_DIR / f"{n}.yaml") for n in ("static", "continuous", "chunked")]
    assert [sc.scheduler.type for sc in loaded] == ["static", "continuous", "chunked"]
    first = loaded[0]
    for sc in loaded[1:]:
        assert sc.workload == first.workload
        assert (sc.seed, sc.model, sc.hardware, sc.tensor_parallel) == (
            first.seed, first.model, first.hardware, first.tensor_parallel)
        assert sc.kv_cache == first.kv_cache
        assert sc.slo == first.slo


def test_bursty_gamma_has_chunked_traffic_with_cv_3():
    bursty = load_scenario(SCENARIOS_DIR / "bursty-gamma.yaml")
    chunked = load_scenario(SCENARIOS_DIR / "chunked.yaml")
    assert bursty.workload.arrival.process == "gamma"
    assert bursty.workload.arrival.shape == pytest.approx(1 / 9)
    assert bursty.workload.arrival.rate == chunked.workload.arrival.rate
    assert bursty.workload.prompt_len == chunked.workload.prompt_len
    assert bursty.workload.output_len == chunked.workload.output_len


def test_multi_replica_spreads_requests_over_four_replicas():
    result = _run("multi-replica.yaml")
    assert result.scenario.cluster.num_replicas == 4
    assert result.scenario.cluster.router == "least_outstanding"
    assert set(result.requests_df["replica"]) == {0, 1, 2, 3}
    _assert_conserved(result, 200)


@pytest.mark.parametrize("mode", ["recompute", "soft_reset", "swap"])
def test_kv_pressure_preempts_and_still_finishes_every_request(mode: str):
    result = _run("kv-pressure.yaml", f"scheduler.preemption_mode={mode}")
    assert result.scenario.scheduler.preemption_mode == mode
    assert result.summary["num_preemptions"] > 0
    assert (result.iterations_df["num_preempted"] > 0).any()
    assert result.summary["completed"] == 200
    assert result.summary["rejected"] == 0
    _assert_conserved(result, 200)


def test_kv_pressure_swap_moves_blocks_to_host():
    result = _run("kv-pressure.yaml", "scheduler.preemption_mode=swap")
    assert (result.iterations_df["num_swapped"] > 0).any()


def test_orca_continuous_beats_static_on_p99_e2e():
    cont = _run("orca-varied-outputs.yaml")
    static = _run("orca-varied-outputs.yaml", "scheduler.type=static")
    # static holds a batch until its longest member is done, so later arrivals queue behind it
    assert cont.summary["p99_e2el_ms"] < 0.7 * static.summary["p99_e2el_ms"]
    assert cont.summary["request_goodput"] > static.summary["request_goodput"]


def test_sarathi_chunked_prefill_cuts_p99_itl_and_tpot():
    def pair(*overrides: str) -> tuple[RunResult, RunResult]:
        chunked = _run("sarathi-long-prompts.yaml", "workload.num_requests=400", *overrides)
        cont = _run("sarathi-long-prompts.yaml", "workload.num_requests=400", "scheduler.type=continuous",
                    "scheduler.max_num_batched_tokens=8192", *overrides)
        assert chunked.summary["rejected"] == cont.summary["rejected"] == 0
        return chunked, cont

    # a whole long prefill stalls every decode under continuous batching; a 512-token budget caps it
    chunked, cont = pair()
    assert chunked.summary["p99_itl_ms"] < 0.5 * cont.summary["p99_itl_ms"]
    # On the scenario's A100 vLLM runs FlashAttention 2, whose varlen kernel runs every decode row of
    # a chunk step as one thread block per query head (sim/varlen_attention.py): the many 512-token
    # chunk steps give back the TPOT that chunking saves. Where FA3 runs (H100) chunking cuts both.
    chunked, cont = pair("hardware=h100-sxm")
    assert chunked.summary["p99_itl_ms"] < 0.5 * cont.summary["p99_itl_ms"]
    assert chunked.summary["p99_tpot_ms"] < cont.summary["p99_tpot_ms"]
