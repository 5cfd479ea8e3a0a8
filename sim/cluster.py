"""Several replicas behind a router, fed by one arrival process and by conversations' next turns.

Routing happens at the request's arrival time, from the router's own view (``router.py``). A
request that is a conversation's turn (``Request.next_turn``) releases the next turn
``think_time_s`` seconds after it ends (finished or rejected): the client waits for the reply,
then types (a closed loop per session).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import simpy

from .engine import Replica, check_conservation
from .request import Request
from .router import ClusterConfig, Router, RouterName
from .sessions import later_turns
from .workload import RequestArrays


class Cluster:
    """Replicas, a router, and the processes that deliver requests at their arrival times."""

    def __init__(self, env: simpy.Environment, replicas: list[Replica], router: RouterName = "round_robin",
                 *, config: ClusterConfig | None = None, seed: int = 0) -> None:
        self.env = env
        self.replicas = replicas
        if config is not None:
            self.router = Router(replicas, config.router, refresh_s=config.router_refresh_s,
                                 prefix_weight=config.prefix_weight, load_weight=config.load_weight, seed=seed)
        else:
            self.router = Router(replicas, router, seed=seed)
        self.num_done = 0
        # requests reported done, to catch one reported twice: a flag per id for ids 0..N-1 (a
        # generated workload's; one byte each, where a set of ints held ~65), a set for any other
        self._done_flags = bytearray()
        self._done_other: set[int] = set()
        self.on_progress: Callable[[int], None] | None = None
        # called with (answered turn, next turn) before the next turn's think time starts (live mode
        # writes the next prompt's token ids: the conversation so far, the reply as generated)
        self.on_turn: Callable[[Request, Request], None] | None = None
        # when the arrival process next delivers a request (seconds): the replicas fast-forward
        # only over steps that end before it
        self._next_arrival = -math.inf
        self._unreleased = 0  # conversation turns not yet sent
        self._all_released: simpy.Event = env.event()
        # Conversation turns between answer and send: when each think time ends (a heap of times).
        self._releases: list[float] = []
        self._due_turns: list[tuple[float, int, Request]] = []  # (due, request id, turn) of turns not sent
        # Sent turns with a next turn, not yet answered, by replica: {request id: think time} and a
        # heap of (think time, request id) whose answered entries are dropped when they surface.
        self._asking: dict[int, dict[int, float]] = {rep.replica_id: {} for rep in replicas}
        self._asking_heap: dict[int, list[tuple[float, int]]] = {rep.replica_id: [] for rep in replicas}
        # A router that can tell which of its next picks surely go elsewhere (``Router.
        # picks_elsewhere``) lets a replica look ahead past those arrivals, not just to everyone's
        # next one (without conversations: their turns take picks too). The requests the arrival
        # process delivers, the index of the one it waits for, and the times SimPy schedules it
        # and the ones after it at (worked out as they are asked for).
        self._ahead = self.router.looks_ahead
        self._slot = {rep.replica_id: i for i, rep in enumerate(replicas)}
        self._stream: Sequence[Request] | None = None
        self._stream_times: np.ndarray | None = None  # the columns' arrival times (RequestArrays)
        self._at = 0
        self._times_ahead: list[float] = []
        for rep in replicas:
            rep.on_done = self._count_done
            rep.next_arrival = partial(self._peek_arrival, rep.replica_id)
            rep.arrives_at = self._arrives_at

    def _peek_arrival(self, replica: int) -> float:
        """No request reaches any replica before this time (seconds), as far as ``replica`` can tell.

        The arrival process's next request; a conversation turn whose think time runs, when it ends;
        a turn whose previous turn is not answered yet, no sooner than that turn's think time from
        now, when the previous turn is on another replica. One on ``replica`` itself is not answered
        before the end of the asking replica's next steps, which it is asking about: a stretch ends
        with the step that finishes a request. Without conversations, fresh arrivals that surely go
        to other replicas (``Router.picks_elsewhere``: the replica stretching is sent nothing and
        reports no finish before its stretch's last step ends) are looked past."""
        t = self._next_arrival
        if self._ahead and -math.inf < t < math.inf:
            t = self._time_ahead(self.router.picks_elsewhere(self._slot[replica]))
        if self._releases:
            t = min(t, self._releases[0])
        if self._unreleased:
            now = self.env.now
            for r, heap in self._asking_heap.items():
                if r == replica:
                    continue
                asking = self._asking[r]
                while heap and heap[0][1] not in asking:
                    heapq.heappop(heap)
                if heap:
                    t = min(t, now + heap[0][0])
        return t

    def _time_ahead(self, m: int) -> float:
        """When the m-th request after the one the arrival process waits for (m = 0: that one) is
        sent: the time SimPy schedules it at, chained from the pending one as ``arrivals`` computes
        its delays; inf past the last request."""
        times = self._times_ahead
        if len(times) <= m:
            stream, at = self._stream, self._at
            if not times:
                times.append(self._next_arrival)
            t = times[-1]
            col = self._stream_times
            while len(times) <= m:
                j = at + len(times)
                if j >= len(stream):  # type: ignore[arg-type]
                    return math.inf
                a = float(col[j]) if col is not None else stream[j].arrival_time  # type: ignore[index]
                delay = a - t
                if delay > 0:  # as ``arrivals`` waits for it: from the request before's time
                    t = t + delay
                times.append(t)
        return times[m]

    def _arrives_at(self, t: float) -> bool:
        """Whether a fresh request not sent yet is due exactly at ``t`` (seconds). A stretch that
        runs past other replicas' arrivals must not end on one: SimPy orders events of one instant
        by when they were scheduled, and a stretch schedules its end earlier than the plain step
        would, so the replica's next step and that arrival would swap order (with a request of
        its own arriving exactly when that step ends, it would then miss it)."""
        if not self._ahead or not self._next_arrival <= t < math.inf:
            return False
        m = 0
        while (due := self._time_ahead(m)) < t:
            m += 1
        return due == t

    def _count_done(self, req: Request) -> None:
        rid = req.request_id
        flags = self._done_flags
        if 0 <= rid < len(flags):
            if flags[rid]:
                raise AssertionError(f"request {rid} reported done twice")
            flags[rid] = 1
        else:
            if rid in self._done_other:
                raise AssertionError(f"request {rid} reported done twice")
            self._done_other.add(rid)
        self.num_done += 1
        self._answered(req)
        if req.next_turn is not None:
            # (replica -1: answered or refused outside any replica, e.g. a disaggregated cluster's
            # one-token turn finished in the prefill pool)
            asking = self._asking.get(req.replica)
            if asking is not None:
                asking.pop(rid, None)
            if self.on_turn is not None:
                self.on_turn(req, req.next_turn)
            think = req.think_time_s
            # the time _release's timeout lands on
            due = self.env.now + think if think > 0 else self.env.now
            heapq.heappush(self._releases, due)
            heapq.heappush(self._due_turns, (due, req.next_turn.request_id, req.next_turn))
            self.env.process(self._release(think))
        if self.on_progress is not None:
            self.on_progress(1)

    def _answered(self, req: Request) -> None:
        """The router learns that a request it sent was answered."""
        self.router.on_done(self.replicas[req.replica])

    def _send(self, req: Request) -> None:
        """A request arrives now: route it."""
        rep = self.router.pick(req, self.env.now)
        if req.next_turn is not None:
            # before submit: a request the replica refuses is reported done inside it
            self._asking[rep.replica_id][req.request_id] = req.think_time_s
            heapq.heappush(self._asking_heap[rep.replica_id], (req.think_time_s, req.request_id))
        rep.submit(req)

    def _close(self):  # noqa: ANN202 - a SimPy process step
        """Nothing more will arrive: let idle replicas end."""
        for rep in self.replicas:
            rep.close()
        yield from ()

    def _release(self, think_s: float):  # noqa: ANN202 - a SimPy process
        if think_s > 0:
            yield self.env.timeout(think_s)
        # Turns due on one instant go out in request-id order, whichever release fires first: their
        # releases fire in the order the turns before them were reported done, and two replicas'
        # steps ending on one instant report in an order the fast-forward may change.
        _, _, req = heapq.heappop(self._due_turns)
        req.arrival_time = self.env.now
        heapq.heappop(self._releases)  # (the earliest: think times end in time order)
        self._send(req)
        self._unreleased -= 1
        if self._unreleased == 0 and not self._all_released.triggered:
            self._all_released.succeed()

    def arrivals(self, requests: list[Request]):  # noqa: ANN201 - a SimPy process
        env = self.env
        # a session's later turns are sent when the turn before them is answered (columns of
        # one-turn requests have none, and reading them twice would make every request twice)
        later = set() if isinstance(requests, RequestArrays) else later_turns(requests)
        self._unreleased = len(later)
        self._ahead = self._ahead and not later
        self._stream = requests
        self._stream_times = requests.arrival_time if isinstance(requests, RequestArrays) else None
        for i, req in enumerate(requests):
            if req.request_id in later:
                continue
            delay = req.arrival_time - env.now
            if delay > 0:
                self._next_arrival = env.now + delay  # the time SimPy schedules the timeout at
                self._at = i
                self._times_ahead = []
                yield env.timeout(delay)
            self._send(req)
        self._next_arrival = math.inf
        if self._unreleased:
            yield self._all_released
        yield from self._close()

    def run(self, requests: list[Request]) -> None:
        """Replay ``requests`` (sorted by arrival time) to the end, then check conservation."""
        self._done_flags = bytearray(len(requests))
        self.env.process(self.arrivals(requests))
        self.env.run()
        check_conservation(requests, self.replicas, self.num_done)
        if self._done_flags.count(1) + len(self._done_other) != len(requests):
            raise AssertionError("some requests were never reported done")


def replica_summary(replicas: list[Replica], served_by: np.ndarray, makespan_s: float,
                    busy_s: list[float]) -> list[dict[str, Any]]:
    """One entry per replica for summary.json: requests served (``served_by``: each recorded
    request's replica, -1 for one never routed), prefix-cache hit rate (cached prompt tokens over
    prompt tokens looked up, as vLLM counts it) and busy share of the run."""
    ids = np.asarray(served_by, dtype=np.int64)
    served = np.bincount(ids[(ids >= 0) & (ids < len(replicas))], minlength=len(replicas)).tolist()
    out = []
    for i, rep in enumerate(replicas):
        kv = rep.scheduler.kv
        queries, hits = kv.prefix_queries * kv.block_size, kv.prefix_hits * kv.block_size
        out.append({
            "replica": rep.replica_id,
            "num_requests": served[i],
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "prefix_cache_hit_tokens": hits,
            "prefix_cache_query_tokens": queries,
            "busy_fraction": busy_s[i] / makespan_s if makespan_s > 0 else None,
        })
    return out
