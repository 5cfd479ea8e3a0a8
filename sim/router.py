"""Routing requests among replicas, and the ``cluster`` section of a scenario.

Routers: ``round_robin``; ``least_outstanding`` (fewest waiting + running + swapped requests);
``kv_aware`` (most free KV blocks after the prompts already queued there, ties to the least
outstanding). The router only reads the replicas' queues, so this module (and the scenario
schema that imports ``ClusterConfig``) has no SimPy in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from .config_model import ConfigModel

if TYPE_CHECKING:
    from .engine import Replica
    from .request import Request

RouterName = Literal["round_robin", "least_outstanding", "kv_aware"]


class ClusterConfig(ConfigModel):
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
