"""Routers: each sees only its own view (own counts, scrapes every refresh interval, own record of
routed prompts), and prefix-aware routing pays on multi-turn chat."""

from __future__ import annotations

import pytest
from servesim.sim.kv_cache import BlockManager
from servesim.sim.request import Request
from servesim.sim.router import Router
from servesim.sim.scenario import scenario_from_dict
from servesim.sim.simulate import simulate


def chat(router: str, **cluster) -> dict:
    return scenario_from_dict({
        "name": "chat", "seed": 3, "model": "llama-3.1-8b", "hardware": "h100-sxm",
        "cost_model": {"type": "roofline"},
        "scheduler": {"type": "chunked", "max_num_seqs": 64, "max_num_batched_tokens": 2048},
        "kv_cache": {"block_size": 16, "num_blocks": 2500, "enable_prefix_caching": True},
        "cluster": {"num_replicas": 4, "router": router, **cluster},
        "workload": {
            "num_requests": 60, "arrival": {"process": "poisson", "rate": 3.0},
            "prompt_len": {"dist": "uniform", "min": 50, "max": 300},
            "output_len": {"dist": "uniform", "min": 20, "max": 200},
            "sessions": {"turns": 5, "think_time_s": 2.0, "system_prompt_len": 200},
        },
    })


@pytest.fixture(scope="module")
def chat_runs():
    return {r: simulate(chat(r), progress=False) for r in ("prefix_aware", "round_robin")}


def test_prefix_aware_beats_round_robin_on_multi_turn_chat(chat_runs):
    pa, rr = chat_runs["prefix_aware"].summary, chat_runs["round_robin"].summary
    assert pa["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"] + 0.1
    assert pa["median_ttft_ms"] < rr["median_ttft_ms"]


def test_summary_reports_hit_rate_per_replica(chat_runs):
    s = chat_runs["prefix_aware"].summary
    reps = s["replicas"]
    assert [r["replica"] for r in reps] == [0, 1, 2, 3]
    assert sum(r["num_requests"] for r in reps) == len(chat_runs["prefix_aware"].requests) == 300
    hits = sum(r["prefix_cache_hit_tokens"] for r in reps)
    queries = sum(r["prefix_cache_query_tokens"] for r in reps)
    assert hits / queries == pytest.approx(s["prefix_cache_hit_rate"])
    assert all(0 < r["busy_fraction"] <= 1 for r in reps)


def test_prefix_aware_keeps_a_session_on_one_replica_when_load_weight_is_zero():
    res = simulate(chat("prefix_aware", load_weight=0.0), progress=False)
    by_session: dict[int, set[int]] = {}
    for req in res.requests:
        by_session.setdefault(req.session_id, set()).add(req.replica)
    # every later turn matches its own conversation best; only the first turn (system prompt) is a toss-up
    assert all(len(reps) == 1 for reps in by_session.values())


@pytest.mark.parametrize("router", ["least_kv_usage", "power_of_two_choices", "prefix_aware", "kv_aware", "vllm_dp"])
def test_every_router_serves_each_request_once(router):
    res = simulate(chat(router, router_refresh_s=0.5), progress=False)
    assert res.summary["completed"] == 300  # conservation is asserted by the cluster at the end


def test_power_of_two_choices_is_seeded():
    sc = chat("power_of_two_choices")
    a = [r.replica for r in simulate(sc, progress=False).requests]
    b = [r.replica for r in simulate(sc, progress=False).requests]
    c = [r.replica for r in simulate(sc.model_copy(update={"seed": 4}), progress=False).requests]
    assert a == b and a != c


# ---- the router's view, on stand-in replicas ---------------------------------------------------------
class _Sched:
    def __init__(self, blocks: int) -> None:
        self.kv = BlockManager(blocks, 16)
        self.waiting: list[Request] = []
        self.num_running = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


class _Rep:
    def __init__(self, i: int, blocks: int = 100) -> None:
        self.replica_id = i
        self.scheduler = _Sched(blocks)


def _fill(rep: _Rep, tokens: int, rid: int) -> None:
    rep.scheduler.kv.allocate(Request(rid, 0.0, tokens, 1), tokens)


def test_least_kv_usage_reads_a_scrape_that_is_stale_until_the_refresh_interval():
    reps = [_Rep(0), _Rep(1)]
    router = Router(reps, "least_kv_usage", refresh_s=10.0)
    _fill(reps[0], 800, 1)  # replica 0 half full, replica 1 empty
    assert router.pick(Request(10, 0.0, 16, 1), now=0.0) is reps[1]
    _fill(reps[1], 1600, 2)  # now replica 1 is fuller, but the router has not scraped again
    router.on_done(reps[1])
    assert router.pick(Request(11, 1.0, 16, 1), now=1.0) is reps[1]
    router.on_done(reps[1])
    assert router.pick(Request(12, 10.0, 16, 1), now=10.0) is reps[0]  # fresh scrape


def test_least_outstanding_counts_what_the_router_sent_and_was_answered():
    reps = [_Rep(0), _Rep(1)]
    router = Router(reps, "least_outstanding")
    assert router.pick(Request(1, 0.0, 16, 1)) is reps[0]
    assert router.pick(Request(2, 0.0, 16, 1)) is reps[1]
    router.on_done(reps[1])
    assert router.pick(Request(3, 0.0, 16, 1)) is reps[1]


def test_prefix_aware_scores_matched_prefix_against_load():
    reps = [_Rep(0), _Rep(1)]
    seg = ((7, 320),)
    router = Router(reps, "prefix_aware", prefix_weight=1.0, load_weight=0.5)
    first = router.pick(Request(1, 0.0, 320, 1, segments=seg))
    # same prompt: replica that got it scores 1.0 prefix + 0 load (it is the busiest) > 0 + 0.5
    assert router.pick(Request(2, 0.0, 320, 1, segments=seg)) is first
    # with load weighing more than a full prefix match, the idle replica wins
    heavy = Router(reps, "prefix_aware", prefix_weight=1.0, load_weight=2.0)
    a = heavy.pick(Request(3, 0.0, 320, 1, segments=seg))
    assert heavy.pick(Request(4, 0.0, 320, 1, segments=seg)) is not a


def test_the_prefix_router_hashes_no_more_blocks_than_a_replica_can_record():
    # a 2**32-token prompt cost 2**28 hashes in the router before its replica rejected it
    reps = [_Rep(0, blocks=100), _Rep(1, blocks=300)]
    router = Router(reps, "prefix_aware")
    assert len(router.prompt_keys(Request(0, 0.0, 2**32, 2, segments=((1, 2**32),)))) == 300
    assert len(router.prompt_keys(Request(1, 0.0, 320, 2, segments=((1, 320),)))) == 320 // router.block_size


def test_vllm_dp_weighs_waiting_four_times_and_counts_its_picks_until_the_next_snapshot():
    """vLLM's DPLBAsyncMPClient: 4 x waiting + running from the coordinator's snapshot (every
    router_refresh_s), each pick counted as waiting at its engine until the next one; ties low index."""
    reps = [_Rep(0), _Rep(1)]
    router = Router(reps, "vllm_dp", refresh_s=0.1)
    reps[0].scheduler.num_running = 6  # 6 running, nothing waiting: score 6
    reps[1].scheduler.num_running = 3  # 3 running, 1 waiting: score 7 (4 with waiting counted once)
    reps[1].scheduler.waiting.append(Request(1, 0.0, 16, 1))
    assert router.pick(Request(10, 0.0, 16, 1), now=0.0) is reps[0]  # 6 < 7; replica 0 now 10
    assert router.pick(Request(11, 0.01, 16, 1), now=0.01) is reps[1]  # 7 < 10; replica 1 now 11
    reps[1].scheduler.num_running = 0  # replica 1 drains, but the snapshot is 0.1 s old at most
    reps[1].scheduler.waiting.clear()
    assert router.pick(Request(12, 0.05, 16, 1), now=0.05) is reps[0]  # 10 < 11: its picks still count
    assert router.pick(Request(13, 0.2, 16, 1), now=0.2) is reps[1]  # fresh snapshot: 0 < 6
