"""Is a candidate configuration worse than the baseline? (``servesim compare``, built for CI.)

Both scenarios are simulated on the *same* workloads: the baseline's ``workload`` and ``slo``
sections, seeds ``seed .. seed + N - 1`` of the baseline, so run i of the candidate sees exactly the
requests run i of the baseline saw. For each summary metric the change is

    change = 100 * (mean over seeds of candidate - mean over seeds of baseline) / mean of baseline   [%]

and its 95 % confidence interval comes from a paired bootstrap over seeds: resampling picks whole
seeds (the baseline and candidate run of a seed together), because the seeds are the independent
units while requests within one run are not (a burst delays many neighbours at once). It is the
BCa bootstrap of ``scipy.stats.bootstrap`` (``paired=True``, ``BOOTSTRAP_RESAMPLES`` resamples, a
fixed random seed so the same runs print the same interval), falling back to the percentile
bootstrap when BCa is undefined (every resample equal). When every seed's change is exactly zero
the interval is [0, 0].

``--fail-on METRIC=+X%`` marks an increase as the bad direction (latencies), ``METRIC=-X%`` a
decrease (throughput, goodput, attainment). A regression is *flagged* when both hold:

- it is significant: the whole 95 % interval is on the bad side of zero (low > 0 for "+",
  high < 0 for "-"), and
- it is large enough: the point estimate of the change is beyond the margin (> X for "+",
  < -X for "-").

``compare`` exits 1 when any ``--fail-on`` is flagged, 0 otherwise (2 for usage errors).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..hints import did_you_mean
from ..host_memory import SEED_RUN_BYTES, Demand, over_host_memory
from ..outputs import begin_folder, write_csv, write_text
from ..scenario import Scenario, ScenarioError, scenario_to_yaml
from .parallel import TaskRunner
from .points_log import Recording, run_recorded

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95
DEFAULT_METRICS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "mean_e2el_ms",
                   "p99_e2el_ms", "request_throughput", "output_throughput")
SLO_METRICS = ("request_goodput", "slo_attainment")
RUNS_FILE = "runs.jsonl"  # each finished run, for --resume (points_log.py)
MARKER = "compare.json"  # written last: it marks a finished comparison
SPEC_LABELS = {"baseline": "baseline scenario", "candidate": "candidate scenario", "seeds": "--seeds"}
_FAIL_ON = re.compile(r"^(?P<metric>[a-z0-9_]+)=(?P<sign>[+-])(?P<margin>\d+(?:\.\d+)?)%$")


@dataclass(frozen=True, slots=True)
class FailOn:
    metric: str
    sign: int  # +1: an increase is bad; -1: a decrease is bad
    margin_pct: float

    def __str__(self) -> str:
        return f"{self.metric}={'+' if self.sign > 0 else '-'}{self.margin_pct:g}%"


def parse_fail_on(items: Sequence[str], known: Sequence[str]) -> list[FailOn]:
    out = []
    for item in items:
        m = _FAIL_ON.match(item.replace(" ", ""))
        if m is None:
            raise ScenarioError(f"--fail-on {item!r}: expected METRIC=+X% (an increase is bad) or METRIC=-X%, "
                                "e.g. p99_tpot_ms=+5%")
        metric = m.group("metric")
        if metric not in known:
            hint = did_you_mean(metric, known)
            raise ScenarioError(f"--fail-on {item!r}: unknown metric '{metric}'{hint}; summary keys such as "
                                "p99_tpot_ms, mean_ttft_ms, request_goodput")
        if any(f.metric == metric for f in out):  # (the last rule silently replaced the first)
            raise ScenarioError(f"--fail-on {item!r}: {metric} has a rule already; give each metric one")
        out.append(FailOn(metric, 1 if m.group("sign") == "+" else -1, float(m.group("margin"))))
    return out


@dataclass
class MetricChange:
    metric: str
    baseline: float  # mean over seeds
    candidate: float
    change_pct: float
    ci_low_pct: float
    ci_high_pct: float
    method: str  # "BCa", "percentile", "exact" (all paired changes zero) or "n/a"
    fail_on: FailOn | None = None

    @property
    def flagged(self) -> bool:
        f = self.fail_on
        if f is None or math.isnan(self.change_pct):
            return False
        if f.sign > 0:
            return self.ci_low_pct > 0.0 and self.change_pct > f.margin_pct
        return self.ci_high_pct < 0.0 and self.change_pct < -f.margin_pct


def _rel_change(b: np.ndarray, c: np.ndarray, axis: int = -1) -> np.ndarray:
    mb = np.mean(b, axis=axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        return 100.0 * (np.mean(c, axis=axis) - mb) / mb


def paired_change(b: np.ndarray, c: np.ndarray) -> tuple[float, float, float, str]:
    """(change %, CI low %, CI high %, method) for paired per-seed values (module docstring)."""
    from scipy import stats

    b, c = np.asarray(b, dtype=np.float64), np.asarray(c, dtype=np.float64)
    keep = np.isfinite(b) & np.isfinite(c)
    b, c = b[keep], c[keep]
    if b.size == 0 or np.mean(b) == 0:
        return math.nan, math.nan, math.nan, "n/a"
    change = float(_rel_change(b, c))
    if np.array_equal(b, c):
        return 0.0, 0.0, 0.0, "exact"
    if b.size < 2:
        return change, math.nan, math.nan, "n/a"
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # degenerate resamples: handled by the nan check below
            res = stats.bootstrap((b, c), _rel_change, paired=True, vectorized=True, n_resamples=BOOTSTRAP_RESAMPLES,
                                  confidence_level=CONFIDENCE, method=method,
                                  rng=np.random.default_rng(BOOTSTRAP_SEED))
        lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if math.isfinite(lo) and math.isfinite(hi):
            return change, lo, hi, method
    return change, change, change, "percentile"


@dataclass
class CompareResult:
    baseline: Scenario
    candidate: Scenario
    seeds: list[int]
    per_seed: pd.DataFrame  # seed, side ("baseline"/"candidate"), status, error, summary metrics
    changes: list[MetricChange]
    notes: list[str]
    set_both: list[str] = field(default_factory=list)  # --set, applied to both sides
    set_candidate: list[str] = field(default_factory=list)  # --candidate-set: what the candidate changes
    resumed: int = 0  # runs taken from runs.jsonl instead of run now

    @property
    def flagged(self) -> list[MetricChange]:
        return [m for m in self.changes if m.flagged]

    @property
    def failed_runs(self) -> pd.DataFrame:
        return self.per_seed[self.per_seed["status"] != "ok"]

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame([{
            "metric": m.metric, "baseline": m.baseline, "candidate": m.candidate, "change_pct": m.change_pct,
            "ci_low_pct": m.ci_low_pct, "ci_high_pct": m.ci_high_pct, "ci_method": m.method,
            "fail_on": str(m.fail_on) if m.fail_on else "", "flagged": m.flagged,
        } for m in self.changes])  # fmt: skip


def same_workload(baseline: Scenario, candidate: Scenario) -> tuple[Scenario, list[str]]:
    """The candidate with the baseline's workload and SLO, and a note for each section replaced."""
    notes = []
    if candidate.workload != baseline.workload:
        notes.append("the candidate's workload section differs from the baseline's; both run the baseline's")
    if candidate.slo != baseline.slo:
        notes.append("the candidate's slo differs from the baseline's; goodput uses the baseline's for both")
    return candidate.model_copy(update={"workload": baseline.workload, "slo": baseline.slo}), notes


def summary_keys() -> list[str]:
    """Every key a run's summary has (what --fail-on and --metrics may name)."""
    from ..metrics import ITERATION_COLUMNS, REQUEST_COLUMNS, summarize

    empty = pd.DataFrame({c: [] for c in REQUEST_COLUMNS})
    return list(summarize(empty, pd.DataFrame(columns=list(ITERATION_COLUMNS)), None, slo={"ttft_ms": 1.0}))


def _run_summary(sc: Scenario) -> dict[str, Any]:
    """Worker entry point: one simulation's summary."""
    from ..simulate import simulate, summary_iterations

    return simulate(sc, progress=False, iterations=summary_iterations(sc)).summary


def compare(baseline: Scenario, candidate: Scenario, seeds: int = 10, fail_on: Sequence[str] = (),
            metrics: Sequence[str] | None = None, workers: int | None = None, progress: bool = True,
            set_both: Sequence[str] = (), set_candidate: Sequence[str] = (), out_dir: str | Path | None = None,
            resume: bool = False) -> CompareResult:
    """Run both on seeds ``baseline.seed ..`` and the change of each metric with its CI.

    ``set_both`` / ``set_candidate``: the overrides already applied to the scenarios, for the header.
    ``out_dir``: record each finished run in its ``runs.jsonl``; ``resume``: keep the runs recorded
    there (the folder must hold this same comparison) and run only the others.
    """
    if seeds < 1:
        raise ScenarioError(f"--seeds must be >= 1, got {seeds}")
    # both sides' runs of every seed are listed up front and their summaries kept
    over = over_host_memory([Demand("--seeds", "runs (a baseline and a candidate per seed)", 2.0 * seeds,
                                    SEED_RUN_BYTES, items_per_unit=2.0, unit=" seeds")])
    if over is not None:
        raise ScenarioError(f"{over[0]} {seeds}: {over[1]}")
    known = summary_keys()
    rules = {f.metric: f for f in parse_fail_on(fail_on, known)}  # checked before any run
    if rules and seeds < 2:
        raise ScenarioError(f"--fail-on needs --seeds 2 or more (got {seeds}): a change is flagged only when its "
                            "confidence interval over seeds excludes zero, and one seed gives no interval")
    wanted = list(metrics) if metrics else [*DEFAULT_METRICS, *(SLO_METRICS if baseline.slo else ())]
    unknown = [m for m in wanted if m not in known]
    if unknown:
        hint = did_you_mean(unknown[0], known)
        raise ScenarioError(f"--metrics: unknown summary key '{unknown[0]}'{hint}")
    wanted += [m for m in rules if m not in wanted]
    cand, notes = same_workload(baseline, candidate)
    seed_list = [baseline.seed + i for i in range(seeds)]
    tasks = [side.model_copy(update={"seed": s}) for side in (baseline, cand) for s in seed_list]
    spec = {"baseline": scenario_to_yaml(baseline), "candidate": scenario_to_yaml(cand), "seeds": seed_list}
    recording = None if out_dir is None else Recording(Path(out_dir), RUNS_FILE, spec, SPEC_LABELS, "comparison",
                                                       resume, (MARKER,))
    done = run_recorded(_run_summary, dict(enumerate(tasks)),
                        lambda: TaskRunner("local", workers=workers, progress=progress, desc="compare"),
                        recording, "runs")
    rows = []
    for k in range(len(tasks)):
        rec = done.get(k)
        side = "baseline" if k < seeds else "candidate"
        rows.append({"seed": seed_list[k % seeds], "side": side, "status": rec["status"], "error": rec["error"],
                     **(rec["value"] or {})})
    per_seed = pd.DataFrame(rows)
    for m in wanted:  # a side whose every run failed has no metric columns
        if m not in per_seed:
            per_seed[m] = math.nan
    b_df = per_seed[per_seed["side"] == "baseline"].set_index("seed")
    c_df = per_seed[per_seed["side"] == "candidate"].set_index("seed")
    both = [s for s in seed_list if b_df.loc[s, "status"] == "ok" and c_df.loc[s, "status"] == "ok"]
    changes = []
    for m in wanted:
        b = b_df.loc[both, m].to_numpy(dtype=np.float64) if both else np.zeros(0)
        c = c_df.loc[both, m].to_numpy(dtype=np.float64) if both else np.zeros(0)
        change, lo, hi, method = paired_change(b, c)
        changes.append(MetricChange(m, float(np.nanmean(b)) if b.size else math.nan,
                                    float(np.nanmean(c)) if c.size else math.nan, change, lo, hi, method,
                                    rules.get(m)))
    return CompareResult(baseline, cand, seed_list, per_seed, changes, notes, list(set_both), list(set_candidate),
                         done.resumed)


def format_compare(result: CompareResult) -> str:
    head = ["metric", "baseline", "candidate", "change", "95% CI", "fail-on", ""]
    table = [head]
    for m in result.changes:
        def pct(x: float) -> str:
            return "-" if math.isnan(x) else f"{x:+.2f}%"

        ci = "-" if math.isnan(m.ci_low_pct) else f"[{m.ci_low_pct:+.2f}, {m.ci_high_pct:+.2f}]%"
        table.append([m.metric, f"{m.baseline:.4g}", f"{m.candidate:.4g}", pct(m.change_pct), ci,
                      str(m.fail_on).split("=", 1)[1] if m.fail_on else "",
                      "REGRESSION" if m.flagged else ""])
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = [f"baseline {result.baseline.name} ({result.baseline.scheduler_name}) vs candidate "
             f"{result.candidate.name} ({result.candidate.scheduler_name}), seeds {result.seeds[0]}..{result.seeds[-1]}, "
             f"same workload; CI: paired bootstrap over seeds ({BOOTSTRAP_RESAMPLES} resamples)"]
    if result.set_both or result.set_candidate:
        lines.append("overrides: " + "; ".join(
            [f"both --set {', '.join(result.set_both)}"] * bool(result.set_both)
            + [f"candidate --candidate-set {', '.join(result.set_candidate)}"] * bool(result.set_candidate)))
    for note in result.notes:
        lines.append(f"note: {note}")
    seeds = result.per_seed
    if "rejected" in seeds and seeds["rejected"].fillna(0).gt(0).any():
        mean = seeds.groupby("side")["rejected"].mean()
        lines.append(f"REJECTED requests, mean per seed: baseline {mean.get('baseline', math.nan):.1f}, candidate "
                     f"{mean.get('candidate', math.nan):.1f}; throughput and latencies count only the admitted ones")
    for j, r in enumerate(table):
        lines.append("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths,
                                                                                                  strict=True))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    for _, r in result.failed_runs.iterrows():
        lines.append(f"failed run: {r['side']} seed {r['seed']}: {r['error']}")
    flagged = result.flagged
    if flagged:
        lines.append("REGRESSION: " + "; ".join(
            f"{m.metric} {m.change_pct:+.2f}% [{m.ci_low_pct:+.2f}, {m.ci_high_pct:+.2f}] beyond {m.fail_on}"
            for m in flagged))
    else:
        rules = [str(m.fail_on) for m in result.changes if m.fail_on]
        lines.append("no significant regression" + (f" ({', '.join(rules)})" if rules else ""))
    return "\n".join(lines)


def write_compare(result: CompareResult, out_dir: str | Path) -> Path:
    """compare.csv (one row per metric), compare_seeds.csv (every run's summary), compare.json."""
    from ..metrics import to_json

    out = begin_folder(out_dir, MARKER)
    write_csv(result.frame(), out / "compare.csv")
    write_csv(result.per_seed, out / "compare_seeds.csv")
    write_text(out / MARKER, to_json({
        "baseline": result.baseline.name, "candidate": result.candidate.name, "seeds": result.seeds,
        "bootstrap": {"kind": "paired over seeds", "resamples": BOOTSTRAP_RESAMPLES, "seed": BOOTSTRAP_SEED,
                      "confidence": CONFIDENCE},
        "notes": result.notes,
        "set": result.set_both, "candidate_set": result.set_candidate,
        "changes": result.frame().to_dict(orient="records"),
        "regression": bool(result.flagged),
    }))  # fmt: skip
    return out
