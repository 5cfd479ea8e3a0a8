"""The Batch a scheduler hands the executor: the seam between policy and execution.

One row per scheduled request: how many new tokens it computes this step and how many of its
tokens are already in the KV cache. Rows are numpy arrays so the cost model and the metrics can
work on whole steps at once; ``requests`` holds the matching Request objects for the live
executor, which also reads block tables from the scheduler's block manager.

A step's aggregates (``step_sums``: rows, decode rows, tokens, attention pairs, KV tokens) are
computed once per Batch and shared by the cost model and the metrics. The arrays of a Batch are
never written after it is built; some are read-only views of shared scheduler arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .request import Request

_add = np.add.reduce  # ndarray.sum without its Python wrapper


class StepSums(NamedTuple):
    """A step's aggregates; a tuple, so ``n, n_dec, tokens, pairs, decode_kv, prefill_kv = sums`` works."""

    seqs: int  # rows
    decode_seqs: int  # rows with q == 1
    tokens: int  # sum of q
    prefill_attn_pairs: int  # over rows with q > 1: q * (ctx + (q + 1) / 2)
    decode_kv_tokens: int  # over rows with q == 1: ctx + 1
    prefill_kv_tokens: int  # over rows with q > 1: ctx + q


def step_sums(q: np.ndarray, ctx: np.ndarray, decode_head: int = 0) -> StepSums:
    """(rows, decode rows, tokens, prefill attention pairs, decode KV tokens, prefill KV tokens).

    Decode rows are rows with q == 1; prefill attention pairs are the sum over the other rows of
    q * (ctx + (q + 1) / 2) (an integer: q * (q + 1) is even); decode KV tokens the sum over
    decode rows of ctx + 1, prefill KV tokens the sum over the others of ctx + q. ``q`` and
    ``ctx`` are int64 arrays (``Batch`` rows); int32 could overflow the sum of q*q. The first
    ``decode_head`` rows are known to have q == 1. Few numpy calls on purpose: this runs once per
    simulated step, and a step's prefill rows are usually few, so they are summed as ints.
    """
    n = q.shape[0]
    ctx_sum = int(_add(ctx))
    if decode_head == n:
        return StepSums(n, n, n, 0, ctx_sum + n, 0)
    if decode_head and n - decode_head <= _FEW:
        ql = q[decode_head:].tolist()
        cl = ctx[decode_head:].tolist()
    else:
        pre = (q != 1).nonzero()[0]
        if len(pre) == 0:  # decode-only, the common step
            return StepSums(n, n, n, 0, ctx_sum + n, 0)
        if len(pre) > _FEW:
            tokens = int(_add(q))
            dec = q == 1
            n_dec = n - len(pre)
            # sum over all rows of q * (ctx + (q + 1) / 2), minus what decode rows add (ctx + 1 each).
            decode_kv = int(np.dot(dec, ctx)) + n_dec if n_dec else 0
            pairs = int(np.dot(q, ctx)) + (int(np.dot(q, q)) + tokens) // 2 - decode_kv
            return StepSums(n, n_dec, tokens, pairs, decode_kv, ctx_sum + tokens - decode_kv)
        ql = q[pre].tolist()
        cl = ctx[pre].tolist()
    # every row outside ql/cl has q == 1
    n_dec = tokens = n - len(ql)
    pairs = pre_ctx = 0
    for qi, ci in zip(ql, cl, strict=True):
        tokens += qi
        if qi == 1:
            n_dec += 1
        else:
            pairs += qi * ci + qi * (qi + 1) // 2
            pre_ctx += ci
    decode_kv = ctx_sum - pre_ctx + n_dec
    return StepSums(n, n_dec, tokens, pairs, decode_kv, ctx_sum + tokens - decode_kv)


_FEW = 64  # up to this many rows of a step are summed as Python ints


@dataclass(slots=True, kw_only=True)
class Batch:
    """One step: per row (request), the tokens it computes and the tokens it has in the KV cache.

    Built by keyword. Holds nothing of the scheduler's own bookkeeping: what an executor, the
    cost model and the metrics read, and a way to list the rows' requests when one asks.
    """

    num_new_tokens: np.ndarray  # int64, tokens computed for each request this step
    num_context_tokens: np.ndarray  # int64, tokens of each request already in the KV cache
    # Rows whose computation reaches the end of their tokens sample one output token.
    samples: np.ndarray  # bool
    preempted: list[Request] = field(default_factory=list)
    # KV block copies done before the step: (device block, host block) and (host, device) pairs.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # The rows' leading plain decodes (q == 1, samples), when known: a pure decode step's
    # aggregates then need almost no work.
    decode_rows: int = 0
    # The Request of each row is looked up only when asked for (live mode, tests): simulation
    # never needs the objects, and building the list every step is a measurable cost.
    requests_of: Callable[[], list[Request]] | None = None
    _requests: list[Request] | None = None
    _sums: StepSums | None = None
    _num_decode: int = -1
    _longest: int = -1
    _num_samples: int = -1

    @property
    def requests(self) -> list[Request]:
        """The Request of each row, in row order."""
        if self._requests is None:
            self._requests = self.requests_of() if self.requests_of is not None else []
        return self._requests

    @property
    def size(self) -> int:
        return len(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return len(self.num_new_tokens) == 0 and not self.swap_out and not self.swap_in

    @property
    def decode_only(self) -> bool:
        """Every row computes one token and samples (as the scheduler marked it)."""
        m = self.decode_rows
        return m > 0 and m == len(self.num_new_tokens)

    @property
    def sums(self) -> StepSums:
        """``step_sums`` of the rows, computed once."""
        sums = self._sums
        if sums is None:
            sums = self._sums = step_sums(self.num_new_tokens, self.num_context_tokens, self.decode_rows)
        return sums

    def set_shape(self, seqs: int, decode_seqs: int, tokens: int, pairs: int, decode_kv: int, prefill_kv: int,
                  longest_decode_kv: int, plain_decodes: int, num_samples: int) -> None:
        """The aggregates, computed by whoever built the rows (``row_kernels.batch_rows``): the
        ``step_sums`` figures, the largest ctx + 1 of a row with q == 1 (0: none),
        ``num_decode_tokens`` and ``num_samples``."""
        self._sums = StepSums(seqs, decode_seqs, tokens, pairs, decode_kv, prefill_kv)
        self._longest = longest_decode_kv
        self._num_decode = plain_decodes
        self._num_samples = num_samples

    @property
    def num_samples(self) -> int:
        """Rows that sample a token this step."""
        k = self._num_samples
        if k < 0:
            k = self._num_samples = int(np.count_nonzero(self.samples))
        return k

    @property
    def longest_decode_kv(self) -> int | None:
        """The largest ctx + 1 over rows with q == 1 (KV tokens a decode row reads), None without such
        rows. The leading ``decode_rows`` take one reduction, the few rows after them a loop."""
        if self._longest >= 0:
            return self._longest or None
        q = self.num_new_tokens
        ctx = self.num_context_tokens
        m = self.decode_rows
        n = len(q)
        if 0 < m <= n and n - m <= _FEW:
            longest = int(np.maximum.reduce(ctx[:m]))
            for qi, ci in zip(q[m:].tolist(), ctx[m:].tolist(), strict=True):
                if qi == 1 and ci > longest:
                    longest = ci
            return longest + 1
        dec = q == 1
        return int(np.maximum.reduce(ctx[dec])) + 1 if np.count_nonzero(dec) else None

    @property
    def num_tokens(self) -> int:
        return self.sums.tokens

    @property
    def num_decode_tokens(self) -> int:
        """Rows computing exactly one token that samples, with context (plain decodes)."""
        k = self._num_decode
        if k < 0:
            ctx = self.num_context_tokens
            m = self.decode_rows
            n = len(ctx)
            if m == n and n:  # every row has q == 1 and samples; ctx >= 0
                k = int(np.count_nonzero(ctx))
            elif m and n - m <= _FEW:  # the first m rows have q == 1 and sample
                k = int(np.count_nonzero(ctx[:m]))
                for q, s, c in zip(self.num_new_tokens[m:].tolist(), self.samples[m:].tolist(), ctx[m:].tolist(),
                                   strict=True):
                    if q == 1 and s and c > 0:
                        k += 1
            else:
                k = int(np.count_nonzero((self.num_new_tokens == 1) & self.samples & (ctx > 0)))
            self._num_decode = k
        return k

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def num_swap_blocks(self) -> int:
        return len(self.swap_out) + len(self.swap_in)

    @staticmethod
    def of(requests: list[Request], num_new_tokens, num_context_tokens, samples=None) -> Batch:  # noqa: ANN001
        """A batch built by hand (tests, calibration): rows in the order of ``requests``.

        ``samples`` defaults to "every row reaches the end of its request's tokens".
        """
        new = np.asarray(num_new_tokens, dtype=np.int64)
        ctx = np.asarray(num_context_tokens, dtype=np.int64)
        if samples is None:
            samples = ctx + new >= np.asarray([r.num_tokens for r in requests], dtype=np.int64)
        return Batch(num_new_tokens=new, num_context_tokens=ctx, samples=np.asarray(samples, dtype=bool),
                     _requests=list(requests))

    @staticmethod
    def empty() -> Batch:
        z = np.zeros(0, dtype=np.int64)
        return Batch(num_new_tokens=z, num_context_tokens=z.copy(), samples=np.zeros(0, dtype=bool))
