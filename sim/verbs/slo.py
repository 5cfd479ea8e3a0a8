"""Service-level objectives over a set of runs: what ``servesim plan`` checks at each arrival rate.

An SLO is a list of terms ``[STAT_]METRIC_ms=TARGET`` (milliseconds):

- ``METRIC``: ``ttft``, ``tpot``, ``e2el`` (per request), ``queueing_delay`` (arrival to first
  scheduled, per request) or ``itl`` (per token).
- ``pNN_`` (e.g. ``p99_ttft_ms=500``): a *percentile* term over the pooled requests (or tokens, for
  ``itl``) of all runs: it holds when at least NN % of them are at or under the target, which is the
  same as "the NN-th percentile is <= target" counted on requests rather than interpolated.
  Rejected requests count as misses. ``median_`` means ``p50_``.
- ``mean_``: the mean over the pooled finished requests (or tokens) is <= target.
- no prefix (``ttft_ms=500``, vLLM's ``--goodput`` keys): a *per-request* target. A request is good
  when it meets every per-request target at once; the terms hold together when the fraction of
  good requests (``slo_attainment``) is at least the required attainment (``--attainment``).

A TPOT target is met by requests with a single output token (they have no TPOT), as in vLLM.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..errors import ScenarioError
from ..hints import did_you_mean
from ..metrics import LATENCY_COLUMNS, LogHistogram

# metric -> requests column (ITL is per token: the histogram, no column)
METRIC_COLUMNS: dict[str, str | None] = {**LATENCY_COLUMNS, "itl": None}
PER_REQUEST_METRICS = tuple(LATENCY_COLUMNS)
_TERM = re.compile(r"^(?:(?P<stat>mean|median|p\d+(?:\.\d+)?)_)?(?P<metric>[a-z0-9_]+?)_ms$")


class SloError(ScenarioError):
    """A malformed SLO term; the message is one line naming it (a ScenarioError, so the CLI prints
    it as a usage error)."""


@dataclass(frozen=True, slots=True)
class SloTerm:
    """One target: ``stat`` is "request" (per-request), "mean" or "pNN" (percentile NN)."""

    stat: str
    metric: str
    target_ms: float

    @property
    def key(self) -> str:
        prefix = "" if self.stat == "request" else f"{self.stat}_"
        return f"{prefix}{self.metric}_ms"

    @property
    def quantile(self) -> float:
        """The required fraction (0..1) for a percentile term."""
        return float(self.stat[1:]) / 100.0

    def __str__(self) -> str:
        return f"{self.key}={self.target_ms:g}"


def parse_term(key: str, target: float) -> SloTerm:
    m = _TERM.match(key.strip())
    if m is None or m.group("metric") not in METRIC_COLUMNS:
        metric = m.group("metric") if m else key
        hint = did_you_mean(metric, METRIC_COLUMNS)
        raise SloError(
            f"SLO term {key!r}: expected [pNN_|median_|mean_]METRIC_ms with METRIC one of "
            f"{', '.join(METRIC_COLUMNS)}{hint}"
        )
    stat, metric = m.group("stat") or "request", m.group("metric")
    if stat == "median":
        stat = "p50"
    if stat.startswith("p") and not 0.0 < float(stat[1:]) < 100.0:
        raise SloError(f"SLO term {key!r}: the percentile must be between 0 and 100")
    if stat == "request" and metric == "itl":
        raise SloError(f"SLO term {key!r}: ITL is per token, not per request; use a percentile (p99_itl_ms) or mean_itl_ms")
    if not (math.isfinite(target) and target > 0):
        raise SloError(f"SLO term {key!r}: the target must be a positive number of milliseconds, got {target}")
    return SloTerm(stat, metric, float(target))


def parse_slo(text: str | Iterable[str]) -> list[SloTerm]:
    """Terms from ``"p99_ttft_ms=500,p99_tpot_ms=50"`` (or several such strings)."""
    items = [text] if isinstance(text, str) else list(text)
    terms: list[SloTerm] = []
    for item in items:
        for part in (p.strip() for p in item.split(",")):
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep:
                raise SloError(f"SLO term {part!r}: expected KEY=MILLISECONDS, e.g. p99_ttft_ms=500")
            try:
                target = float(value)
            except ValueError:
                raise SloError(f"SLO term {part!r}: {value!r} is not a number of milliseconds") from None
            terms.append(parse_term(key, target))
    keys = [t.key for t in terms]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise SloError(f"SLO term {dup[0]!r} is given twice")
    if not terms:
        raise SloError("empty SLO: give terms such as p99_ttft_ms=500,p99_tpot_ms=50")
    return terms


def terms_from_scenario_slo(slo: dict[str, float]) -> list[SloTerm]:
    """The scenario's ``slo:`` section (vLLM goodput keys) as per-request terms."""
    return [parse_term(k, v) for k, v in slo.items()]


def tightest_targets(terms: Sequence[SloTerm], metrics: Sequence[str] = ("ttft", "tpot", "e2el")) -> dict[str, float]:
    """The tightest target (ms) each of ``metrics`` has in ``terms``, keyed ``METRIC_ms``."""
    out: dict[str, float] = {}
    for t in terms:
        if t.metric in metrics:
            k = f"{t.metric}_ms"
            out[k] = min(out.get(k, math.inf), t.target_ms)
    return out


def request_thresholds(terms: Sequence[SloTerm]) -> dict[str, float]:
    """Per-request targets (ms) used to count goodput: the per-request terms if any, else the
    tightest target each request-level metric has in a percentile or mean term. Keys are the
    summary's SLO keys (ttft_ms, tpot_ms, e2el_ms)."""
    return tightest_targets([t for t in terms if t.stat == "request"] or list(terms))


@dataclass(slots=True)
class TermResult:
    term: SloTerm
    value: float  # the attained fraction (percentile / per-request terms) or the mean in ms
    passed: bool


def _meets(requests_df: pd.DataFrame, term: SloTerm) -> np.ndarray:
    """Per request: finished and at or under the term's target."""
    ok = np.asarray(requests_df["state"] == "finished", dtype=bool)
    v = requests_df[METRIC_COLUMNS[term.metric]].to_numpy(dtype=np.float64) * 1e3
    with np.errstate(invalid="ignore"):
        passes = v <= term.target_ms
    if term.metric == "tpot":
        passes |= requests_df["num_output_tokens"].to_numpy() <= 1
    return ok & passes


def _hist_fraction_at_most(hist: LogHistogram, target_s: float) -> float:
    """Fraction of the histogram's values <= target (seconds), counting only bins that lie wholly
    under the target: at most one bin (0.1 % of the value) is counted as a miss that might not be."""
    if hist.count == 0:
        return math.nan
    if target_s >= hist.max:
        return 1.0
    b = int(math.floor(math.log(max(target_s, hist.lo) / hist.lo) / math.log(hist.ratio)))
    return float(hist.counts[: max(b, 0)].sum() / hist.count)


def evaluate(
    terms: Sequence[SloTerm], requests_df: pd.DataFrame, itl_hist: LogHistogram | None, attainment: float
) -> list[TermResult]:
    """Check every term on pooled requests (and the pooled ITL histogram).

    Per-request terms are evaluated together and reported as one result on the first of them
    (its ``value`` is the fraction of requests meeting all of them).
    """
    results: list[TermResult] = []
    n = len(requests_df)
    request_terms = [t for t in terms if t.stat == "request"]
    if request_terms:
        good = np.ones(n, dtype=bool)
        for t in request_terms:
            good &= _meets(requests_df, t)
        frac = float(good.mean()) if n else math.nan
        results.append(TermResult(request_terms[0], frac, bool(frac >= attainment)))
    fin = requests_df[requests_df["state"] == "finished"]
    for t in terms:
        if t.stat == "request":
            continue
        if t.metric == "itl":
            hist = itl_hist if itl_hist is not None else LogHistogram()
            if t.stat == "mean":
                value = hist.mean * 1e3 if hist.count else math.nan
                passed = bool(value <= t.target_ms)
            else:
                value = _hist_fraction_at_most(hist, t.target_ms / 1e3)
                passed = bool(value >= t.quantile)
        elif t.stat == "mean":
            v = fin[METRIC_COLUMNS[t.metric]].to_numpy(dtype=np.float64) * 1e3
            v = v[np.isfinite(v)]
            value = float(v.mean()) if v.size else math.nan
            passed = bool(value <= t.target_ms)
        else:
            value = float(_meets(requests_df, t).mean()) if n else math.nan
            passed = bool(value >= t.quantile)
        results.append(TermResult(t, value, passed))
    return results


def describe(terms: Sequence[SloTerm], attainment: float) -> str:
    """One line: the terms as a user would type them, plus the attainment when it applies."""
    text = ",".join(str(t) for t in terms)
    if any(t.stat == "request" for t in terms):
        text += f" (per-request terms: {attainment:.0%} of requests meet all)"
    return text
