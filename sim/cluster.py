"""Several replicas behind a router, fed by one arrival process.

Routers: ``round_robin``; ``least_outstanding`` (fewest waiting + running + swapped requests);
``kv_aware`` (most free KV blocks after the prompts already queued there, ties to the least
outstanding). Routing happens at the request's arrival time, from what the replicas hold then.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import simpy

from .engine import Replica, check_conservation
from .request import Request
from .router import Router, RouterName


class Cluster:
    """Replicas, a router, and the process that delivers requests at their arrival times."""

    def __init__(self, env: simpy.Environment, replicas: list[Replica], router: RouterName = "round_robin") -> None:
        self.env = env
        self.replicas = replicas
        self.router = Router(replicas, router)
        self.num_done = 0
        self._done_ids: set[int] = set()
        self.on_progress: Callable[[int], None] | None = None
        # when the arrival process next delivers a request (seconds): the replicas fast-forward
        # only over steps that end before it
        self._next_arrival = -math.inf
        for rep in replicas:
            rep.on_done = self._count_done
            rep.next_arrival = self._peek_arrival

    def _peek_arrival(self) -> float:
        return self._next_arrival

    def _count_done(self, req: Request) -> None:
        if req.request_id in self._done_ids:
            raise AssertionError(f"request {req.request_id} reported done twice")
        self._done_ids.add(req.request_id)
        self.num_done += 1
        if self.on_progress is not None:
            self.on_progress(1)

    def arrivals(self, requests: list[Request]):  # noqa: ANN201 - a SimPy process
        env = self.env
        pick = self.router.pick
        for req in requests:
            delay = req.arrival_time - env.now
            if delay > 0:
                self._next_arrival = env.now + delay  # the time SimPy schedules the timeout at
                yield env.timeout(delay)
            pick(req).submit(req)
        self._next_arrival = math.inf
        for rep in self.replicas:
            rep.close()

    def run(self, requests: list[Request]) -> None:
        """Replay ``requests`` (sorted by arrival time) to the end, then check conservation."""
        self.env.process(self.arrivals(requests))
        self.env.run()
        check_conservation(requests, self.replicas, self.num_done)
        if len(self._done_ids) != len(requests):
            raise AssertionError("some requests were never reported done")
