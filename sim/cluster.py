"""Several replicas behind a router, fed by one arrival process.

Routers: ``round_robin``; ``least_outstanding`` (fewest waiting + running + swapped requests);
``kv_aware`` (most free KV blocks after the prompts already queued there, ties to the least
outstanding). Routing happens at the request's arrival time, from what the replicas hold then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import simpy
from pydantic import BaseModel, ConfigDict, Field

from .engine import Replica, check_conservation
from .request import Request

RouterName = Literal["round_robin", "least_outstanding", "kv_aware"]


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=1)
    router: RouterName = "round_robin"


class Router:
    def __init__(self, replicas: list[Replica], policy: RouterName) -> None:
        self.replicas = replicas
        self.policy = policy
        self._next = 0

    def pick(self, req: Request) -> Replica:
        reps = self.replicas
        if len(reps) == 1:
            return reps[0]
        if self.policy == "round_robin":
            rep = reps[self._next % len(reps)]
            self._next += 1
            return rep
        if self.policy == "least_outstanding":
            return min(reps, key=lambda r: (r.num_outstanding, r.replica_id))
        # kv_aware: free blocks net of the prompts still queued at each replica
        def headroom(r: Replica) -> tuple[float, int, int]:
            kv = r.scheduler.kv
            queued = sum(kv.blocks_for(q.num_tokens) for q in r.scheduler.waiting)
            return (-(kv.num_free_blocks - queued), r.num_outstanding, r.replica_id)

        return min(reps, key=headroom)


class Cluster:
    """Replicas, a router, and the process that delivers requests at their arrival times."""

    def __init__(self, env: simpy.Environment, replicas: list[Replica], router: RouterName = "round_robin") -> None:
        self.env = env
        self.replicas = replicas
        self.router = Router(replicas, router)
        self.num_done = 0
        self._done_ids: set[int] = set()
        self.on_progress: Callable[[int], None] | None = None
        for rep in replicas:
            rep.on_done = self._count_done

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
                yield env.timeout(delay)
            pick(req).submit(req)
        for rep in self.replicas:
            rep.close()

    def run(self, requests: list[Request]) -> None:
        """Replay ``requests`` (sorted by arrival time) to the end, then check conservation."""
        self.env.process(self.arrivals(requests))
        self.env.run()
        check_conservation(requests, self.replicas, self.num_done)
        if len(self._done_ids) != len(requests):
            raise AssertionError("some requests were never reported done")
