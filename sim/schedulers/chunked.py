"""Chunked-prefill scheduling (Sarathi-Serve, vLLM v1): one token budget per step, decodes first.

Each step spends ``max_num_batched_tokens`` on, in order: one token for every running request
that is decoding; prefill chunks of running requests whose prompt is only partly computed;
swapped requests brought back; then chunks of waiting prompts, oldest first. A request's chunk
is capped by ``long_prefill_token_threshold`` when set. If the KV cache cannot hold the step, the
newest running request is preempted (or the lowest-priority one) and, as in vLLM v1, no new
request is admitted in that step. With ``chunked_prefill`` off (vLLM V1's
``enable_chunked_prefill=False``) a waiting request is taken in only when what it needs (capped
by the threshold) fits the budget left whole; the first that does not ends the admissions of the
step (``vllm/v1/core/sched/scheduler.py``: "If chunked_prefill is disabled, we can stop the
scheduling here").
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from .. import row_kernels as rk
from ..batch import Batch
from ..request import Request
from .base import PolicyConfig, Scheduler
from .blocks import attach_cached_prefix, drop_cached_prefix

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


class ChunkedConfig(PolicyConfig):
    """Chunked prefill under one token budget per step (the default policy)."""

    type: Literal["chunked"] = "chunked"
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="cap on one request's prefill tokens per step (0 = no cap)"
    )
    chunked_prefill: bool = Field(
        True, description="False: a waiting request is taken in only when its tokens (capped by the threshold) "
        "fit the step's budget whole (vLLM V1's enable_chunked_prefill=False)"
    )


class ChunkedScheduler(Scheduler):
    config_type = ChunkedConfig

    def decodes_ahead(self) -> bool:
        # nothing swapped, and nothing waiting, no seat for it or no room: every next step decodes
        # the running rows (when they all decode and fit the budget) and admits nothing (with
        # chunked prefill off, whether the head fits whole is not foreseen here: no look-ahead)
        return (not self.swapped and self.run.n <= self.max_num_batched_tokens
                and (not self.waiting or self.run.n >= self.max_num_seqs
                     or (self.config.chunked_prefill and self._head_stays_out())))

    def reject_reason(self, request: Request) -> str | None:
        """``Scheduler.reject_reason``, and with chunked prefill off a request whose tokens could
        outgrow the step's budget: coming back from a preemption it must be prefilled whole, prompt
        and output so far (vLLM refuses such a server at start: max_num_batched_tokens must be at
        least max_model_len)."""
        reason = super().reject_reason(request)
        if reason or self.config.chunked_prefill:
            return reason
        need = request.prompt_len + request.output_len - 1
        if self.config.long_prefill_token_threshold:
            need = min(need, self.config.long_prefill_token_threshold)
        if need > self.max_num_batched_tokens:
            return (f"request {request.request_id}: prompt {request.prompt_len} + output {request.output_len} "
                    f"tokens can need {need} in one step, past max_num_batched_tokens {self.max_num_batched_tokens}, "
                    "and chunked prefill is off; raise max_num_batched_tokens or turn chunked prefill on")
        return None

    def _head_stays_out(self) -> bool:
        """Whether the first waiting request fails admission in each next plain decode step: the
        decodes leave the same budget, and its first chunk does not fit the free blocks."""
        budget = self.max_num_batched_tokens - self.run.n  # what the decodes leave
        if budget <= 0:
            return True  # no admission is tried
        req = self.waiting[0]
        return self._blocks_keep_out(req, min(req.num_tokens, budget,
                                              self.config.long_prefill_token_threshold or budget))

    def schedule(self, now: float) -> Batch:
        run = self.run
        budget = self.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold or budget
        n = run.n
        preempted_any = False
        # rows None: the step's rows are 0..len(new)-1, every running row in table order (the
        # common case, worked on whole-table views); the first decode_rows of them decode one token.
        rows: np.ndarray | None = None
        new = _EMPTY
        decode_rows = 0
        if n:
            if rk.ON:
                new_all = np.empty(n, dtype=np.int64)
                budget, decode_rows, given = rk.split_budget(run.computed, run.tokens, n, budget, threshold, new_all)
            else:
                new_all, budget, decode_rows, given = _split_budget(run.computed, run.tokens, n, budget, threshold)
            if decode_rows == n:  # every running row decodes, within the budget
                new_all = self._const_views(n)[1]
                preempted = self._grow_decodes()
            elif given == n:
                preempted = self._grow_all(new_all)
            else:
                rows = new_all.nonzero()[0]
                preempted = self._grow_rows(rows, new_all[rows])
            if preempted is not None and preempted.any():
                preempted_any = True
                if decode_rows != n:
                    decode_rows = 0  # a victim may have been one of the leading decodes
                # a preempted row's tokens go back to the budget, but vLLM v1 admits nothing new
                budget += int(np.add.reduce(new_all[preempted]))
                run.remove(preempted)
                new_all = new_all[~preempted]
            if rows is None:
                new = new_all
            else:
                rows = new_all.nonzero()[0]
                new = new_all[rows]

        if not preempted_any:
            extra_rows: list[int] = []
            extra_new: list[int] = []
            budget = self._bring_back_swapped(now, budget, threshold, extra_rows, extra_new)
            # (still swapped: only queued requests that hold their blocks, which take none)
            budget = self._admit_waiting(now, budget, threshold, extra_rows, extra_new, holders_only=bool(self.swapped))
            if extra_rows:
                # extra rows are appended rows, in order; they continue 0..k-1 unless one was skipped
                if rows is None and len(extra_rows) != run.n - len(new):
                    rows = self._const_views(len(new))[0]
                if rows is not None:
                    rows = np.concatenate([rows, np.asarray(extra_rows, dtype=np.int64)])
                new = np.concatenate([new, extra_new])  # Python ints: int64, like new
        return self._make_batch(rows, new, decode_rows)

    def _bring_back_swapped(
        self, now: float, budget: int, threshold: int, rows: list[int], new: list[int]
    ) -> int:
        while self.swapped and budget > 0 and self.run.n < self.max_num_seqs:
            if not self._try_swap_in_one(now):
                break
            i = self.run.n - 1  # the row it was just admitted to
            req = self.run.reqs[i]
            chunk = min(int(self.run.tokens[i] - self.run.computed[i]), budget, threshold)
            if not self.kv.allocate(req, int(self.run.computed[i]) + chunk):
                continue  # back in the cache but no room to grow this step; it runs next step
            self.run.nblocks[i] = self.kv.num_blocks_of(req)
            rows.append(i)
            new.append(chunk)
            budget -= chunk
        return budget

    def _admit_waiting(self, now: float, budget: int, threshold: int, rows: list[int], new: list[int],
                       holders_only: bool = False) -> int:
        """Admit waiting requests in order while budget, seats and blocks last; ``holders_only``: only
        those at the head that hold their blocks already (a disaggregated decode instance's
        transferred requests, admitted while a swapped request waits for blocks they hold)."""
        kv = self.kv
        while self.waiting and budget > 0 and self.run.n < self.max_num_seqs:
            req = self.waiting[0]
            if holders_only and not kv.holds(req):
                break
            fresh, cached, computed = attach_cached_prefix(kv, req)
            chunk = min(req.num_tokens - computed, budget, threshold)
            if not self.config.chunked_prefill and min(req.num_tokens - computed, threshold) > budget:
                drop_cached_prefix(kv, req, cached)
                break  # it waits for a step with room for all of it; so does everyone behind it
            if not kv.allocate(req, computed + chunk, watermark=True):
                drop_cached_prefix(kv, req, cached)
                break
            self.waiting.popleft()
            rows.append(self._admit_queued(req, fresh, cached, computed, now))
            new.append(chunk)
            budget -= chunk
        return budget


def _split_budget(computed: np.ndarray, tokens: np.ndarray, n: int, budget: int,
                  threshold: int) -> tuple[np.ndarray, int, int, int]:
    """The step's token budget over running rows 0..n-1: one token to each decoding row (one
    token pending), in table order while the budget lasts; what is left to the rows still
    prefilling, in table order, each chunk capped at ``threshold``. Returns (tokens per row,
    budget left, leading decode rows, rows given tokens); the leading decode rows are the rows
    before the first prefilling one (n: none prefills) when every decode fits, else 0.
    ``row_kernels.split_budget`` is the same split as one compiled loop."""
    need = tokens[:n] - computed[:n]
    decoding = need == 1
    n_dec = int(np.count_nonzero(decoding))
    if n_dec == n and n <= budget:
        return _EMPTY, budget - n, n, n
    waiting_rows = (~decoding).nonzero()[0].tolist()
    if n_dec <= budget:
        new = decoding.astype(np.int64)
        lead = waiting_rows[0] if waiting_rows else 0
    else:
        new = np.zeros(n, dtype=np.int64)
        new[decoding.nonzero()[0][:budget]] = 1
        n_dec = budget
        lead = 0
    budget -= n_dec
    for i in waiting_rows:
        if budget <= 0:
            break
        chunk = min(int(need[i]), budget, threshold)
        new[i] = chunk
        budget -= chunk
    return new, budget, lead, int(np.count_nonzero(new))
