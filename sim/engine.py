"""One serving replica as a SimPy process: schedule -> execute -> update, one iteration a step.

The same loop runs in simulation (``simpy.Environment``: a step takes the seconds the cost model
predicts) and live (``simpy.rt.RealtimeEnvironment(strict=False)``: the executor runs the real
model, and the clock advances by what the step really took, scheduling and bookkeeping
included). An idle replica waits on an arrival event instead of polling; a policy that holds
queued work back (a batching delay, ``Scheduler.next_wakeup``) has the replica wait for the next
arrival or its deadline, whichever comes first.

Fast-forward (simulation only): when the policy says its next steps are plain decodes of every
running row (``Scheduler.decodes_ahead``) and none of them finishes a request or runs short of KV
blocks, the replica prices those steps one by one with the executor, stops before the step in
which the next request arrives (``next_arrival``, set by the cluster), applies them to the
running table at once and waits one SimPy event for all of them. Every step keeps its exact start,
duration, inter-token latencies and iteration record, so the run is the plain loop's, step for step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import simpy
import simpy.rt

from .batch import Batch, StepSums
from .request import Request, RequestState
from .schedulers import Scheduler

if TYPE_CHECKING:
    from .cost_model import CostModel


class Executor(Protocol):
    def run(self, batch: Batch) -> float:
        """Execute one step; return its duration in seconds."""
        ...


MAX_STRETCH = 4096  # most steps one fast-forward covers
MIN_STRETCH = 4  # a shorter stretch costs about what its plain steps would


class SimExecutor:
    """Executes a step by asking the cost model how long it takes.

    ``overlap_host``: the engine prepares the next step on the CPU while the device runs this one
    (vLLM's async scheduling), so the cost model's host term (``loop_overhead``) and the device
    time overlap: a step takes the longer of the two instead of their sum.
    """

    def __init__(self, cost_model: CostModel, kv_block_bytes: float, overlap_host: bool = False) -> None:
        self.cost_model = cost_model
        self.kv_block_bytes = kv_block_bytes
        self._host = getattr(cost_model, "loop_overhead", None) if overlap_host else None
        # a cost model with step_time reads the Batch's aggregates, computed once per step; one whose
        # features need the rows themselves (a fitted CPU profile, a GPU layer-table profile) says so
        # with needs_rows and takes the same aggregates beside the rows, so they are not summed twice
        self._needs_rows = getattr(cost_model, "needs_rows", False)
        self._step_time = None if self._needs_rows else getattr(cost_model, "step_time", None)
        # a model priced from sums may still want the rows of a step with decode and prefill rows
        self._mixed_rows = self._step_time is not None and getattr(cost_model, "mixed_needs_rows", False)

    def decode_time(self, n: int, context_tokens: int) -> float | None:
        """``run`` of a plain decode step (n rows computing one token each, ``context_tokens``
        in their KV caches together) without building its Batch; None when the cost model prices
        the rows themselves."""
        if self._step_time is None:
            return None
        t = self._step_time(StepSums(n, n, n, 0, context_tokens + n, 0), 0.0)
        if self._host is not None and t > 0:
            host = self._host(n)
            t = max(t - host, host)
        return t

    def prices_rows(self, sums: StepSums) -> bool:
        """Whether ``price`` reads the rows (q, ctx) of a step with these sums, not only the sums."""
        return self._step_time is None or (self._mixed_rows and sums.prefill_attn_pairs and sums.decode_seqs)

    def price(self, sums: StepSums, longest_decode_kv: int, q: np.ndarray | None = None,
              ctx: np.ndarray | None = None) -> float:
        """``run`` of a step without swaps from its ``sums``, the largest ctx + 1 of its q == 1 rows
        (0: none) and, for a cost model that prices rows (``prices_rows``), the rows' new and
        context tokens: the compiled engine's steps (``compiled_engine.py``). Each branch is
        ``run``'s call, with the same arguments."""
        if self._mixed_rows and sums.prefill_attn_pairs and sums.decode_seqs:
            t = self.cost_model.iteration_time(q, ctx, 0.0, sums=sums, longest_decode_kv=longest_decode_kv)
        elif self._step_time is not None:
            t = self._step_time(sums, 0.0)
        elif self._needs_rows:
            t = self.cost_model.iteration_time(q, ctx, 0.0, sums=sums)
        else:
            t = self.cost_model.iteration_time(q, ctx, 0.0)
        if self._host is not None and t > 0:
            host = self._host(sums[0])
            t = max(t - host, host)
        return t

    def run(self, batch: Batch) -> float:
        swap_blocks = len(batch.swap_out) + len(batch.swap_in)
        swap_bytes = swap_blocks * self.kv_block_bytes if swap_blocks else 0.0
        if self._mixed_rows and (sums := batch.sums).prefill_attn_pairs and sums.decode_seqs:
            t = self.cost_model.iteration_time(batch.num_new_tokens, batch.num_context_tokens, swap_bytes, sums=sums,
                                               longest_decode_kv=batch.longest_decode_kv)
        elif self._step_time is not None:
            t = self._step_time(batch.sums, swap_bytes)
        elif self._needs_rows:
            t = self.cost_model.iteration_time(batch.num_new_tokens, batch.num_context_tokens, swap_bytes,
                                               sums=batch.sums)
        else:
            t = self.cost_model.iteration_time(batch.num_new_tokens, batch.num_context_tokens, swap_bytes)
        if self._host is not None and t > 0:
            host = self._host(batch.sums[0])
            t = max(t - host, host)
        return t


class SimEnvironment(simpy.Environment):
    """The simulation clock: a ``simpy.Environment`` that a replica may move forward without an
    event (``skip_to``) when no event is due before the new time. A step that nothing else can
    interrupt (no arrival, no other replica's step ends inside it) then costs no Timeout, heap
    push and pop, or generator resume; every event that does happen keeps its time and order."""

    def skip_to(self, t: float) -> bool:
        """Set the clock to ``t`` (>= now) if no event is scheduled at or before it; else False
        (the caller yields a timeout, which lets those events go first, as they would)."""
        queue = self._queue
        if queue and queue[0][0] <= t:
            return False
        self._now = t
        return True


class Recorder(Protocol):  # what the engine needs from sim/metrics.py
    def on_iteration(self, **kwargs: object) -> None: ...
    def on_itl(self, itl: np.ndarray) -> None: ...
    def on_request_done(self, req: Request) -> None: ...
    def on_decode_steps(self, replica: int, starts: list[float], durations: list[float], n: int,
                        kv_blocks_used: np.ndarray, kv_blocks_total: int, num_waiting: int, num_swapped: int,
                        first_itl: np.ndarray, last_running: int, running: int) -> None: ...


class Replica:
    """A serving replica: a scheduler, an executor, and the SimPy process that drives them."""

    def __init__(
        self,
        env: simpy.Environment,
        replica_id: int,
        scheduler: Scheduler,
        executor: Executor,
        recorder: Recorder,
        on_done=None,  # callable(Request) -> None, called once per finished or rejected request
        async_scheduling: bool = False,
        fast_forward: bool = True,
    ) -> None:
        self.env = env
        self.replica_id = replica_id
        self.scheduler = scheduler
        self.executor = executor
        self.recorder = recorder
        self.on_done = on_done
        self.realtime = isinstance(env, simpy.rt.RealtimeEnvironment)
        self.num_iterations = 0
        self.num_fast_forward_steps = 0  # of num_iterations, steps taken by fast-forward
        self.num_stretches = 0  # fast-forwards those steps were taken in
        self.arrivals_open = True  # the cluster clears this when no request is left to arrive
        # vLLM's async scheduling: the step after the running one is already scheduled, so a request
        # arriving during a step reaches the scheduler only after the next step has been chosen
        self.async_scheduling = async_scheduling
        # called when the seats and KV blocks of requests held since they finished come back (async
        # scheduling: after the next schedule, not when ``on_done`` reports them): a disaggregated
        # cluster's KV pulls and holds wait for those blocks
        self.on_released: Callable[[], None] | None = None
        # whether KV blocks held outside the scheduler are due back (a disaggregated prefill instance's
        # prompts held for their transfer, freed with a poke): with none free, the replica waits for
        # them instead of reporting that its scheduler made no progress
        self.blocks_due: Callable[[], bool] | None = None
        self._in_step = False
        self._arrived: list[Request] = []
        self._wakeup = env.event()
        # When the next request can arrive (seconds); None: unknown, so no fast-forward. Whoever
        # submits requests to this replica must answer it (the cluster does).
        self.next_arrival: Callable[[], float] | None = None
        # whether a request (to any replica) arrives exactly at a time: a stretch does not end there
        # (set by the cluster when stretches may run past other replicas' arrivals)
        self.arrives_at: Callable[[float], bool] | None = None
        # only an executor that prices a step without side effects (SimExecutor.decode_time) can be
        # asked about steps the stretch may then not take; a replay or live executor never is
        self.fast_forward = fast_forward and not self.realtime and hasattr(executor, "decode_time")
        self._stretch_end = -math.inf  # end of the fast-forward in flight
        self.process = env.process(self._loop())

    @property
    def num_outstanding(self) -> int:
        s = self.scheduler
        return s.num_waiting + s.num_running + s.num_swapped + len(self._arrived)

    def submit(self, req: Request) -> None:
        """A request arrives at this replica now."""
        req.replica = self.replica_id
        if self.env.now < self._stretch_end:
            raise RuntimeError(
                f"replica {self.replica_id}: request {req.request_id} submitted at {self.env.now} s inside a "
                f"fast-forward that ends at {self._stretch_end} s; next_arrival must announce every submit"
            )
        if self._in_step and self.async_scheduling:
            self._arrived.append(req)  # the engine drains its input after scheduling the next step
            return
        self._admit(req)

    def _flush_arrived(self) -> None:
        arrived, self._arrived = self._arrived, []
        for req in arrived:
            self._admit(req)

    def _admit(self, req: Request) -> None:
        if not self.scheduler.add(req):
            self._done(req)
            return
        if not self._wakeup.triggered:
            self._wakeup.succeed()

    def close(self) -> None:
        """No more arrivals: let an idle replica's process end."""
        self.arrivals_open = False
        if not self._wakeup.triggered:
            self._wakeup.succeed()

    def poke(self) -> None:
        """Blocks were freed outside the scheduler (a disaggregated KV transfer ended): look again."""
        if not self._wakeup.triggered:
            self._wakeup.succeed()

    def _release_finished(self) -> int:
        """The scheduler gives back what finished requests held (async scheduling); ``on_released``
        hears of it. Returns how many requests."""
        released = self.scheduler.release_finished()
        if released and self.on_released is not None:
            self.on_released()
        return released

    def _done(self, req: Request) -> None:
        self.recorder.on_request_done(req)
        if self.on_done is not None:
            self.on_done(req)

    def _wall_now(self) -> float:
        env = self.env
        return env.env_start + (time.monotonic() - env.real_start) / env.factor  # type: ignore[attr-defined]

    def _loop(self):  # noqa: ANN202 - a SimPy process
        env = self.env
        sched = self.scheduler
        kv = sched.kv
        rec = self.recorder
        realtime = self.realtime
        clock = time.perf_counter
        # a simulation clock with nothing due before a step's end is moved there directly
        skip = env.skip_to if isinstance(env, SimEnvironment) else None
        overhead = 0.0  # live mode: seconds spent in update + schedule around this step
        last_dt = 0.0  # the last plain step's duration (seconds)
        # the last plain step left a row short of its tokens (a prefill chunk): the next step is no
        # plain decode of every row, so trying a stretch would only cost time
        pending_prefill = False
        while True:
            if self._arrived and not sched.has_unfinished:  # nothing else to schedule: seen at once
                self._flush_arrived()
            if not sched.has_unfinished:
                self._release_finished()  # (async scheduling) the last step's outputs are processed
                if not self.arrivals_open:
                    return
                yield self._wakeup
                self._wakeup = env.event()
                continue
            # (the last step's duration as a guess: with an arrival closer than that, no stretch of
            # two steps fits, and trying would only cost time)
            if (self.fast_forward and not pending_prefill and not self._arrived and self.next_arrival is not None
                    and self.next_arrival() - env.now > last_dt):
                k = sched.decode_stretch(MAX_STRETCH, MIN_STRETCH)
                if k >= MIN_STRETCH:
                    stretch = self._fast_forward(k)
                    if stretch is not None:
                        ends, durations, finished = stretch
                        self._stretch_end = ends[-1]
                        for delay in _hops(env.now, ends, durations):
                            yield env.timeout(delay)
                        self._stretch_end = -math.inf
                        # reported when the plain loop would: at the end of the step that finished
                        # them (a conversation's next turn starts its think time then)
                        for req in finished:
                            self._done(req)
                        continue
            t_sched = clock() if realtime else 0.0
            batch = sched.schedule(env.now)
            # (async scheduling) the outputs of the step that just ended are processed after this
            # schedule: the requests it finished give their seats and blocks back now
            released = self._release_finished()
            if self._arrived:  # arrivals of the step that just ended, seen from the next schedule on
                self._flush_arrived()
            if batch.is_empty:
                if released or batch.preempted:
                    # schedule again at once: with the seats and blocks back, or after a step whose
                    # preemptions took every row and, as vLLM V1 does, admitted nothing (a
                    # disaggregated decode instance whose queued transferred requests hold the blocks)
                    continue
                wake = sched.next_wakeup(env.now)
                if wake is not None and wake > env.now:
                    # a batching delay: the policy is waiting for more requests, up to a deadline
                    yield self._wakeup | env.timeout(wake - env.now)
                    if self._wakeup.triggered:
                        self._wakeup = env.event()
                    continue
                if ((sched.num_running == 0 and sched.num_swapped == 0 and self.arrivals_open)
                        or (self.blocks_due is not None and self.blocks_due())):
                    # only an arrival (e.g. after a batching delay) or blocks coming back from
                    # outside the scheduler can change anything; wait for one
                    yield self._wakeup
                    self._wakeup = env.event()
                    continue
                raise RuntimeError(
                    f"replica {self.replica_id}: scheduler made no progress with {sched.num_waiting} waiting, "
                    f"{sched.num_running} running, {sched.num_swapped} swapped and "
                    f"{kv.num_free_blocks}/{kv.num_blocks} KV blocks free"
                )
            if realtime:
                overhead += clock() - t_sched
            start = env.now
            dt = last_dt = self.executor.run(batch)
            pending_prefill = (self.fast_forward and batch.decode_rows != len(batch.num_new_tokens)
                               and batch.num_samples != len(batch.samples))
            if realtime:
                # the clock advances by what the step really took, scheduling included
                dt = max(dt, self._wall_now() - start)
            self._in_step = True
            if skip is None or not skip(env.now + dt):  # (the time env.timeout(dt) would end at)
                yield env.timeout(dt)
            self._in_step = False
            t_upd = clock() if realtime else 0.0
            out = sched.update(batch, env.now)
            self.num_iterations += 1
            if len(out.itl):
                rec.on_itl(out.itl)
            for req in out.finished:
                self._done(req)
            rec.on_iteration(
                replica=self.replica_id,
                start=start,
                duration=dt,
                batch=batch,
                kv_blocks_used=kv.num_used_blocks,
                kv_blocks_total=kv.num_blocks,
                num_waiting=sched.num_waiting,
                num_running=sched.num_running,
                num_swapped=sched.num_swapped,
                num_preempted=len(batch.preempted),
                sched_overhead_s=overhead if realtime else math.nan,
            )
            if realtime:
                overhead = clock() - t_upd


    def _fast_forward(self, k: int) -> tuple[list[float], list[float], list[Request]] | None:
        """Take up to ``k`` plain decode steps that end before the next arrival: price them, apply
        them (the last may finish requests), record them as the plain loop would; return the steps'
        ends and durations and the requests the last step finished, which the caller reports done
        at that step's end (None: no step fits)."""
        sched = self.scheduler
        limit = self.next_arrival()  # type: ignore[misc]
        n = sched.decode_rows()
        running = sched.num_running
        context = sched.decode_context()
        price = self.executor.decode_time  # type: ignore[attr-defined]
        t = self.env.now
        starts: list[float] = []
        durations: list[float] = []
        ends: list[float] = []
        for j in range(k):
            dt = price(n, context + j * n)
            if dt is None:  # a cost model that prices the rows themselves
                dt = self.executor.run(sched.decode_batch(j))
            end = t + dt  # what env.now becomes after env.timeout(dt)
            if not end < limit:
                break
            starts.append(t)
            durations.append(dt)
            ends.append(end)
            t = end
        if self.arrives_at is not None:
            while ends and self.arrives_at(ends[-1]):
                del starts[-1], durations[-1], ends[-1]
        if not ends:
            return None
        kv = sched.kv
        used = kv.num_used_blocks
        itl0, taken, finished = sched.advance_decodes(ends)
        used_after = used + np.cumsum(taken)
        used_after[-1] = kv.num_used_blocks  # the last step's finished requests gave theirs back
        rec = self.recorder
        rec.on_decode_steps(self.replica_id, starts, durations, n, used_after, kv.num_blocks,
                            sched.num_waiting, sched.num_swapped, itl0, sched.num_running, running)
        self.num_iterations += len(ends)
        self.num_fast_forward_steps += len(ends)
        self.num_stretches += 1
        return ends, durations, finished


def _exact_delay(now: float, end: float) -> float | None:
    """The delay d with ``now + d == end`` exactly (SimPy schedules at now + delay), or None.

    ``now + d`` rounds monotonically in d, so such a d, when there is one, lies within an ulp or
    two of ``end - now`` (which is itself exact when ``now >= end / 2``). There may be none: with
    ``now < end / 2`` the exact sums can fall on the rounding ties either side of ``end`` and round
    away from it (now 0.05, end 0.24999999999999997)."""
    d = end - now
    for _ in range(8):
        s = now + d
        if s == end:
            return d
        d = math.nextafter(d, math.inf if s < end else -math.inf)
    return None


def _hops(now: float, ends: Sequence[float], durations: Sequence[float]) -> list[float]:
    """Delays that move SimPy's clock from ``now`` onto ``ends[-1]`` exactly, as the plain loop's
    steps would: one jump when ``ends[-1]`` can be hit from ``now``, otherwise step by step (each
    step's own duration lands on its end exactly, since ``ends[i] = ends[i-1] + durations[i]``)
    until a jump to the last end can be made from there."""
    delays: list[float] = []
    for i in range(len(ends)):
        d = _exact_delay(now, ends[-1])
        if d is not None:
            delays.append(d)
            return delays
        delays.append(durations[i])
        now = ends[i]
    return delays


def check_conservation(requests: Sequence[Request], replicas: list[Replica], num_done: int) -> None:
    """End-of-run check: every request finished with all its tokens or was rejected with a reason,
    each exactly once, and every replica gave back all its KV blocks.

    Read off the recorder's records when it keeps them (the requests may be created lazily and
    gone), else off the Request objects."""
    if num_done != len(requests):
        raise AssertionError(f"{len(requests)} requests submitted but {num_done} reported done")
    check_done = getattr(replicas[0].recorder, "check_done", None) if replicas else None
    if check_done is not None:
        check_done(len(requests))
    else:
        for req in requests:
            if req.state == RequestState.FINISHED:
                if req.num_output_tokens != req.output_len:
                    raise AssertionError(
                        f"request {req.request_id} finished with {req.num_output_tokens} of {req.output_len} tokens"
                    )
            elif req.state == RequestState.REJECTED:
                if not req.reject_reason:
                    raise AssertionError(f"request {req.request_id} rejected without a reason")
            else:
                raise AssertionError(f"request {req.request_id} left in state {req.state.name}")
    for rep in replicas:
        rep.scheduler.check_drained()
