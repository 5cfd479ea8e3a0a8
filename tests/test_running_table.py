"""RunningTable's row mechanics against plain Python lists: removing rows (stretch by stretch or
by mask), growing past its capacity, and the flat counters view that decode steps advance."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from servesim.sim.request import Request
from servesim.sim.schedulers.running import RunningTable, StepRows


def _table(n: int, capacity: int) -> tuple[RunningTable, list[list[float]]]:
    t = RunningTable(capacity)
    rows = []
    for i in range(n):
        r = Request(i, 0.0, 10 + i, 5 + i, priority=i % 3)
        r.num_computed_tokens, r.num_output_tokens, r.last_token_time = 3 * i, i % 4, 0.5 * i
        t.append(r, nblocks=i + 1)
        rows.append([r.num_computed_tokens, r.num_tokens, r.num_output_tokens, r.output_len, i + 1, r.priority,
                     r.last_token_time])
    return t, rows


def _columns(t: RunningTable) -> list[list[float]]:
    n = t.n
    cols = [t.computed[:n], t.tokens[:n], t.out[:n], t.out_len[:n], t.nblocks[:n], t.prio[:n], t.last_tok[:n]]
    return [list(r) for r in zip(*(c.tolist() for c in cols), strict=True)]


@pytest.mark.parametrize("gone", [[0], [5], [11], [0, 1], [2, 7], [3, 4, 5], [0, 11], [1, 3, 6, 8, 10],
                                  list(range(0, 12, 2)), list(range(12)), [0, 1, 2, 3, 4, 5, 6, 7, 8, 10]])
def test_removed_rows_leave_the_others_in_order(gone):
    t, rows = _table(12, 16)
    reqs = list(t.reqs)
    t.remove_rows(gone)
    keep = [i for i in range(12) if i not in gone]
    assert t.n == len(keep)
    assert _columns(t) == [rows[i] for i in keep]
    assert t.reqs == [reqs[i] for i in keep]


def test_removal_by_mask_matches_removal_by_rows_on_random_sets():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 30)
        gone = sorted(rng.sample(range(n), rng.randint(1, n)))
        a, rows = _table(n, 32)
        b, _ = _table(n, 32)
        a.remove_rows(gone)
        drop = np.zeros(n, dtype=bool)
        drop[gone] = True
        b.remove(drop)
        assert _columns(a) == _columns(b) == [rows[i] for i in range(n) if i not in gone]


def test_a_table_grown_past_its_capacity_keeps_its_rows_and_its_counters_view():
    t, rows = _table(5, 2)  # capacity 2: grows twice
    assert t.ints.shape[1] >= 5 and _columns(t) == rows
    assert np.shares_memory(t.counters, t.ints)
    # a decode step of every row advances computed, tokens and out by one through the flat view
    step = StepRows(np.arange(5), whole=True, decode_rows=5)
    t.out[:5] = 1  # every row has emitted a token already
    before = _columns(t)
    itl, first, done = t.advance(step, np.ones(5, dtype=np.int64), np.ones(5, dtype=bool), 9.0)
    after = _columns(t)
    for b, a in zip(before, after, strict=True):
        assert a[:3] == [b[0] + 1, b[1] + 1, b[2] + 1] and a[3:6] == b[3:6] and a[6] == 9.0
    assert first == [] and itl.tolist() == [9.0 - b[6] for b in before]


@pytest.mark.parametrize("m, tail", list(itertools.product([1, 3], [[1], [4, 0], [2, 5, 1]])))
def test_a_decode_step_with_a_few_rows_after_the_decodes_matches_the_masked_update(m, tail):
    """Rows 0..m-1 decode; the rows after them compute ``tail`` tokens (0: none this step)."""
    n = m + len(tail)
    fast, _ = _table(n, 16)
    ref, _ = _table(n, 16)
    for t in (fast, ref):
        t.out[:m] = 1
        t.tokens[:m] = t.computed[:m] + 1
    new = np.array([1] * m + tail, dtype=np.int64)
    samples = fast.computed[:n] + new >= fast.tokens[:n]
    got = fast.advance(StepRows(np.arange(n), whole=True, decode_rows=m), new, samples, 7.0)
    want = ref._advance_masked(n, m, new, samples, 7.0)  # masks over every row: the reference
    assert _columns(fast) == _columns(ref)
    assert sorted(got[0].tolist()) == sorted(want[0].tolist())
    assert sorted(got[1]) == sorted(want[1]) and sorted(got[2].tolist()) == sorted(want[2].tolist())


@pytest.mark.parametrize("gone", [[3, 1], [2, 2], [5, 9, 7]])
def test_rows_to_remove_out_of_order_are_refused_before_anything_moves(gone):
    t, rows = _table(12, 16)
    with pytest.raises(AssertionError, match="ascending and distinct"):
        t.remove_rows(gone)
    assert t.n == 12 and _columns(t) == rows
