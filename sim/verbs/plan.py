"""What-if capacity planning: the highest arrival rate one replica sustains within an SLO, then
how many replicas a target rate needs (``servesim plan``).

How a rate is judged (the README's "Capacity planning" section says the same for users):

- The scenario's workload is replayed at the rate with ``seeds`` different seeds (``seed``,
  ``seed + 1``, ...). The same seeds are used at every rate, and Poisson / gamma gaps are drawn as
  unit-rate gaps scaled by 1 / rate, so two rates see the same traffic pattern, stretched: the
  pass/fail answer changes smoothly with the rate instead of jumping with each new draw.
- The SLO terms (``servesim.sim.verbs.slo``) are checked on the requests of all seeds *pooled*: the
  attainment is the fraction over every request of every seed. Pooling estimates the long-run
  attainment and gets more precise with more seeds; requiring every seed to pass would instead get
  stricter with every seed added (the minimum of N noisy values keeps falling). How many seeds
  passed on their own is reported next to the pooled answer.
- A replica that cannot keep up has a queue that grows for as long as requests keep coming, so a
  short run can hide an overload. Unless the SLO already bounds ``queueing_delay``, plan adds the
  stability term ``median_queueing_delay_ms=2000`` (half the requests start within 2 s of arriving)
  and sizes the arrival window so that an overload larger than half the tolerance breaks it. In the
  fluid limit, an overload ``eps = rate / capacity - 1`` delays a request arriving at time t by
  ``eps * t``; the fraction q of requests arriving before ``D / eps`` is within a delay bound D, so a
  ``pNN`` delay term over a window T fails once ``eps > D / (q * T)``. Choosing
  ``T = 2 * D / (q * tolerance)`` makes that ``eps > tolerance / 2``. At low rates the window is
  stretched so each seed has at least ``min_requests`` requests.
- Search: from the start rate, double (or halve) until the result flips, then bisect the bracket
  geometrically until ``hi / lo <= 1 + tolerance``. The answer is ``lo``, the highest rate that
  passed: the boundary lies in ``[lo, lo * (1 + tolerance))`` when pass/fail is monotone in the
  rate, give or take the ``tolerance / 2`` of overload the window can miss.
- Replicas for a target rate: the cluster (with the scenario's router) is simulated at the target
  rate with ``ceil(target / capacity)`` replicas, then one more or one fewer until the smallest
  count that passes is found; the same terms, seeds and window apply.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..config_model import MAX_SIM_SECONDS
from ..host_memory import POOLED_REQUEST_BYTES, SEED_RUN_BYTES, Demand, over_host_memory
from ..metrics import ITERATION_COLUMNS, LogHistogram, summarize, to_json
from ..outputs import begin_folder, write_csv, write_text
from ..scenario import Scenario, ScenarioError
from ..workload import mean_floor
from .parallel import Outcome, TaskRunner, default_workers
from .slo import SloTerm, TermResult, describe, evaluate, parse_term, request_thresholds, tightest_targets

STABILITY_TERM = parse_term("median_queueing_delay_ms", 2000.0)
MAX_BRACKET_STEPS = 20  # doublings / halvings from the start rate before giving up
MAX_REPLICA_STEPS = 64
_REQUEST_COLS = ["state", "num_output_tokens", "num_preemptions", "ttft", "tpot", "e2e", "queueing_delay", "arrival_time",
                 "finish_time", "prompt_len"]


SESSION_WINDOWS = 10  # a sessions workload's derived window: at least this many mean conversation lengths


@dataclass(slots=True)
class PlanSettings:
    """How ``plan`` searches. Rates in requests/s, times in seconds unless named _ms."""

    terms: list[SloTerm]
    attainment: float = 0.9  # fraction of requests that must meet all per-request terms
    seeds: int = 3
    tolerance: float = 0.05  # relative width of the final bracket
    window_s: float | None = None  # arrival window per seed; None: derived (module docstring)
    min_requests: int = 200  # per seed, at any rate
    start_rate: float | None = None  # None: the scenario's workload.arrival.rate
    floor_window_s: float = 0.0  # a derived window is at least this (``for_scenario``: conversations)

    def __post_init__(self) -> None:
        if not 0.0 < self.attainment <= 1.0:
            raise ScenarioError(f"--attainment must be in (0, 1], got {self.attainment}")
        if self.seeds < 1:
            raise ScenarioError(f"--seeds must be >= 1, got {self.seeds}")
        if self.min_requests < 1:  # (0 or -5 let a seed's window shrink to nothing)
            raise ScenarioError(f"--min-requests must be >= 1, got {self.min_requests}")
        # every seed's run at a rate is kept until the rate is judged: a huge count would die allocating them;
        # when one seed's requests alone do not fit, the request count is what to lower (not --seeds)
        one = over_host_memory([Demand("--min-requests", "requests per seed", self.min_requests, POOLED_REQUEST_BYTES)])
        if one is not None:
            raise ScenarioError(f"{one[0]} {self.min_requests}: {one[1]}")
        over = over_host_memory([Demand("--seeds", "seed runs", self.seeds,
                                        SEED_RUN_BYTES + self.min_requests * POOLED_REQUEST_BYTES)])
        if over is not None:
            raise ScenarioError(f"{over[0]} {self.seeds}: {over[1]}")
        if not 0.0 < self.tolerance < 1.0:
            raise ScenarioError(f"--tolerance must be in (0, 1) (a fraction of the rate), got {self.tolerance}")
        if self.window_s is not None and not 0 < self.window_s <= MAX_SIM_SECONDS:
            raise ScenarioError(f"--duration must be > 0 seconds and at most {MAX_SIM_SECONDS:.0e} (the simulated "
                                f"clock's range), got {self.window_s}")
        if self.start_rate is not None and not 0 < self.start_rate < math.inf:
            raise ScenarioError(f"--start-rate must be a finite number > 0 requests/s, got {self.start_rate}")
        if not any(t.metric == "queueing_delay" and t.stat != "mean" for t in self.terms):
            self.terms = [*self.terms, STABILITY_TERM]

    @property
    def base_window_s(self) -> float:
        """The arrival window that exposes an overload of tolerance / 2 (module docstring)."""
        if self.window_s is not None:
            return self.window_s
        q_terms = [t for t in self.terms if t.metric == "queueing_delay" and t.stat != "mean"]
        need = []
        for t in q_terms:
            q = t.quantile if t.stat != "request" else self.attainment
            need.append(2.0 * (t.target_ms / 1e3) / (q * self.tolerance))
        return max(max(need), self.floor_window_s)

    def for_scenario(self, sc: Scenario) -> PlanSettings:
        """These settings with the window floor ``sc`` needs: a sessions workload's load is steady
        only over many conversations' lengths (``SESSION_WINDOWS`` x mean turns x think time), so a
        derived window is at least that; a window given with --duration is used as given."""
        ss = sc.workload.sessions
        if ss is None or self.window_s is not None:
            return self
        return replace(self, floor_window_s=SESSION_WINDOWS * mean_floor(ss.turns) * ss.think_time_s)

    def window_at(self, rate: float) -> float:
        return max(self.base_window_s, self.min_requests / rate)


@dataclass(slots=True)
class RunDigest:
    """What a worker sends back from one simulation: enough to pool runs, small to pickle."""

    summary: dict[str, Any]
    requests: pd.DataFrame
    itl_hist: LogHistogram


@dataclass
class RatePoint:
    """One evaluated (rate, replicas): pooled summary over the seeds and each term's result."""

    rate: float
    replicas: int
    summary: dict[str, Any]
    results: list[TermResult]
    seeds_passing: int
    num_seeds: int
    window_s: float
    errors: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.errors and all(r.passed for r in self.results)

    def row(self) -> dict[str, Any]:
        s = self.summary
        row: dict[str, Any] = {"request_rate": self.rate, "replicas": self.replicas,
                               "rate_per_replica": self.rate / self.replicas, "passed": self.passed,
                               "seeds_passing": self.seeds_passing, "seeds": self.num_seeds,
                               "window_s": self.window_s}  # fmt: skip
        for key in ("completed", "rejected", "request_throughput", "request_goodput", "slo_attainment",
                    "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
                    "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms", "mean_queueing_delay_ms",
                    "median_queueing_delay_ms", "max_kv_usage", "mean_batch_size", "num_preemptions"):
            row[key] = s.get(key, math.nan)
        for r in self.results:
            # percentile and per-request terms: the attained fraction; mean terms: the mean (ms)
            row[f"slo[{'per-request' if r.term.stat == 'request' else r.term.key}]"] = r.value
        row["error"] = "; ".join(self.errors)
        return row


@dataclass
class PlanResult:
    scenario: Scenario
    settings: PlanSettings
    capacity: float  # requests/s one replica sustains; 0 when no rate passed
    bracket: tuple[float, float]  # (highest passing, lowest failing) rate; inf when none failed
    points: list[RatePoint]
    target_rate: float | None = None
    replicas: int | None = None  # for target_rate; None when not asked or not found
    replica_points: list[RatePoint] = field(default_factory=list)

    @property
    def chosen(self) -> RatePoint | None:
        return next((p for p in self.points if p.rate == self.capacity), None)

    def frame(self) -> pd.DataFrame:
        rows = [dict(p.row(), stage="capacity") for p in sorted(self.points, key=lambda p: p.rate)]
        rows += [dict(p.row(), stage="replicas") for p in sorted(self.replica_points, key=lambda p: p.replicas)]
        df = pd.DataFrame(rows)
        return df[["stage", *[c for c in df.columns if c != "stage"]]] if len(df) else df

    def to_dict(self) -> dict[str, Any]:
        st = self.settings
        return {
            "scenario": self.scenario.name,
            "scheduler": self.scenario.scheduler_name,
            "slo": [str(t) for t in st.terms],
            "attainment": st.attainment,
            "seeds": list(range(self.scenario.seed, self.scenario.seed + st.seeds)),
            "tolerance": st.tolerance,
            "window_s": st.base_window_s,
            "min_requests": st.min_requests,
            "capacity_rps": self.capacity,
            "bracket_rps": list(self.bracket),
            "target_rate": self.target_rate,
            "replicas": self.replicas,
            "num_simulations": st.seeds * (len(self.points) + len(self.replica_points)),
        }


# ---- one rate -----------------------------------------------------------------------------------
def _check_rate_workload(sc: Scenario) -> None:
    wl = sc.workload
    if wl.trace is not None or wl.arrival is None or not hasattr(wl.arrival, "rate"):
        kind = "a trace" if wl.trace is not None or wl.arrival is None else f"'{wl.arrival.process}' arrivals"
        raise ScenarioError(
            f"workload.arrival: plan varies the arrival rate, which {kind} does not have; "
            "use poisson, gamma or constant arrivals"
        )


def at_rate(sc: Scenario, rate: float, window_s: float, seed: int, replicas: int = 1) -> Scenario:
    """The scenario with arrivals at ``rate`` over ``window_s`` seconds, ``seed`` and ``replicas``."""
    wl = sc.workload
    arrival = wl.arrival.model_copy(update={"rate": float(rate)})
    workload = wl.model_copy(update={"arrival": arrival, "num_requests": None, "duration_s": float(window_s)})
    cluster = sc.cluster.model_copy(update={"num_replicas": int(replicas)})
    return sc.model_copy(update={"workload": workload, "seed": int(seed), "cluster": cluster})


def simulate_digest(sc: Scenario) -> RunDigest:
    """Worker entry point: simulate one scenario and keep what pooling needs."""
    from ..simulate import simulate, summary_iterations

    res = simulate(sc, progress=False, iterations=summary_iterations(sc))
    return RunDigest(res.summary, res.requests_df[_REQUEST_COLS].copy(), res.itl_hist)


def pool(digests: Sequence[RunDigest], slo_ms: dict[str, float]) -> tuple[pd.DataFrame, LogHistogram, dict[str, Any]]:
    """Requests and ITLs of several runs together, and their summary (rates over the summed durations)."""
    requests = pd.concat([d.requests for d in digests], ignore_index=True)
    hist = LogHistogram()
    for d in digests:
        hist.merge(d.itl_hist)
    duration = float(sum(d.summary["duration_s"] for d in digests))
    s = summarize(requests, pd.DataFrame(columns=list(ITERATION_COLUMNS)), hist,
                  slo=slo_ms, duration_s=duration)
    if not slo_ms:  # no per-request threshold named: goodput is undefined, not the throughput
        s["request_goodput"] = s["slo_attainment"] = math.nan
    qd = requests.loc[requests["state"] == "finished", "queueing_delay"].to_numpy(dtype=np.float64)
    s["median_queueing_delay_ms"] = float(np.median(qd) * 1e3) if qd.size else math.nan
    iters = np.array([d.summary["num_iterations"] for d in digests], dtype=np.float64)
    s["num_iterations"] = int(iters.sum())
    s["max_kv_usage"] = float(max(d.summary["max_kv_usage"] for d in digests))
    batch = np.array([d.summary["mean_batch_size"] for d in digests], dtype=np.float64)
    s["mean_batch_size"] = float((batch * iters).sum() / iters.sum()) if iters.sum() else math.nan
    return requests, hist, s


def evaluate_rate(runner: TaskRunner, sc: Scenario, st: PlanSettings, rate: float, replicas: int = 1) -> RatePoint:
    """Simulate ``rate`` on ``replicas`` with every seed and judge the pooled result."""
    tasks = rate_tasks(sc, st, rate, replicas)
    outcomes = runner.map(simulate_digest, tasks, desc=f"plan {rate:.4g} req/s x{replicas}")
    return judge_rate(st, rate, replicas, tasks, outcomes)


def rate_tasks(sc: Scenario, st: PlanSettings, rate: float, replicas: int = 1) -> list[Scenario]:
    """The runs that judge ``rate`` on ``replicas``: one per seed, over the window ``st`` sets."""
    window = st.window_at(rate / replicas)
    where = f"plan: {rate:g} req/s on {replicas} replica(s)"
    if window > MAX_SIM_SECONDS:
        raise ScenarioError(f"{where} needs a {window:.3g} s arrival window for {st.min_requests} requests, past the "
                            f"{MAX_SIM_SECONDS:.0e} s servesim simulates; start from a higher --start-rate")
    tasks = [at_rate(sc, rate, window, sc.seed + i, replicas) for i in range(st.seeds)]
    over = tasks[0].over_host_memory()  # the copies skip validation: a huge rate would die allocating
    if over is not None:
        raise ScenarioError(f"{where} over a {window:.3g} s window is more than this machine can simulate "
                            f"({over[0]}: {over[1]}); lower --target-rate, --start-rate or --duration")
    return tasks


def judge_rate(st: PlanSettings, rate: float, replicas: int, tasks: Sequence[Scenario],
               outcomes: Sequence[Outcome]) -> RatePoint:
    """Pool the seeds' runs of ``rate_tasks`` and check the SLO terms on them."""
    window = tasks[0].workload.duration_s if tasks else st.window_at(rate / replicas)
    errors = [f"seed {t.seed}: {o.error}" for t, o in zip(tasks, outcomes, strict=True) if not o.ok]
    digests = [o.value for o in outcomes if o.ok]
    if not digests:
        return RatePoint(rate, replicas, {}, [], 0, st.seeds, window, errors)
    slo_ms = request_thresholds(st.terms)
    requests, hist, summary = pool(digests, slo_ms)
    results = evaluate(st.terms, requests, hist, st.attainment)
    seeds_passing = sum(all(r.passed for r in evaluate(st.terms, d.requests, d.itl_hist, st.attainment))
                        for d in digests)
    return RatePoint(rate, replicas, summary, results, seeds_passing, st.seeds, window, errors)


# ---- the searches -------------------------------------------------------------------------------
def find_capacity(runner: TaskRunner, sc: Scenario, st: PlanSettings) -> tuple[float, tuple[float, float], list[RatePoint]]:
    """Bracket then bisect the highest passing rate of one replica (module docstring)."""
    _check_rate_workload(sc)
    points: list[RatePoint] = []

    def passes(rate: float) -> bool:
        p = evaluate_rate(runner, sc, st, rate)
        if p.errors and not p.summary:
            raise ScenarioError(f"plan: every run at {rate:g} req/s failed: {p.errors[0]}")
        points.append(p)
        return p.passed

    start = st.start_rate or float(sc.workload.arrival.rate)
    lo, hi = 0.0, math.inf
    if passes(start):
        lo = start
        for _ in range(MAX_BRACKET_STEPS):
            if not passes(lo * 2.0):
                hi = lo * 2.0
                break
            lo *= 2.0
    else:
        hi = start
        for _ in range(MAX_BRACKET_STEPS):
            if passes(hi / 2.0):
                lo = hi / 2.0
                break
            hi /= 2.0
    if lo == 0.0 or math.isinf(hi):
        return lo, (lo, hi), points
    while hi / lo > 1.0 + st.tolerance:
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo, (lo, hi), points


def find_replicas(runner: TaskRunner, sc: Scenario, st: PlanSettings, capacity: float,
                  target_rate: float) -> tuple[int | None, list[RatePoint]]:
    """Smallest replica count whose cluster passes at ``target_rate``, starting at target / capacity."""
    points: dict[int, RatePoint] = {}

    def passes(n: int) -> bool:
        if n not in points:
            points[n] = evaluate_rate(runner, sc, st, target_rate, n)
        return points[n].passed

    n = max(1, math.ceil(target_rate / capacity - 1e-9))
    steps = 0
    if passes(n):
        while n > 1 and passes(n - 1) and steps < MAX_REPLICA_STEPS:
            n, steps = n - 1, steps + 1
        return n, list(points.values())
    while steps < MAX_REPLICA_STEPS:
        n, steps = n + 1, steps + 1
        if passes(n):
            return n, list(points.values())
    return None, list(points.values())


def check_target_rate(target_rate: float) -> None:
    """``--target-rate``: a finite number of requests/s above 0 (plan and the disaggregated plan)."""
    if not 0 < target_rate < math.inf:
        raise ScenarioError(f"--target-rate must be a finite number > 0 requests/s, got {target_rate}")


def plan(sc: Scenario, st: PlanSettings, target_rate: float | None = None, workers: int | None = None,
         progress: bool = True) -> PlanResult:
    """Capacity of one replica of ``sc`` under ``st``, and replicas for ``target_rate`` if given."""
    if target_rate is not None:
        check_target_rate(target_rate)
    one = sc.model_copy(update={"cluster": sc.cluster.model_copy(update={"num_replicas": 1})})
    with TaskRunner("local", workers=min(workers or default_workers(), st.seeds), progress=progress,
                    desc="plan") as runner:
        capacity, bracket, points = find_capacity(runner, one, st)
        result = PlanResult(sc, st, capacity, bracket, points, target_rate)
        if target_rate is not None and capacity > 0:
            result.replicas, result.replica_points = find_replicas(runner, sc, st, capacity, target_rate)
    return result


# ---- output -------------------------------------------------------------------------------------
def _cell(x: Any, spec: str) -> str:
    if isinstance(x, bool | np.bool_):
        return "yes" if x else "NO"
    if isinstance(x, float | int | np.floating | np.integer):
        return "-" if isinstance(x, float) and math.isnan(x) else format(x, spec)
    return str(x)


SESSION_RATES_NOTE = ("rates here are conversation starts per second (workload.arrival of a workload.sessions "
                      f"workload); each conversation sends one request per turn; the arrival window is at least "
                      f"{SESSION_WINDOWS} conversation lengths (mean turns x think time) unless --duration sets it")


def format_plan(result: PlanResult) -> str:
    """The evaluated rates as a table, then the answer in a sentence or two."""
    st = result.settings
    cols = [("request_rate", "rate/s", ".3f"), ("replicas", "repl", "d"), ("passed", "pass", ""),
            ("seeds_passing", "seeds ok", "d"), ("slo_attainment", "attain", ".3f"),
            ("request_goodput", "goodput/s", ".3f"), ("rejected", "rejected", ".0f"),
            ("median_ttft_ms", "TTFT p50", ".0f"),
            ("p99_ttft_ms", "TTFT p99", ".0f"), ("p99_tpot_ms", "TPOT p99", ".1f"),
            ("p99_itl_ms", "ITL p99", ".1f"), ("p99_e2el_ms", "E2E p99", ".0f"),
            ("median_queueing_delay_ms", "queue p50", ".0f")]  # fmt: skip
    df = result.frame()
    lines = [f"SLO: {describe(st.terms, st.attainment)}",
             f"seeds {result.scenario.seed}..{result.scenario.seed + st.seeds - 1} pooled, arrival window "
             f"{st.base_window_s:.0f} s per seed (at least {st.min_requests} requests), tolerance {st.tolerance:.0%}"]
    if len(df):
        table = [[h for _, h, _ in cols]]
        for _, row in df.iterrows():
            table.append([_cell(row[c], spec) for c, _, spec in cols])
        widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
        for i, r in enumerate(table):
            lines.append("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
    lo, hi = result.bracket
    if result.capacity == 0.0:
        first = result.points[-1] if result.points else None
        why = "; ".join(f"{r.term.key} {r.value:.3g}" for r in first.results if not r.passed) if first else ""
        lines.append(f"capacity: no rate down to {hi:.4g} req/s meets the SLO ({why})")
    elif math.isinf(hi):
        lines.append(f"capacity: every rate up to {lo:.4g} req/s met the SLO (no upper bound found)")
    else:
        disagg = result.scenario.cluster.disagg
        unit = ("per replica" if disagg is None else
                f"for the whole disaggregated deployment ({disagg.prefill.count} prefill + "
                f"{disagg.decode.count} decode instances)")
        lines.append(f"capacity: {result.capacity:.4g} req/s {unit} "
                     f"(passes at {lo:.4g}, fails at {hi:.4g} req/s)")
    if result.target_rate is not None:
        if result.capacity == 0.0:
            lines.append(f"replicas for {result.target_rate:g} req/s: none, a replica meets the SLO at no rate")
        elif result.replicas is None:
            lines.append(f"replicas for {result.target_rate:g} req/s: not found within {MAX_REPLICA_STEPS} steps")
        else:
            lines.append(f"replicas for {result.target_rate:g} req/s: {result.replicas} "
                         f"(router {result.scenario.cluster.router}, "
                         f"{result.target_rate / result.replicas:.4g} req/s each)")
    if result.scenario.workload.sessions is not None:
        lines.append(SESSION_RATES_NOTE)
    return "\n".join(lines)


def write_plan(result: PlanResult, out_dir: str | Path, plots: bool = True) -> Path:
    """plan.csv (every evaluated point), latency_vs_rate.png, and plan.json (the answer, last)."""
    out = begin_folder(out_dir, "plan.json")
    write_csv(result.frame(), out / "plan.csv")
    if plots and result.points:
        from ..plots import plot_latency_vs_rate

        rows = pd.DataFrame([p.row() for p in result.points if p.summary])
        plot_latency_vs_rate(out / "latency_vs_rate.png", rows, chosen_rate=result.capacity or None,
                             slo=tightest_targets(result.settings.terms, ("ttft", "tpot", "itl", "e2el")), latencies=("ttft", "tpot", "itl", "e2el"))
    write_text(out / "plan.json", to_json(result.to_dict()))
    return out
