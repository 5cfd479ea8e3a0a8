"""The compiled engine (sim/compiled_engine.py) is the Python engine's plain loop, bit for bit.

Every run here is simulated on the Python engine with the fast-forward off (each step through
``ChunkedScheduler.schedule`` / ``update`` and a SimPy event) and on the compiled engine, and
every output must be identical: the requests and iterations tables, the summary, and the ITL
histogram down to its running sum and squared deviations (the same values staged and flushed at
the same points). Randomized scenarios cover KV pressure with preemption, rejections, tiny token
budgets and seat counts, prefill thresholds, both roofline attention paths (H100, A100's FA2
varlen pricing of mixed steps), a constant step cost whose step ends fall exactly on arrival
times (SimPy's tie order), bursts of simultaneous arrivals and unsorted ones.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from servesim.sim import compiled_engine as ce
from servesim.sim import compiled_price as cp
from servesim.sim import compiled_profile as cg
from servesim.sim import row_kernels as rk
from servesim.sim.batch import Batch
from servesim.sim.cost_model import build_cost_model
from servesim.sim.engine import SimExecutor
from servesim.sim.metrics import ITERATION_COLUMNS, MetricsRecorder
from servesim.sim.presets import get_model
from servesim.sim.scenario import ScenarioError, load_scenario, scenario_from_dict
from servesim.sim.simulate import build_scheduler, plan_kv, simulate
from servesim.sim.workload import RequestArrays
from test_fast_forward import SCENARIOS_DIR, SHIPPED, assert_same_run

pytestmark = pytest.mark.skipif(not rk.available(), reason="numba is not installed")


@pytest.fixture(autouse=True)
def jit_on(monkeypatch):
    """The compiled loops on for every run (the compiled engine needs them), restored after."""
    was = rk.ON
    monkeypatch.setenv("SERVESIM_JIT", "1")
    yield
    rk.use(was)


def assert_identical(sc, requests=None, iterations="full"):
    python = simulate(sc, requests=requests, progress=False, fast_forward=False, compiled=False,
                      iterations=iterations)
    compiled = simulate(sc, requests=requests, progress=False, compiled=True, iterations=iterations)
    assert_same_run(python, compiled)
    ha, hb = python.itl_hist, compiled.itl_hist
    assert (ha.sum, ha._m2) == (hb.sum, hb._m2)
    return python, compiled


def _scenario(seed: int, n: int, *, hardware: str, block_size: int, num_blocks: int, watermark: float,
              scheduler: dict, cost: dict):
    return scenario_from_dict({
        "name": f"compiled-{seed}", "seed": seed, "model": "llama-3.1-8b", "hardware": hardware,
        "scheduler": {"type": "chunked", **scheduler}, "cost_model": cost,
        "kv_cache": {"block_size": block_size, "num_blocks": num_blocks, "watermark": watermark},
        "workload": {"num_requests": max(n, 1), "arrival": {"process": "poisson", "rate": 1.0},
                     "prompt_len": {"dist": "fixed", "value": 8}, "output_len": {"dist": "fixed", "value": 8}},
    })


def random_case(seed: int, prefix_caching: bool = False, async_scheduling: bool = False,
                chunked_prefill: bool = True, shared_prefixes: bool = False):
    """A scenario and its requests as columns: lengths, arrival pattern, KV size and knobs drawn;
    ``prefix_caching``: on, with a random ``cache_preempted_blocks`` (no prompt shares a prefix,
    so what is cached is each victim's own blocks); ``async_scheduling``: on; ``chunked_prefill``
    False: prompts taken in whole (vLLM V1's ``enable_chunked_prefill=False``); ``shared_prefixes``:
    prefix caching on and some prompts sharing one of a few prefixes (their lengths drawn, some
    past the prompt), so blocks are shared, found by others, computed twice at once and evicted
    from under a chain."""
    rng = np.random.default_rng(seed)
    n = int(rng.choice([1, 3, 40, 300]))
    bs = int(rng.choice([1, 4, 16]))
    scheduler = {"max_num_seqs": int(rng.choice([1, 4, 32, 256])),
                 "max_num_batched_tokens": int(rng.choice([1, 16, 512, 4096]))}
    if rng.random() < 0.3:
        scheduler["long_prefill_token_threshold"] = int(rng.choice([1, 8, 100]))
    if rng.random() < 0.2:
        scheduler["max_model_len"] = int(rng.choice([60, 400]))
    prompt = rng.integers(1, int(rng.choice([8, 200, 2000])) + 1, n)
    output = rng.integers(1, int(rng.choice([1, 8, 120])) + 1, n)
    if rng.random() < 0.5:
        cost = {"type": "roofline"}
    else:
        cost = {"type": "constant", "step_ms": float(rng.choice([0.5, 1.0, 10.0])),
                "per_token_ms": float(rng.choice([0.0, 0.01]))}
    pattern = seed % 4
    if pattern == 0:
        arrival = np.cumsum(rng.exponential(1 / float(rng.choice([2.0, 50.0, 1000.0])), n))
    elif pattern == 1:  # bursts: many requests on one instant
        arrival = np.sort(rng.choice([0.0, 0.25, 0.5, 1.5], n))
    elif pattern == 2 and cost["type"] == "constant":  # step ends exactly on arrival times
        cost["per_token_ms"] = 0.0
        arrival = np.sort(cost["step_ms"] / 1000 * rng.integers(0, 3 * n + 1, n))
    else:  # unsorted: late rows sent at once, after the one before them
        arrival = rng.uniform(0.0, n / 20, n)
    need = int(((prompt + output + bs - 1) // bs).max())
    num_blocks = int(rng.choice([max(need // 2, 1), need, need + 2, 3 * need, 100_000]))
    sc = _scenario(seed, n, hardware=str(rng.choice(["h100-sxm", "a100-80g"])), block_size=bs,
                   num_blocks=num_blocks, watermark=float(rng.choice([0.0, 0.01, 0.1])), scheduler=scheduler,
                   cost=cost)
    if prefix_caching:
        keep = ["all", "prompt", "none"][seed % 3]
        sc = sc.model_copy(update={
            "kv_cache": sc.kv_cache.model_copy(update={"enable_prefix_caching": True}),
            "scheduler": sc.scheduler.model_copy(update={"cache_preempted_blocks": keep})})
        assert sc.kv_cache.enable_prefix_caching and sc.policy.cache_preempted_blocks == keep
    if async_scheduling:
        sc = sc.model_copy(update={"scheduler": sc.scheduler.model_copy(update={"async_scheduling": True})})
        assert sc.policy.async_scheduling
    if not chunked_prefill:
        sc = sc.model_copy(update={"scheduler": sc.scheduler.model_copy(update={"chunked_prefill": False})})
        assert not sc.policy.chunked_prefill
    prefix_id, prefix_len = np.full(n, -1), np.zeros(n, dtype=np.int64)
    if shared_prefixes:  # (drawn apart, so the rest of the case is the one without them)
        more = np.random.default_rng(seed + 10_000)
        kinds = int(more.choice([1, 3]))
        prefix_id = np.where(more.random(n) < float(more.choice([0.5, 0.9])), more.integers(0, kinds, n), -1)
        lens = more.choice([bs, 3 * bs + 1, 64, 500], kinds)
        prefix_len = np.where(prefix_id >= 0, lens[np.maximum(prefix_id, 0)], 0).astype(np.int64)
        sc = sc.model_copy(update={
            "kv_cache": sc.kv_cache.model_copy(update={"enable_prefix_caching": True}),
            "scheduler": sc.scheduler.model_copy(update={"cache_preempted_blocks": ["all", "prompt", "none"][seed % 3]})})
    requests = RequestArrays(arrival.astype(np.float64), prompt, output, prefix_id, prefix_len)
    return sc, requests


@pytest.mark.parametrize("seed", range(40))
def test_random_scenario_is_the_python_engines_run(seed: int):
    sc, requests = random_case(seed)
    assert_identical(sc, requests, iterations=["full", "binned", "off", "auto"][seed % 4])


@pytest.mark.parametrize("seed", range(80))
def test_shared_prefixes_are_the_python_engines_run(seed: int):
    """Prefix caching over prompts that share prefixes: blocks held by several requests, found by
    later ones (``num_cached_tokens``, the hit counters), published twice when two requests compute
    them in one step, evicted least recently used first from under a chain; with async scheduling
    in a third of the cases and victims' own blocks published in every ``cache_preempted_blocks``
    mode."""
    sc, requests = random_case(seed, async_scheduling=seed % 3 == 1, shared_prefixes=True)
    assert_identical(sc, requests, iterations=["full", "binned", "off", "auto"][seed % 4])


def test_the_shared_prefix_cases_reach_the_hard_paths(monkeypatch):
    """The cases above are not vacuous. Counted on the Python engine's block manager over the same
    80 cases: prompts found cached, blocks computed twice at once (a publication skipped: the
    key was cached by another request first), keyed blocks evicted, and lookups stopped at an
    evicted block with later blocks of the chain still cached (which a count of blocks per prefix
    could not represent)."""
    from servesim.sim.kv_cache import BlockManager

    seen = {"skipped": 0, "evicted": 0, "gaps": 0}
    publish, evict, lookup = BlockManager.cache_computed_blocks, BlockManager._evict, BlockManager.lookup_prefix

    def counting_publish(self, request, num_computed_tokens):
        keys = self._prompt_keys(request)
        done = self._registered.get(request.request_id, 0)
        if request.request_id in self._tables:
            upto = min(len(keys), num_computed_tokens // self.block_size)
            seen["skipped"] += sum(k in self._key_block for k in keys[done:upto])
        return publish(self, request, num_computed_tokens)

    def counting_evict(self):
        seen["evicted"] += 1
        return evict(self)

    def counting_lookup(self, request):
        got = lookup(self, request)
        if self.enable_prefix_caching and request.request_id in self._keys:
            keys = self._keys[request.request_id]
            seen["gaps"] += any(k in self._key_block for k in keys[got // self.block_size + 1:])
        return got

    monkeypatch.setattr(BlockManager, "cache_computed_blocks", counting_publish)
    monkeypatch.setattr(BlockManager, "_evict", counting_evict)
    monkeypatch.setattr(BlockManager, "lookup_prefix", counting_lookup)
    cached = cases_with_hits = 0
    for seed in range(80):
        sc, requests = random_case(seed, async_scheduling=seed % 3 == 1, shared_prefixes=True)
        df = simulate(sc, requests=requests, progress=False, compiled=False, iterations="off").requests_df
        cached += int(df["num_cached_tokens"].sum())
        cases_with_hits += bool(df["num_cached_tokens"].sum())
    assert cases_with_hits >= 25 and cached > 100_000, (cases_with_hits, cached)
    assert seen["skipped"] > 0 and seen["evicted"] > 1000 and seen["gaps"] > 0, seen


@pytest.mark.parametrize("seed", range(60))
def test_prefix_caching_is_the_python_engines_run(seed: int):
    """Prefix caching on without shared prefixes: a request preempted by recompute leaves its
    computed blocks (all, or the prompt's) in the cache and finds what was not evicted when it is
    admitted again; finished requests' published blocks stay evictable, least recently used first."""
    sc, requests = random_case(seed, prefix_caching=True)
    assert_identical(sc, requests, iterations=["full", "binned", "off", "auto"][seed % 4])


@pytest.mark.parametrize("seed", range(60))
def test_async_scheduling_is_the_python_engines_run(seed: int):
    """Async scheduling (vLLM V1's): a request arriving during a step joins the queue after the
    next schedule, and a finished request keeps its seat and blocks through it; odd seeds with
    prefix caching on too."""
    sc, requests = random_case(seed, prefix_caching=seed % 2 == 1, async_scheduling=True)
    assert_identical(sc, requests, iterations=["full", "binned", "off", "auto"][seed % 4])


@pytest.mark.parametrize("seed", range(30))
def test_chunked_prefill_off_is_the_python_engines_run(seed: int):
    """Prompts taken in whole (the budget's first refusal ends the step's admissions; a request that
    could outgrow a step is rejected), with async scheduling and prefix caching on some seeds."""
    sc, requests = random_case(seed, prefix_caching=seed % 3 == 1, async_scheduling=seed % 2 == 1,
                               chunked_prefill=False)
    assert_identical(sc, requests, iterations=["full", "binned", "off", "auto"][seed % 4])


def test_async_scheduling_changes_the_runs():
    """The async cases above are not the synchronous runs under another name."""
    differ = 0
    for seed in range(20):
        sc, requests = random_case(seed, async_scheduling=True)
        on = simulate(sc, requests=requests, progress=False, compiled=True)
        sync = simulate(random_case(seed)[0], requests=requests, progress=False, compiled=True)
        differ += int(not on.requests_df["first_token_time"].equals(sync.requests_df["first_token_time"]))
    assert differ >= 10, differ


def test_the_prefix_caching_cases_re_hit_their_own_blocks():
    """Some victims above find blocks of their own again (the compiled engine's LRU queue is used),
    so the runs differ from the same runs with prefix caching off."""
    differ = 0
    for seed in range(60):
        sc, requests = random_case(seed, prefix_caching=True)
        if sc.policy.cache_preempted_blocks == "none":
            continue
        on = simulate(sc, requests=requests, progress=False, compiled=True)
        off_sc = sc.model_copy(update={"kv_cache": sc.kv_cache.model_copy(update={"enable_prefix_caching": False})})
        off = simulate(off_sc, requests=requests, progress=False, compiled=True)
        differ += int(not on.requests_df["finish_time"].equals(off.requests_df["finish_time"]))
    assert differ >= 4, differ


@pytest.mark.parametrize("seed", [1, 5, 9, 13, 17, 21])
def test_policy_priority_is_the_python_engines_run(seed: int):
    """``policy: priority`` with requests as columns (all priority 0): the victims are fcfs's."""
    sc, requests = random_case(seed)
    sc = sc.model_copy(update={"scheduler": sc.scheduler.model_copy(update={"policy": "priority"})})
    assert sc.policy.policy == "priority"
    python, _ = assert_identical(sc, requests)


ROUTERS = ["round_robin", "least_outstanding", "kv_aware", "least_kv_usage", "vllm_dp", "power_of_two_choices"]


def with_replicas(sc, num_replicas: int, router: str, refresh_s: float = 0.0):
    return sc.model_copy(update={"cluster": sc.cluster.model_copy(update={
        "num_replicas": num_replicas, "router": router, "router_refresh_s": refresh_s})})


@pytest.mark.parametrize("seed", range(30))
def test_several_replicas_are_the_python_engines_plain_loop(seed: int):
    """Replicas behind round robin or least outstanding: the compiled engine orders every arrival,
    step end and wakeup as SimPy does (time, then when it was queued), so the ITLs reach the
    histogram in the plain loop's order too (the Python fast-forward's order differs in the last
    bits of mean and std ITL with several replicas, ``ORDER_ONLY``). Every router it runs, the
    scraping ones with and without a refresh interval; odd seeds with prefix caching on (each
    replica keeps its own cache)."""
    sc, requests = random_case(seed, prefix_caching=seed % 2 == 1, async_scheduling=seed % 4 >= 2)
    rng = np.random.default_rng(seed + 1000)
    sc = with_replicas(sc, int(rng.choice([2, 3, 5])), ROUTERS[seed % 6], float(rng.choice([0.0, 0.05, 0.5])))
    assert_identical(sc, requests, iterations=["full", "binned", "off", "auto"][seed % 4])


@pytest.mark.parametrize("seed", range(12))
def test_replicas_whose_steps_end_together_on_arrivals_are_the_plain_loop(seed: int):
    """A constant step cost and arrivals on its grid: several replicas' steps end on one instant,
    often with an arrival on it, and the router's counts at that arrival depend on which went first."""
    rng = np.random.default_rng(seed)
    n, step = 300, float(rng.choice([1000 / 1024, 1000 / 2048]))  # (2**-10 s, 2**-11 s: sums of them are exact)
    prompt, output = rng.integers(1, 200, n), rng.integers(1, 40, n)
    arrival = np.sort(step / 1000 * rng.integers(0, n, n))
    sc = _scenario(seed, n, hardware="h100-sxm", block_size=16, num_blocks=int(rng.choice([20, 100_000])),
                   watermark=0.0, scheduler={"max_num_seqs": int(rng.choice([2, 64])), "max_num_batched_tokens": 64},
                   cost={"type": "constant", "step_ms": step, "per_token_ms": 0.0})
    sc = with_replicas(sc, int(rng.choice([3, 4])), ROUTERS[seed % 6], [0.0, 0.001][seed % 2])
    requests = RequestArrays(arrival, prompt, output, np.full(n, -1), np.zeros(n, dtype=np.int64))
    python, _ = assert_identical(sc, requests, iterations=["full", "binned"][seed % 2])
    ends = python.requests_df["finish_time"].to_numpy()
    assert np.isin(arrival, ends).any()  # (ties happen)


def test_the_random_cases_reach_preemption_rejection_and_ties():
    """The cases above are not all easy ones: some preempt, some reject, some end steps on arrivals."""
    preempted = rejected = tied = 0
    for seed in range(40):
        sc, requests = random_case(seed)
        res = simulate(sc, requests=requests, progress=False, compiled=True, iterations="full")
        df = res.requests_df
        preempted += int(df["num_preemptions"].sum() > 0)
        rejected += int((df["state"] == "rejected").any())
        ends = (res.iterations_df["start"] + res.iterations_df["duration"]).to_numpy()
        tied += int(np.isin(requests.arrival_time, ends).any())
    assert preempted >= 4 and rejected >= 4 and tied >= 2, (preempted, rejected, tied)


def test_a_run_past_the_itl_and_row_buffers_is_the_python_engines_run():
    """More than one ITL buffer (65,536 values) and one block of iteration rows (4,096 steps),
    binned and full: the flushes fall at the same points."""
    rng = np.random.default_rng(11)
    n = 1500
    sc = _scenario(1, n, hardware="a100-80g", block_size=16, num_blocks=3000, watermark=0.01,
                   scheduler={"max_num_seqs": 32, "max_num_batched_tokens": 256}, cost={"type": "roofline"})
    requests = RequestArrays(np.cumsum(rng.exponential(1 / 4.0, n)), rng.integers(4, 1500, n),
                             rng.integers(1, 200, n), np.full(n, -1), np.zeros(n, dtype=np.int64))
    for iterations in ("binned", "full"):
        python, _ = assert_identical(sc, requests, iterations)
    assert python.itl_hist.count > 2 * ce.ITL_CAP and python.summary["num_iterations"] > 2 * ce.ROW_BLOCK


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(SCENARIOS_DIR)) for p in SHIPPED])
def test_shipped_scenario_in_its_class_is_the_python_engines_run(path):
    sc = load_scenario(path, ["workload.num_requests=200"])
    kv = plan_kv(sc)
    from servesim.sim.workload import generate_workload

    requests = generate_workload(sc.workload, sc.seed).requests
    rk.use(True)
    cost = build_cost_model(sc.cost_model, get_model(sc.model), sc.cost_hardware(), sc.tensor_parallel,
                            sc.kv_cache.block_size)
    why = ce.reason_not_compiled(sc, requests, build_scheduler(sc, kv, block_ids=False),
                                 SimExecutor(cost, kv.block_bytes, overlap_host=sc.policy.async_scheduling))
    if why is not None:
        with pytest.raises(ScenarioError, match="compiled engine cannot run"):
            simulate(sc, progress=False, compiled=True)
        pytest.skip(f"not in the compiled engine's class: {why}")
    assert_identical(sc)


def test_some_shipped_scenarios_are_in_its_class():
    quick = load_scenario(SCENARIOS_DIR / "quickstart.yaml")
    assert quick.scheduler_name == "chunked" and quick.cluster.num_replicas == 1
    rk.use(True)
    kv = plan_kv(quick)
    cost = build_cost_model(quick.cost_model, get_model(quick.model), quick.cost_hardware(), quick.tensor_parallel,
                            quick.kv_cache.block_size)
    from servesim.sim.workload import generate_workload

    assert ce.reason_not_compiled(quick, generate_workload(quick.workload, 0).requests,
                                  build_scheduler(quick, kv, block_ids=False), SimExecutor(cost, kv.block_bytes)) is None


BASE = {"name": "class", "seed": 1, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "workload": {"num_requests": 20, "arrival": {"process": "poisson", "rate": 5.0},
                     "prompt_len": {"dist": "fixed", "value": 40}, "output_len": {"dist": "fixed", "value": 5}}}


@pytest.mark.parametrize(("change", "reason"), [
    ({"cluster": {"num_replicas": 2, "router": "prefix_aware"}}, "router prefix_aware"),
    ({"scheduler": {"type": "continuous"}}, "scheduler continuous"),
    ({"scheduler": {"type": "chunked", "preemption_mode": "swap"}}, "preemption_mode swap"),
    ({"kv_cache": {"enable_prefix_caching": True}, "workload": {**BASE["workload"], "token_ids": True}},
     "prefix caching over prompt token ids"),
    ({"workload": {**BASE["workload"], "sessions": {"turns": 3}}}, "request objects"),
])
def test_what_it_does_not_run_is_named_and_runs_on_the_python_engine(change, reason):
    try:
        sc = scenario_from_dict({**BASE, **change})
    except ScenarioError as e:  # (a workload field spelled differently: look it up, do not pass)
        pytest.fail(f"test scenario invalid: {e}")
    with pytest.raises(ScenarioError, match=f"compiled engine cannot run this scenario: .*{reason}"):
        simulate(sc, progress=False, compiled=True)
    auto = simulate(sc, progress=False)  # the Python engine
    assert auto.summary["completed"] == simulate(sc, progress=False, compiled=False).summary["completed"] > 0


def test_with_the_loops_off_it_says_so(monkeypatch):
    monkeypatch.setenv("SERVESIM_JIT", "0")
    with pytest.raises(ScenarioError, match="compiled step loops are off"):
        simulate(scenario_from_dict(BASE), progress=False, compiled=True)


def test_auto_uses_it_for_a_run_in_its_class(monkeypatch):
    """``compiled=None`` (what ``servesim run`` does) takes the compiled engine by itself; the
    Python engine's Replica never runs."""
    from servesim.sim import engine

    def no_replica(*_a, **_k):
        raise AssertionError("the Python engine ran")

    monkeypatch.setattr(engine.Replica, "__init__", no_replica)
    res = simulate(scenario_from_dict(BASE), progress=False)
    assert res.summary["completed"] == 20 and res.summary["num_iterations"] > 0


def test_progress_counts_every_request():
    sc, requests = random_case(3)
    kv = plan_kv(sc)
    rk.use(True)
    cost = build_cost_model(sc.cost_model, get_model(sc.model), sc.cost_hardware(), 1, sc.kv_cache.block_size)
    seen = []
    steps = ce.run_compiled(requests, build_scheduler(sc, kv, block_ids=False), SimExecutor(cost, kv.block_bytes),
                            MetricsRecorder(), seen.append)
    assert sum(seen) == len(requests) and steps > 0


def test_iteration_rows_are_recorded_as_step_by_step():
    """``on_iteration_rows`` in blocks against ``on_iteration`` per step: full rows that switch to
    bins part way (``bin_after``), binned and off; rows, bins, summary figures and busy seconds."""
    rng = np.random.default_rng(2)
    k = 13_000
    rows = np.zeros((k, len(ITERATION_COLUMNS)))
    rows[:, 1] = np.cumsum(rng.exponential(0.03, k))
    rows[:, 2] = rng.exponential(0.02, k)
    rows[:, 3] = rng.integers(1, 300, k)
    rows[:, 5] = np.minimum(rows[:, 3], rng.integers(0, 300, k))
    rows[:, 6] = rows[:, 5] + rng.integers(0, 900, k)
    rows[:, 4] = rows[:, 6] - rows[:, 5]
    rows[:, 7] = rng.integers(0, 1000, k)
    rows[:, 8] = 1000
    rows[:, 9:11] = rng.integers(0, 50, (k, 2))
    rows[:, 12] = rng.integers(0, 2, k)
    rows[:, 14] = math.nan
    for mode, bin_after in (("full", 5000), ("full", None), ("binned", None), ("off", None)):
        step_by_step = MetricsRecorder(iterations=mode, bin_after=bin_after)
        for r in rows:
            q = np.ones(int(r[3]), dtype=np.int64)
            batch = Batch(num_new_tokens=q, num_context_tokens=q, samples=q.astype(bool))
            batch.set_shape(int(r[3]), 0, int(r[6]), 0, 0, 0, 0, int(r[5]), 0)
            step_by_step.on_iteration(0, float(r[1]), float(r[2]), batch, int(r[7]), int(r[8]), int(r[9]),
                                      int(r[10]), 0, int(r[12]))
        blocks = MetricsRecorder(iterations=mode, bin_after=bin_after)
        i = 0
        while i < k:
            m = int(rng.integers(1, 5000))
            blocks.on_iteration_rows(rows[i : i + m])
            i += m
        assert step_by_step.iterations_mode == blocks.iterations_mode
        a, b = step_by_step.iterations_frame(), blocks.iterations_frame()
        assert a.equals(b), mode
        assert step_by_step.iteration_summary() == blocks.iteration_summary()
        assert step_by_step.busy_by_replica().tolist() == blocks.busy_by_replica().tolist()


def test_lengths_past_int64_sums_are_rejected_as_the_python_engine_rejects_them():
    """Prompt + output beyond 2**63 (a hostile trace): the rejection check must not wrap."""
    big = 2**62
    for prompt, output, max_len in ((big, big, 1000), (big, big, None), (2**63 - 1, 1, None), (1, 2**63 - 1, None),
                                    (5, 5, None)):
        sched = {"max_model_len": max_len} if max_len else {}
        sc = _scenario(0, 2, hardware="h100-sxm", block_size=16, num_blocks=1000, watermark=0.01, scheduler=sched,
                       cost={"type": "constant", "step_ms": 1.0})
        requests = RequestArrays(np.array([0.0, 0.5]), np.array([prompt, 7]), np.array([output, 3]), np.full(2, -1),
                                 np.zeros(2, dtype=np.int64))
        python, _ = assert_identical(sc, requests)
        assert python.requests_df["state"].tolist() == ["finished" if prompt == 5 else "rejected", "finished"]


def test_a_numba_that_cannot_build_it_falls_back_to_the_python_engine(monkeypatch):
    import sys

    rk.use(True)
    for name in [*ce._PLAIN, "_price"]:  # (restored after the test: the failure puts the plain functions back)
        monkeypatch.setattr(ce, name, getattr(ce, name))
    for mod in (cp, cg):
        for name in mod.PLAIN:
            monkeypatch.setattr(mod, name, getattr(mod, name))
    monkeypatch.setattr(ce, "_price_rows", ce._price_rows)
    monkeypatch.setattr(ce, "_loaded", None)
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    sc = scenario_from_dict(BASE)
    with pytest.warns(RuntimeWarning, match="compiled engine is unavailable"):
        res = simulate(sc, progress=False)
    assert res.engine == "python" and ce._loaded is False
    assert cp.price is cp.PLAIN["price"] and ce._price is cp.price  # (the price's compiled callees too)
    with pytest.raises(ScenarioError, match="numba could not build"):
        simulate(sc, progress=False, compiled=True)


def test_several_replicas_rows_are_recorded_as_step_by_step():
    """Two replicas' rows, interleaved in the order their steps ended, handed over in blocks: each
    replica's bins take its staged steps when it has 4,096, and a later flush may widen every
    replica's bins. Here replica 1's flush (row 8190) comes before replica 0's (row 8191), whose
    last step starts past the 2,048 bins of 0.01 s and widens them; both in one block. Grouped by
    replica, replica 0 widened the bins before replica 1 added its steps, and its bins' busy
    seconds were summed in other groups (last-bit differences)."""
    rng = np.random.default_rng(9)
    k = 8192
    rows = np.zeros((k, len(ITERATION_COLUMNS)))
    rows[:, 0] = np.arange(k) % 2 == 0  # replica 1, 0, 1, 0, ...
    rows[:, 1] = np.append(np.linspace(0.0, 20.47, k - 1), 20.49)
    rows[:, 2] = rng.exponential(0.03, k)
    rows[:, 3] = rows[:, 5] = rows[:, 6] = rng.integers(1, 64, k)
    rows[:, 7:9] = (10, 100)
    rows[:, 14] = math.nan
    step_by_step = MetricsRecorder(num_replicas=2, iterations="binned")
    for r in rows:
        q = np.ones(int(r[3]), dtype=np.int64)
        batch = Batch(num_new_tokens=q, num_context_tokens=q, samples=q.astype(bool))
        batch.set_shape(int(r[3]), int(r[3]), int(r[6]), 0, 0, 0, 0, int(r[5]), 0)
        step_by_step.on_iteration(int(r[0]), float(r[1]), float(r[2]), batch, 10, 100, 0, 0, 0, 0)
    blocks = MetricsRecorder(num_replicas=2, iterations="binned")
    for i in range(0, k, ce.ROW_BLOCK):
        blocks.on_iteration_rows(rows[i : i + ce.ROW_BLOCK])
    a, b = step_by_step.iterations_frame(), blocks.iterations_frame()
    assert len(a) > 1000 and a.equals(b)
    assert step_by_step.busy_by_replica().tolist() == blocks.busy_by_replica().tolist()


def test_servesim_run_says_why_a_large_run_took_the_python_engine(tmp_path, capsys):
    """With the compiled loops on (a large run; here ``SERVESIM_JIT=1``), a run the compiled engine
    does not take is named with the reason on stderr; one it takes has no such note."""
    import yaml
    from servesim.sim.cli import main

    for name, change, note in (("outside", {"scheduler": {"type": "continuous"}}, "scheduler continuous"),
                               ("inside", {}, None)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**BASE, **change}))
        assert main(["run", str(path), "--quiet", "--no-plots", "--out", str(tmp_path / name)]) == 0
        captured = capsys.readouterr()
        engine = "the Python engine" if note else "the compiled engine"
        assert f"on {engine};" in captured.out
        if note:
            assert f"the compiled engine (several times faster on large runs) does not run {note}" in captured.err
        else:
            assert "does not run" not in captured.err


def test_prefix_ids_of_any_size_and_a_table_too_large(monkeypatch):
    """A trace's prefix ids may be any non-negative ints (numbered densely, only equality
    matters); a prefix cache whose tables would pass the limit is named and left to Python."""
    sc, requests = random_case(5, shared_prefixes=True)
    ids = np.where(requests.prefix_id >= 0, requests.prefix_id * 10**12 + 7, -1)
    sparse = RequestArrays(requests.arrival_time, requests.prompt_len, requests.output_len, ids, requests.prefix_len)
    python, compiled = assert_identical(sc, sparse)
    assert python.requests_df["num_cached_tokens"].sum() > 0
    monkeypatch.setattr(ce, "CACHE_BYTES_MOST", 1000)
    with pytest.raises(ScenarioError, match="MiB key table per replica"):
        simulate(sc, requests=sparse, progress=False, compiled=True)
