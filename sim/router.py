"""Routing requests among replicas from the router's own view, and the ``cluster`` section of a scenario.

A router sees what a real one could, never the simulator's state at the instant of the pick:

- its own count of each replica's outstanding requests (sent there and not yet answered: a
  router proxies the responses, so it knows this exactly);
- a scrape of each replica's metrics (KV blocks used and free, prompts queued), refreshed every
  ``router_refresh_s`` seconds of simulated time, as routers poll vLLM's ``/metrics`` endpoint
  (0 = at every pick);
- its own record of the prompt blocks it sent to each replica (llm-d's approximate prefix-cache
  index, and SGLang's router's per-worker radix tree), LRU-bounded at the replica's KV size.

Routers: ``round_robin``; ``least_outstanding`` (own count); ``kv_aware`` (most free KV blocks net
of the prompts queued there, scraped; ties to the least outstanding); ``least_kv_usage`` (lowest
scraped KV usage, ties to the least outstanding); ``power_of_two_choices`` (two replicas drawn at
random with the scenario's seed, the one with fewer outstanding); ``prefix_aware`` (llm-d's
weighted scorers: ``prefix_weight`` x the share of the prompt's blocks found at the head of the
replica's index + ``load_weight`` x (1 - outstanding / most outstanding)); ``vllm_dp`` (vLLM's own
data-parallel load balancer, ``DPLBAsyncMPClient.get_core_engine_for_request``: 4 x waiting +
running per engine from the DP coordinator's snapshot of the engines' counts, which it publishes
every 0.1 s (``router_refresh_s``), each request sent to an engine since counted there as waiting
until the next snapshot; the lowest score, ties to the lower index).

This module has no SimPy in it; the cluster calls ``pick`` and ``on_done``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

import numpy as np
from pydantic import Field

from .config_model import ConfigModel
from .disagg_config import DisaggConfig, RouterName
from .prefix_keys import segment_block_keys

if TYPE_CHECKING:
    from .engine import Replica
    from .request import Request

__all__ = ["ClusterConfig", "Router", "RouterName"]

# power_of_two_choices: pairs ``picks_elsewhere`` looks ahead through (each holds a given replica
# with probability 2 / replicas, so a few dozen cover a long stretch)
_PAIRS_AHEAD = 64


class ClusterConfig(ConfigModel):
    num_replicas: int = Field(1, ge=1)
    router: RouterName = "round_robin"
    router_refresh_s: float = Field(0.0, ge=0.0, allow_inf_nan=False,
                                    description="seconds between the router's scrapes of replica metrics (0 = every pick)")
    prefix_weight: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="prefix_aware: weight of the prefix score")
    load_weight: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="prefix_aware: weight of the load score")
    disagg: DisaggConfig | None = None


def draw_pair(rng: np.random.Generator, n: int) -> tuple[int, int]:
    """power_of_two_choices: the next two distinct replicas of ``n`` to compare, from ``rng`` (the
    compiled engine draws a run's pairs ahead with this, in the same order)."""
    a, b = rng.choice(n, size=2, replace=False).tolist()
    return a, b


class _Scrape:
    """The router's last scrape of one replica's metrics."""

    __slots__ = ("free_blocks", "queued_blocks", "usage", "waiting", "running")

    def __init__(self) -> None:
        self.free_blocks = 0
        self.queued_blocks = 0
        self.usage = 0.0
        self.waiting = 0  # vllm_dp: the scheduler's queues at the scrape, and the requests sent since
        self.running = 0


class Router:
    """Picks a replica per request from its own view (see the module docstring)."""

    def __init__(self, replicas: list[Replica], policy: RouterName, *, refresh_s: float = 0.0,
                 prefix_weight: float = 1.0, load_weight: float = 1.0, seed: int = 0) -> None:
        self.replicas = replicas
        self.policy = policy
        self.refresh_s = refresh_s
        self.prefix_weight = prefix_weight
        self.load_weight = load_weight
        self._next = 0
        self._rng = np.random.default_rng(seed)
        # power_of_two_choices: pairs drawn ahead of their picks (``picks_elsewhere``), next first; the
        # picks take them before drawing more, so the sequence of pairs is the same either way
        self._pairs: deque[tuple[int, int]] = deque()
        self.outstanding = [0] * len(replicas)
        self._index_of = {id(r): i for i, r in enumerate(replicas)}
        self._scrapes = [_Scrape() for _ in replicas]
        self._scraped_at = -np.inf
        self.block_size = replicas[0].scheduler.kv.block_size if replicas else 16
        # approximate prefix index: per replica, the block keys it was sent, least recently used first
        self._index: list[OrderedDict[int, None]] = [OrderedDict() for _ in replicas]
        self._index_cap = [r.scheduler.kv.num_blocks for r in replicas]

    # ---- the router's view ---------------------------------------------------------------------
    def _scrape(self, now: float) -> None:
        if now - self._scraped_at < self.refresh_s and self.refresh_s > 0:
            return
        self._scraped_at = now
        for rep, s in zip(self.replicas, self._scrapes, strict=True):
            kv = rep.scheduler.kv
            s.free_blocks = kv.num_free_blocks
            s.usage = kv.num_used_blocks / kv.num_blocks
            if self.policy == "vllm_dp":
                s.waiting, s.running = rep.scheduler.num_waiting, rep.scheduler.num_running
            if self.policy == "kv_aware":
                s.queued_blocks = sum(kv.blocks_for(q.num_tokens) for q in rep.scheduler.waiting)

    def prompt_keys(self, req: Request) -> list[int]:
        """The request's full prompt blocks as the router hashes them (it reads the prompt it proxies),
        up to as many as the largest replica's record holds (beyond, none could be found anyway; a
        prompt of 2**32 tokens would otherwise cost 2**28 hashes before its replica rejects it)."""
        bs = self.block_size
        if req.segments is not None:
            return segment_block_keys(req.segments, bs, min(req.prompt_len, max(self._index_cap) * bs))
        if req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
            keys, parent = [], 0
            for i in range(len(ids) // bs):
                parent = hash((parent, tuple(ids[i * bs : (i + 1) * bs])))
                keys.append(parent)
            return keys
        if req.prefix_id >= 0:
            return [hash((0x9F1, req.prefix_id, i)) for i in range(min(req.prefix_len, req.prompt_len) // bs)]
        return []

    def matched_blocks(self, r: int, keys: list[int]) -> int:
        """Leading prompt blocks of ``keys`` in the router's record of replica ``r``."""
        index = self._index[r]
        n = 0
        for key in keys:
            if key not in index:
                break
            n += 1
        return n

    def _record(self, r: int, keys: list[int]) -> None:
        index = self._index[r]
        for key in keys:
            index[key] = None
            index.move_to_end(key)
        while len(index) > self._index_cap[r]:
            index.popitem(last=False)

    # ---- picking --------------------------------------------------------------------------------
    def pick(self, req: Request, now: float = 0.0) -> Replica:
        """The replica for ``req`` arriving at ``now`` (seconds); counts it as outstanding there."""
        r = self._choose(req, now)
        self.outstanding[r] += 1
        return self.replicas[r]

    def on_done(self, rep: Replica) -> None:
        """A request sent to ``rep`` was answered (finished or rejected)."""
        self.outstanding[self._index_of[id(rep)]] -= 1

    def _choose(self, req: Request, now: float) -> int:
        n = len(self.replicas)
        out = self.outstanding
        policy = self.policy
        if policy == "prefix_aware":
            keys = self.prompt_keys(req)
            r = self._prefix_aware(keys) if n > 1 else 0
            self._record(r, keys)
            return r
        if n == 1:
            return 0
        if policy == "round_robin":
            r = self._next % n
            self._next += 1
            return r
        if policy == "least_outstanding":
            return min(range(n), key=lambda i: (out[i], i))
        if policy == "power_of_two_choices":
            a, b = self._pairs.popleft() if self._pairs else self._draw_pair()
            return a if (out[a], a) <= (out[b], b) else b
        self._scrape(now)
        s = self._scrapes
        if policy == "least_kv_usage":
            return min(range(n), key=lambda i: (s[i].usage, out[i], i))
        if policy == "vllm_dp":
            r = min(range(n), key=lambda i: (4 * s[i].waiting + s[i].running, i))
            s[r].waiting += 1  # vLLM counts its pick as waiting there until the next snapshot
            return r
        # kv_aware: free blocks net of the prompts queued at each replica
        return min(range(n), key=lambda i: (-(s[i].free_blocks - s[i].queued_blocks), out[i], i))

    @property
    def looks_ahead(self) -> bool:
        """Whether ``picks_elsewhere`` can tell anything: a policy whose next picks follow from its
        own turn counter, counts or draws (not from scraped metrics or prefix records)."""
        return len(self.replicas) > 1 and self.policy in ("round_robin", "least_outstanding", "power_of_two_choices")

    def picks_elsewhere(self, r: int) -> int:
        """How many of the next picks surely go to other replicas than ``r``, provided ``r`` is sent
        nothing and reports no answer meanwhile (``looks_ahead`` policies; 0 for the others).

        Round robin: those before its turn comes. Power of two choices: those whose pair of
        replicas to compare (drawn ahead, up to ``_PAIRS_AHEAD`` of them) leaves it out. Least
        outstanding: those while some other replica surely has fewer outstanding requests. The
        others' count can only grow by the picks before the j-th (answers lower it), so before the
        j-th it is at most their count now plus j - 1, and the least of them at most that over
        N - 1 (pigeonhole): below ``r``'s own count for every j <= its count x (N - 1) - the
        others' count."""
        n = len(self.replicas)
        if not self.looks_ahead:
            return 0
        if self.policy == "round_robin":
            return (r - self._next) % n
        if self.policy == "power_of_two_choices":
            pairs = self._pairs
            while len(pairs) < _PAIRS_AHEAD:  # drawn now from the same generator, in the same order
                pairs.append(self._draw_pair())
            for j, (a, b) in enumerate(pairs):
                if r in (a, b):
                    return j
            return len(pairs)
        out = self.outstanding
        mine = out[r]
        return max(mine * (n - 1) - (sum(out) - mine), 0)

    def _draw_pair(self) -> tuple[int, int]:
        return draw_pair(self._rng, len(self.replicas))

    def _prefix_aware(self, keys: list[int]) -> int:
        out = self.outstanding
        most = max(out)
        best, best_key = 0, None
        for r in range(len(self.replicas)):
            prefix = self.matched_blocks(r, keys) / len(keys) if keys else 0.0
            load = 1.0 - out[r] / most if most > 0 else 1.0
            score = self.prefix_weight * prefix + self.load_weight * load
            key = (-score, out[r], r)
            if best_key is None or key < best_key:
                best, best_key = r, key
        return best
