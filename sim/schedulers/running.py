"""The running requests as a structure of arrays, behind a narrow API.

A policy's ``schedule`` picks rows of this table and how many tokens each computes; the
vectorised work over the rows (appending and removing, growing their KV blocks with the policy's
preemption passed in as ``make_room``, a finished step's counters, inter-token latencies, who
finished) happens here, in a few numpy operations per step rather than a Python loop per request. A row's counters are written back to its ``Request`` (``sync``) when it leaves.

``StepRows`` is the scheduler's own record of the rows a step scheduled: an index array, or, in
the common case of every running row in table order, the leading ``k`` rows (``whole``), which
the update handles with slices instead of fancy indexing. It never leaves the scheduler; the
``Batch`` handed to the executor carries only the step's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import row_kernels as rk
from ..kv_cache import BlockManager
from ..request import Request

# the policy's preemption: (blocks each row needs, mask of rows preempted so far, rows never preempted)
MakeRoom = Callable[[np.ndarray, np.ndarray, int], None]


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(slots=True)
class StepRows:
    """The table rows one step scheduled (``whole``: they are 0..k-1, every running row in order),
    of which the first ``decode_rows`` compute one token and sample."""

    rows: np.ndarray
    whole: bool = False
    decode_rows: int = 0


class RunningTable:
    """Running requests as a structure of arrays, in admission order (oldest first).

    The columns are rows of one 2-D int64 array, so removing rows moves them all in one
    operation; the float column (``last_tok``) is its last row's bits read as float64. The first
    three (computed, tokens, out) are also one flat view (``counters``): a step that adds one to
    them for every row is then one contiguous operation over the whole capacity, including the
    unused columns past ``n``, which hold nothing (``append`` writes all of a column).
    """

    __slots__ = ("reqs", "n", "ints", "computed", "tokens", "out", "out_len", "nblocks", "prio", "last_tok",
                 "counters", "_scratch", "_itl")

    def __init__(self, capacity: int) -> None:
        cap = max(capacity, 1)
        self.reqs: list[Request] = []
        self.n = 0
        self._bind(np.zeros((7, cap), dtype=np.int64))  # all-zero bits are 0.0 in the float row

    def _bind(self, ints: np.ndarray) -> None:
        self.ints = ints
        self.computed = ints[0]  # tokens with KV in the cache
        self.tokens = ints[1]  # tokens that exist (prompt + outputs)
        self.out = ints[2]  # outputs generated so far
        self.out_len = ints[3]  # outputs wanted
        self.nblocks = ints[4]  # device blocks held
        self.prio = ints[5]
        self.last_tok = ints[6].view(np.float64)  # time of the last output token
        self.counters = ints[:3].reshape(-1)  # computed, tokens, out over the whole capacity (a view)
        # what the compiled loops (row_kernels) write a step's row lists and ITLs into
        cap = ints.shape[1]
        self._scratch = (np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64))
        self._itl = np.empty(cap)

    def append(self, req: Request, nblocks: int) -> int:
        i = self.n
        if i == self.ints.shape[1]:
            self._bind(np.concatenate([self.ints, np.zeros_like(self.ints)], axis=1))
        self.reqs.append(req)
        self.ints[:6, i] = (req.num_computed_tokens, req.num_tokens, req.num_output_tokens, req.output_len,
                            nblocks, req.priority)
        self.last_tok[i] = req.last_token_time
        self.n = i + 1
        return i

    def sync(self, i: int) -> Request:
        """Write row i's counters back to its Request."""
        req = self.reqs[i]
        req.num_computed_tokens = int(self.computed[i])
        req.num_output_tokens = int(self.out[i])
        req.last_token_time = float(self.last_tok[i])
        return req

    def remove(self, drop: np.ndarray) -> None:
        """Remove the rows where ``drop`` (bool, length n) is true, keeping order."""
        gone = drop.nonzero()[0]
        self.remove_rows(gone.tolist(), drop, gone)

    def remove_rows(self, gone: list[int], drop: np.ndarray | None = None, gone_rows: np.ndarray | None = None) -> None:
        """Remove rows ``gone`` (ascending, distinct), keeping order; ``drop`` is their mask and
        ``gone_rows`` the same rows as an int64 array, if known."""
        if not gone:
            return
        n = self.n
        k = n - len(gone)
        ints = self.ints
        if rk.ON:
            if rk.close_rows(ints, gone_rows if gone_rows is not None else np.array(gone, dtype=np.int64), n) < 0:
                raise AssertionError(f"rows to remove must be ascending and distinct, got {gone}")
        elif len(gone) > 1 and any(a >= b for a, b in zip(gone, gone[1:], strict=False)):
            raise AssertionError(f"rows to remove must be ascending and distinct, got {gone}")
        elif len(gone) <= _FEW_GONE:  # the common case: shift each stretch between them down
            dst = gone[0]
            for j, g in enumerate(gone, 1):
                end = gone[j] if j < len(gone) else n
                if end > g + 1:
                    ints[:, dst : dst + end - g - 1] = ints[:, g + 1 : end]  # last_tok's bits too
                    dst += end - g - 1
        else:
            if drop is None:
                drop = np.zeros(n, dtype=bool)
                drop[gone] = True
            keep = ~drop
            ints[:, :k] = ints[:, :n][:, keep]
        # A new list, never an in-place edit: a Batch handed out earlier still indexes the old one.
        reqs = list(self.reqs)
        for i in reversed(gone):
            del reqs[i]
        self.reqs = reqs
        self.n = k

    # ---- KV blocks for a step ----------------------------------------------------------------
    def grow(self, kv: BlockManager, rows: np.ndarray, new: np.ndarray, make_room: MakeRoom,
             protect: int = 0) -> np.ndarray:
        """Give running ``rows`` the blocks for ``new`` more tokens each, preempting if short.

        ``rows``/``new`` are parallel arrays in table order. Victims are chosen among all running
        rows (scheduled or not) except the first ``protect`` rows. Returns a bool mask over the
        table of rows preempted (to be removed by the caller). ``make_room(need_by_row, preempted,
        protect)`` is the policy's preemption, called when the blocks are short.
        """
        n = self.n
        preempted = np.zeros(n, dtype=bool)
        if len(rows) == 0:
            return preempted
        bs = kv.block_size
        need = (self.computed[rows] + new + bs - 1) // bs - self.nblocks[rows]
        need = np.maximum(need, 0)
        if int(need.sum()) > kv.num_free_blocks:
            need_by_row = np.zeros(n, dtype=np.int64)
            need_by_row[rows] = need
            make_room(need_by_row, preempted, protect)
        todo = (need > 0).nonzero()[0]
        if len(todo) == 0:
            return preempted
        grown = rows[todo]
        counts = need[todo]
        kept = ~preempted[grown]
        if not kept.all():
            grown, counts = grown[kept], counts[kept]
        reqs = self.reqs
        failed = kv.extend_each([reqs[i] for i in grown.tolist()], counts.tolist())
        if failed >= 0:
            req = reqs[int(grown[failed])]
            raise AssertionError(f"request {req.request_id}: allocation failed after preemption freed space")
        self.nblocks[grown] += counts
        return preempted

    def grow_leading(self, kv: BlockManager, new: np.ndarray, make_room: MakeRoom,
                     protect: int = 0) -> np.ndarray | None:
        """``grow`` for a step that schedules every running row, row i computing ``new[i]`` more
        tokens (0: none).

        Works on whole-table views; the few rows crossing a block boundary are handled as plain
        ints. Returns the mask of preempted rows, or None when there was no shortage.
        """
        n = self.n
        bs = kv.block_size
        nb = self.nblocks[:n]
        if rk.ON:
            rows_b, blocks_b, counts_b = self._scratch
            k = rk.blocks_short(nb, self.computed, new, bs, rows_b, blocks_b, counts_b)
            if k == 0:
                return None
            todo, blocks = rows_b[:k], blocks_b[:k]
            counts = counts_b[:k].tolist()
        else:
            want = self.computed[:n] + new
            todo = (want > nb * bs).nonzero()[0]
            if len(todo) == 0:
                return None
            blocks = (want[todo] + (bs - 1)) // bs
            counts = (blocks - nb[todo]).tolist()
        rows = todo.tolist()
        reqs = self.reqs
        if sum(counts) <= kv.num_free_blocks:
            failed = kv.extend_each([reqs[i] for i in rows], counts)
            if failed >= 0:
                req = reqs[rows[failed]]
                raise AssertionError(f"request {req.request_id}: allocation failed after preemption freed space")
            nb[todo] = blocks
            return None
        # short: the policy preempts until the other rows' blocks fit
        want_todo = (self.computed[todo] + new[todo]).tolist()
        blocks_todo = blocks.tolist()
        preempted = np.zeros(n, dtype=bool)
        need_by_row = np.zeros(n, dtype=np.int64)
        need_by_row[todo] = counts
        make_room(need_by_row, preempted, protect)
        alloc = kv.allocate
        nblocks = self.nblocks
        for i, t, b in zip(rows, want_todo, blocks_todo, strict=True):
            if preempted[i]:
                continue
            if not alloc(reqs[i], t):
                raise AssertionError(f"request {reqs[i].request_id}: allocation failed after preemption freed space")
            nblocks[i] = b
        return preempted

    def grow_decodes(self, kv: BlockManager, make_room: MakeRoom, protect: int = 0) -> np.ndarray | None:
        """``grow_leading`` for a step in which every running row computes its one pending token
        (``want`` is ``tokens``): a row needs a block exactly when its computed tokens fill the
        blocks it holds, and then one. The same blocks in the same order, in fewer operations."""
        n = self.n
        free = kv.num_free_blocks
        # the rows that need a block, each counted one more block when they all fit
        if rk.ON:
            todo = self._scratch[0][: rk.full_rows(self.computed, self.nblocks, n, kv.block_size, free,
                                                   self._scratch[0])]
        else:
            nb = self.nblocks[:n]
            todo = (self.computed[:n] >= nb * kv.block_size).nonzero()[0]
            if len(todo) <= free:
                nb[todo] += 1
        if len(todo) == 0:
            return None
        if len(todo) > free:  # short: the policy preempts (the general path)
            return self.grow_leading(kv, self.tokens[:n] - self.computed[:n], make_room, protect)
        reqs = self.reqs
        if not kv.append_blocks([reqs[i] for i in todo.tolist()]):
            raise AssertionError(f"{len(todo)} decode rows could not take a block with {free} free")
        return None

    # ---- one step's progress ---------------------------------------------------------------
    def advance(self, step: StepRows, new: np.ndarray, samples: np.ndarray,
                now: float) -> tuple[np.ndarray, list[int], np.ndarray]:
        """Apply a finished step at ``now`` (seconds) to the rows of ``step``.

        Each row computed ``new`` tokens; rows with ``samples`` emitted one. Returns the
        inter-token latencies of the emitted tokens (seconds), the rows that emitted their first
        token and the rows that are done (all their outputs emitted), as table rows. The latencies
        and done rows may be views of the table's buffers: read them before its next ``advance``.
        """
        if rk.ON:
            first, done = self._scratch[0], self._scratch[1]
            ni, nf, nd = rk.advance_rows(self.ints, self.last_tok, step.rows, new, samples, now, self._itl, first, done)
            return self._itl[:ni], first[:nf].tolist() if nf else [], done[:nd]
        if step.whole:
            return self._advance_leading(len(step.rows), step.decode_rows, new, samples, now)
        rows = step.rows
        self.computed[rows] += new
        srows = rows[samples]
        had = self.out[srows] > 0
        itl = now - self.last_tok[srows[had]]
        first = srows[~had]
        self.out[srows] += 1
        self.tokens[srows] += 1
        self.last_tok[srows] = now
        done = srows[self.out[srows] >= self.out_len[srows]]
        return itl, first.tolist(), done

    def _advance_leading(self, k: int, decode_rows: int, new: np.ndarray, s: np.ndarray,
                         now: float) -> tuple[np.ndarray, list[int], np.ndarray]:
        """``advance`` for rows 0..k-1: whole-table slices, no fancy indexing. The leading
        ``decode_rows`` plain decodes take the slices; a few rows after them (prefill chunks, the
        rows just admitted) are done one by one, which costs less than masks over every row."""
        m = decode_rows
        # (more than k: a count from before preempted rows left)
        if m >= k or k - m > _FEW_TAIL or k != self.n:
            return self._advance_masked(k, m, new, s, now)
        # the rows after the decodes as they were before the step: the decodes' update adds one to
        # every column's counters, and these rows are then written whole
        tail = self.ints[:4, m:k].tolist()
        itl, first, done = self._advance_decodes_step(m, now, every_column=True)
        tail_itl: list[float] = []
        tail_done: list[int] = []
        computed, tokens, out, last = self.computed, self.tokens, self.out, self.last_tok
        for i, c, t, o, o_len, q, sample in zip(range(m, k), *tail, new[m:k].tolist(), s[m:k].tolist(),
                                                strict=True):
            computed[i] = c + q
            if sample:
                if o:
                    tail_itl.append(now - float(last[i]))
                else:
                    first.append(i)
                o += 1
                t += 1
                last[i] = now
                if o >= o_len:
                    tail_done.append(i)
            tokens[i] = t
            out[i] = o
        if tail_itl:
            itl = np.concatenate([itl, tail_itl])
        if tail_done:
            done = np.concatenate([done, np.asarray(tail_done, dtype=np.int64)])
        return itl, first, done

    def _advance_decodes_step(self, m: int, now: float,
                              every_column: bool = False) -> tuple[np.ndarray, list[int], np.ndarray]:
        """One step of rows 0..m-1, each computing one token and sampling: ITLs, first-token rows
        and finished rows. ``every_column``: the counters of every column may take the step (the
        caller rewrites rows m..n-1), which is one contiguous operation instead of a 2-D one."""
        out = self.out[:m]
        last = self.last_tok[:m]
        if np.count_nonzero(out) == m:  # (out >= 0: nonzero is > 0)
            itl = now - last
            first: list[int] = []
        else:
            had = out > 0
            itl = now - last[had]
            first = (~had).nonzero()[0].tolist()
        if every_column or m == self.n:
            np.add(self.counters, 1, out=self.counters)  # computed, tokens and out of every column
        else:
            self.ints[:3, :m] += 1
        last.fill(now)
        return itl, first, (out >= self.out_len[:m]).nonzero()[0]

    def _advance_masked(self, k: int, decode_rows: int, new: np.ndarray, s: np.ndarray,
                        now: float) -> tuple[np.ndarray, list[int], np.ndarray]:
        if decode_rows == k:  # every row computes one token and samples
            return self._advance_decodes_step(k, now)
        out = self.out[:k]
        last = self.last_tok[:k]
        had = out > 0
        itl = now - last[had & s]
        first = (s > had).nonzero()[0].tolist()  # sampling rows without an earlier output
        self.computed[:k] += new
        self.ints[1:3, :k] += s  # tokens and out
        last[s] = now
        done = (s & (out >= self.out_len[:k])).nonzero()[0]
        return itl, first, done

    # ---- a stretch of plain decode steps ---------------------------------------------------
    def decode_horizon(self, block_size: int, free_blocks: int, max_steps: int, min_steps: int = 1) -> int:
        """Plain decode steps (every row computes its one pending token and samples) the rows can
        take in a row up to the first step that finishes one of them, without needing more than
        ``free_blocks`` new KV blocks; at most ``max_steps``, 0 when a row is not a plain decode
        or fewer than ``min_steps`` would be."""
        n = self.n
        if n == 0 or max_steps <= 0:
            return 0
        out = self.out[:n]
        # the step that emits a row's last token retires it: the stretch ends with that step (checked
        # first: with many rows a finish is usually a step or two away)
        k = min(int(np.minimum.reduce(self.out_len[:n] - out)), max_steps)
        if k <= 0 or k < min_steps:
            return 0
        computed = self.computed[:n]
        if np.count_nonzero(self.tokens[:n] - computed != 1) or np.count_nonzero(out) != n:
            return 0
        first = self.nblocks[:n] * block_size - computed  # step at which each row takes a new block
        if _blocks_by_step(first, block_size, k) > free_blocks:
            lo, hi = 0, k  # the longest stretch whose blocks fit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _blocks_by_step(first, block_size, mid) <= free_blocks:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo if lo >= min_steps else 0
        return k

    def advance_decodes(self, kv: BlockManager, ends: list[float]) -> tuple[np.ndarray, np.ndarray]:
        """Apply ``len(ends)`` plain decode steps of every row, step j ending at ``ends[j]`` (seconds).

        The KV blocks are taken in the order the steps one by one would take them (step, then
        row), so block ids and prefix-cache evictions match. Returns the first step's inter-token
        latencies (one per row; later steps' are ``ends[j] - ends[j-1]`` for every row) and the
        number of blocks each step took.
        """
        n = self.n
        k = len(ends)
        bs = kv.block_size
        computed = self.computed[:n]
        first = self.nblocks[:n] * bs - computed
        count = (k - 1 - first) // bs + 1  # new blocks per row over the stretch (<= 0: none)
        grow = (count > 0).nonzero()[0]
        if not len(grow):
            taken = np.zeros(k, dtype=np.int64)
        else:
            # a few rows cross a block boundary in a short stretch: (step, row) pairs as plain ints
            rows = grow.tolist()
            events = sorted((f + m * bs, i) for i, f, c in zip(rows, first[grow].tolist(), count[grow].tolist(),
                                                                strict=True) for m in range(c))
            # each event is one block: the row's table is full when its step starts
            reqs = self.reqs
            if not kv.append_blocks([reqs[i] for _, i in events]):
                raise AssertionError(f"a decode stretch of {k} steps ran out of KV blocks")
            taken = np.bincount([step for step, _ in events], minlength=k)
            self.nblocks[grow] += count[grow]
        itl0 = ends[0] - self.last_tok[:n]
        np.add(self.counters, k, out=self.counters)  # computed, tokens and out of every row (and column)
        self.last_tok[:n] = ends[-1]
        return itl0, taken


_FEW_TAIL = 8  # up to this many rows after a step's leading decodes are advanced one by one
_FEW_GONE = 8  # up to this many removed rows are closed up stretch by stretch


def _blocks_by_step(first: np.ndarray, block_size: int, k: int) -> int:
    """New KV blocks rows take over steps 0..k-1 when row i takes one at ``first[i]`` and every
    ``block_size`` steps after."""
    c = (k - 1 - first) // block_size + 1
    return int(np.add.reduce(c[c > 0]))
