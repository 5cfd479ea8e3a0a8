"""The engine's fast-forward over plain decode steps is the plain loop, step for step.

Each run is simulated twice, with ``fast_forward`` off (every step through schedule / update)
and on, and the two must agree: identical requests and iterations tables (every latency, every
step's start, duration and KV blocks) and summary. The one allowed difference: with several
replicas the ITL histogram receives the same values in another order, so its mean and std may
differ in the last bits (checked to 1e-12 relative).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import simpy
from servesim.sim.engine import Replica, _exact_delay, _hops
from servesim.sim.request import Request
from servesim.sim.scenario import load_scenario, scenario_from_dict
from servesim.sim.simulate import build_scheduler, plan_kv, run_replicas, simulate

SCENARIOS_DIR = Path(__file__).resolve().parent.parent / "scenarios"
SHIPPED = sorted(SCENARIOS_DIR.rglob("*.yaml"))
ORDER_ONLY = {"mean_itl_ms", "std_itl_ms"}  # sums over the same values, added in another order


def assert_same_run(plain, fast, replicas: int = 1) -> None:
    pd.testing.assert_frame_equal(plain.requests_df, fast.requests_df, check_exact=True)
    pd.testing.assert_frame_equal(plain.iterations_df, fast.iterations_df, check_exact=True)
    assert plain.summary.keys() == fast.summary.keys()
    for key, a in plain.summary.items():
        b = fast.summary[key]
        if isinstance(a, float) and math.isnan(a):
            assert isinstance(b, float) and math.isnan(b), key
        elif replicas > 1 and key in ORDER_ONLY:
            assert b == pytest.approx(a, rel=1e-12), key
        else:
            assert a == b, key
    ha, hb = plain.itl_hist, fast.itl_hist
    assert np.array_equal(ha.counts, hb.counts) and (ha.count, ha.min, ha.max) == (hb.count, hb.min, hb.max)


def both(sc, requests=None):
    plain = simulate(sc, requests=requests, progress=False, fast_forward=False)
    fast = simulate(sc, requests=requests, progress=False, fast_forward=True)
    return plain, fast


def fast_forwarded_steps(sc, what: str = "num_fast_forward_steps", requests=None) -> int:
    """Steps the replicas took by fast-forward in a run of ``sc`` (``what="num_stretches"``: the
    stretches they took them in)."""
    kv = plan_kv(sc)
    from servesim.sim.cost_model import build_cost_model
    from servesim.sim.engine import SimExecutor
    from servesim.sim.presets import get_hardware, get_model
    from servesim.sim.workload import generate_requests

    cost = build_cost_model(sc.cost_model, get_model(sc.model), get_hardware(sc.hardware), sc.tensor_parallel)
    env = simpy.Environment()
    _, replicas = run_replicas(env, sc, requests if requests is not None else generate_requests(sc.workload, sc.seed),
                               lambda _r: (build_scheduler(sc, kv), SimExecutor(cost, kv.block_bytes)), False)
    return sum(getattr(rep, what) for rep in replicas)


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(SCENARIOS_DIR)) for p in SHIPPED])
def test_shipped_scenario_is_the_same_with_fast_forward(path: Path):
    sc = load_scenario(path, ["workload.num_requests=150"])
    assert_same_run(*both(sc), replicas=sc.cluster.num_replicas)


@pytest.mark.slow
@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(SCENARIOS_DIR)) for p in SHIPPED])
def test_shipped_scenario_at_full_size_is_the_same_with_fast_forward(path: Path):
    sc = load_scenario(path)
    assert_same_run(*both(sc), replicas=sc.cluster.num_replicas)


def random_scenario(seed: int):
    rng = np.random.default_rng(seed)
    sched_type = ["chunked", "continuous"][seed % 2]
    scheduler = {"type": sched_type, "max_num_seqs": int(rng.choice([4, 16, 64])),
                 "max_num_batched_tokens": int(rng.choice([512, 2048])),
                 "preemption_mode": str(rng.choice(["recompute", "soft_reset", "swap"])),
                 "policy": str(rng.choice(["fcfs", "priority"])),
                 "async_scheduling": bool(rng.random() < 0.3)}
    if sched_type == "continuous":
        scheduler["schedule_order"] = str(rng.choice(["prefill_first", "decode_first"]))
    workload = {
        "num_requests": 120,
        "arrival": {"process": "poisson", "rate": float(rng.choice([0.5, 4.0, 40.0]))},
        "prompt_len": {"dist": "uniform", "min": 4, "max": 480},
        "output_len": {"dist": "uniform", "min": 1, "max": int(rng.choice([40, 300]))},
    }
    if rng.random() < 0.5:
        workload["prefix"] = {"num_prefixes": 3, "prefix_len": 64, "fraction": 0.7}
    d = {
        "name": f"random-{seed}", "seed": seed, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "scheduler": scheduler, "workload": workload,
        "kv_cache": {"block_size": int(rng.choice([8, 16])), "num_blocks": int(rng.choice([120, 400, 4000])),
                     "enable_prefix_caching": bool(rng.random() < 0.5), "swap_space_gb": 0.05},
        "cluster": {"num_replicas": int(rng.choice([1, 1, 2])),
                    "router": str(rng.choice(["round_robin", "least_outstanding", "kv_aware"]))},
    }
    if sched_type == "chunked" and rng.random() < 0.5:  # (drawn last: the other draws stay as they were)
        scheduler["chunked_prefill"] = False
    return scenario_from_dict(d)


@pytest.mark.parametrize("seed", range(16))
def test_random_scenario_is_the_same_with_fast_forward(seed: int):
    sc = random_scenario(seed)
    assert_same_run(*both(sc), replicas=sc.cluster.num_replicas)


def random_preset_workload(rng: np.random.Generator) -> dict:
    """120 requests at low to high load, short to long prompts, half of them with shared prefixes."""
    workload = {
        "num_requests": 120,
        "arrival": {"process": "poisson", "rate": float(rng.choice([0.5, 4.0, 40.0]))},
        "prompt_len": {"dist": "uniform", "min": 1, "max": int(rng.choice([60, 480, 2000]))},
        "output_len": {"dist": "uniform", "min": 1, "max": int(rng.choice([40, 300]))},
    }
    if rng.random() < 0.5:
        workload["prefix"] = {"num_prefixes": 3, "prefix_len": 300, "fraction": 0.7}
    return workload


def random_composed_scenario(seed: int):
    """The composed policies (Transformers and TensorRT-LLM presets): stall or preempt on KV
    shortage, safety margin, reserve-to-completion admission, row caps, prefix caching."""
    rng = np.random.default_rng(seed)
    if seed % 2:
        scheduler = {"preset": "hf-transformers", "scheduler_type": str(rng.choice(["fifo", "prefill_first"])),
                     "max_requests_per_batch": int(rng.choice([4, 32, 1024])),
                     "max_batch_tokens": int(rng.choice([64, 512, 8192]))}
    else:
        scheduler = {"preset": "tensorrt-llm", "max_batch_size": int(rng.choice([4, 32, 256])),
                     "max_num_tokens": int(rng.choice([128, 512, 8192])),
                     "capacity_scheduler_policy": str(rng.choice(["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"]))}
    workload = random_preset_workload(rng)
    return scenario_from_dict({
        "name": f"random-composed-{seed}", "seed": seed, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "scheduler": scheduler, "workload": workload,
        "kv_cache": {"block_size": int(rng.choice([16, 64, 256])), "num_blocks": int(rng.choice([40, 200, 4000])),
                     "enable_prefix_caching": bool(rng.random() < 0.5)},
        "cluster": {"num_replicas": int(rng.choice([1, 1, 2]))},
    })


@pytest.mark.parametrize("seed", range(12))
def test_random_composed_scenario_is_the_same_with_fast_forward(seed: int):
    sc = random_composed_scenario(seed)
    assert_same_run(*both(sc), replicas=sc.cluster.num_replicas)


def random_sglang_scenario(seed: int):
    """SGLang's retracting policy: prefill-or-decode steps, token-ratio admission (whose estimate
    decays every decode step, stretches included), retraction, page size 1 and radix reuse."""
    rng = np.random.default_rng(seed)
    workload = random_preset_workload(rng)
    return scenario_from_dict({
        "name": f"random-sglang-{seed}", "seed": seed, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "scheduler": {"preset": "sglang", "schedule_policy": str(rng.choice(["fcfs", "lpm"])),
                      "chunked_prefill_size": int(rng.choice([64, 512, 8192, -1])),
                      "max_running_requests": int(rng.choice([4, 32, 256])),
                      "schedule_conservativeness": float(rng.choice([0.3, 1.0]))},
        "workload": workload,
        "kv_cache": {"num_blocks": int(rng.choice([3000, 8000, 100000])), "block_size": int(rng.choice([1, 1, 16]))},
        "cluster": {"num_replicas": int(rng.choice([1, 1, 2]))},
    })


@pytest.mark.parametrize("seed", range(8))
def test_random_sglang_scenario_is_the_same_with_fast_forward(seed: int):
    sc = random_sglang_scenario(seed)
    assert_same_run(*both(sc), replicas=sc.cluster.num_replicas)


@pytest.mark.parametrize("rate", [2.0, 8.0])
def test_sglang_admission_estimate_decays_through_a_stretch_as_step_by_step(rate: float):
    # a pool tight enough that the decayed new-token ratio decides admissions after each stretch
    sc = scenario_from_dict({
        "name": "sglang-tight", "seed": 1, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "scheduler": {"preset": "sglang"}, "kv_cache": {"num_blocks": 2500},
        "workload": {"num_requests": 150, "arrival": {"process": "poisson", "rate": rate},
                     "prompt_len": {"dist": "uniform", "min": 20, "max": 300},
                     "output_len": {"dist": "uniform", "min": 10, "max": 400}},
    })
    assert fast_forwarded_steps(sc) > 0
    assert_same_run(*both(sc))


def random_session_scenario(seed: int):
    """Multi-turn conversations: a turn is sent a think time after the one before it is answered
    (zero, short or long, fixed or exponential), on one to four replicas behind every router kind."""
    rng = np.random.default_rng(seed)
    kind = str(rng.choice(["chunked", "continuous", "preset"]))
    kv = {"num_blocks": int(rng.choice([2000, 12000, 100000]))}
    if kind == "preset":
        scheduler = {"preset": str(rng.choice(["sglang", "hf-transformers", "tensorrt-llm", "vllm-v1"]))}
    else:
        scheduler = {"type": kind, "max_num_seqs": int(rng.choice([4, 32, 256])),
                     "max_num_batched_tokens": int(rng.choice([512, 2048]))}
        kv.update(enable_prefix_caching=bool(rng.random() < 0.7), block_size=16)
    sessions = {"turns": {"dist": "uniform", "min": 1, "max": int(rng.choice([3, 12]))},
                "think_time_s": float(rng.choice([0.0, 0.05, 1.0, 8.0])),
                "think_time_dist": str(rng.choice(["exponential", "fixed"])),
                "system_prompt_len": int(rng.choice([0, 100, 800]))}
    workload = {"num_requests": int(rng.choice([20, 60])),
                "arrival": {"process": "poisson", "rate": float(rng.choice([0.5, 4.0, 40.0]))},
                "prompt_len": {"dist": "lognormal", "mean": 200, "std": 150, "min": 8, "max": 2048},
                "output_len": {"dist": "lognormal", "mean": float(rng.choice([20, 250])), "std": 100, "min": 1,
                               "max": 1024},
                "sessions": sessions}
    return scenario_from_dict({
        "name": f"random-sessions-{seed}", "seed": seed, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "scheduler": scheduler, "workload": workload, "kv_cache": kv,
        "cluster": {"num_replicas": int(rng.choice([1, 2, 4])),
                    "router": str(rng.choice(["round_robin", "least_outstanding", "prefix_aware", "kv_aware"]))},
    })


@pytest.mark.parametrize("seed", range(12))
def test_random_session_scenario_is_the_same_with_fast_forward(seed: int):
    sc = random_session_scenario(seed)
    assert_same_run(*both(sc), replicas=sc.cluster.num_replicas)


def random_static_scenario(seed: int):
    """Static batches (and Triton's dynamic batcher, by size or queue delay): a finished member
    keeps its seat and blocks aside until the batch ends, the others decode on."""
    rng = np.random.default_rng(seed)
    if seed % 2:
        scheduler = {"type": "static", "max_num_seqs": int(rng.choice([1, 4, 32]))}
    else:
        scheduler = {"type": "dynamic_batcher", "max_num_seqs": int(rng.choice([1, 4, 32])),
                     "max_queue_delay_s": float(rng.choice([0.0, 0.01, 0.5]))}
    return scenario_from_dict({
        "name": f"random-static-{seed}", "seed": seed, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "scheduler": scheduler, "workload": random_preset_workload(rng),
        "kv_cache": {"num_blocks": int(rng.choice([200, 1000, 40000])), "block_size": int(rng.choice([1, 16]))},
        "cluster": {"num_replicas": int(rng.choice([1, 1, 2]))},
    })


@pytest.mark.parametrize("seed", range(8))
def test_random_static_scenario_is_the_same_with_fast_forward(seed: int):
    sc = random_static_scenario(seed)
    assert_same_run(*both(sc), replicas=sc.cluster.num_replicas)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["binned", "off"])
def test_binned_iterations_and_itls_are_the_same_with_fast_forward(seed: int, mode: str,
                                                                   monkeypatch: pytest.MonkeyPatch):
    # a stretch stages its steps' bin rows and ITLs as the steps one by one would, flushing at the
    # same points, so even the bins' float sums and the ITL histogram's mean and std are equal to
    # the bit (one replica: with several, the ITLs interleave in another order). Small staging
    # buffers put many flush points inside stretches.
    from servesim.sim import iteration_bins
    from servesim.sim.metrics import MetricsRecorder

    monkeypatch.setattr(iteration_bins, "_PENDING", int(np.random.default_rng(seed).choice([3, 7, 64])))
    monkeypatch.setattr(MetricsRecorder, "_ITL_BUFFER", int(np.random.default_rng(seed).choice([5, 16, 97])))
    sc = random_scenario(seed).model_copy(update={"cluster": random_scenario(seed).cluster.model_copy(
        update={"num_replicas": 1})})
    plain = simulate(sc, progress=False, fast_forward=False, iterations=mode)
    fast = simulate(sc, progress=False, fast_forward=True, iterations=mode)
    assert fast_forwarded_steps(sc) > 0
    pd.testing.assert_frame_equal(plain.requests_df, fast.requests_df, check_exact=True)
    pd.testing.assert_frame_equal(plain.iterations_df, fast.iterations_df, check_exact=True)
    assert plain.summary.keys() == fast.summary.keys()
    for key, a in plain.summary.items():
        b = fast.summary[key]
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), key
    ha, hb = plain.itl_hist, fast.itl_hist
    assert np.array_equal(ha.counts, hb.counts)
    assert (ha.count, ha.sum, ha.min, ha.max, ha.std) == (hb.count, hb.sum, hb.min, hb.max, hb.std)


def round_robin_cluster(replicas: int, seed: int = 4, router: str = "round_robin"):
    return scenario_from_dict({
        "name": "round-robin", "seed": seed, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "scheduler": {"type": "chunked", "max_num_seqs": 64, "max_num_batched_tokens": 512},
        "cluster": {"num_replicas": replicas, "router": router},
        "workload": {"num_requests": 150, "arrival": {"process": "poisson", "rate": 1.5 * replicas},
                     "prompt_len": {"dist": "uniform", "min": 10, "max": 900},
                     "output_len": {"dist": "uniform", "min": 1, "max": 300}},
    })


@pytest.mark.parametrize("replicas", [2, 3, 5])
@pytest.mark.parametrize("as_objects", [False, True], ids=["columns", "objects"])
@pytest.mark.parametrize("router", ["round_robin", "least_outstanding", "power_of_two_choices"])
def test_replicas_fast_forward_past_arrivals_that_surely_go_elsewhere(replicas: int, as_objects: bool,
                                                                      router: str, monkeypatch: pytest.MonkeyPatch):
    # round robin's next target is known ahead, and least outstanding's is surely another replica
    # while that one has fewer outstanding: a replica's stretch runs past the other replicas'
    # arrivals, and the run is still the plain loop's
    from servesim.sim.router import Router
    from servesim.sim.workload import generate_requests

    sc = round_robin_cluster(replicas, seed=replicas, router=router)

    def requests():  # (a run changes Request objects: fresh ones for each)
        return list(generate_requests(sc.workload, sc.seed)) if as_objects else None

    plain = simulate(sc, requests=requests(), progress=False, fast_forward=False)
    assert_same_run(plain, simulate(sc, requests=requests(), progress=False), replicas=replicas)
    own = fast_forwarded_steps(sc, "num_stretches", requests())
    monkeypatch.setattr(Router, "picks_elsewhere", lambda self, r: 0)  # everyone's next arrival
    everyone = fast_forwarded_steps(sc, "num_stretches", requests())
    if router == "power_of_two_choices" and replicas == 2:
        assert own == everyone  # (every pair is both replicas: nothing surely goes elsewhere)
    else:
        assert own < (0.95 if router != "round_robin" else 0.85 if replicas == 2 else 0.7) * everyone


@pytest.mark.parametrize("rate", [32.0, 8.0, 6.0])
@pytest.mark.parametrize("outputs", [8, 40, 41])
def test_round_robin_stretches_do_not_end_on_an_arrival_instant(rate: float, outputs: int):
    # steps of exactly 1/32 s and arrivals on the same binary grid: stretch ends, other replicas'
    # arrivals and a replica's own next request fall on the same instants. A stretch that ended on
    # another replica's arrival reordered that instant's events, and the replica then missed its own
    # request arriving exactly at its next step's end (32 req/s: scheduled one step late).
    sc = scenario_from_dict({
        "name": "same-instants", "seed": 1, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "cost_model": {"type": "constant", "step_ms": 31.25},
        "scheduler": {"type": "chunked", "max_num_seqs": 16, "max_num_batched_tokens": 512},
        "cluster": {"num_replicas": 4, "router": "round_robin"},
        "workload": {"num_requests": 120, "arrival": {"process": "constant", "rate": rate},
                     "prompt_len": {"dist": "fixed", "value": 16}, "output_len": {"dist": "fixed", "value": outputs}},
    })
    assert_same_run(*both(sc), replicas=4)  # (steps of several replicas ending on one instant: by replica)
    assert fast_forwarded_steps(sc) > 0


@pytest.mark.parametrize("router", ["least_outstanding", "prefix_aware", "round_robin"])
def test_conversations_with_steps_and_turns_on_the_same_instants_are_the_plain_loop(router: str):
    # the same binary grid with conversations: steps of several replicas end on one instant (their
    # iteration rows once came out in another order with the fast-forward), turns arrive on it
    sc = scenario_from_dict({
        "name": "same-instants-sessions", "seed": 2, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "cost_model": {"type": "constant", "step_ms": 31.25},
        "scheduler": {"type": "chunked", "max_num_seqs": 16, "max_num_batched_tokens": 512},
        "kv_cache": {"enable_prefix_caching": True},
        "cluster": {"num_replicas": 4, "router": router},
        "workload": {"num_requests": 30, "arrival": {"process": "constant", "rate": 32.0},
                     "prompt_len": {"dist": "fixed", "value": 16}, "output_len": {"dist": "fixed", "value": 8},
                     "sessions": {"turns": {"dist": "uniform", "min": 2, "max": 5}, "think_time_s": 0.5,
                                  "system_prompt_len": 32}},
    })
    assert_same_run(*both(sc), replicas=4)
    assert fast_forwarded_steps(sc) > 0


@pytest.mark.parametrize("router", ["round_robin", "least_outstanding"])
def test_turns_released_on_one_instant_go_out_in_the_same_order_with_the_fast_forward(router: str):
    # two replicas finish requests on one instant (one of them at the end of a stretch, whose event
    # was scheduled earlier than the plain step's), so they are reported done in another order and
    # their next turns, due together think_time later, were released in that order: round robin gave
    # them each other's replica (found by a randomised search; varied outputs make the stretches)
    sc = scenario_from_dict({
        "name": "turns-on-one-instant", "seed": 8093, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "cost_model": {"type": "constant", "step_ms": 15.625, "per_token_ms": 0.0},
        "scheduler": {"type": "continuous", "max_num_seqs": 16, "max_num_batched_tokens": 64},
        "kv_cache": {"block_size": 16},
        "cluster": {"num_replicas": 2, "router": router},
        "workload": {"num_requests": 10, "arrival": {"process": "constant", "rate": 8.0},
                     "prompt_len": {"dist": "fixed", "value": 16},
                     "output_len": {"dist": "lognormal", "mean": 40.0, "std": 40.0, "min": 1, "max": 321},
                     "sessions": {"turns": {"dist": "uniform", "min": 1, "max": 3}, "think_time_s": 0.5,
                                  "think_time_dist": "fixed"}},
    })
    assert_same_run(*both(sc), replicas=2)
    assert fast_forwarded_steps(sc) > 0


def kv_blocked_queue(prefix_caching: bool, watermark: float, policy: dict):
    """Every request arrives at once and the cache holds a few dozen: the queue waits for KV blocks
    (seats are free) from the first finish to the last."""
    return scenario_from_dict({
        "name": "kv-blocked-queue", "seed": 3, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 2048, **policy},
        "kv_cache": {"block_size": 16, "num_blocks": 300, "watermark": watermark,
                     "enable_prefix_caching": prefix_caching},
        "workload": {"num_requests": 200, "arrival": {"process": "poisson", "rate": 1000.0},
                     "prompt_len": {"dist": "uniform", "min": 100, "max": 400},
                     "output_len": {"dist": "uniform", "min": 50, "max": 300}},
    })


BLOCKED_QUEUE_POLICIES = [{"type": "chunked"}, {"type": "continuous", "schedule_order": "prefill_first"},
                          {"type": "continuous", "schedule_order": "decode_first"}]


@pytest.mark.parametrize("watermark", [0.0, 0.05])
@pytest.mark.parametrize("policy", BLOCKED_QUEUE_POLICIES, ids=lambda p: "-".join(p.values()))
def test_a_queue_waiting_for_kv_blocks_is_fast_forwarded_between_finishes(watermark: float, policy: dict):
    # the head's first chunk (whole prompt) does not fit and decode steps only take blocks: until
    # a request finishes, every step decodes and the admission fails (most steps here)
    sc = kv_blocked_queue(False, watermark, policy)
    plain, fast = both(sc)
    assert_same_run(plain, fast)
    assert fast_forwarded_steps(sc) > 0.8 * len(plain.iterations_df)
    # with prefix caching each failed try is a counted lookup: those steps stay plain
    sc = kv_blocked_queue(True, watermark, policy)
    plain, fast = both(sc)
    assert_same_run(plain, fast)
    assert fast_forwarded_steps(sc) < 0.2 * len(plain.iterations_df)


def test_the_equivalence_runs_do_fast_forward():
    # the equivalence above would hold vacuously if no stretch were ever taken
    sc = load_scenario(SCENARIOS_DIR / "chunked.yaml", ["workload.num_requests=150"])
    assert fast_forwarded_steps(sc) > 100
    assert sum(fast_forwarded_steps(random_scenario(s)) > 0 for s in range(16)) >= 8
    assert sum(fast_forwarded_steps(random_composed_scenario(s)) > 0 for s in range(12)) >= 6
    assert sum(fast_forwarded_steps(random_sglang_scenario(s)) > 0 for s in range(8)) >= 4
    assert sum(fast_forwarded_steps(random_session_scenario(s)) > 0 for s in range(12)) >= 6
    assert sum(fast_forwarded_steps(random_static_scenario(s)) > 0 for s in range(8)) >= 4


def test_replica_without_next_arrival_never_fast_forwards():
    sc = load_scenario(SCENARIOS_DIR / "chunked.yaml", ["workload.num_requests=20"])
    kv = plan_kv(sc)
    ff = {}
    for told in (False, True):
        env = simpy.Environment()
        rep = Replica(env, 0, build_scheduler(sc, kv), _ConstExecutor(), _NullRecorder())
        if told:
            rep.next_arrival = lambda: math.inf
        for i in range(3):
            rep.submit(Request(i, 0.0, 32, 50))
        rep.close()
        env.run()
        assert rep.num_iterations == 50
        ff[told] = rep.num_fast_forward_steps
    assert ff == {False: 0, True: 49}  # every step but the prefill


def test_an_executor_that_cannot_price_a_step_aside_is_never_asked_to():
    # a replay or live executor counts the steps it runs: a stretch must not ask it about steps
    # it may then not take
    class Counting:
        def __init__(self) -> None:
            self.calls = 0

        def run(self, batch) -> float:  # noqa: ANN001
            self.calls += 1
            return 0.01

    sc = load_scenario(SCENARIOS_DIR / "chunked.yaml", ["workload.num_requests=20"])
    env = simpy.Environment()
    ex = Counting()
    rep = Replica(env, 0, build_scheduler(sc, plan_kv(sc)), ex, _NullRecorder())
    rep.next_arrival = lambda: math.inf
    rep.submit(Request(0, 0.0, 32, 40))
    rep.close()
    env.run()
    assert rep.num_fast_forward_steps == 0 and ex.calls == rep.num_iterations == 40


def test_a_submit_inside_a_fast_forward_is_refused():
    sc = load_scenario(SCENARIOS_DIR / "chunked.yaml", ["workload.num_requests=20"])
    env = simpy.Environment()
    rep = Replica(env, 0, build_scheduler(sc, plan_kv(sc)), _ConstExecutor(), _NullRecorder())
    rep.next_arrival = lambda: math.inf  # claims nothing will arrive
    rep.submit(Request(0, 0.0, 32, 500))

    def late_submit():
        yield env.timeout(1.0)  # mid-stretch: the replica was told nothing would come
        rep.submit(Request(1, 1.0, 32, 5))

    env.process(late_submit())
    with pytest.raises(RuntimeError, match="inside a fast-forward"):
        env.run()


class _ConstExecutor:
    def run(self, batch) -> float:  # noqa: ANN001
        return 0.01

    def decode_time(self, n: int, context_tokens: int) -> float:
        return 0.01


class _NullRecorder:
    def on_iteration(self, **kwargs) -> None: ...
    def on_itl(self, itl) -> None: ...  # noqa: ANN001
    def on_request_done(self, req) -> None: ...  # noqa: ANN001
    def on_decode_steps(self, *args) -> None: ...  # noqa: ANN002


def test_a_stretch_whose_end_one_delay_cannot_reach_lands_on_it_step_by_step():
    # 0.05 + d rounds to a neighbour of 0.24999999999999997 for every d: SimPy cannot get there in
    # one timeout, yet eight plain 25 ms steps from 0.05 end exactly there
    now, ends = 0.05, []
    for _ in range(8):
        ends.append((ends[-1] if ends else now) + 0.025)
    assert _exact_delay(now, ends[-1]) is None
    t = now
    for d in _hops(now, ends, [0.025] * 8):
        t = t + d
    assert t == ends[-1]
    assert _exact_delay(0.5, 0.75) == 0.25 and _hops(0.5, [0.75], [0.25]) == [0.25]


def test_the_constant_25ms_saturation_run_that_hung_is_the_plain_loop():
    # the search's saturation run of a 25 ms constant step: its first stretch starts at 0.05 s
    sc = scenario_from_dict({
        "name": "cf", "model": "llama-3.1-8b", "hardware": "l40s",
        "cost_model": {"type": "constant", "step_ms": 25},
        "scheduler": {"type": "chunked", "max_num_seqs": 4, "max_num_batched_tokens": 512},
        "workload": {"num_requests": 200, "arrival": {"process": "constant", "rate": 1e6},
                     "prompt_len": {"dist": "fixed", "value": 16}, "output_len": {"dist": "fixed", "value": 10}},
    })
    assert_same_run(*both(sc))
    assert fast_forwarded_steps(sc) > 0


@pytest.mark.parametrize("hardware", ["rtx-pro-6000", "rtx-4090"])
def test_fast_forward_prices_decode_waves_as_the_plain_loop(hardware: str):
    """On GPUs whose roofline prices short-context decode steps as FA2's block waves
    (``fa2_decode_tile_s``), a stretch's steps cost what the plain loop's do."""
    sc = scenario_from_dict({
        "name": f"ff-{hardware}", "seed": 3, "model": "llama-3.1-8b", "hardware": hardware,
        "scheduler": {"type": "chunked", "max_num_seqs": 64, "max_num_batched_tokens": 1024},
        "workload": {"num_requests": 200, "arrival": {"process": "poisson", "rate": 2.0},
                     "prompt_len": {"dist": "uniform", "min": 4, "max": 200},
                     "output_len": {"dist": "uniform", "min": 20, "max": 400}},
    })
    assert fast_forwarded_steps(sc) > 0
    assert_same_run(*both(sc))


def promise_checked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every policy's ``schedule`` check the promise the fast-forward relies on: when
    ``decodes_ahead`` holds and a plain decode step fits (``decode_stretch``), the step it returns
    decodes every running row by one token and admits, brings back and preempts nothing.
    Returns a one-element count of the steps checked."""
    from servesim.sim.schedulers import POLICIES

    checked = [0]
    for cls in {*POLICIES.values()}:
        original = cls.schedule

        def schedule(self, now, _original=original):  # noqa: ANN001, ANN202
            promised = self.decode_stretch(1, 1) == 1
            n, waiting, swapped = self.run.n, len(self.waiting), len(self.swapped)
            batch = _original(self, now)
            if promised:
                checked[0] += 1
                assert (self.run.n, len(self.waiting), len(self.swapped)) == (n, waiting, swapped), \
                    f"{type(self).__name__}: decodes_ahead, yet the step admitted, preempted or swapped"
                assert len(batch.num_new_tokens) == n and bool(np.all(batch.num_new_tokens == 1)), \
                    f"{type(self).__name__}: decodes_ahead, yet the step is not a decode of every row"
            return batch

        monkeypatch.setattr(cls, "schedule", schedule)
    return checked


def long_prompt_scenario(seed: int):
    """Prompts near the step budget, recompute preemption and a cache that runs short: queued
    requests whose whole prompt (or prompt + outputs, after a preemption) only just fits a step."""
    rng = np.random.default_rng(seed)
    policy = [{"type": "chunked"}, {"type": "continuous", "schedule_order": "prefill_first"},
              {"type": "continuous", "schedule_order": "decode_first"}][seed % 3]
    return scenario_from_dict({
        "name": f"long-prompts-{seed}", "seed": seed, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "scheduler": {"max_num_seqs": int(rng.choice([16, 64])), "max_num_batched_tokens": 512,
                      "preemption_mode": str(rng.choice(["recompute", "soft_reset"])), **policy},
        "kv_cache": {"block_size": 16, "num_blocks": int(rng.choice([120, 300, 3000])),
                     "watermark": float(rng.choice([0.0, 0.02]))},
        "workload": {"num_requests": 150, "arrival": {"process": "poisson", "rate": float(rng.choice([2.0, 50.0]))},
                     "prompt_len": {"dist": "uniform", "min": 250, "max": 512},
                     "output_len": {"dist": "uniform", "min": 1, "max": int(rng.choice([60, 400]))}},
    })


@pytest.mark.parametrize("seed", range(9))
def test_decodes_ahead_promises_only_plain_decode_steps(seed: int, monkeypatch: pytest.MonkeyPatch):
    checked = promise_checked(monkeypatch)
    for sc in (long_prompt_scenario(seed), random_scenario(seed), random_composed_scenario(seed),
               random_sglang_scenario(seed), random_static_scenario(seed)):
        simulate(sc, progress=False, fast_forward=False)
    assert checked[0] > 0


@pytest.mark.parametrize("mode", ["full", "binned"])
def test_a_stretch_across_the_switch_to_bins_is_recorded_as_its_steps(mode: str):
    """``on_decode_steps`` against ``on_iteration`` / ``on_itl`` step by step, with stretches that
    cross ``bin_after`` (a full run switching to time bins): the rows before the switch stay rows
    and the bins get the same groups of steps (a stretch switched before its first step once, and
    the bins' float sums then differed in the last bit from the plain loop's)."""
    from servesim.sim.batch import Batch
    from servesim.sim.metrics import MetricsRecorder

    rng = np.random.default_rng(5)
    n, total = 3, 13_000
    plain = MetricsRecorder(iterations=mode, bin_after=5000)
    fast = MetricsRecorder(iterations=mode, bin_after=5000)
    t, last, done = 0.0, np.zeros(n), 0
    while done < total:
        k = min(int(rng.integers(1, 3000)), total - done)
        durations = rng.exponential(0.02, k).tolist()
        starts, ends = [], []
        for d in durations:
            starts.append(t)
            t = t + d
            ends.append(t)
        used = rng.integers(0, 900, k)
        first_itl = ends[0] - last
        fast.on_decode_steps(0, starts, durations, n, used, 1000, 2, 0, first_itl, n - 1, n)
        for j in range(k):
            q = np.ones(n, dtype=np.int64)
            batch = Batch(num_new_tokens=q, num_context_tokens=q, samples=q.astype(bool))
            batch.set_shape(n, n, n, 0, 0, 0, 0, n, n)
            plain.on_itl(first_itl if j == 0 else np.full(n, ends[j] - ends[j - 1]))
            plain.on_iteration(0, starts[j], durations[j], batch, int(used[j]), 1000, 2, n - 1 if j == k - 1 else n, 0, 0)
        last = np.full(n, ends[-1])
        done += k
    assert plain.iterations_mode == fast.iterations_mode == "binned"
    assert plain.iterations_frame().equals(fast.iterations_frame())
    assert plain.iteration_summary() == fast.iteration_summary()
    assert plain.busy_by_replica().tolist() == fast.busy_by_replica().tolist()
    ha, hb = plain.itl_histogram, fast.itl_histogram
    assert (ha.count, ha.sum, ha._m2) == (hb.count, hb.sum, hb._m2) and np.array_equal(ha.counts, hb.counts)
