"""``servesim plan``: the capacity search against cases whose capacity is known in closed form.

With a constant-time cost model, constant arrivals and constant lengths, the saturation rate is
exact. Chunked scheduling with ``max_num_seqs = B`` slots and a step of ``s`` seconds whatever its
tokens: a request holds a slot for exactly ``O`` steps (the step that prefills its prompt and
samples token 1, then O - 1 decodes), so one replica completes at most ``B / (O * s)`` requests/s;
below that rate arrivals find a free slot within one step, above it the queue grows without bound.
With one slot and a per-token cost ``c``, a request takes ``(s + c * P) + (O - 1) * (s + c)``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from servesim.sim.cli import main
from servesim.sim.scenario import scenario_from_dict
from servesim.sim.verbs.plan import PlanSettings, at_rate, plan
from servesim.sim.verbs.slo import parse_slo
from servesim.sim.workload import generate_requests

TOL = 0.05


def closed_form(slots: int, step_ms: float, per_token_ms: float, prompt: int, output: int, **over) -> dict:
    d = {
        "name": "closed-form",
        "model": "tiny",
        "hardware": "cpu-2core",
        "cost_model": {"type": "constant", "step_ms": step_ms, "per_token_ms": per_token_ms},
        "scheduler": {"type": "chunked", "max_num_seqs": slots, "max_num_batched_tokens": 4096},
        "kv_cache": {"num_blocks": 100000, "block_size": 16},
        "workload": {"num_requests": 100, "arrival": {"process": "constant", "rate": 1.0},
                     "prompt_len": prompt, "output_len": output},
    }  # fmt: skip
    d.update(over)
    return d


CASES = {
    # B / (O * s) = 2 / (4 * 0.5 s) = 1 request/s
    "two-slots-constant-step": (closed_form(2, 500.0, 0.0, 64, 4), 2 / (4 * 0.500)),
    # 1 / ((0.2 + 0.005 * 200) + 3 * (0.2 + 0.005)) = 1 / 1.815 s
    "one-slot-per-token-cost": (closed_form(1, 200.0, 5.0, 200, 4), 1 / ((0.200 + 0.005 * 200) + 3 * 0.205)),
}
# Steps of hundreds of ms keep each run to a few hundred iterations; a step is still well under
# the 2 s stability bound, so a rate below saturation never queues past it.


@pytest.mark.parametrize("case", list(CASES))
def test_plan_finds_the_exact_saturation_rate_within_its_tolerance(case: str):
    raw, exact = CASES[case]
    # TPOT never binds here (it is one step): only the stability term can stop the search, so
    # this checks that an overload is caught by the queue, not hidden by a lax latency SLO.
    st = PlanSettings(parse_slo("p99_tpot_ms=10000"), seeds=1, tolerance=TOL, min_requests=20)
    res = plan(scenario_from_dict(raw), st, workers=1, progress=False)
    lo, hi = res.bracket
    assert hi / lo <= 1 + TOL
    assert abs(res.capacity / exact - 1) <= TOL, (res.capacity, exact, res.bracket)
    # and every evaluated rate's verdict is the truth: pass below saturation, fail well above it
    for p in res.points:
        if p.rate <= exact:
            assert p.passed, p.rate
        elif p.rate >= exact * (1 + TOL / 2):
            assert not p.passed, p.rate


def test_replicas_for_a_target_rate_follow_the_round_robin_split():
    raw, exact = CASES["two-slots-constant-step"]
    st = PlanSettings(parse_slo("p99_tpot_ms=10000"), seeds=1, tolerance=TOL, min_requests=20)
    res = plan(scenario_from_dict(raw), st, target_rate=3.4, workers=1, progress=False)
    # round robin splits constant arrivals evenly: 3.4 / 4 = 0.85 < 1 < 3.4 / 3 = 1.13
    assert res.replicas == math.ceil(3.4 / exact) == 4
    verdicts = {p.replicas: p.passed for p in res.replica_points}
    assert verdicts == {3: False, 4: True}


def test_a_stricter_ttft_slo_lowers_the_capacity_below_saturation():
    raw, exact = CASES["two-slots-constant-step"]
    raw = dict(raw, workload={**raw["workload"], "arrival": {"process": "poisson", "rate": 1.0}})
    sc = scenario_from_dict(raw)
    lax = plan(sc, PlanSettings(parse_slo("p99_tpot_ms=10000"), seeds=2, min_requests=50), workers=1,
               progress=False)
    strict = plan(sc, PlanSettings(parse_slo("p90_ttft_ms=1500"), seeds=2, min_requests=50), workers=1,
                  progress=False)
    assert 0 < strict.capacity < lax.capacity <= exact * (1 + TOL)


def test_no_rate_passes_when_one_request_alone_misses_the_slo():
    raw, _ = CASES["two-slots-constant-step"]
    st = PlanSettings(parse_slo("p50_tpot_ms=50"), seeds=1, min_requests=10, window_s=20.0)
    res = plan(scenario_from_dict(raw), st, workers=1, progress=False)
    assert res.capacity == 0.0 and res.bracket[0] == 0.0
    assert not any(p.passed for p in res.points)


def test_the_stability_term_is_added_unless_the_slo_bounds_queueing_delay():
    assert [str(t) for t in PlanSettings(parse_slo("p99_ttft_ms=500")).terms] == [
        "p99_ttft_ms=500", "p50_queueing_delay_ms=2000"]  # fmt: skip
    own = PlanSettings(parse_slo("p90_queueing_delay_ms=1000"), tolerance=0.1)
    assert [str(t) for t in own.terms] == ["p90_queueing_delay_ms=1000"]
    # window = 2 D / (q * tolerance): the overload it can miss is at most tolerance / 2
    assert own.base_window_s == pytest.approx(2 * 1.0 / (0.9 * 0.1))
    assert own.window_at(0.01) == pytest.approx(own.min_requests / 0.01)


def test_rates_share_seeds_so_a_faster_rate_is_the_same_traffic_compressed():
    raw, _ = CASES["two-slots-constant-step"]
    raw = dict(raw, workload={**raw["workload"], "arrival": {"process": "poisson", "rate": 1.0},
                              "prompt_len": {"dist": "uniform", "min": 8, "max": 64}})  # fmt: skip
    sc = scenario_from_dict(raw)
    slow = generate_requests(at_rate(sc, 2.0, 100.0, seed=3).workload, 3)
    fast = generate_requests(at_rate(sc, 4.0, 50.0, seed=3).workload, 3)
    assert len(slow) == len(fast) > 100
    for a, b in zip(slow, fast, strict=True):
        assert a.arrival_time == pytest.approx(2 * b.arrival_time)
        assert a.prompt_len == b.prompt_len


def test_plan_cli_prints_the_table_and_writes_csv_json_and_plot(capsys, tmp_path: Path):
    import yaml

    raw, exact = CASES["two-slots-constant-step"]
    path = tmp_path / "cf.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "plan"
    code = main(["plan", str(path), "--slo", "p99_tpot_ms=10000", "--seeds", "1", "--min-requests", "20",
                 "--target-rate", "1.8", "--workers", "1", "--quiet", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "capacity:" in captured.out and "replicas for 1.8 req/s: 2" in captured.out
    answer = json.loads((out / "plan.json").read_text())
    assert abs(answer["capacity_rps"] / exact - 1) <= TOL and answer["replicas"] == 2
    table = pd.read_csv(out / "plan.csv")
    assert set(table["stage"]) == {"capacity", "replicas"}
    assert table.loc[table["stage"] == "capacity", "passed"].any()
    assert (out / "latency_vs_rate.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "argv, mentions",
    [
        (["--slo", "p99_ttf_ms=5"], "did you mean 'ttft'"),
        (["--tolerance", "2"], "--tolerance"),
        (["--set", "workload.arrival={process: trace, path: t.csv, column: t}"], "workload.arrival"),
    ],
)
def test_plan_usage_errors_are_one_line(capsys, tmp_path: Path, argv: list[str], mentions: str):
    import yaml

    raw, _ = CASES["two-slots-constant-step"]
    path = tmp_path / "cf.yaml"
    path.write_text(yaml.safe_dump(dict(raw, slo={"tpot_ms": 500})))
    (tmp_path / "t.csv").write_text("t\n0\n1\n")
    code = main(["plan", str(path), "--quiet", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and mentions in err, err


@pytest.mark.slow
def test_sarathi_scenario_capacity_orders_chunked_over_continuous_over_static():
    # The shipped scenario with its strict p99 TBT SLO (see its header), at a coarse tolerance
    # and one seed; `servesim plan` at the defaults gives the README's table.
    from servesim.sim.scenario import load_scenario

    path = Path(__file__).resolve().parent.parent / "scenarios" / "sarathi-long-prompts.yaml"
    st = dict(seeds=1, tolerance=0.2)
    cap = {}
    for kind, budget in (("static", 8192), ("continuous", 8192), ("chunked", 512)):
        sc = load_scenario(path, [f"scheduler.type={kind}", f"scheduler.max_num_batched_tokens={budget}"])
        cap[kind] = plan(sc, PlanSettings(parse_slo("p99_itl_ms=100"), **st), workers=1, progress=False).capacity
    assert cap["chunked"] > 1.5 * cap["continuous"] > 1.5 * 1.5 * cap["static"] > 0, cap
