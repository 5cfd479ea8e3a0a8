"""The simulations behind ``servesim search``: one saturation run per point (its capacity bound)
and plan's rate test, batched per step and cached by (scenario, rate) (see ``search.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..scenario import Scenario
from .parallel import TaskRunner
from .plan import PlanSettings, RatePoint, judge_rate, rate_tasks, simulate_digest
from .search_space import Point

SATURATION_MARGIN = 1.25  # the steady burst throughput can sit below the sustainable rate by ramp and drain
SATURATION_RATE = 1e6  # requests/s: every saturation request arrives within a millisecond or so


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
    from ..simulate import simulate, summary_iterations

    res = simulate(sc, progress=False, iterations=summary_iterations(sc))
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


