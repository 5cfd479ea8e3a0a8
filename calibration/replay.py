"""The dynamics check of ``servesim validate --replay-steps``: a live run's own steps, replayed.

Live mode and simulation run one engine loop (``sim/engine.py``) with the same scheduler
classes; they differ in the executor and the clock. Live, a step advances the clock by what it
really took, from the moment the loop resumed (the end of the previous step's forward, or the
wake-up of an idle replica) to the end of its own forward, so a step's recorded ``duration``
already holds the host time between two forwards: the previous step's update and metrics, this
step's scheduling, the event loop. Arrivals are events on that same clock: a request that lands
on the wall clock during a step is processed, at its own arrival time, before the step's end
event, and the next schedule call sees it.

``ReplayExecutor`` answers step k with its recorded duration instead of a cost model's
prediction. The simulated clock then advances by exactly the floats the live clock did (SimPy
computes ``now + duration`` on both sides), so if the two modes share their dynamics every step
starts at the same time with the same rows, and every request's TTFT and E2E come out equal.
The executor checks each step against the record as it goes and stops the replay at the first
one that differs: another start time, other rows (request, new tokens, cached tokens), or a step
that live did not run; a step live ran that the replay never reached is the last possibility.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import simpy
from servesim.sim.batch import Batch
from servesim.sim.engine import SimEnvironment
from servesim.sim.request import Request
from servesim.sim.scenario import Scenario, ScenarioError
from servesim.sim.simulate import RunResult, build_scheduler, finish_run, plan_kv, run_replicas

TOLERANCE_S = 1e-9  # float rounding: a replay is bit-exact unless the two clocks add up differently
SHOW_ROWS = 12  # rows of a batch printed in a divergence report


@dataclass
class StepTrace:
    """The executed steps of one replica, in order: when each started and how long it took (seconds),
    and its rows (request id, new tokens, cached tokens)."""

    start: np.ndarray
    duration: np.ndarray
    request_ids: list[np.ndarray]
    num_new_tokens: list[np.ndarray]
    num_context_tokens: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.duration)

    @classmethod
    def of_run(cls, run: RunResult) -> StepTrace:
        """The trace a one-replica live run recorded (its iterations and its executor's rows)."""
        if run.step_shapes is None or run.step_request_ids is None:
            raise ScenarioError("--replay-steps needs a live run of one replica (its executor records each step's rows)")
        it = run.iterations_df
        if len(it) != len(run.step_shapes) or len(it) != len(run.step_request_ids):
            raise RuntimeError(f"replay: {len(it)} iterations but {len(run.step_shapes)} recorded steps (a servesim bug)")
        return cls(it["start"].to_numpy(dtype=np.float64), it["duration"].to_numpy(dtype=np.float64),
                   list(run.step_request_ids), [q for q, _ in run.step_shapes], [c for _, c in run.step_shapes])

    def rows(self, k: int) -> list[tuple[int, int, int]]:
        return _rows(self.request_ids[k], self.num_new_tokens[k], self.num_context_tokens[k])


def _rows(ids: np.ndarray, q: np.ndarray, ctx: np.ndarray) -> list[tuple[int, int, int]]:
    return list(zip(ids.tolist(), q.tolist(), ctx.tolist(), strict=True))


@dataclass
class Divergence:
    """Where the replay first left the live run. ``sim_start`` / ``sim_rows`` are None for a step
    the replay never ran, ``live_*`` None for one that live never ran."""

    step: int
    reason: str
    request_id: int | None
    live_start: float | None
    sim_start: float | None
    live_rows: list[tuple[int, int, int]] | None
    sim_rows: list[tuple[int, int, int]] | None


class _Diverged(Exception):
    # SimPy re-raises a process's exception as type(e)(*e.args): the Divergence must be the one arg
    def __init__(self, divergence: Divergence) -> None:
        super().__init__(divergence)
        self.divergence = divergence


class ReplayExecutor:
    """Returns each step's recorded duration, after checking the step is the one that was recorded."""

    def __init__(self, env: simpy.Environment, trace: StepTrace, tolerance_s: float = TOLERANCE_S) -> None:
        self.env = env
        self.trace = trace
        self.tolerance_s = tolerance_s
        self.num_steps = 0

    def run(self, batch: Batch) -> float:
        k, trace, now = self.num_steps, self.trace, self.env.now
        sim_rows = _rows(np.fromiter((r.request_id for r in batch.requests), dtype=np.int64, count=batch.size),
                         batch.num_new_tokens, batch.num_context_tokens)
        if k >= len(trace):
            raise _Diverged(Divergence(k, f"the simulation runs step {k}, which live never ran",
                                       sim_rows[0][0] if sim_rows else None, None, now, None, sim_rows))
        live_rows, live_start = trace.rows(k), float(trace.start[k])
        if sim_rows != live_rows:
            raise _Diverged(Divergence(k, "the batches differ", _first_different_request(live_rows, sim_rows),
                                       live_start, now, live_rows, sim_rows))
        if abs(now - live_start) > self.tolerance_s:
            raise _Diverged(Divergence(k, f"the step starts {now - live_start:+.9f} s from live",
                                       live_rows[0][0] if live_rows else None, live_start, now, live_rows, sim_rows))
        self.num_steps = k + 1
        return float(trace.duration[k])


def _first_different_request(live: list[tuple[int, int, int]], sim: list[tuple[int, int, int]]) -> int | None:
    """The request of the first row that is not the same on both sides (in row order, live first)."""
    for a, b in zip(live, sim, strict=False):
        if a != b:
            return a[0]
    longer = live if len(live) > len(sim) else sim
    return longer[min(len(live), len(sim))][0] if len(live) != len(sim) else None


@dataclass
class DynamicsCheck:
    """The outcome of a replay: how many steps and requests matched, and the worst time difference."""

    num_steps: int  # steps live ran
    num_replayed: int  # steps the replay ran before it finished or diverged
    num_requests: int  # requests compared (0 when the replay diverged before finishing)
    max_ttft_diff_s: float
    max_e2e_diff_s: float
    tolerance_s: float
    divergence: Divergence | None
    run: RunResult | None  # the replay's run; None when it stopped at a divergence

    @property
    def passed(self) -> bool:
        return self.divergence is None

    def to_dict(self) -> dict:
        """Plain values for validation.json (``to_json`` writes an unmeasured nan difference as null)."""
        d = self.divergence
        return {"passed": self.passed, "steps": self.num_steps, "steps_replayed": self.num_replayed,
                "requests_compared": self.num_requests, "max_abs_ttft_diff_s": self.max_ttft_diff_s,
                "max_abs_e2e_diff_s": self.max_e2e_diff_s, "tolerance_s": self.tolerance_s,
                "divergence": None if d is None else {
                    "step": d.step, "reason": d.reason, "request_id": d.request_id, "live_start_s": d.live_start,
                    "sim_start_s": d.sim_start, "live_rows": d.live_rows, "sim_rows": d.sim_rows}}


def check_dynamics(sc: Scenario, requests: list[Request], trace: StepTrace, reference: pd.DataFrame,
                   tolerance_s: float = TOLERANCE_S, progress: bool | None = False) -> DynamicsCheck:
    """Simulate ``requests`` under ``sc`` (one replica, the live run's KV cache) with each step taking
    its duration in ``trace``, and compare every request's TTFT and E2E with ``reference`` (the
    live run's ``requests_df``). Resets the requests' progress first."""
    if sc.cluster.num_replicas != 1:
        raise ScenarioError(f"--replay-steps replays one replica; cluster.num_replicas is {sc.cluster.num_replicas}")
    kv = plan_kv(sc)
    for r in requests:
        r.reset_progress()
    env = SimEnvironment()
    executor = ReplayExecutor(env, trace, tolerance_s)
    try:
        recorder, _ = run_replicas(env, sc, requests, lambda _r: (build_scheduler(sc, kv), executor), progress)
    except _Diverged as e:
        return DynamicsCheck(len(trace), executor.num_steps, 0, math.nan, math.nan, tolerance_s, e.divergence, None)
    run = finish_run(sc, "replay", requests, recorder, kv, 0.0)
    n = executor.num_steps
    if n < len(trace):
        rows = trace.rows(n)
        return DynamicsCheck(len(trace), n, 0, math.nan, math.nan, tolerance_s, Divergence(
            n, f"the simulation finished after {n} steps; live ran {len(trace)}", rows[0][0] if rows else None,
            float(trace.start[n]), None, rows, None), run)
    live = reference.set_index("request_id").sort_index()
    sim = run.requests_df.set_index("request_id").sort_index()
    if not live.index.equals(sim.index):
        raise RuntimeError("replay: live and replayed runs hold different requests (a servesim bug)")
    ttft, e2e = _abs_diff(live["ttft"], sim["ttft"]), _abs_diff(live["e2e"], sim["e2e"])
    worst = np.maximum(ttft, e2e)
    divergence = None
    bad = np.flatnonzero(worst > tolerance_s)
    if len(bad):
        rid = int(live.index[bad[0]])
        divergence = Divergence(n, f"every step matched, yet request {rid}'s TTFT differs by {ttft[bad[0]]:.3g} s "
                                   f"and its E2E by {e2e[bad[0]]:.3g} s", rid, None, None, None, None)
    return DynamicsCheck(len(trace), n, len(live), _max(ttft), _max(e2e), tolerance_s, divergence, run)


def _abs_diff(a: pd.Series, b: pd.Series) -> np.ndarray:
    """|a - b| per request; two undefined values (a rejected request) are equal, one is infinitely apart."""
    x, y = a.to_numpy(dtype=np.float64), b.to_numpy(dtype=np.float64)
    d = np.abs(x - y)
    nan_x, nan_y = np.isnan(x), np.isnan(y)
    d[nan_x & nan_y] = 0.0
    d[nan_x ^ nan_y] = math.inf
    return d


def _max(d: np.ndarray) -> float:
    return float(d.max()) if len(d) else 0.0


def _format_rows(rows: list[tuple[int, int, int]] | None, other: list[tuple[int, int, int]] | None) -> str:
    """``request:new+cached`` per row; rows missing from or different on the other side are starred."""
    if rows is None:
        return "(no such step)"
    theirs = set(other or ())
    cells = [f"{rid}:{q}+{c}{'' if (rid, q, c) in theirs else '*'}" for rid, q, c in rows]
    more = f" ... (+{len(cells) - SHOW_ROWS} rows)" if len(cells) > SHOW_ROWS else ""
    return f"{len(rows)} rows: " + " ".join(cells[:SHOW_ROWS]) + more


def _time(t: float | None) -> str:
    return "-" if t is None else f"{t:.6f} s"


def format_dynamics(check: DynamicsCheck) -> str:
    """The check in a line when it passes; the first divergence and both batches when it does not."""
    head = "dynamics check (--replay-steps: the live run's step durations replayed into the simulation): "
    if check.passed:
        return (head + f"identical, {check.num_steps} steps and {check.num_requests} requests; max |dTTFT| "
                f"{check.max_ttft_diff_s:.3g} s, max |dE2E| {check.max_e2e_diff_s:.3g} s "
                f"(tolerance {check.tolerance_s:g} s)")
    d = check.divergence
    assert d is not None
    lines = [head + f"DIVERGED at step {d.step} of {check.num_steps}: {d.reason}"
             + (f"; first request {d.request_id}" if d.request_id is not None else "")]
    if d.live_rows is not None or d.sim_rows is not None:
        lines += [f"  live: starts {_time(d.live_start)}, {_format_rows(d.live_rows, d.sim_rows)}",
                  f"  sim:  starts {_time(d.sim_start)}, {_format_rows(d.sim_rows, d.live_rows)}",
                  "  (rows are request:new+cached tokens; * marks a row the other side does not have)"]
    return "\n".join(lines)


def divergence_line(check: DynamicsCheck) -> str:
    """One line for the failure list: where the replay left the live run."""
    d = check.divergence
    if d is None:
        return ""
    who = f", request {d.request_id}" if d.request_id is not None else ""
    return f"dynamics: the replay diverged from the live run at step {d.step}{who}: {d.reason}"
