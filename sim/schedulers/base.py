"""The scheduler interface and the machinery every policy shares.

A scheduler is pure policy: ``add(request)``, ``schedule(now) -> Batch``, ``update(batch, now)``.
It owns the waiting, running and swapped queues and talks to the KV ``BlockManager`` only through
allocate / free / can_allocate / swap. It never sleeps, never reads a clock (``now`` is handed in)
and imports neither SimPy nor torch, which is what lets live mode reuse it unchanged.

Running requests keep their hot counters in numpy arrays (``running.py``: ``RunningTable``) so a
step over a few hundred decoding sequences costs a handful of vector operations, not a Python loop
per request. ``update`` applies the step ``schedule`` last returned: the scheduler keeps that
step's table rows (``scheduled``) itself, so the ``Batch`` carries none of its bookkeeping.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from .. import row_kernels as rk
from ..batch import Batch
from ..config_model import ConfigModel
from ..kv_cache import BlockManager
from ..request import Request, RequestState
from .blocks import request_blocks_to_completion
from .running import RunningTable, StepRows, _readonly

PreemptionMode = Literal["recompute", "soft_reset", "swap"]
# What a request preempted by recompute or soft reset leaves in the prefix cache (prefix caching on)
CachePreempted = Literal["all", "prompt", "none"]


class PolicyConfig(ConfigModel):
    """The knobs every policy reads; names follow vLLM where vLLM has the knob.

    Each policy subclasses this with a ``type: Literal[NAME]`` and only the knobs it adds; the
    scenario's ``scheduler`` section is the union of them, tagged by ``type``.
    """

    type: str
    max_num_seqs: int = Field(256, ge=1, description="most sequences running at once (static: batch size)")
    max_num_batched_tokens: int = Field(8192, ge=1, description="token budget of one step")
    max_model_len: int | None = Field(None, ge=1, description="reject requests whose prompt+output exceed this")
    policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_mode: PreemptionMode = "recompute"
    # With prefix caching on, what a request preempted by recompute (or soft reset) finds of its own
    # KV when it is admitted again. "all": vLLM V1, every fully computed block, prompt and generated,
    # stays cached until evicted (scheduler.py _preempt_request -> KVCacheManager.free); "prompt":
    # SGLang, whose radix tree keeps the prefilled prompt and frees the decoded tokens
    # (schedule_batch.py retract_decode -> release_req); "none": only blocks the prompt shares with
    # other requests (servesim before this knob).
    cache_preempted_blocks: CachePreempted = Field(
        "all", description="what a preempted request finds of its own KV when it comes back (prefix caching on)")
    # The engine loop, not the policy: the CPU chooses step n+1 while the device runs step n (vLLM's
    # --async-scheduling, vllm/v1/core/sched/async_scheduler.py), so a request arriving during step n
    # is first scheduled into step n+2 and host time overlaps device time (sim/engine.py).
    async_scheduling: bool = Field(False, description="schedule the next step while this one runs (vLLM V1)")

    @model_validator(mode="before")
    @classmethod
    def _kv_knobs_elsewhere(cls, data: Any) -> Any:
        if isinstance(data, dict) and "watermark" in data:
            raise ValueError("watermark is a KV-cache knob: set kv_cache.watermark")
        return data


@dataclass(slots=True)
class StepOutput:
    """What one step produced, for the engine's metrics."""

    finished: list[Request]
    # seconds between consecutive tokens of the same request, one per non-first token (possibly a
    # view of the running table's buffer: valid until the next update)
    itl: np.ndarray
    num_first_tokens: int


def _requests_at(table: list[Request], rows: np.ndarray) -> list[Request]:
    return [table[i] for i in rows.tolist()]


class Scheduler:
    """Shared state and mechanics; subclasses implement ``schedule``."""

    config_type: ClassVar[type[PolicyConfig]] = PolicyConfig

    def __init__(self, config: PolicyConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.kv = block_manager
        self.block_size = block_manager.block_size
        self.max_num_seqs = self.seats(config, block_manager)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.preemption_mode = config.preemption_mode
        self.cache_preempted = config.cache_preempted_blocks
        self.waiting: deque[Request] = deque()
        self.swapped: deque[Request] = deque()
        self.run = RunningTable(self.max_num_seqs)
        self.num_preemptions = 0
        self._order = 0  # admission counter
        self._preempted_this_step: list[Request] = []
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._swapped_in_now: set[int] = set()
        # Read-only 0..k-1, ones and True arrays whose [:k] views serve as the slots, new-token
        # counts and sample flags of whole-table steps (no allocation per step).
        self._c_arange = self._c_ones = _readonly(np.zeros(0, dtype=np.int64))
        self._c_true = _readonly(np.zeros(0, dtype=bool))
        self._c_views: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.scheduled = StepRows(self._c_arange)  # the rows of the step last scheduled
        # Async scheduling (vLLM V1): step n+1 is scheduled before step n's outputs are processed,
        # so a request finished in step n keeps its seat and KV blocks through that schedule. They
        # are held here (their seats taken off max_num_seqs) until release_finished().
        self.hold_finished = config.async_scheduling
        self._held: list[Request] = []

    @staticmethod
    def seats(config: PolicyConfig, block_manager: BlockManager) -> int:
        """Most requests running at once: ``max_num_seqs``; a policy may derive it from the cache."""
        return config.max_num_seqs

    # ---- interface -------------------------------------------------------------------------
    def add(self, request: Request) -> bool:
        """Queue a new request. Returns False (and marks it rejected with a reason) if it can never run."""
        reason = self.reject_reason(request)
        if reason is not None:
            request.state = RequestState.REJECTED
            request.reject_reason = reason
            return False
        request.state = RequestState.WAITING
        if self.kv.holds(request):
            # it arrives holding every block it needs to start (a disaggregated decode instance's
            # transferred request): ahead of queued ones that must allocate, which could otherwise
            # wait for its blocks (with async scheduling it reaches the queue after a preemption)
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)
        return True

    def schedule(self, now: float) -> Batch:  # pragma: no cover - abstract
        raise NotImplementedError

    def next_wakeup(self, now: float) -> float | None:
        """When a policy that returned an empty batch wants to be asked again (seconds), or None.

        Only batching delays use it (Triton's dynamic batcher waits for a batch to fill): the engine
        then waits for the next arrival or this time, whichever comes first. Policies that never
        hold work back return None, and an idle replica simply waits for an arrival.
        """
        return None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.swapped or self.run.n)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return self.run.n

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    # ---- admission checks ------------------------------------------------------------------
    def max_kv_tokens(self, request: Request) -> int:
        """KV tokens the request needs at its longest: every token but the last sampled one."""
        return request.prompt_len + request.output_len - 1

    def reject_reason(self, request: Request) -> str | None:
        """Why a request can never be served by this replica, or None."""
        rid = request.request_id
        if request.prompt_len < 1 or request.output_len < 1:
            return f"request {rid}: prompt_len and output_len must be >= 1"
        total = request.prompt_len + request.output_len
        cfg = self.config
        if cfg.max_model_len is not None and total > cfg.max_model_len:
            return (
                f"request {rid}: prompt {request.prompt_len} + output {request.output_len} tokens exceed "
                f"max_model_len {cfg.max_model_len}"
            )
        need = self.kv.blocks_for(self.max_kv_tokens(request))
        usable = self.kv.num_blocks - self.kv.watermark_blocks
        if need > usable:
            return (
                f"request {rid}: prompt {request.prompt_len} + output {request.output_len} tokens need {need} "
                f"KV blocks but the cache has {usable}; raise kv_cache.num_blocks (or gpu_memory_utilization) "
                f"or shorten the request"
            )
        return None

    # ---- running-table mechanics -------------------------------------------------------------
    def _admit(self, req: Request, now: float) -> int:
        """Move a request that already holds its blocks into the running table."""
        req.state = RequestState.RUNNING
        if req.first_scheduled_time != req.first_scheduled_time:  # nan: first time scheduled
            req.first_scheduled_time = now
        return self.run.append(req, self.kv.num_blocks_of(req))

    def _admit_queued(self, req: Request, fresh: bool, cached: int, computed: int, now: float) -> int:
        """Admit a queued request that ``blocks.attach_cached_prefix`` looked up and that now holds
        its blocks (the caller took it off the queue); returns its row."""
        if fresh and req.num_preemptions == 0:
            req.num_cached_tokens = cached
        req.num_computed_tokens = computed
        return self._admit(req, now)

    def _pick_victim(self, candidates: np.ndarray) -> int:
        """Row to preempt among ``candidates`` (bool mask): newest first, or lowest priority."""
        rows = candidates.nonzero()[0]
        if self.config.policy == "priority":
            # highest priority value = least important; ties go to the most recently admitted
            prio = self.run.prio[rows]
            worst = rows[prio == prio.max()]
            return int(worst[-1])
        return int(rows[-1])

    def _preempt_row(self, i: int) -> None:
        """Preempt running row i: recompute, soft reset or swap. Caller removes the row afterwards."""
        req = self.run.sync(i)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_this_step.append(req)
        # A request swapped in during this very step has no data on the device yet: recompute it.
        swapped_in_now = req.request_id in self._swapped_in_now
        if self.preemption_mode == "swap" and not swapped_in_now:
            pairs = self.kv.swap_out(req)
            if pairs is not None:
                self._swap_out.extend(pairs)
                req.state = RequestState.SWAPPED
                self.swapped.append(req)
                return
            # host swap space is full: fall back to recompute, as the request cannot wait in host memory
        if self.cache_preempted != "none" and not swapped_in_now:
            self.kv.cache_preempted(req, generated=self.cache_preempted == "all")
        self.kv.free(req)
        if self.preemption_mode == "soft_reset":
            # Transformers' soft reset: what was generated becomes part of the prompt.
            req.num_prompt_tokens = req.num_tokens
        req.num_computed_tokens = 0
        req.state = RequestState.WAITING
        self._requeue_front(req)

    def _requeue_front(self, req: Request) -> None:
        """Queue a preempted request first, as vLLM V1 prepends it, behind only queued requests that
        already hold their blocks: a disaggregated decode instance's transferred requests
        (``DisaggCluster._transfer``). Ahead of them, a victim that must allocate could wait for
        blocks that only they give back, by running (a deadlock a randomised search found). Outside a
        decode pool no queued request holds blocks, and this is ``appendleft``."""
        waiting, kv = self.waiting, self.kv
        k = 0
        while k < len(waiting) and kv.holds(waiting[k]):
            k += 1
        waiting.insert(k, req)

    def _grow_rows(self, rows: np.ndarray, new: np.ndarray, protect: int = 0) -> np.ndarray:
        """``RunningTable.grow`` with this policy's preemption; returns the mask of preempted rows."""
        return self.run.grow(self.kv, rows, new, self._preempt_until_fits, protect)

    def _preempt_until_fits(self, need_by_row: np.ndarray, preempted: np.ndarray, protect: int) -> None:
        """Preempt victims (marked in ``preempted``) until the unpreempted rows' block needs fit.

        Recounts after each victim: a prefix-shared block freed by a victim stays in use. Rows
        below ``protect`` are never victims; stops when no candidate is left.
        """
        while int(need_by_row[~preempted].sum()) > self.kv.num_free_blocks:
            candidates = ~preempted
            candidates[:protect] = False
            if not candidates.any():
                break
            v = self._pick_victim(candidates)
            preempted[v] = True
            self._preempt_row(v)

    def _grow_all(self, new: np.ndarray, protect: int = 0) -> np.ndarray | None:
        """``RunningTable.grow_leading`` with this policy's preemption (every running row scheduled,
        row i computing ``new[i]`` tokens)."""
        return self.run.grow_leading(self.kv, new, self._preempt_until_fits, protect)

    def _grow_decodes(self) -> np.ndarray | None:
        """``_grow_all`` for a step in which every running row decodes one token."""
        return self.run.grow_decodes(self.kv, self._preempt_until_fits)

    def _const_views(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Read-only (0..k-1, k ones, k Trues); the views are immutable, so they are cached."""
        views = self._c_views.get(k)
        if views is None:
            if k > len(self._c_arange):
                cap = max(2 * k, 64)
                self._c_arange = _readonly(np.arange(cap, dtype=np.int64))
                self._c_ones = _readonly(np.ones(cap, dtype=np.int64))
                self._c_true = _readonly(np.ones(cap, dtype=bool))
                self._c_views.clear()
            views = self._c_views[k] = (self._c_arange[:k], self._c_ones[:k], self._c_true[:k])
        return views

    def _make_batch(self, rows: np.ndarray | None, new: np.ndarray, decode_rows: int = 0) -> Batch:
        """The step's Batch. ``rows`` None: the rows are 0..len(new)-1 (every running row, in order),
        of which the first ``decode_rows`` each compute their one pending token and sample."""
        run = self.run
        prefix = rows is None
        shape = None
        if rows is None:
            k = len(new)
            rows, ones, trues = self._const_views(k)
            if decode_rows == k:
                new = ones
        else:
            decode_rows = 0
        new = new.astype(np.int64, copy=False)
        if rk.ON:  # the rows and the step's aggregates in one compiled pass
            k = len(rows)
            ctx = np.empty(k, dtype=np.int64)
            samples = np.empty(k, dtype=bool)
            shape = rk.batch_rows(run.computed, run.tokens, rows, new, ctx, samples)
        elif prefix:
            ctx = run.computed[:k].copy()
            samples = trues if decode_rows == k else ctx + new >= run.tokens[:k]
        else:
            ctx = run.computed[rows]
            samples = ctx + new >= run.tokens[rows]
        pre, so, si = self._preempted_this_step, self._swap_out, self._swap_in
        self._preempted_this_step, self._swap_out, self._swap_in = [], [], []
        if self._swapped_in_now:
            self._swapped_in_now.clear()
        self.kv.end_step()
        self.scheduled = StepRows(rows, prefix, decode_rows)
        batch = Batch(num_new_tokens=new, num_context_tokens=ctx, samples=samples,
                      preempted=pre, swap_out=so, swap_in=si, decode_rows=decode_rows,
                      requests_of=partial(_requests_at, run.reqs, rows))
        if shape is not None:
            batch.set_shape(*shape)
        return batch

    def _try_swap_in_one(self, now: float) -> bool:
        """Bring the oldest swapped request back into the running table if its blocks fit."""
        req = self.swapped[0]
        pairs = self.kv.swap_in(req)
        if pairs is None:
            return False
        self.swapped.popleft()
        self._swap_in.extend(pairs)
        self._swapped_in_now.add(req.request_id)
        self._admit(req, now)
        return True

    # ---- update ----------------------------------------------------------------------------
    def update(self, batch: Batch, now: float) -> StepOutput:
        """Apply the step ``schedule`` last returned (``batch``), finished at ``now`` (seconds):
        advance counters, emit tokens, retire the requests that are done."""
        step = self.scheduled
        if len(step.rows) == 0:
            return StepOutput([], np.zeros(0), 0)
        run = self.run
        new = batch.num_new_tokens
        itl, first, done = run.advance(step, new, batch.samples, now)
        for i in first:
            req = run.reqs[i]
            if req.first_token_time != req.first_token_time:
                req.first_token_time = now
        if self.kv.enable_prefix_caching:
            rows = step.rows
            for j in (new > 1).nonzero()[0].tolist():
                i = j if step.whole else int(rows[j])
                self.kv.cache_computed_blocks(run.reqs[i], int(run.computed[i]))
        return StepOutput(self._finish_rows(done, now), itl, len(first))

    def _finish_rows(self, done: np.ndarray, now: float) -> list[Request]:
        """Retire the running rows ``done`` (finished this step) and return their requests."""
        finished: list[Request] = []
        if len(done):
            run = self.run
            for i in done.tolist():
                req = run.sync(i)
                self._retire(req, now)
                finished.append(req)
            self._on_rows_finished(done)
        return finished

    def _retire(self, req: Request, now: float) -> None:
        req.state = RequestState.FINISHED
        req.finish_time = now
        if self.hold_finished:
            self._held.append(req)
            self.max_num_seqs -= 1
        else:
            self.kv.free(req)

    def admits_transfer(self, request: Request) -> bool:
        """Whether a disaggregated decode instance may pull ``request``'s KV now, blocks apart (the
        caller allocates its prompt and first token): a policy that grows rows on demand and
        preempts when short always may."""
        return True

    def _fits_to_completion(self, request: Request, reserved: int = 0) -> bool:
        """For a policy that starts a request only with room for all of it: whether ``request``'s blocks
        at its longest fit the free ones beside ``reserved`` (what running requests still grow into)
        and what the requests queued holding their blocks still need. Transferred requests pulled
        past that held blocks that none of them could start without (a disaggregated decode
        instance: 16 of 60 requests stuck under static batching, found by a randomised search)."""
        kv = self.kv
        queued = sum(request_blocks_to_completion(kv, w) for w in self.waiting if kv.holds(w))
        return request_blocks_to_completion(kv, request) + queued + reserved <= kv.num_free_blocks

    def release_finished(self) -> int:
        """Give back the seats and KV blocks of the requests held since they finished (async
        scheduling: after the schedule that followed their last step); returns how many."""
        held = self._held
        if not held:
            return 0
        for req in held:
            self.kv.free(req)
        self.max_num_seqs += len(held)
        self._held = []
        return len(held)

    def _on_rows_finished(self, rows: np.ndarray) -> None:
        self.run.remove_rows(rows.tolist(), gone_rows=rows)

    # ---- a stretch of plain decode steps (the engine's fast-forward) ---------------------------
    def decodes_ahead(self) -> bool:
        """Policy: whether, until a request arrives, finishes or runs short of KV blocks, every next
        step of this policy decodes every running row by one token and admits nothing. A policy
        that says True lets the engine take such steps without calling ``schedule``/``update``."""
        return False

    def _blocks_keep_out(self, req: Request, tokens: int) -> bool:
        """Whether queued ``req``'s allocation of its first ``tokens`` tokens (watermark kept) fails
        now and in every next plain decode step, which only take blocks until one finishes a
        request (and ends a stretch). Not with prefix caching, whose every try looks the prompt up
        (counted in the hit rate, and it moves the cached blocks in the eviction order)."""
        kv = self.kv
        if kv.enable_prefix_caching or kv.holds(req):
            return False
        return kv.num_free_blocks - kv.blocks_for(tokens) < kv.watermark_blocks

    def decode_stretch(self, max_steps: int, min_steps: int = 1) -> int:
        """How many next steps (at most ``max_steps``) are plain decodes of every running row that
        only an arrival could change: none runs short of KV blocks, and only the last may finish
        requests. 0 when fewer than ``min_steps`` would be."""
        if self._held or not self.decodes_ahead():
            return 0  # (held seats and blocks come back after the next schedule: a plain step)
        return self.run.decode_horizon(self.block_size, self.kv.num_free_blocks, max_steps, min_steps)

    def decode_rows(self) -> int:
        """Rows each step of a stretch decodes: the running table's (``num_running`` may count more:
        a static batch's finished members hold their seats aside)."""
        return self.run.n

    def decode_context(self) -> int:
        """Tokens the running rows hold in the KV cache together (a decode step's context)."""
        return int(np.add.reduce(self.run.computed[: self.run.n]))

    def decode_batch(self, step: int) -> Batch:
        """The Batch of step ``step`` (0-based) of the stretch, for the executor's step time."""
        n = self.run.n
        _, ones, trues = self._const_views(n)
        return Batch(num_new_tokens=ones, num_context_tokens=self.run.computed[:n] + step, samples=trues,
                     decode_rows=n)

    def advance_decodes(self, ends: list[float]) -> tuple[np.ndarray, np.ndarray, list[Request]]:
        """Apply the stretch's steps, step j ending at ``ends[j]`` (seconds), and retire the
        requests its last step finished; returns the first step's ITLs per row and the KV blocks
        each step took (``RunningTable.advance_decodes``), and the finished requests."""
        itl0, taken = self.run.advance_decodes(self.kv, ends)
        run = self.run
        n = run.n
        done = (run.out[:n] >= run.out_len[:n]).nonzero()[0]
        return itl0, taken, self._finish_rows(done, ends[-1])

    # ---- end-of-run check ------------------------------------------------------------------
    def check_drained(self) -> None:
        """Raise unless every queue is empty and every KV block is back."""
        if self.has_unfinished:
            raise AssertionError(
                f"scheduler still holds work: {len(self.waiting)} waiting, {self.run.n} running, "
                f"{len(self.swapped)} swapped"
            )
        self.kv.check_all_free()
