"""The paged KV block manager: allocation, freeing, prefix caching, swap space."""

from __future__ import annotations

import random

import pytest
from servesim.sim.kv_cache import BlockManager, CountingBlockManager
from servesim.sim.request import Request, RequestState


def req(i: int, prompt: int = 40, **kw) -> Request:
    return Request(i, 0.0, prompt, 10, **kw)


def test_allocate_grows_by_whole_blocks_and_free_returns_them():
    kv = BlockManager(10, 4)
    r = req(0)
    assert kv.allocate(r, 5)
    assert kv.num_blocks_of(r) == 2
    assert kv.allocate(r, 8)  # still fits in two blocks
    assert kv.num_blocks_of(r) == 2
    assert kv.allocate(r, 9)
    assert kv.num_blocks_of(r) == 3
    assert kv.free(r) == 3
    kv.check_all_free()


def test_allocation_that_does_not_fit_changes_nothing():
    kv = BlockManager(4, 4)
    a, b = req(0), req(1)
    assert kv.allocate(a, 12)
    assert not kv.allocate(b, 8)
    assert kv.num_blocks_of(b) == 0 and kv.num_free_blocks == 1


def test_watermark_keeps_blocks_free_on_admission_only():
    kv = BlockManager(100, 4, watermark=0.1)
    r = req(0)
    assert not kv.can_allocate(95, watermark=True)
    assert kv.can_allocate(90, watermark=True)
    assert kv.can_allocate(95)
    assert kv.allocate(r, 95 * 4)


def test_block_tables_of_live_requests_never_share_a_block():
    kv = BlockManager(50, 4)
    reqs = [req(i) for i in range(5)]
    for r in reqs:
        assert kv.allocate(r, 37)
    blocks = [b for r in reqs for b in kv.block_table(r)]
    assert len(blocks) == len(set(blocks))


def test_prefix_cache_hits_shared_prefix_blocks_and_refcounts_them():
    kv = BlockManager(20, 4, enable_prefix_caching=True)
    a = req(0, prompt=20, prefix_id=7, prefix_len=12)
    assert kv.lookup_prefix(a) == 0
    assert kv.allocate(a, 20)
    kv.cache_computed_blocks(a, 20)
    b = req(1, prompt=30, prefix_id=7, prefix_len=12)
    assert kv.lookup_prefix(b) == 12  # three full shared blocks
    assert kv.block_table(b)[:3] == kv.block_table(a)[:3]
    kv.free(a)
    # the shared blocks are still held by b; nothing is evictable yet from them
    assert kv.stats().num_cached_evictable == 0
    kv.free(b)
    assert kv.stats().num_cached_evictable == 3
    kv.check_all_free()


def test_prefix_cache_by_token_ids_uses_a_hash_chain():
    kv = BlockManager(20, 4, enable_prefix_caching=True)
    ids = list(range(100, 112))
    a = req(0, prompt=12, prompt_token_ids=ids)
    kv.allocate(a, 12)
    kv.cache_computed_blocks(a, 12)
    same_start = req(1, prompt=12, prompt_token_ids=ids[:8] + [1, 2, 3, 4])
    assert kv.lookup_prefix(same_start) == 8
    other_first_block = req(2, prompt=12, prompt_token_ids=[9, 9, 9, 9] + ids[4:])
    # same second block content, different parent: the chain makes it a miss
    assert kv.lookup_prefix(other_first_block) == 0


def test_a_fully_cached_prompt_still_leaves_one_token_to_compute():
    kv = BlockManager(20, 4, enable_prefix_caching=True)
    ids = list(range(8))
    a = req(0, prompt=8, prompt_token_ids=ids)
    kv.allocate(a, 8)
    kv.cache_computed_blocks(a, 8)
    b = req(1, prompt=8, prompt_token_ids=ids)
    assert kv.lookup_prefix(b) == 4


def test_evictable_cached_blocks_are_reused_least_recently_used_first():
    kv = BlockManager(4, 4, enable_prefix_caching=True)
    a = req(0, prompt=9, prefix_id=1, prefix_len=8)
    kv.allocate(a, 9)
    kv.cache_computed_blocks(a, 9)
    kv.free(a)  # 2 cached evictable blocks + 2 free
    assert kv.num_free_blocks == 4
    big = req(1)
    assert kv.allocate(big, 16)  # takes the free ones, then evicts the cached blocks
    c = req(2, prompt=9, prefix_id=1, prefix_len=8)
    kv.free(big)
    assert kv.lookup_prefix(c) == 0


def preempt_after(kv: BlockManager, r: Request, outputs: int, generated: bool = True) -> None:
    """Run ``r`` (admitted through a lookup) to ``outputs`` generated tokens, then preempt it by
    recompute as a scheduler does: publish, free, forget what was computed."""
    kv.lookup_prefix(r)
    r.num_output_tokens = outputs
    r.num_computed_tokens = r.num_tokens - 1  # decoding: all but the token just sampled
    assert kv.allocate(r, r.num_computed_tokens)
    kv.cache_computed_blocks(r, r.prompt_len)
    r.num_preemptions += 1
    kv.cache_preempted(r, generated=generated)
    kv.free(r)
    r.num_computed_tokens = 0


def test_a_preempted_request_finds_its_own_prompt_and_generated_blocks_and_nobody_else_does():
    kv = BlockManager(20, 4, enable_prefix_caching=True)
    a = req(0, prompt=10, prefix_id=3, prefix_len=8)
    preempt_after(kv, a, outputs=5)  # 15 tokens, 14 computed: 3 full blocks, 2 of them the shared prefix
    assert kv.stats().num_cached_evictable == 3
    same_prefix = req(1, prompt=20, prefix_id=3, prefix_len=8)
    assert kv.lookup_prefix(same_prefix) == 8  # the shared prefix, not a's own third block
    assert kv.lookup_prefix(a) == 12  # up to num_tokens - 1 = 14 tokens: 3 blocks
    assert (kv.prefix_hits, kv.preempted_prefix_hits) == (2, 3)  # the comeback is counted apart
    kv.free(same_prefix)
    a.state = RequestState.FINISHED
    kv.free(a)
    kv.check_all_free()


def test_publishing_the_prompt_only_leaves_the_generated_blocks_to_recompute():
    kv = BlockManager(20, 4, enable_prefix_caching=True)
    a = req(0, prompt=10)
    preempt_after(kv, a, outputs=5, generated=False)  # SGLang: the radix tree keeps the prompt
    assert kv.lookup_prefix(a) == 8  # the prompt's 2 full blocks of the 3 computed


def test_generated_blocks_continue_the_hash_chain_over_the_generated_ids_when_there_are_any():
    prompt = list(range(100, 110))
    outputs = [7, 7, 8, 8, 9]
    hits = {}
    for live in (True, False):  # live mode has the generated ids, a simulation does not
        kv = BlockManager(20, 4, enable_prefix_caching=True)
        a = req(0, prompt=10, prompt_token_ids=prompt, output_token_ids=outputs if live else [])
        preempt_after(kv, a, outputs=5)
        # a later prompt that is a's prompt and replies: vLLM's content hash finds a's third block
        follow_up = req(1, prompt=16, prompt_token_ids=prompt + outputs + [1])
        hits[live] = kv.lookup_prefix(follow_up), kv.lookup_prefix(a)
    assert hits[True] == (12, 12)
    assert hits[False] == (8, 12)  # simulated generated blocks are a's alone; a finds them all the same


def test_swap_out_and_in_round_trip_moves_blocks_through_host_memory():
    kv = BlockManager(8, 4, num_host_blocks=4)
    r = req(0)
    kv.allocate(r, 12)
    dev = list(kv.block_table(r))
    out = kv.swap_out(r)
    assert [d for d, _ in out] == dev
    assert kv.num_free_blocks == 8 and kv.num_host_free_blocks == 1
    back = kv.swap_in(r)
    assert [h for h, _ in back] == [h for _, h in out]
    # the host blocks are reusable only once this step's copies are decided
    assert kv.num_blocks_of(r) == 3 and kv.num_host_free_blocks == 1
    kv.end_step()
    assert kv.num_host_free_blocks == 4
    kv.free(r)
    kv.check_all_free()


def test_swap_out_refuses_when_host_space_is_short():
    kv = BlockManager(8, 4, num_host_blocks=1)
    r = req(0)
    kv.allocate(r, 12)
    assert kv.swap_out(r) is None
    assert kv.num_blocks_of(r) == 3


def test_extend_each_is_allocate_in_order_and_stops_at_the_first_failure():
    for caching in (False, True):
        one, each = BlockManager(12, 4, enable_prefix_caching=caching), BlockManager(12, 4, enable_prefix_caching=caching)
        rs = [req(i) for i in range(4)]
        for kv in (one, each):
            assert kv.allocate(rs[0], 4)
        wants = [9, 1, 16, 30]  # 2 more blocks for request 0, 1 and 4 for new ones, then 8 > the 4 left
        counts = [2, 1, 4, 8]
        expect = -1
        for j, (r, t) in enumerate(zip(rs, wants, strict=True)):
            if not one.allocate(r, t):
                expect = j
                break
        assert expect == 3
        assert each.extend_each(rs, counts) == expect
        assert [each.block_table(r) for r in rs] == [one.block_table(r) for r in rs]
        assert each.num_free_blocks == one.num_free_blocks == 4
        # enough blocks (the fast path without caching): the same blocks as allocate one by one
        assert each.extend_each(rs[:2], [1, 2]) == -1
        assert one.allocate(rs[0], 16) and one.allocate(rs[1], 12)
        assert [each.block_table(r) for r in rs] == [one.block_table(r) for r in rs]


def check_block_accounting(kv: BlockManager) -> None:
    """Every block is exactly one of: on the free list (named by no key), cached and evictable
    (keyed, no holder), or held; a keyed block counts its holders, a block no key names has one
    holder at most and counts 0 (what the bulk take and free paths rely on)."""
    holders = [0] * kv.num_blocks
    for table in kv._tables.values():
        for b in table:
            holders[b] += 1
    free = set(kv._free)
    assert len(free) == len(kv._free), "a block is twice on the free list"
    for b in range(kv.num_blocks):
        keyed = kv._block_key[b] is not None
        places = (b in free) + (b in kv._evictable) + (holders[b] > 0)
        assert places == 1, f"block {b}: free {b in free}, evictable {b in kv._evictable}, {holders[b]} holders"
        if keyed:
            assert b not in free and kv._ref[b] == holders[b], f"keyed block {b}: ref {kv._ref[b]}, {holders[b]} holders"
            assert kv._key_block[kv._block_key[b]] == b
        else:
            assert b not in kv._evictable and kv._ref[b] == 0 and holders[b] <= 1, f"unkeyed block {b}"


def test_random_traffic_keeps_every_block_accounted_for():
    """Random admissions (shared prefixes, lookups), growth, publishing, preemption with published
    blocks, eviction and frees, at several block sizes: the accounting holds after every operation,
    and all blocks come back."""
    import random

    for seed in range(40):
        rng = random.Random(seed)
        bs = rng.choice([1, 2, 4, 16])
        kv = BlockManager(rng.choice([12, 40, 200]), bs, enable_prefix_caching=rng.random() < 0.8)
        live: list[Request] = []
        next_id = 0
        for _ in range(300):
            op = rng.random()
            if op < 0.35 or not live:  # admit: look up the cache, then take the first chunk
                r = Request(next_id, 0.0, rng.randint(1, 60), rng.randint(1, 20),
                            prefix_id=rng.choice([-1, 0, 1]), prefix_len=rng.choice([0, 8, 24]))
                next_id += 1
                cached = kv.lookup_prefix(r)
                chunk = min(r.prompt_len - cached, rng.randint(1, 64))
                if kv.allocate(r, cached + chunk):
                    r.num_computed_tokens = cached + chunk
                    kv.cache_computed_blocks(r, r.num_computed_tokens)
                    live.append(r)
                elif cached:
                    kv.free(r)
            elif op < 0.7:  # grow: a chunk or a decode
                r = rng.choice(live)
                if r.num_computed_tokens < r.prompt_len:
                    want = min(r.prompt_len, r.num_computed_tokens + rng.randint(1, 64))
                else:
                    want = r.num_computed_tokens + 1
                    r.num_output_tokens += 1
                if kv.allocate(r, want):
                    r.num_computed_tokens = want
                    kv.cache_computed_blocks(r, want)
            elif op < 0.85:  # preempt by recompute, publishing what it computed
                r = live.pop(rng.randrange(len(live)))
                r.num_preemptions += 1
                kv.cache_preempted(r, generated=rng.random() < 0.5)
                kv.free(r)
                r.num_computed_tokens = 0
            else:  # finish
                r = live.pop(rng.randrange(len(live)))
                r.state = RequestState.FINISHED
                kv.free(r)
            check_block_accounting(kv)
        for r in live:
            r.state = RequestState.FINISHED
            kv.free(r)
        kv.check_all_free()
        check_block_accounting(kv)


@pytest.mark.parametrize("seed", range(6))
def test_counting_manager_answers_every_call_as_the_block_manager_without_caching(seed):
    # simulation without prefix caching keeps counts only: random allocations (with and without
    # the watermark), per-request growth, decode appends, frees, swaps out and in, step ends; every
    # answer, count, holder and stat must be the id-keeping manager's
    rng = random.Random(seed)
    num_blocks, host = rng.choice([(24, 0), (24, 10), (64, 40), (9, 30)])
    ids = BlockManager(num_blocks, 4, num_host_blocks=host, watermark=0.1)
    counts = CountingBlockManager(num_blocks, 4, num_host_blocks=host, watermark=0.1)
    rs = [req(i) for i in range(8)]
    out: set[int] = set()  # swapped out: as in the schedulers, they grow and free nothing until back
    swaps = 0
    for _ in range(400):
        op = rng.choice(["allocate", "extend", "append", "free", "swap_out", "swap_in", "end_step"])
        live = [r for r in rs if r.request_id not in out]
        if op == "allocate" and live:
            r, t, w = rng.choice(live), rng.randint(0, 60), rng.random() < 0.5
            got = [kv.allocate(r, t, watermark=w) for kv in (ids, counts)]
        elif op == "extend" and live:
            chosen = rng.sample(live, rng.randint(1, min(4, len(live))))
            c = [rng.randint(1, 5) for _ in chosen]
            got = [ids.extend_each(chosen, c), counts.extend_each(chosen, c)]
        elif op == "append" and live:
            chosen = [rng.choice(live) for _ in range(rng.randint(0, 6))]
            got = [kv.append_blocks(chosen) for kv in (ids, counts)]
        elif op == "free" and live:
            r = rng.choice(live)
            got = [kv.free(r) for kv in (ids, counts)]
        elif op in ("swap_out", "swap_in"):
            r = rng.choice(live if op == "swap_out" else [q for q in rs if q.request_id in out] or rs)
            got = [getattr(kv, op)(r) for kv in (ids, counts)]
            got = [None if g is None else len(g) for g in got]  # (ids: real copy pairs; counts: placeholders)
            if got[0]:
                (out.add if op == "swap_out" else out.discard)(r.request_id)
                swaps += op == "swap_out"
        else:
            got = [kv.end_step() for kv in (ids, counts)]
        assert got[0] == got[1], (op, got)
        assert ids.stats() == counts.stats()
        assert [(ids.num_blocks_of(r), ids.holds(r)) for r in rs] == [(counts.num_blocks_of(r), counts.holds(r))
                                                                      for r in rs]
        assert (ids.num_free_blocks, ids.num_used_blocks, ids.num_host_free_blocks) == \
            (counts.num_free_blocks, counts.num_used_blocks, counts.num_host_free_blocks)
    assert swaps or not host, "the sequence never swapped"
    for kv in (ids, counts):
        for r in rs:
            kv.free(r)
        for r in rs:
            assert kv.swap_in(r) is not None
            kv.free(r)
        kv.check_all_free()
    with pytest.raises(RuntimeError, match="keeps block counts"):
        counts.block_table(rs[0])
