"""Continuous batching without chunking (Orca, vLLM v0): membership changes every iteration.

Finished requests leave at once. Whole prompts are admitted under ``max_num_batched_tokens`` and
``max_num_seqs`` when the KV cache keeps its watermark free. With ``schedule_order:
prefill_first`` (vLLM v0's default) a step either prefills newly admitted prompts or decodes
every running request, never both; swapped requests come back before any new prompt. With
``decode_first`` every running request decodes and whole prompts fill what is left of the budget
in the same step. Under KV pressure the newest running request (or the lowest-priority one) is
preempted by recompute, soft reset or swap.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from ..batch import Batch
from .base import PolicyConfig, Scheduler
from .blocks import attach_cached_prefix, drop_cached_prefix


class ContinuousConfig(PolicyConfig):
    """Continuous batching of whole prompts."""

    type: Literal["continuous"] = "continuous"
    # vLLM v0 runs a prefill-only step whenever it can admit a prompt (prefill_first);
    # decode_first runs every decode and fills the rest of the budget with whole prompts.
    schedule_order: Literal["prefill_first", "decode_first"] = "prefill_first"


class ContinuousScheduler(Scheduler):
    config_type = ContinuousConfig

    def decodes_ahead(self) -> bool:
        # nothing swapped, and nothing waiting, no seat for it or no room: every next step decodes
        # the running rows (when they all decode and fit the budget) and admits nothing
        return (not self.swapped and self.run.n <= self.max_num_batched_tokens
                and (not self.waiting or self.run.n >= self.max_num_seqs or self._head_stays_out()))

    def _head_stays_out(self) -> bool:
        """Whether the first waiting request fails admission in each next plain decode step: its
        whole prompt exceeds the budget the step leaves (and it may not run alone), or its blocks
        do not fit."""
        budget = self.max_num_batched_tokens
        if self.config.schedule_order != "prefill_first":
            budget -= self.run.n  # admission comes after the decodes
            if budget <= 0:
                return True  # no admission is tried
        req = self.waiting[0]
        if req.num_tokens > budget and req.num_preemptions == 0:
            return True
        return self._blocks_keep_out(req, req.num_tokens)

    def schedule(self, now: float) -> Batch:
        prefill_first = self.config.schedule_order == "prefill_first"
        if prefill_first:
            # vLLM v0: requests coming back from swap decode first; otherwise admit prompts, and if
            # any were admitted the step is prefill-only.
            if self._bring_back_swapped(now) == 0:
                # (still swapped: only queued requests that hold their blocks, which take none)
                rows, new = self._admit_prompts(now, self.max_num_batched_tokens, holders_only=bool(self.swapped))
                if rows:
                    return self._make_batch(np.asarray(rows, dtype=np.int64), np.asarray(new, dtype=np.int64))
            return self._decode_step(now, admit=False)
        return self._decode_step(now, admit=True)

    def _bring_back_swapped(self, now: float) -> int:
        brought = 0
        while self.swapped and self.run.n < self.max_num_seqs and self._try_swap_in_one(now):
            brought += 1
        return brought

    def _decode_step(self, now: float, admit: bool) -> Batch:
        run = self.run
        n = run.n
        # rows None: the step's rows are 0..len(new)-1, every running row in table order, of
        # which the first decode_rows decode one token (the common step, on whole-table views)
        rows: np.ndarray | None = np.zeros(0, dtype=np.int64)
        new = np.zeros(0, dtype=np.int64)
        decode_rows = 0
        budget = self.max_num_batched_tokens
        preempted_any = False
        if n:
            tokens = run.tokens[:n]
            new_all = tokens - run.computed[:n]
            if n <= budget and np.count_nonzero(new_all == 1) == n:
                # every row decodes and all fit: the oldest-first cut below would keep them all
                budget -= n
                preempted = self._grow_decodes()
                if preempted is not None and preempted.any():
                    preempted_any = True
                    run.remove(preempted)
                rows, new, decode_rows = None, self._const_views(run.n)[1], run.n
            else:
                order = new_all.nonzero()[0]
                # decodes are one token each; a row still owing more (swapped back mid-prompt) is rare
                keep = np.cumsum(new_all[order]) <= budget
                if len(keep):
                    keep[0] = True  # the oldest row always runs, even if it alone exceeds the budget
                sched = order[keep]
                sel = np.zeros(n, dtype=np.int64)
                sel[sched] = new_all[sched]
                budget -= int(sel.sum())
                preempted = self._grow_rows(sched, sel[sched])
                if preempted.any():
                    preempted_any = True
                    run.remove(preempted)
                    sel = sel[~preempted]
                rows = sel.nonzero()[0]
                new = sel[rows]
        if admit and not preempted_any and budget > 0:
            # swapped requests come back (they decode from the next step) before any new prompt
            self._bring_back_swapped(now)
            extra_rows, extra_new = self._admit_prompts(now, budget, holders_only=bool(self.swapped))
            if extra_rows:
                # admitted rows are appended in order; they continue 0..k-1 unless a swap-in came between
                if rows is None and len(extra_rows) != run.n - len(new):
                    rows = self._const_views(len(new))[0]
                if rows is not None:
                    rows = np.concatenate([rows, np.asarray(extra_rows, dtype=np.int64)])
                new = np.concatenate([new, np.asarray(extra_new, dtype=np.int64)])
        return self._make_batch(rows, new, decode_rows)

    def _admit_prompts(self, now: float, budget: int, holders_only: bool = False) -> tuple[list[int], list[int]]:
        """Admit whole prompts, oldest first, while seats, budget and blocks (watermark) allow;
        ``holders_only``: only those at the head that hold their blocks already (a disaggregated
        decode instance's transferred requests, admitted while a swapped request waits for blocks
        they hold)."""
        kv = self.kv
        rows: list[int] = []
        new: list[int] = []
        while self.waiting and self.run.n < self.max_num_seqs:
            req = self.waiting[0]
            if holders_only and not kv.holds(req):
                break
            fresh, cached, computed = attach_cached_prefix(kv, req)
            tokens = req.num_tokens - computed
            # A preempted request re-prefills prompt + outputs, which may exceed the budget; let it
            # run alone rather than starve forever.
            alone_ok = not rows and req.num_preemptions > 0
            if (tokens > budget and not alone_ok) or not kv.allocate(req, computed + tokens, watermark=True):
                drop_cached_prefix(kv, req, cached)
                break
            self.waiting.popleft()
            rows.append(self._admit_queued(req, fresh, cached, computed, now))
            new.append(tokens)
            budget -= tokens
        return rows, new

    def reject_reason(self, request):  # type: ignore[no-untyped-def]
        reason = super().reject_reason(request)
        if reason is None and request.prompt_len > self.max_num_batched_tokens:
            return (
                f"request {request.request_id}: prompt of {request.prompt_len} tokens exceeds "
                f"max_num_batched_tokens {self.max_num_batched_tokens} and continuous batching does not "
                f"chunk prompts; raise max_num_batched_tokens or use scheduler.type: chunked"
            )
        return reason
