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

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from ..hints import did_you_mean
from ..presets import HARDWARE, get_hardware
from ..scenario import Scenario, ScenarioError, apply_override, scenario_from_dict
from .parallel import TaskRunner
from .plan import PlanSettings, RatePoint, _check_rate_workload, judge_rate, rate_tasks, simulate_digest
from .sweep import GridAxis, grid_points, parse_grid

SATURATION_MARGIN = 1.25  # the steady burst throughput can sit below the sustainable rate by ramp and drain
SATURATION_RATE = 1e6  # requests/s: every saturation request arrives within a millisecond or so
STATUSES = ("best", "best-so-far", "feasible", "pruned", "infeasible", "unfinished")


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
class Point:
    """One configuration of the space and what the search learned about it."""

    index: int
    values: dict[str, Any]
    scenario: Scenario | None
    status: str = "unfinished"
    reason: str = ""
    replica_cost: float = math.nan  # $/hour of one replica: tensor_parallel x $/GPU-hour
    upper_bound_rps: float = math.nan  # capacity bound of one replica from the saturation run
    replicas: int | None = None  # smallest n with one replica passing at target / n
    failed_replicas: int = 0  # largest n known to fail (0: none)
    tested: dict[int, RatePoint] = field(default_factory=dict)
    sims: int = 0  # simulations this point ran (cache hits not counted)

    @property
    def lower_bound_replicas(self) -> int:
        return max(1, self.failed_replicas + 1)

    @property
    def cost(self) -> float:
        return self.replicas * self.replica_cost if self.replicas else math.nan


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


# ---- the space ----------------------------------------------------------------------------------
def parse_space(items: Sequence[str]) -> list[GridAxis]:
    """``--space key.path=v1,v2`` items (``sweep --grid`` syntax); hardware names are checked here."""
    if not items:
        raise ScenarioError("search needs at least one --space key.path=v1,v2,..., e.g. --space hardware=h100-sxm,l40s")
    try:
        axes = parse_grid(items)
    except ScenarioError as e:
        raise ScenarioError(str(e).replace("--grid", "--space")) from None
    for a in axes:
        if a.key == "hardware":
            for v in a.values:
                if v not in HARDWARE:
                    raise ScenarioError(f"--space hardware: unknown hardware {v!r}{did_you_mean(str(v), HARDWARE)}; "
                                        f"choose from: {', '.join(HARDWARE)}")
    return axes


def space_hardware(base: Scenario, axes: Sequence[GridAxis]) -> list[str]:
    """Every hardware name the space uses (the base scenario's when no axis varies it)."""
    for a in axes:
        if a.key == "hardware":
            return [str(v) for v in a.values]
    return [base.hardware]


def build_points(raw: dict[str, Any], axes: Sequence[GridAxis], base_overrides: Sequence[str],
                 source: str, base_dir: Path) -> list[Point]:
    """One ``Point`` per combination; one that does not validate is infeasible with the reason."""
    points = []
    for i, combo in enumerate(grid_points(axes)):
        values = {a.key: a.values[j] for a, j in zip(axes, combo, strict=True)}
        d = copy.deepcopy(raw)
        try:
            for item in [*base_overrides, *(f"{a.key}={a.texts[j]}" for a, j in zip(axes, combo, strict=True))]:
                apply_override(d, item)
            sc = scenario_from_dict(d, source=source)
            sc.workload = sc.workload.resolve_paths(base_dir)
            points.append(Point(i, values, sc))
        except UserError as e:
            points.append(Point(i, values, None, "infeasible", str(e).splitlines()[0]))
    return points


def check_feasible(p: Point, prices: dict[str, float]) -> None:
    """Mark ``p`` infeasible when one replica cannot hold the model; price it otherwise."""
    from ..simulate import plan_kv

    sc = p.scenario
    if sc is None:
        return
    hw = get_hardware(sc.hardware)
    if sc.tensor_parallel > hw.gpus_per_node:
        p.status, p.reason = "infeasible", (f"tensor_parallel={sc.tensor_parallel} spans more than one "
                                            f"{hw.name} node ({hw.gpus_per_node} GPUs): not modelled")
        return
    try:
        plan_kv(sc)
    except UserError as e:
        p.status, p.reason = "infeasible", str(e).splitlines()[0]
        return
    p.replica_cost = sc.tensor_parallel * prices[sc.hardware]


# ---- simulations --------------------------------------------------------------------------------
def saturation_scenario(sc: Scenario, n: int) -> Scenario:
    """``n`` requests of the scenario's workload arriving at once (within ~n / SATURATION_RATE s)."""
    wl = sc.workload
    arrival = wl.arrival.model_copy(update={"rate": SATURATION_RATE})
    workload = wl.model_copy(update={"arrival": arrival, "num_requests": int(n), "duration_s": None})
    cluster = sc.cluster.model_copy(update={"num_replicas": 1})
    return sc.model_copy(update={"workload": workload, "cluster": cluster})


def saturation_run(sc: Scenario) -> tuple[float, int, str]:
    """Worker entry point: (capacity bound in requests/s, rejected requests, the first rejection's
    reason) of a saturation scenario. The bound is the completion rate between the 10th and 90th
    percentile finish times, times ``SATURATION_MARGIN``; inf when too few requests finished."""
    from ..simulate import simulate

    res = simulate(sc, progress=False)
    df = res.requests_df
    rejected = df[df["state"] == "rejected"]
    reason = str(rejected["reject_reason"].iloc[0]) if len(rejected) else ""
    t = np.sort(df.loc[df["state"] == "finished", "finish_time"].to_numpy(dtype=np.float64))
    if t.size < 10:
        return math.inf, len(rejected), reason
    lo, hi = int(0.1 * t.size), int(0.9 * t.size)
    span = t[hi] - t[lo]
    return (SATURATION_MARGIN * (hi - lo) / span if span > 0 else math.inf), len(rejected), reason


class Simulations:
    """The runner plus a cache of judged rates keyed by (scenario, rate): identical points share runs."""

    def __init__(self, runner: TaskRunner, st: PlanSettings) -> None:
        self.runner, self.st = runner, st
        self.cache: dict[tuple[str, float], RatePoint] = {}
        self.run = self.reused = 0

    def key(self, sc: Scenario, rate: float) -> tuple[str, float]:
        return sc.model_dump_json(), float(rate)

    def judge(self, asks: Sequence[tuple[Point, int, float]]) -> list[RatePoint]:
        """Judge each (point, replicas, per-replica rate); all uncached runs in one batch."""
        todo: dict[tuple[str, float], list[Scenario]] = {}
        for p, _, rate in asks:
            k = self.key(p.scenario, rate)
            if k not in self.cache and k not in todo:
                todo[k] = rate_tasks(p.scenario, self.st, rate)
        flat = [t for tasks in todo.values() for t in tasks]
        outcomes = self.runner.map(simulate_digest, flat) if flat else []
        self.run += len(flat)
        i = 0
        for k, tasks in todo.items():
            self.cache[k] = judge_rate(self.st, k[1], 1, tasks, outcomes[i:i + len(tasks)])
            i += len(tasks)
        out = []
        seen: set[tuple[str, float]] = set()
        for p, _, rate in asks:
            k = self.key(p.scenario, rate)
            if k not in todo or k in seen:
                self.reused += self.st.seeds
            else:
                p.sims += self.st.seeds
            seen.add(k)
            out.append(self.cache[k])
        return out

    def saturate(self, points: Sequence[Point], n: int, target_rate: float) -> None:
        """One saturation run per point (shared by identical scenarios): sets ``upper_bound_rps``
        and the replicas known to fail (those that would each get more than the bound)."""
        keys: dict[tuple[str, float], list[Point]] = {}
        for p in points:
            keys.setdefault(self.key(p.scenario, SATURATION_RATE), []).append(p)
        outcomes = self.runner.map(saturation_run, [saturation_scenario(ps[0].scenario, n) for ps in keys.values()])
        self.run += len(keys)
        self.reused += len(points) - len(keys)
        for ps, o in zip(keys.values(), outcomes, strict=True):
            ps[0].sims += 1
            for p in ps:
                if not o.ok:
                    p.status, p.reason = "infeasible", f"saturation run failed: {o.error}"
                    continue
                bound, rejected, reason = o.value
                if rejected:  # a request this configuration can never serve fails every SLO term
                    p.status, p.reason = "infeasible", f"{rejected} of {n} requests rejected: {reason}"
                    continue
                p.upper_bound_rps = bound
                p.failed_replicas = max(0, math.ceil(target_rate / p.upper_bound_rps) - 1)


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
