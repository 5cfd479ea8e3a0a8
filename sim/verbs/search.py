"""Deployment search (``servesim search``): the cheapest GPU, TP degree, scheduler knobs and replica
count that serve a target rate within an SLO.

Every point of the ``--space`` (the cross product of scenario overrides, as ``sweep --grid``) is one
replica's configuration. A point costs ``replicas x tensor_parallel x $/GPU-hour``; the replicas it
needs for the target rate R are the smallest n for which one replica passes the SLO at R / n
(plan's test of a rate: ``plan.rate_tasks`` / ``plan.judge_rate``, same seeds, window and
stability term). That n is ``ceil(R / capacity)`` for plan's capacity, found directly as an
integer, so no simulation is spent on capacity digits that do not change the replica count.

How the search avoids simulations:

1. Infeasible points cost nothing: a scenario that does not validate, a TP degree beyond one node
   (``gpus_per_node``), a model whose weights and reserves leave no KV block per GPU
   (``simulate.plan_kv``) -- reported with the reason, not an error.
2. One saturation run per feasible point (every request arriving at once): its steady completion
   rate times ``SATURATION_MARGIN`` bounds the capacity from above, so ``ceil(R / bound)`` bounds
   the replicas from below and the cost from below.
3. Points are visited cheapest lower bound first, ``wave`` points at a time. Before each test a
   point's replica count is capped by the best cost found so far (a strictly cheaper deployment
   is the only one that can win); a point whose lower bound already reaches the best cost is
   pruned without another simulation, and one that fails at its cap is pruned as "cannot win".
4. Replicas are bracketed (the lower bound first, then doubling, capped) and bisected on
   integers; results are cached by (scenario, rate), so identical points share their runs.

All the runs of one step of a wave go to the runner together (local processes or Ray tasks). The
wave size, not the number of workers, fixes the order of decisions, so the table is the same on
any backend and any worker count (only the ``wall_s`` columns differ). Ties on cost go to the
point found first. ``budget_s`` stops the search between steps; the best found so far is then
marked as such, and undecided points are listed as ``unfinished``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..scenario import Scenario, ScenarioError
from .parallel import TaskRunner
from .plan import PlanSettings, _check_rate_workload
from .search_runs import Simulations
from .search_space import Point, build_points, check_feasible
from .sweep import GridAxis


@dataclass(slots=True)
class SearchSettings:
    target_rate: float  # requests/s the deployment must serve
    plan: PlanSettings  # how one rate is judged (terms, attainment, seeds, window)
    prices: dict[str, float]  # $ per GPU-hour per hardware name
    wave: int = 8  # points advanced together (fixes the order of decisions; not the worker count)
    max_replicas: int = 128
    saturation_requests: int = 200
    budget_s: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.target_rate) and self.target_rate > 0):
            raise ScenarioError(f"--target-rate must be > 0 requests/s, got {self.target_rate}")
        for name, value, low in (("--wave", self.wave, 1), ("--max-replicas", self.max_replicas, 1),
                                 ("--saturation-requests", self.saturation_requests, 10)):
            if value < low:
                raise ScenarioError(f"{name} must be >= {low}, got {value}")
        if self.budget_s is not None and not self.budget_s > 0:
            raise ScenarioError(f"--budget-s must be > 0 seconds, got {self.budget_s}")


@dataclass
class SearchResult:
    base: Scenario
    axes: list[GridAxis]
    settings: SearchSettings
    points: list[Point]
    best: Point | None
    complete: bool  # False when --budget-s stopped the search
    sims_run: int
    sims_reused: int
    wall_s: float
    backend: str


# ---- the search ---------------------------------------------------------------------------------
def _cap(p: Point, best: Point | None, max_replicas: int) -> int:
    """Most replicas ``p`` may use and still be strictly cheaper than ``best``."""
    if best is None:
        return max_replicas
    return min(max_replicas, math.ceil(best.cost / p.replica_cost - 1e-9) - 1)


def _next_replicas(p: Point, cap: int) -> int | None:
    """The replica count to test next, at most ``cap``; None when there is nothing left to learn.
    From the lower bound up by doubling until one passes, then bisect between fail and pass."""
    lo, known = p.lower_bound_replicas, p.replicas
    if lo > cap or (known is not None and known <= lo):
        return None
    if known is not None:
        return min((p.failed_replicas + known) // 2, cap)
    return lo if not p.tested else min(cap, max(lo, 2 * p.failed_replicas))


def search(raw: dict[str, Any], base: Scenario, axes: Sequence[GridAxis], ss: SearchSettings,
           base_overrides: Sequence[str] = (), source: str = "scenario", base_dir: Path = Path("."),
           backend: str = "local", workers: int | None = None, ray_address: str | None = None,
           progress: bool = True) -> SearchResult:
    """Run the search described in the module docstring."""
    from tqdm import tqdm

    _check_rate_workload(base)
    if base.cluster.disagg is not None:
        raise ScenarioError(f"cluster.disagg: search prices one replica's configuration x replicas, which a "
                            f"disaggregated deployment is not; size its prefill:decode split with servesim plan "
                            f"{source} --target-rate {ss.target_rate:g}")
    t0 = time.perf_counter()
    points = build_points(raw, axes, base_overrides, source, base_dir)
    if all(p.scenario is None for p in points):
        raise ScenarioError(f"search: none of the {len(points)} points is a valid scenario; the first: {points[0].reason}")
    for p in points:
        check_feasible(p, ss.prices)
    live = [p for p in points if p.status == "unfinished"]
    best: Point | None = None
    complete = True
    bar = tqdm(total=len(points), desc="search", unit="point", disable=not progress, leave=False, mininterval=0.5)
    bar.update(len(points) - len(live))
    with TaskRunner(backend, workers=workers, ray_address=ray_address, progress=False, desc="search") as runner:
        sims = Simulations(runner, ss.plan)
        sims.saturate(live, ss.saturation_requests, ss.target_rate)
        for p in live:
            if p.status == "infeasible":
                bar.update(1)
        live = [p for p in live if p.status == "unfinished"]
        live.sort(key=lambda p: (p.lower_bound_replicas * p.replica_cost, p.index))
        queue = list(live)
        while queue:
            if ss.budget_s is not None and time.perf_counter() - t0 > ss.budget_s:
                complete = False
                break
            wave, queue = queue[:ss.wave], queue[ss.wave:]
            while wave:
                asks, still = [], []
                for p in wave:
                    n = _next_replicas(p, _cap(p, best, ss.max_replicas))
                    if n is None:
                        _decide(p, best, ss.max_replicas)
                        if p.status == "feasible" and (best is None or p.cost < best.cost - 1e-9):
                            best = p
                        bar.update(1)
                        bar.set_postfix_str(f"best ${best.cost:.2f}/h" if best else "", refresh=False)
                        continue
                    asks.append((p, n, ss.target_rate / n))
                    still.append(p)
                wave = still
                if not asks:
                    break
                for (p, n, _), rp in zip(asks, sims.judge(asks), strict=True):
                    p.tested[n] = rp
                    if rp.errors and not rp.summary:
                        p.status, p.reason = "infeasible", rp.errors[0]
                    elif rp.passed:
                        p.replicas = n if p.replicas is None else min(p.replicas, n)
                    else:
                        p.failed_replicas = max(p.failed_replicas, n)
                wave = [p for p in wave if p.status == "unfinished"]
                if ss.budget_s is not None and time.perf_counter() - t0 > ss.budget_s:
                    complete = False
                    queue = []
                    break
    bar.close()
    if not complete:  # the budget ran out: the cheapest deployment known to pass, marked as such
        passing = [p for p in points if p.replicas is not None]
        best = min(passing, key=lambda p: (p.cost, p.index)) if passing else None
    if best is not None:
        best.status = "best" if complete else "best-so-far"
    return SearchResult(base, list(axes), ss, points, best, complete, sims.run, sims.reused,
                        time.perf_counter() - t0, backend)


def _decide(p: Point, best: Point | None, max_replicas: int) -> None:
    """Close a point the replica search has nothing more to test on."""
    lb = p.lower_bound_replicas
    if p.replicas is not None and p.replicas <= lb:
        p.status = "feasible"
    elif best is not None:
        why = "its saturation bound" if not p.tested else f"fails at {p.failed_replicas} replicas"
        p.status, p.reason = "pruned", (f"needs >= {lb} replicas ({why}): >= ${lb * p.replica_cost:.2f}/h, "
                                        f"not below ${best.cost:.2f}/h")
    else:
        p.status, p.reason = "infeasible", f"fails the SLO even with {max_replicas} replicas (--max-replicas)"
