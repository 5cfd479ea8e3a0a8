"""Live mode: the simulator's schedulers drive the real (tiny, random-weight) model in real time."""

from __future__ import annotations

import time

import pytest
import simpy.rt
from servesim.sim.cluster import Cluster
from servesim.sim.engine import Replica
from servesim.sim.kv_cache import BlockManager, CountingBlockManager
from servesim.sim.metrics import MetricsRecorder
from servesim.sim.request import Request, RequestState
from servesim.sim.scenario import scenario_from_dict
from servesim.sim.schedulers import ContinuousConfig, make_scheduler

torch = pytest.importorskip("torch")

from servesim.kernels import live  # noqa: E402
from servesim.sim import simulate as sim_module  # noqa: E402


def tiny_scenario(kind: str = "chunked", num_blocks: int | None = None, mode: str = "recompute", n: int = 8):
    d = {
        "name": "live-test",
        "seed": 3,
        "model": "tiny",
        "hardware": "cpu-2core",
        "scheduler": {"type": kind, "max_num_seqs": 8, "max_num_batched_tokens": 128, "preemption_mode": mode},
        "kv_cache": {"block_size": 8, "swap_space_gb": 0.001},
        "live": {"threads": 2, "warmup_steps": 0, "kv_cache_memory_mb": 4},
        "workload": {
            "num_requests": n,
            "arrival": {"process": "constant", "rate": 200.0},
            "prompt_len": {"dist": "uniform", "min": 9, "max": 40},
            "output_len": {"dist": "uniform", "min": 12, "max": 30},
            "token_ids": True,
            "vocab_size": 4096,
        },
    }
    if num_blocks is not None:
        d["kv_cache"]["num_blocks"] = num_blocks
    return scenario_from_dict(d)


def test_live_and_sim_build_their_scheduler_through_the_same_code_path(monkeypatch):
    built = []
    real = sim_module.build_scheduler

    def spy(sc, kv, block_ids=True):
        s = real(sc, kv, block_ids)
        built.append((type(s), s.config, sc.scheduler, type(s.kv)))
        return s

    monkeypatch.setattr(sim_module, "build_scheduler", spy)
    monkeypatch.setattr(live, "build_scheduler", spy)
    assert live.build_scheduler is spy  # live imports the simulator's builder, not its own
    sc = tiny_scenario(n=3)
    sim_module.simulate(sc, progress=False)
    live.run_live(sc, progress=False)
    (sim_cls, sim_cfg, sim_sc_cfg, sim_kv), (live_cls, live_cfg, live_sc_cfg, live_kv) = built
    assert sim_cls is live_cls
    # the block manager differs: live mode's kernels read block ids, a simulation without prefix
    # caching keeps counts (the same answers to the scheduler)
    assert (sim_kv, live_kv) == (CountingBlockManager, BlockManager)
    assert sim_cfg is sim_sc_cfg and live_cfg is live_sc_cfg  # the scenario's own config object
    assert sim_cfg == live_cfg


def _tokens(sc):
    res = live.run_live(sc, progress=False)
    assert all(r.state == RequestState.FINISHED for r in res.requests)
    assert all(len(r.output_token_ids) == r.output_len for r in res.requests)
    return {r.request_id: list(r.output_token_ids) for r in res.requests}, res


@pytest.mark.parametrize("mode", ["recompute", "soft_reset", "swap"])
def test_greedy_tokens_survive_heavy_preemption_unchanged(mode):
    reference, _ = _tokens(tiny_scenario(num_blocks=400))
    pressured, res = _tokens(tiny_scenario(num_blocks=14, mode=mode))
    assert res.summary["num_preemptions"] > 0, "the small cache did not preempt; the test proves nothing"
    assert pressured == reference


def test_a_victim_rehits_its_own_blocks_live_with_unchanged_tokens_and_the_replay_takes_the_same_steps(
        monkeypatch, reference_tokens):
    from servesim.calibration.replay import StepTrace, check_dynamics

    rehits = []
    lookup = BlockManager.lookup_prefix

    def spy(self, r):  # noqa: ANN001, ANN202
        cached = lookup(self, r)
        if r.num_preemptions:
            rehits.append(cached)
        return cached

    monkeypatch.setattr(BlockManager, "lookup_prefix", spy)
    d = tiny_scenario(num_blocks=10, n=4).model_dump(mode="json", exclude_none=True)
    d["kv_cache"]["enable_prefix_caching"] = True
    sc = scenario_from_dict(d)
    pressured, res = _tokens(sc)
    assert res.summary["num_preemptions"] > 0 and max(rehits) > 0, "no victim found its blocks; proves nothing"
    assert pressured == reference_tokens  # the KV a victim finds again is the KV it computed
    # the replay keys a victim's generated blocks by its id (it has no generated ids), live by the
    # ids: the same blocks hit, so the simulation takes the live run's steps
    live_rehits, rehits[:] = list(rehits), []
    check = check_dynamics(sc, res.requests, StepTrace.of_run(res), res.requests_df)
    assert check.passed and check.num_replayed == check.num_steps
    assert rehits == live_rehits


def test_live_run_conserves_requests_and_never_shares_cache_rows(monkeypatch):
    seen_overlap = []
    original = live.LiveExecutor.run

    def checked(self, batch):
        rows = [b for r in batch.requests for b in self.kv.block_table(r)]
        if len(rows) != len(set(rows)):
            seen_overlap.append(rows)
        return original(self, batch)

    monkeypatch.setattr(live.LiveExecutor, "run", checked)
    sc = tiny_scenario(kind="continuous", num_blocks=16, n=6)
    res = live.run_live(sc, progress=False)  # run_replicas asserts conservation and no leaked block
    assert not seen_overlap
    assert res.summary["completed"] == 6
    assert res.mode == "live"
    assert res.iterations_df["sched_overhead_s"].notna().all()


class _SlowExecutor:
    """Each step sleeps for real, like a slow forward pass."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def run(self, batch) -> float:
        time.sleep(self.seconds)
        return self.seconds


def test_a_request_arriving_during_a_step_is_scheduled_in_the_next_step():
    env = simpy.rt.RealtimeEnvironment(strict=False)
    sched = make_scheduler(ContinuousConfig(schedule_order="decode_first"), BlockManager(64, 16))
    rep = Replica(env, 0, sched, _SlowExecutor(0.3), MetricsRecorder())
    a = Request(0, 0.0, 8, 4)
    b = Request(1, 0.1, 8, 2)  # arrives while a's first step (0.0 -> 0.3) runs
    env.sync()
    Cluster(env, [rep]).run([a, b])
    assert a.first_scheduled_time == pytest.approx(0.0, abs=0.05)
    # seen by the very next schedule call, at the end of a's first step, not a step later
    assert b.first_scheduled_time == pytest.approx(0.3, abs=0.08)
    assert b.first_token_time == pytest.approx(0.6, abs=0.12)


@pytest.fixture(scope="module")
def reference_tokens():
    return _tokens(tiny_scenario(num_blocks=400, n=4))[0]


@pytest.mark.parametrize("preset", [
    {"preset": "tensorrt-llm", "capacity_scheduler_policy": "MAX_UTILIZATION", "max_num_tokens": 128,
     "enable_chunked_prefill": True},
    pytest.param({"preset": "hf-transformers", "max_batch_tokens": 128}, marks=pytest.mark.slow),
    pytest.param({"preset": "sglang", "chunked_prefill_size": 64}, marks=pytest.mark.slow),
])
def test_engine_preset_schedulers_drive_the_model_live_with_unchanged_tokens(preset, reference_tokens):
    sc = tiny_scenario(num_blocks=10, n=4)
    d = sc.model_dump(mode="json", exclude_none=True)
    d["scheduler"] = preset
    d["kv_cache"] = {"block_size": 8, "num_blocks": 10, "swap_space_gb": 0.001}  # 80 tokens: pressure
    tokens, res = _tokens(scenario_from_dict(d))
    assert res.scenario.scheduler_name == preset["preset"]
    assert tokens == reference_tokens  # greedy outputs do not depend on how the steps were scheduled
    if preset["preset"] != "sglang":  # its admission estimate keeps this small run clear of retraction
        assert res.summary["num_preemptions"] > 0, "no KV pressure; the test proves little"


def test_a_live_run_that_cannot_fit_is_refused_before_anything_is_allocated(monkeypatch):
    from servesim.sim.scenario import ScenarioError, load_scenario

    built = []
    monkeypatch.setattr(live, "LlamaModel", lambda *a, **k: built.append(1))
    big = load_scenario("scenarios/quickstart.yaml", ["workload.num_requests=3", "live.kv_cache_memory_mb=100"])
    with pytest.raises(ScenarioError, match=r"^model: live mode builds llama-3.1-8b .* 29.9 GiB of float32 weights"):
        live.run_live(big)
    kv_heavy = load_scenario("scenarios/live-cpu-chunked.yaml", ["workload.num_requests=3"])
    with pytest.raises(ScenarioError, match=r"^live.kv_cache_memory_mb: .* this machine has 1 MiB"):
        live.check_live_fits(kv_heavy, sim_module.plan_kv(kv_heavy, live.KVCache.block_bytes(
            live.get_model("tiny"), 16, 4)), memory_bytes=2**20)
    live.check_live_fits(kv_heavy, sim_module.plan_kv(kv_heavy, live.KVCache.block_bytes(
        live.get_model("tiny"), 16, 4)), memory_bytes=2**30)  # 16 MB of KV and ~10 MB of weights fit
    with pytest.raises(ScenarioError, match="^cluster.disagg: live mode runs colocated replicas only"):
        live.run_live(load_scenario("scenarios/cluster/disagg.yaml", ["workload.num_requests=3"]))
    assert built == []


def test_live_sessions_carry_the_generated_reply_into_the_next_turn_and_hit_the_cache_as_simulated():
    from servesim.sim.scenario import load_scenario

    sc = load_scenario("scenarios/live-cpu-chunked.yaml", [
        "workload.token_ids=false", "workload.num_requests=2", "kv_cache.enable_prefix_caching=true",
        "workload.sessions={turns: 3, think_time_s: 0.05, system_prompt_len: 48}",
        "workload.prompt_len={dist: uniform, min: 16, max: 64}", "workload.output_len={dist: uniform, min: 4, max: 12}",
        "live.warmup_steps=0"])
    res = live.run_live(sc, progress=False)
    reqs = {r.request_id: r for r in res.requests}
    assert len(reqs) == 6 and all(r.state == RequestState.FINISHED for r in reqs.values())
    for r in reqs.values():
        assert len(r.prompt_token_ids) == r.prompt_len
        if r.next_turn is not None:  # the conversation so far, the reply as the model generated it
            seen = r.prompt_len + r.output_len
            assert r.next_turn.prompt_token_ids[:seen] == r.all_token_ids()
    sim = sim_module.simulate(sc, progress=False)
    assert res.requests_df["num_cached_tokens"].tolist() == sim.requests_df["num_cached_tokens"].tolist()
    assert res.requests_df["num_cached_tokens"].iloc[1:].gt(0).all()  # every later turn and session hit


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_decode_steps_through_the_graph_path_give_the_same_tokens_under_preemption(mode, reference_tokens, monkeypatch):
    """live.cuda_graphs: decode-only steps go through DecodeGraphs' padded static buffers (eager on
    a CPU); every other step the plain forward. Greedy tokens must not change."""
    from servesim.kernels import graphs

    made = []
    init = graphs.DecodeGraphs.__init__

    def spy(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(graphs.DecodeGraphs, "__init__", spy)
    d = tiny_scenario(num_blocks=10, n=4, mode=mode).model_dump(mode="json", exclude_none=True)
    d["live"]["cuda_graphs"] = True
    tokens, res = _tokens(scenario_from_dict(d))
    assert res.summary["num_preemptions"] > 0, "no KV pressure; the test proves little"
    (g,) = made
    assert g.sizes == [1, 2, 4, 8] and g.max_context == 80  # max_num_seqs 8; 10 blocks of 8 tokens
    assert 0 < g.num_replays < res.summary["num_iterations"]  # decode steps only
    assert res.iterations_df["graphed"].sum() == g.num_replays  # iterations.parquet says which steps
    assert tokens == reference_tokens


def test_every_step_through_decode_and_piecewise_graphs_gives_the_same_tokens(reference_tokens):
    """live.piecewise_graphs beside live.cuda_graphs: prefill and mixed steps through the pieces,
    decode steps through the decode graphs, every step one of the two; tokens unchanged."""
    d = tiny_scenario(num_blocks=10, n=4, mode="swap").model_dump(mode="json", exclude_none=True)
    d["live"].update(cuda_graphs=True, piecewise_graphs=True)
    tokens, res = _tokens(scenario_from_dict(d))
    assert res.summary["num_preemptions"] > 0, "no KV pressure; the test proves little"
    assert res.iterations_df["graphed"].all()  # max_num_batched_tokens 128: every step fits a piece chain
    assert tokens == reference_tokens
