"""Prefill-priority steps with one chunked request, estimated-token admission and retraction (SGLang).

A step is a prefill step or a decode step, never both:

- **prefill** whenever there is something to prefill: the one partly prefilled request continues
  with its next chunk, then queued requests (``fcfs`` or ``lpm`` order) join while the step has
  tokens left (``max_num_batched_tokens`` = SGLang's ``chunked_prefill_size``, and at most
  ``max_prefill_tokens`` once a request is in) and the KV pool can hold them. The pool test is
  SGLang's estimate: free tokens, minus ``min(outputs left, 4096) * new_token_ratio`` for every
  running request, must exceed the newcomer's prompt plus ``min(its max output, 4096)``. A prompt
  longer than what is left of the chunk budget is cut there and becomes the partial request. When
  the estimate says no, the batch is marked full and no prefill is tried until a request finishes
  or is retracted.
- **decode** otherwise: every running request generates one token. If the pool cannot hold one
  more token each, running requests are retracted (fewest outputs first, the longest prompt among
  equals) until 20 tokens per remaining request are free; they go to the back of the queue and
  are recomputed later. With prefix caching on (the radix cache), a retracted request's prompt
  stays cached until evicted and only its decoded tokens are recomputed.

``new_token_ratio`` starts at ``0.7 * schedule_conservativeness``, drops by ``(init - 0.14 * init)
/ 600`` per decode step, jumps to ``(outputs so far + 20 * running) / max outputs`` after a
retraction, and resets when the replica runs dry.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from ..batch import Batch
from ..kv_cache import BlockManager
from ..request import Request
from .base import CachePreempted, PolicyConfig, Scheduler
from .blocks import (
    attach_cached_prefix,
    drop_cached_prefix,
    estimated_future_tokens,
    fewest_outputs_longest_prompt,
    longest_prefix_first,
    move_to_tail,
)

CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
RETRACT_DECODE_STEPS = 20  # global_config.retract_decode_steps
INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
LPM_FALLBACK_QUEUE_LEN = 128  # lpm turns into fcfs above this many waiting requests
IN_BATCH_PREFIX_TOKENS = 32  # IN_BATCH_PREFIX_CACHING_CHECK/DEPRIORITIZE_THRESHOLD


class RetractingConfig(PolicyConfig):
    """SGLang's prefill-or-decode steps with token-ratio admission and retraction."""

    type: Literal["retracting"] = "retracting"
    # None: SGLang's default, min(max(pool tokens / context_length * 512, 2048), 4096)
    max_num_seqs: int | None = Field(None, ge=1)  # type: ignore[assignment]
    waiting_order: Literal["fcfs", "lpm"] = "fcfs"
    max_prefill_tokens: int = Field(16384, ge=1, description="prompt tokens one prefill step may take")
    chunked: bool = True  # False: prompts are not chunked (SGLang's chunked_prefill_size -1)
    conservativeness: float = Field(1.0, ge=0.0, description="scales the new-token ratio of admission")
    context_length: int = Field(4096, ge=1, description="the model's context (sizes the max_num_seqs default)")
    # a retracted request's prompt stays in the radix tree, its decoded tokens are freed
    # (schedule_batch.py retract_decode -> release_req frees from len(prefix_indices) on)
    cache_preempted_blocks: CachePreempted = "prompt"

    @model_validator(mode="after")
    def _recompute_only(self) -> RetractingConfig:
        if self.preemption_mode != "recompute":
            raise ValueError("SGLang retracts by recompute only")
        return self


class RetractingScheduler(Scheduler):
    config_type = RetractingConfig

    def __init__(self, config: RetractingConfig, block_manager: BlockManager) -> None:
        super().__init__(config, block_manager)
        self.waiting_order = config.waiting_order
        self.max_prefill_tokens = config.max_prefill_tokens
        self.chunked = config.chunked
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * config.conservativeness, 1.0)
        self.min_ratio = min(self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio
        self.batch_is_full = False
        self.num_retractions = 0

    @staticmethod
    def seats(config: RetractingConfig, block_manager: BlockManager) -> int:
        if config.max_num_seqs is not None:
            return config.max_num_seqs
        pool = block_manager.num_blocks * block_manager.block_size
        return min(max(int(pool / config.context_length * 512), 2048), 4096)

    # ---- interface ---------------------------------------------------------------------------
    def reject_reason(self, request: Request) -> str | None:
        """The base checks, then SGLang's cap on one request: ``max_new_tokens`` is cut to
        ``max_req_len - prompt - 1`` with ``max_req_len = pool tokens - 1`` (scheduler.py
        ``init_req_max_new_tokens``, tp_worker's ``max_req_len``). SGLang would stop such a request
        early; its admission test (prompt + outputs to come < free tokens) could otherwise never
        pass even on an idle replica, so the request is refused with the cut it would get."""
        reason = super().reject_reason(request)
        if reason is not None:
            return reason
        max_req_len = self.kv.num_blocks * self.block_size - 1
        allowed = max_req_len - request.prompt_len - 1
        if request.output_len > allowed:
            return (f"request {request.request_id}: SGLang caps max_new_tokens at max_req_len - prompt - 1 = "
                    f"{max(allowed, 0)} (max_req_len = {max_req_len}, the KV pool's tokens - 1) and this request "
                    f"asks for {request.output_len} output tokens; raise kv_cache.num_blocks or shorten it")
        return None

    def decodes_ahead(self) -> bool:
        # no prefill to try (the batch is full or nothing waits) and, ``decode_horizon`` checks,
        # no partly prefilled row: each step is a decode of every running row that needs no retraction
        return self.batch_is_full or not self.waiting

    def advance_decodes(self, ends: list[float]) -> tuple[np.ndarray, np.ndarray, list[Request]]:
        for _ in ends:  # each decode step's decay of the estimate, one by one as the plain loop rounds it
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        return super().advance_decodes(ends)

    def schedule(self, now: float) -> Batch:
        if self.run.n == 0:
            self.new_token_ratio = self.init_ratio  # SGLang resets the estimate whenever it idles
            # nothing runs, so no finish would clear NO_TOKEN: a disaggregated prefill instance whose
            # blocks were all held for transfers, or a decode instance whose queued requests arrive
            # holding their blocks, got here with it set and never tried again
            self.batch_is_full = False
        rows, new = self._prefill_step(now)
        if not rows:
            decode = self._decode_step()
            if decode is None:  # every running row decodes one token: the whole-table batch
                n = self.run.n
                return self._make_batch(None, self._const_views(n)[1], n)
            rows, new = decode
        return self._make_batch(np.asarray(rows, dtype=np.int64), np.asarray(new, dtype=np.int64))

    # ---- prefill -----------------------------------------------------------------------------
    def _prefill_step(self, now: float) -> tuple[list[int], list[int]]:
        run, kv = self.run, self.kv
        n = run.n
        need = run.tokens[:n] - run.computed[:n]
        partial = (need > 1).nonzero()[0]
        if (self.batch_is_full or not self.waiting) and len(partial) == 0:
            return [], []
        if n >= self.max_num_seqs and len(partial) == 0:
            self.batch_is_full = True
            return [], []
        bs = self.block_size
        others = np.ones(n, dtype=bool)
        others[partial] = False
        rem_total = kv.num_free_blocks * bs - self._future_tokens(others)
        rem_input = self.max_prefill_tokens
        rem_chunk = self.max_num_batched_tokens if self.chunked else None
        rows: list[int] = []
        new: list[int] = []
        for i in partial.tolist():
            remaining = int(need[i])
            chunk = min(remaining, int(rem_total)) if rem_chunk is None else min(remaining, rem_chunk, int(rem_total))
            req = run.reqs[i]
            if chunk <= 0 or not kv.allocate(req, int(run.computed[i]) + chunk):
                return [], []
            run.nblocks[i] = kv.num_blocks_of(req)
            rows.append(i)
            new.append(chunk)
            rem_total -= chunk + (0 if chunk < remaining else
                                  min(max(int(run.out_len[i] - run.out[i]), 0), CLIP_MAX_NEW_TOKENS))
            rem_input -= chunk
            if rem_chunk is not None:
                rem_chunk -= chunk
            if chunk < remaining:
                return rows, new  # still partial: it takes the whole chunk budget
        if not self.waiting or rem_total <= 0 or rem_input <= 0 or (rem_chunk is not None and rem_chunk <= 0):
            return rows, new
        if self.waiting_order == "lpm":
            self.waiting = longest_prefix_first(self.waiting, kv, LPM_FALLBACK_QUEUE_LEN, IN_BATCH_PREFIX_TOKENS)
        admitted: set[int] = set()
        for req in self.waiting:
            if self.run.n >= self.max_num_seqs:
                self.batch_is_full = True
                break
            fresh, cached, computed = attach_cached_prefix(kv, req)
            extend = req.num_tokens - computed
            max_new = _outputs_to_come(req)
            # a request queued holding its blocks (a disaggregated decode instance's transferred one;
            # SGLang reserves its room at the transfer) has their unused tokens besides the free ones:
            # without them one that nearly fills an idle instance was never admitted
            slack = 0 if fresh else self._unused_held_tokens(req)
            last = rem_chunk is None or extend <= rem_chunk
            tokens = extend if last else rem_chunk
            stop = extend + max_new >= rem_total + slack or (extend > rem_input and rows) or tokens <= 0
            if stop or not kv.allocate(req, computed + tokens):
                if extend + max_new >= rem_total + slack:
                    self.batch_is_full = True  # SGLang's NO_TOKEN
                drop_cached_prefix(kv, req, cached)
                break
            admitted.add(req.request_id)
            rows.append(self._admit_queued(req, fresh, cached, computed, now))
            new.append(tokens)
            rem_total -= max(tokens + (max_new if last else 0) - slack, 0)
            rem_input -= tokens
            if rem_chunk is not None:
                rem_chunk -= tokens
            if not last:
                break  # the new partial request
            if rem_total <= 0:
                self.batch_is_full = True
                break
            if rem_input <= 0 or (rem_chunk is not None and rem_chunk <= 0):
                break
        if admitted:
            self.waiting = deque(r for r in self.waiting if r.request_id not in admitted)
        return rows, new

    def _future_tokens(self, rows_mask: np.ndarray) -> float:
        run = self.run
        n = run.n
        if n == 0 or not rows_mask.any():
            return 0.0
        if rows_mask.all():
            return estimated_future_tokens(run, self.new_token_ratio, CLIP_MAX_NEW_TOKENS)
        left = np.minimum(run.out_len[:n][rows_mask] - run.out[:n][rows_mask], CLIP_MAX_NEW_TOKENS)
        return float(left.sum()) * self.new_token_ratio

    # ---- decode ------------------------------------------------------------------------------
    def _decode_step(self) -> tuple[list[int], list[int]] | None:
        """The decoding rows and one token each, their blocks grown (retracting first when short);
        None when that is every running row (the caller builds the whole-table batch)."""
        run, kv = self.run, self.kv
        n = run.n
        if n == 0:
            return [], []
        bs = self.block_size
        decoding = (run.tokens[:n] - run.computed[:n]) == 1
        dec = decoding.nonzero()[0]
        grows = int(np.count_nonzero(run.computed[dec] + 1 > run.nblocks[dec] * bs))
        if grows > kv.num_free_blocks:
            self._retract(decoding)
            n = run.n
            dec = ((run.tokens[:n] - run.computed[:n]) == 1).nonzero()[0]
            outputs, total_max_new = int(run.out[:n].sum()), int(run.out_len[:n].sum())
            self.new_token_ratio = min(1.0, (outputs + RETRACT_DECODE_STEPS * n) / max(total_max_new, 1))
            self.batch_is_full = False
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        if len(dec) == run.n:  # the common step: each row that fills its blocks takes one more
            run.grow_decodes(kv, self._preempt_until_fits, protect=run.n)  # (never short after the retraction)
            return None
        ones = np.ones(len(dec), dtype=np.int64)
        self._grow_rows(dec, ones, protect=run.n)  # enough room after the retraction: never preempts
        return dec.tolist(), ones.tolist()

    def _retract(self, decoding: np.ndarray) -> None:
        run, kv = self.run, self.kv
        candidates = decoding.copy()
        retracted = np.zeros(run.n, dtype=bool)
        first = True
        while first or kv.num_free_blocks * self.block_size < RETRACT_DECODE_STEPS * int(candidates.sum()):
            if int(candidates.sum()) <= 1:
                break
            first = False
            v = fewest_outputs_longest_prompt(run, candidates)
            candidates[v] = False
            self._retract_row(v, retracted)
        # Corner case SGLang fails on: the partly prefilled request holds the blocks the last decoder
        # needs. Retract it too rather than stop.
        dec = candidates.nonzero()[0]
        grows = int(np.count_nonzero(run.computed[dec] + 1 > run.nblocks[dec] * self.block_size))
        if grows > kv.num_free_blocks:
            for i in (~decoding & ~retracted).nonzero()[0].tolist():
                self._retract_row(i, retracted)
        run.remove(retracted)

    def _retract_row(self, i: int, retracted: np.ndarray) -> None:
        req = self.run.reqs[i]
        retracted[i] = True
        self._preempt_row(i)
        move_to_tail(self.waiting, req)
        self.num_retractions += 1

    def _on_rows_finished(self, rows: np.ndarray) -> None:
        super()._on_rows_finished(rows)
        self.batch_is_full = False

    def admits_transfer(self, request: Request) -> bool:
        """SGLang's decode side reserves a request's room before its KV is pulled, and its admission
        only starts a request whose outputs to come fit: here the prompt and the clipped outputs must
        fit the free tokens beside the reserve of the running requests and the outputs still to come
        of those queued holding their blocks. Two pulled requests that each needed the other's
        blocks to start never started (26 of 100 requests stuck, found by a randomised search)."""
        kv = self.kv
        queued = sum(max(_outputs_to_come(w) - self._unused_held_tokens(w), 0) for w in self.waiting if kv.holds(w))
        room = kv.num_free_blocks * self.block_size - estimated_future_tokens(self.run, self.new_token_ratio,
                                                                            CLIP_MAX_NEW_TOKENS)
        need = request.prompt_len + 1 + min(max(request.output_len - 1, 0), CLIP_MAX_NEW_TOKENS)
        return need < room - queued

    def _unused_held_tokens(self, req: Request) -> int:
        """Tokens of room in the blocks a queued request holds beyond what it has computed."""
        return self.kv.num_blocks_of(req) * self.block_size - req.num_computed_tokens


def _outputs_to_come(req: Request) -> int:
    """A request's outputs still to come, clipped (``add_one_req``: ``max(max_new_tokens -
    len(output_ids), 0)`` before CLIP_MAX_NEW_TOKENS): a retracted request keeps what it generated."""
    return min(max(req.output_len - req.num_output_tokens, 0), CLIP_MAX_NEW_TOKENS)
