"""Mixed prefill + decode steps assembled from building blocks (the Transformers and TensorRT-LLM presets).

A step spends one token budget (``max_num_batched_tokens``) and at most ``max_rows_per_step``
rows on three groups of candidates, walked in the composition's ``order``:

- ``decode``: running requests that owe one token (one vectorised pass over all of them);
- ``partial``: running requests whose prompt is only partly computed (a chunk each);
- ``waiting``: queued requests, oldest first, through the composition's admission gate
  (always last: whether anything is admitted depends on what the running rows needed).

Then the running rows' KV blocks are grown. Short of blocks, ``on_kv_shortage: preempt`` frees
them by preempting victims (TensorRT-LLM pauses the newest request), while ``stall`` lets a row
that cannot get a block sit the step out and preempts someone only when no row at all can run
(Transformers' soft reset). The admission gates are ``free_blocks`` (whatever fits now),
``safety_margin`` (no prefill once free blocks fall under a fraction of the cache, unless it is
the step's first row) and ``reserve_to_completion`` (a request starts only if the blocks for its
whole output are free after the running requests' own remaining needs; nothing is ever evicted).
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import Field, model_validator

from ..batch import Batch
from ..kv_cache import BlockManager
from ..request import Request
from .base import CachePreempted, PolicyConfig, Scheduler
from .blocks import (
    attach_cached_prefix,
    blocks_to_completion,
    chunk_tokens,
    drop_cached_prefix,
    latest_arrival,
    move_to_tail,
    request_blocks_to_completion,
)

Group = Literal["decode", "partial"]


class ComposedConfig(PolicyConfig):
    """Which building blocks a ``ComposedScheduler`` uses (set by an engine preset)."""

    type: Literal["composed"] = "composed"
    # None: bounded only by the cache (every request holding KV holds at least one block)
    max_num_seqs: int | None = Field(None, ge=1)  # type: ignore[assignment]
    order: tuple[Group, ...] = ("decode", "partial")  # running groups; waiting requests always come last
    chunked: bool = True  # False: a prompt starts only if it fits the step's remaining budget whole
    # a prompt chunk cut short is cut at a multiple of this many tokens ("block": the KV block size)
    chunk_unit: Annotated[int, Field(ge=1)] | Literal["block"] = 1
    admission: Literal["free_blocks", "safety_margin", "reserve_to_completion"] = "free_blocks"
    safety_margin: float = Field(0.0, ge=0.0, le=1.0)  # fraction of the cache that must be free for a prefill (safety_margin)
    skip_unfit_waiting: bool = False  # a queued request that does not fit is passed over, not waited on
    on_kv_shortage: Literal["preempt", "stall"] = "preempt"
    victim: Literal["latest_arrival", "oldest_then_newest"] = "latest_arrival"
    requeue: Literal["head", "tail"] = "head"  # where a preempted request goes back in the queue
    admit_after_preemption: Literal["yes", "not_this_step", "not_until_a_finish"] = "yes"
    max_rows_per_step: int = Field(0, ge=0)  # 0 = no cap beyond max_num_seqs
    # the presets choose: TensorRT-LLM stores a paused request's blocks, Transformers is left as it was
    cache_preempted_blocks: CachePreempted = "none"

    @model_validator(mode="after")
    def _no_swap(self) -> ComposedConfig:
        if self.preemption_mode == "swap":
            raise ValueError("a composed scheduler preempts by recompute or soft reset, not swap")
        return self


class ComposedScheduler(Scheduler):
    config_type = ComposedConfig

    def __init__(self, config: ComposedConfig, block_manager: BlockManager) -> None:
        super().__init__(config, block_manager)
        self.comp = config
        self.chunk_unit = block_manager.block_size if config.chunk_unit == "block" else config.chunk_unit
        self._rows_cap = config.max_rows_per_step or self.max_num_seqs
        self._blocked = False  # admissions closed until a request finishes (after a preemption)

    @staticmethod
    def seats(config: ComposedConfig, block_manager: BlockManager) -> int:
        return config.max_num_seqs if config.max_num_seqs is not None else max(block_manager.num_blocks, 1)

    # ---- interface ---------------------------------------------------------------------------
    def decodes_ahead(self) -> bool:
        # nothing waiting, or no seat for it: with every running row decoding, within the budget and
        # the row cap, and blocks for all (``decode_horizon``), each step decodes them all and
        # admits nothing (the safety margin and blocked admissions gate prefills only)
        return ((not self.waiting or self.run.n >= self.max_num_seqs)
                and self.run.n <= min(self.max_num_batched_tokens, self._rows_cap))

    def schedule(self, now: float) -> Batch:
        rows, new, stuck = self._compose(now)
        # No row could get a block: preempt one request and try again, as Transformers does in
        # the same step (the last running request is never preempted).
        while stuck and len(rows) == 0 and self.run.n > 1:
            self._preempt_when_stuck()
            rows, new, stuck = self._compose(now)
        return self._make_batch(rows, new)

    def reject_reason(self, request: Request) -> str | None:
        reason = super().reject_reason(request)
        if reason is None and not self.comp.chunked and request.prompt_len > self.max_num_batched_tokens:
            return (
                f"request {request.request_id}: prompt of {request.prompt_len} tokens exceeds the token budget "
                f"{self.max_num_batched_tokens} and this engine does not chunk prompts; raise the budget or "
                f"enable chunked prefill"
            )
        return reason

    # ---- one attempt at a step ----------------------------------------------------------------
    def _compose(self, now: float) -> tuple[np.ndarray, np.ndarray, bool]:
        run, kv, comp = self.run, self.kv, self.comp
        n = run.n
        budget = self.max_num_batched_tokens
        count = 0
        sel = np.zeros(n, dtype=np.int64)
        # The margin is judged once, at the start of the step (Transformers v5 does the same).
        margin_ok = comp.admission != "safety_margin" or kv.num_free_blocks >= comp.safety_margin * kv.num_blocks
        order_rows: list[np.ndarray] = []
        if n:
            need = run.tokens[:n] - run.computed[:n]
            for group in comp.order:
                if group == "decode":
                    dec = (need == 1).nonzero()[0]
                    take = dec[: max(min(len(dec), budget, self._rows_cap - count), 0)]
                    sel[take] = 1
                    budget -= len(take)
                    count += len(take)
                    order_rows.append(take)
                else:
                    taken = []
                    for i in (need > 1).nonzero()[0].tolist():
                        if budget <= 0 or count >= self._rows_cap or (not margin_ok and count):
                            break
                        chunk = chunk_tokens(int(need[i]), budget, 0, self.chunk_unit)
                        if chunk <= 0:
                            break
                        sel[i] = chunk
                        budget -= chunk
                        count += 1
                        taken.append(i)
                    order_rows.append(np.asarray(taken, dtype=np.int64))
        stalled = False
        preempted_any = False
        if n:
            if comp.on_kv_shortage == "preempt":
                sched = sel.nonzero()[0]
                preempted = self._grow_rows(sched, sel[sched])
                if preempted.any():
                    preempted_any = True
                    budget += int(sel[preempted].sum())
                    count -= int(np.count_nonzero(sel[preempted]))
                    run.remove(preempted)
                    sel = sel[~preempted]
            else:
                ordered = np.concatenate(order_rows) if order_rows else np.zeros(0, dtype=np.int64)
                failed = self._grow_or_stall(ordered, sel)
                if len(failed):
                    stalled = True
                    budget += int(sel[failed].sum())
                    count -= len(failed)
                    sel[failed] = 0
        rows = sel.nonzero()[0]
        new = sel[rows]
        admit = not (
            self._blocked
            or (preempted_any and comp.admit_after_preemption == "not_this_step")
            or (not margin_ok and count)
        )
        if admit and budget > 0 and self.waiting:
            extra_rows, extra_new, failed_admission = self._admit_waiting(now, budget, count, margin_ok)
            stalled = stalled or failed_admission
            if extra_rows:
                rows = np.concatenate([rows, np.asarray(extra_rows, dtype=np.int64)])
                new = np.concatenate([new, np.asarray(extra_new, dtype=np.int64)])
        return rows, new, stalled

    def _grow_or_stall(self, ordered: np.ndarray, sel: np.ndarray) -> np.ndarray:
        """Give rows their blocks in ``ordered`` sequence while blocks last; return the rows left without."""
        run, kv = self.run, self.kv
        if len(ordered) == 0:
            return ordered
        bs = self.block_size
        want = run.computed[ordered] + sel[ordered]
        need = (want + bs - 1) // bs - run.nblocks[ordered]
        growing = (need > 0).nonzero()[0]
        failed: list[int] = []
        free = kv.num_free_blocks
        for j in growing.tolist():
            i = int(ordered[j])
            # Greedy in order, like Transformers: a row that does not fit is skipped, a later
            # smaller one may still fit.
            if need[j] > free or not kv.allocate(run.reqs[i], int(want[j])):
                failed.append(i)
                continue
            free = kv.num_free_blocks
            run.nblocks[i] = kv.num_blocks_of(run.reqs[i])
        return np.asarray(failed, dtype=np.int64)

    def _admit_waiting(self, now: float, budget: int, count: int, margin_ok: bool) -> tuple[list[int], list[int], bool]:
        kv, comp = self.kv, self.comp
        rows: list[int] = []
        new: list[int] = []
        failed = False
        reserve = comp.admission == "reserve_to_completion"
        available = kv.num_free_blocks - blocks_to_completion(self.run, self.block_size) if reserve else 0
        i = 0
        while i < len(self.waiting):
            if self.run.n >= self.max_num_seqs or budget <= 0 or count >= self._rows_cap:
                break
            if not margin_ok and count:
                break
            req = self.waiting[i]
            fresh, cached, computed = attach_cached_prefix(kv, req)
            remaining = req.num_tokens - computed
            if comp.chunked:
                tokens = chunk_tokens(remaining, budget, 0, self.chunk_unit)
            else:
                # A request preempted after generating may have outgrown the budget: it runs alone.
                alone = not rows and count == 0 and req.num_preemptions > 0
                tokens = remaining if remaining <= budget or alone else 0
            need_all = request_blocks_to_completion(kv, req) if reserve else 0
            if tokens <= 0 or (reserve and need_all > available):
                drop_cached_prefix(kv, req, cached)
                break  # head-of-line: the queue waits for this request
            if not kv.allocate(req, computed + tokens, watermark=True):
                drop_cached_prefix(kv, req, cached)
                failed = True
                if comp.skip_unfit_waiting and kv.num_free_blocks > 0:
                    i += 1
                    continue
                break
            del self.waiting[i]
            rows.append(self._admit_queued(req, fresh, cached, computed, now))
            new.append(tokens)
            budget -= tokens
            count += 1
            available -= need_all
        return rows, new, failed

    def admits_transfer(self, request: Request) -> bool:
        # TensorRT-LLM's GUARANTEED_NO_EVICT starts a request only with its blocks to completion free
        if self.comp.admission != "reserve_to_completion":
            return True
        return self._fits_to_completion(request, blocks_to_completion(self.run, self.block_size))

    # ---- preemption --------------------------------------------------------------------------
    def _pick_victim(self, candidates: np.ndarray) -> int:
        if self.config.policy == "priority":
            return super()._pick_victim(candidates)
        return latest_arrival(self.run, candidates)

    def _preempt_row(self, i: int) -> None:
        req = self.run.reqs[i]
        super()._preempt_row(i)
        if self.comp.requeue == "tail":
            move_to_tail(self.waiting, req)
        if self.comp.admit_after_preemption == "not_until_a_finish":
            self._blocked = True

    def _preempt_when_stuck(self) -> None:
        """Transformers' soft reset: the oldest running request while admissions are open, else the newest."""
        run = self.run
        v = run.n - 1 if (self.comp.victim != "oldest_then_newest" or self._blocked) else 0
        drop = np.zeros(run.n, dtype=bool)
        drop[v] = True
        self._preempt_row(v)
        run.remove(drop)

    def _on_rows_finished(self, rows: np.ndarray) -> None:
        super()._on_rows_finished(rows)
        self._blocked = False  # a finish frees blocks: admissions open again
