"""What a run measured: per-request, per-iteration and per-token records, summaries, goodput.

The engine feeds a ``MetricsRecorder`` on its hot path (one call per iteration, one per step's
inter-token latencies, one per finished request); pandas appears only after the run. Summary keys
follow vLLM's ``benchmark_serving.py`` (``mean_ttft_ms``, ``p99_tpot_ms``, ``request_goodput``...)
so numbers can be put side by side with a real vLLM benchmark.

Inter-token latencies are not kept one by one (a long run emits tens of millions of tokens): they
go into a ``LogHistogram`` whose percentiles carry a stated relative error bound.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd

from .batch import Batch
from .iteration_bins import SUM_COLUMNS, IterationBins
from .outputs import begin_folder, write_parquet, write_text
from .request import Request, RequestState

ITERATIONS_MODES = ("full", "binned", "off")
IterationsMode = Literal["full", "binned", "off"]
_PERCENTILES = (90, 95, 99)  # reported for every latency, next to mean, median and std
_RUNS_FROM = 64  # LogHistogram.add looks for runs of equal values in batches this long or longer
_ZERO_ROW = np.zeros(1, dtype=np.intp)
_SLO_KEYS = {"ttft_ms": "ttft", "tpot_ms": "tpot", "e2el_ms": "e2e"}


class LogHistogram:
    """Streaming histogram of positive values (seconds) on geometric bins.

    Bin ``i`` covers ``[lo * ratio**i, lo * ratio**(i+1))``; values below ``lo`` or above ``hi``
    are clamped into the first / last bin (the exact min and max are kept separately).
    ``quantile`` returns the geometric centre of the bin holding each order statistic, so for
    values inside ``[lo, hi]`` the worst-case relative error of any percentile is half a bin
    width, ``sqrt(ratio) - 1`` (about 0.05 % for the default ratio 1.001), measured against
    ``np.percentile``'s linear interpolation between order statistics. ``mean`` is exact (a
    running sum); ``std`` comes from a running sum of squared deviations (Chan et al.'s pairwise
    update, which does not cancel catastrophically the way sum-of-squares minus square-of-sum does).
    """

    def __init__(self, lo: float = 1e-6, hi: float = 1e3, ratio: float = 1.001) -> None:
        if not (0 < lo < hi) or ratio <= 1:
            raise ValueError(
                f"LogHistogram needs 0 < lo < hi and ratio > 1, got lo={lo} hi={hi} ratio={ratio}"
            )
        self.lo, self.hi, self.ratio = float(lo), float(hi), float(ratio)
        self._inv_log_ratio = 1.0 / math.log(ratio)
        self.num_bins = int(math.ceil(math.log(hi / lo) * self._inv_log_ratio))
        self.counts = np.zeros(self.num_bins, dtype=np.int64)
        self.count = 0
        self.sum = 0.0
        self._m2 = 0.0  # sum of squared deviations from the running mean
        self.min = math.inf
        self.max = -math.inf
        self._f = np.empty(0, dtype=np.float64)  # add's scratch
        self._i = np.empty(0, dtype=np.int64)

    @property
    def max_relative_error(self) -> float:
        """Worst-case relative error of ``quantile`` for values inside [lo, hi]."""
        return math.sqrt(self.ratio) - 1.0

    def add(self, values: np.ndarray) -> None:
        """Add a batch of values (seconds; non-positive values land in the first bin)."""
        v = np.asarray(values, dtype=np.float64).ravel()
        n = v.size
        if n == 0:
            return
        s = float(np.add.reduce(v))
        # a nan would index a bin at random; any nan or inf makes the sum non-finite
        if not math.isfinite(s) and not np.isfinite(v).all():
            raise ValueError("LogHistogram.add: values must be finite")
        # the temporaries live in scratch arrays: fresh ones of a 64k-value batch cost more in page
        # faults than the arithmetic
        f, bins = self._scratch(n)
        # Equal neighbours share a bin: a step's decode rows all wait the same gap for their token, so
        # a batch of ITLs is mostly runs of one value. Each run's bin is computed once (the same
        # float operations on the same value) and counted as many times as the run is long.
        starts = None
        if n >= _RUNS_FROM:
            np.not_equal(v[1:], v[:-1], out=f.view(np.bool_)[: n - 1])  # (f is free until the bins)
            starts = np.flatnonzero(f.view(np.bool_)[: n - 1])
            if 2 * len(starts) < n:
                starts += 1
                lengths = np.diff(starts, prepend=0, append=n)
                starts = np.concatenate((_ZERO_ROW, starts))
            else:
                starts = None
        x = v if starts is None else v[starts]
        k = x.size
        fk, bk = f[:k], bins[:k]
        np.maximum(x, self.lo, out=fk)
        fk *= 1.0 / self.lo
        np.log(fk, out=fk)
        fk *= self._inv_log_ratio
        np.copyto(bk, fk, casting="unsafe")  # truncates, as astype(np.int64)
        np.minimum(bk, self.num_bins - 1, out=bk)
        if k < 4096:  # np.add.at avoids allocating a full-length bincount for small batches
            np.add.at(self.counts, bk, 1 if starts is None else lengths)
        elif starts is None:
            self.counts += np.bincount(bk, minlength=self.num_bins)
        else:  # (float weights: exact for counts below 2**53)
            self.counts += np.bincount(bk, weights=lengths, minlength=self.num_bins).astype(np.int64)
        np.subtract(v, s / n, out=f)
        np.square(f, out=f)
        m2 = float(np.add.reduce(f))
        self._combine(n, s, m2, float(np.minimum.reduce(v)), float(np.maximum.reduce(v)))

    def _scratch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """A float64 and an int64 array of length n, reused from one ``add`` to the next."""
        if self._f.size < n:
            self._f = np.empty(n, dtype=np.float64)
            self._i = np.empty(n, dtype=np.int64)
        return self._f[:n], self._i[:n]

    def _combine(self, n: int, s: float, m2: float, vmin: float, vmax: float) -> None:
        if self.count:
            delta = s / n - self.sum / self.count
            self._m2 += m2 + delta * delta * self.count * n / (self.count + n)
        else:
            self._m2 = m2
        self.count += n
        self.sum += s
        self.min = min(self.min, vmin)
        self.max = max(self.max, vmax)

    def merge(self, other: LogHistogram) -> LogHistogram:
        """Add every value of ``other`` (same binning) into this histogram; returns self."""
        if (other.lo, other.hi, other.ratio) != (self.lo, self.hi, self.ratio):
            raise ValueError("cannot merge LogHistograms with different lo/hi/ratio")
        if other.count:
            self.counts += other.counts
            self._combine(other.count, other.sum, other._m2, other.min, other.max)
        return self

    @property
    def mean(self) -> float:
        """Exact mean (seconds); nan when empty."""
        return self.sum / self.count if self.count else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation (seconds, ddof=0 like np.std); nan when empty."""
        return math.sqrt(max(self._m2, 0.0) / self.count) if self.count else math.nan

    def quantile(self, q: float | np.ndarray) -> float | np.ndarray:
        """Quantile(s) ``q`` in [0, 1] (seconds), interpolated like ``np.quantile``; nan when empty."""
        qs = np.atleast_1d(np.asarray(q, dtype=np.float64))
        if np.any((qs < 0) | (qs > 1)):
            raise ValueError(f"quantile q must be in [0, 1], got {q}")
        if not self.count:
            out = np.full(qs.shape, math.nan)
        else:
            cum = np.cumsum(self.counts)
            rank = qs * (self.count - 1)
            below, above = np.floor(rank), np.ceil(rank)
            frac = rank - below
            # The order statistic of 0-based rank k sits in the first bin whose cumulative count > k.
            b_lo = np.searchsorted(cum, below, side="right")
            b_hi = np.searchsorted(cum, above, side="right")
            out = (1 - frac) * self._centre(b_lo) + frac * self._centre(b_hi)
            # Clamping only moves an estimate towards the truth; the extremes are known exactly.
            out = np.clip(out, self.min, self.max)
            out = np.where(qs == 0, self.min, np.where(qs == 1, self.max, out))
        return float(out[0]) if np.ndim(q) == 0 else out

    def _centre(self, b: np.ndarray) -> np.ndarray:
        """Geometric centre of bins ``b`` (seconds)."""
        return self.lo * self.ratio ** (b + 0.5)

    def cdf_points(self) -> tuple[np.ndarray, np.ndarray]:
        """(bin upper edges in seconds, cumulative fraction) for the nonzero bins, for plotting."""
        nz = np.flatnonzero(self.counts)
        if not self.count:
            return np.zeros(0), np.zeros(0)
        edges = np.clip(self.lo * self.ratio ** (nz + 1.0), self.min, self.max)
        return edges, np.cumsum(self.counts[nz]) / self.count

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready state; only nonzero bins are listed."""
        nz = np.flatnonzero(self.counts)
        empty = self.count == 0
        return {
            "lo": self.lo,
            "hi": self.hi,
            "ratio": self.ratio,
            "count": int(self.count),
            "sum": float(self.sum),
            "m2": float(self._m2),
            "min": None if empty else float(self.min),
            "max": None if empty else float(self.max),
            "bins": nz.tolist(),
            "counts": self.counts[nz].tolist(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LogHistogram:
        """Inverse of ``to_dict``."""
        h = cls(lo=d["lo"], hi=d["hi"], ratio=d["ratio"])
        h.counts[np.asarray(d["bins"], dtype=np.int64)] = np.asarray(d["counts"], dtype=np.int64)
        h.count, h.sum, h._m2 = int(d["count"]), float(d["sum"]), float(d["m2"])
        if h.count:
            h.min, h.max = float(d["min"]), float(d["max"])
        return h


@dataclass(frozen=True, slots=True)
class RequestColumn:
    """One column of ``requests.parquet``: recorded off the Request when it is done, or derived."""

    name: str
    dtype: str  # "int64", "float64" or "object"
    derive: Callable[[dict[str, np.ndarray]], np.ndarray] | None = None  # None: the Request attribute ``name``
    metric: str | None = None  # the vLLM metric name of a latency (summary keys, SLO terms), seconds here


def _ttft(d: dict[str, np.ndarray]) -> np.ndarray:
    return d["first_token_time"] - d["arrival_time"]


def _e2e(d: dict[str, np.ndarray]) -> np.ndarray:
    return d["finish_time"] - d["arrival_time"]


def _tpot(d: dict[str, np.ndarray]) -> np.ndarray:
    out = d["num_output_tokens"]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(out > 1, (_e2e(d) - _ttft(d)) / (out - 1), np.nan)


# The one spec of per-request records, in parquet column order; a derived column is computed
# from the recorded ones.
REQUEST_SPEC: tuple[RequestColumn, ...] = (
    RequestColumn("request_id", "int64"),
    RequestColumn("replica", "int64"),
    RequestColumn("arrival_time", "float64"),
    RequestColumn("first_scheduled_time", "float64"),
    RequestColumn("first_token_time", "float64"),
    RequestColumn("finish_time", "float64"),
    RequestColumn("prompt_len", "int64"),
    RequestColumn("output_len", "int64"),
    RequestColumn("num_output_tokens", "int64"),
    RequestColumn("ttft", "float64", _ttft, metric="ttft"),
    RequestColumn("tpot", "float64", _tpot, metric="tpot"),
    RequestColumn("e2e", "float64", _e2e, metric="e2el"),
    RequestColumn("queueing_delay", "float64", lambda d: d["first_scheduled_time"] - d["arrival_time"],
                  metric="queueing_delay"),
    RequestColumn("num_preemptions", "int64"),
    RequestColumn("num_cached_tokens", "int64"),
    RequestColumn("state", "object"),
    RequestColumn("reject_reason", "object"),
)
REQUEST_COLUMNS = tuple(c.name for c in REQUEST_SPEC)
_RECORDED = tuple(c.name for c in REQUEST_SPEC if c.derive is None)
_record = attrgetter(*_RECORDED)  # one C call per finished request
_RECORDED_DTYPES = tuple((c.name, "int8" if c.name == "state" else c.dtype) for c in REQUEST_SPEC if c.derive is None)
_REQUEST_CHUNK = 4096
# vLLM metric name -> requests column, for the per-request latencies
LATENCY_COLUMNS = {c.metric: c.name for c in REQUEST_SPEC if c.metric is not None}

ITERATION_COLUMNS = (
    "replica", "start", "duration", "batch_size", "num_prefill_tokens", "num_decode_tokens",
    "num_tokens", "kv_blocks_used", "kv_blocks_total", "num_waiting", "num_running",
    "num_swapped", "num_preempted", "num_swap_blocks", "sched_overhead_s",
)  # fmt: skip
_FLOAT_ITER_COLUMNS = frozenset({"start", "duration", "sched_overhead_s"})


class MetricsRecorder:
    """Collects a run's records with constant, small per-call cost (see the module docstring)."""

    _ITL_BUFFER = 1 << 16

    def __init__(self, num_replicas: int = 1, itl_histogram: LogHistogram | None = None,
                 iterations: IterationsMode = "full", bin_after: int | None = None) -> None:
        """``iterations``: keep one row per engine step (``full``), time bins of them (``binned``,
        see ``iteration_bins.py``) or only the summary's figures (``off``). ``bin_after`` (full
        only): once the run has that many steps, the rows so far go into time bins and the rest
        of the run is binned (``iterations_mode`` then says ``binned``), so a long run of few
        requests cannot fill memory with rows; the summary is the same either way."""
        if iterations not in ITERATIONS_MODES:
            raise ValueError(f"iterations must be one of {ITERATIONS_MODES}, got {iterations!r}")
        self.num_replicas = num_replicas
        self.iterations_mode = iterations
        self.bin_after = bin_after if iterations == "full" else None
        # seconds each replica spent in steps, added step by step in every mode (so equal in all)
        self._busy = [0.0] * num_replicas
        self._bins = None if iterations == "full" else IterationBins(num_replicas, keep_bins=iterations == "binned")
        if self._bins is not None:
            self._record_into_bins()
        # One float64 row per iteration: a single tuple store is cheaper than 15 column stores,
        # and every count fits exactly in a float64 mantissa.
        self._iters = np.empty((4096, len(ITERATION_COLUMNS)), dtype=np.float64)
        self._n_iters = 0
        # finished requests' records: a short list of tuples, moved into numpy columns in chunks
        # (a million Python tuples would be the run's biggest memory bill)
        self._requests: list[tuple] = []
        self._req_cols: dict[str, list[np.ndarray]] = {name: [] for name in _RECORDED}
        self._num_requests = 0
        self._released = False  # the records were handed to requests_frame(release=True)
        self._itl_hist = itl_histogram if itl_histogram is not None else LogHistogram()
        # ITLs are staged in a buffer so the histogram's log/bincount runs on big chunks.
        self._itl_buf = np.empty(self._ITL_BUFFER, dtype=np.float64)
        self._itl_n = 0
        # prompt tokens looked up in / served from the prefix cache, all replicas (set at the end)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def on_prefix_cache(self, query_tokens: int, hit_tokens: int) -> None:
        """Add one replica's prefix-cache counters (tokens), read off its block manager after the run."""
        self.prefix_cache_queries += query_tokens
        self.prefix_cache_hits += hit_tokens

    def on_iteration(
        self,
        replica: int,
        start: float,
        duration: float,
        batch: Batch,
        kv_blocks_used: int,
        kv_blocks_total: int,
        num_waiting: int,
        num_running: int,
        num_swapped: int,
        num_preempted: int,
        sched_overhead_s: float = math.nan,
    ) -> None:
        """Record one engine iteration of ``replica``: started at ``start``, took ``duration`` (s).

        ``sched_overhead_s`` is the live-mode CPU time spent scheduling (seconds); nan in simulation.
        """
        i = self._n_iters
        if i == len(self._iters):
            if self._past_bin_limit(1):
                self._switch_to_bins()
                self._bin_iteration(replica, start, duration, batch, kv_blocks_used, kv_blocks_total, num_waiting,
                                    num_running, num_swapped, num_preempted, sched_overhead_s)
                return
            grown = np.empty((2 * i, self._iters.shape[1]), dtype=np.float64)
            grown[:i] = self._iters
            self._iters = grown
        self._busy[replica] += duration
        # the Batch computes its aggregates once, shared with the cost model
        num_tokens = batch.num_tokens
        num_decode = batch.num_decode_tokens
        self._iters[i] = (
            replica, start, duration, len(batch.num_new_tokens), num_tokens - num_decode, num_decode,
            num_tokens, kv_blocks_used, kv_blocks_total, num_waiting, num_running, num_swapped,
            num_preempted, len(batch.swap_out) + len(batch.swap_in), sched_overhead_s,
        )  # fmt: skip
        self._n_iters = i + 1

    def on_decode_steps(self, replica: int, starts: list[float], durations: list[float], n: int,
                        kv_blocks_used: np.ndarray, kv_blocks_total: int, num_waiting: int, num_swapped: int,
                        first_itl: np.ndarray, last_running: int, running: int) -> None:
        """Record a fast-forward: consecutive plain decode steps of ``n`` rows each, step j from
        ``starts[j]`` for ``durations[j]`` seconds with ``kv_blocks_used[j]`` blocks held after it;
        ``running`` requests count as running after each step but the last (``n``, or more: a static
        batch's finished members are counted while they wait for the batch to end), and
        ``last_running`` after the last step (it may finish some).

        The same iteration rows and inter-token latencies, in the same order and staging, as
        ``on_iteration`` / ``on_itl`` called step by step: ``first_itl`` per row for step 0, then
        each later step's n rows wait exactly the gap between the two steps' ends.
        """
        rows = np.empty((len(starts), len(ITERATION_COLUMNS)), dtype=np.float64)
        rows[:] = (replica, 0.0, 0.0, n, 0, n, n, 0, kv_blocks_total, num_waiting, running, num_swapped, 0, 0, math.nan)
        rows[:, 1] = starts
        rows[:, 2] = durations
        rows[:, 7] = kv_blocks_used
        rows[-1, 10] = last_running  # the last step's finished requests have left
        # (rows up to bin_after stay rows and the rest go into bins, as step by step: a stretch across
        # the switch is split where the steps would have switched)
        self.on_iteration_rows(rows)
        self._decode_itls(starts, durations, n, first_itl)

    def on_iteration_rows(self, rows: np.ndarray) -> None:
        """Steps recorded elsewhere (a fast-forward's stretch, ``compiled_engine``), one row each in
        ``ITERATION_COLUMNS`` order (the replica first), in the order they ended: kept exactly as
        ``on_iteration`` step by step keeps them (the same rows, the same switch to bins at
        ``bin_after``, each replica's bins added in the same groups, its busy seconds one by one)."""
        i, k = 0, len(rows)
        while i < k:
            if self._bins is None:
                n = self._n_iters
                room = len(self._iters) - n
                if room == 0:
                    if self._past_bin_limit(1):
                        self._switch_to_bins()
                    else:
                        grown = np.empty((2 * n, self._iters.shape[1]), dtype=np.float64)
                        grown[:n] = self._iters
                        self._iters = grown
                    continue
                m = min(room, k - i)
                self._iters[n : n + m] = rows[i : i + m]
                self._n_iters = n + m
                i += m
            else:
                block = rows[i:].copy()
                block[:, 0] = block[:, 1]  # a bin row: start, num_steps 1, then duration on as in a step's row
                block[:, 1] = 1.0
                # each run of one replica's rows in turn, in the order they ended: a replica's bins
                # take its staged steps when it has 4,096, and that may widen every replica's bins,
                # so the runs must reach them in time order, as step by step
                replica = rows[i:, 0]
                cuts = np.flatnonzero(replica[1:] != replica[:-1]) + 1
                for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(block)], strict=True):
                    self._bins.add_block(int(replica[a]), block[a:b])
                i = k
        replica = rows[:, 0]
        for r in np.unique(replica).tolist():
            self._add_busy(int(r), rows[replica == r, 2].tolist())

    def on_request_columns(self, cols: dict[str, np.ndarray]) -> None:
        """Requests recorded elsewhere (``compiled_engine``) as the recorded ``REQUEST_SPEC`` columns
        (``state`` as ``RequestState`` values, ``reject_reason`` None where there is none)."""
        self._flush_requests()
        n = len(cols["request_id"])
        for name, dtype in _RECORDED_DTYPES:
            col = np.asarray(cols[name], dtype=dtype)
            if len(col) != n:
                raise ValueError(f"on_request_columns: column {name} has {len(col)} values for {n} requests")
            self._req_cols[name].append(col)
        self._num_requests += n

    def _record_into_bins(self) -> None:
        self.on_iteration = self._bin_iteration  # type: ignore[method-assign]

    def _past_bin_limit(self, k: int) -> bool:
        """``k`` more rows would outgrow the row buffer past ``bin_after``: time to bin."""
        return self.bin_after is not None and self._n_iters + k > max(len(self._iters), self.bin_after)

    def _switch_to_bins(self) -> None:
        """``bin_after`` reached: the rows so far into time bins, in the order they were recorded
        (per replica, as ``_bin_iteration`` would have added them), and bins from here on."""
        bins = IterationBins(self.num_replicas)
        rows = self._iters[: self._n_iters]
        sums = np.empty((len(rows), len(SUM_COLUMNS)), dtype=np.float64)
        sums[:, 0] = 1.0  # num_steps
        sums[:, 1:] = rows[:, 2:]  # duration as busy_s, then the same columns in the same order
        for r in range(self.num_replicas):
            mine = rows[:, 0] == r
            if mine.any():
                bins.add_many(r, rows[mine, 1], sums[mine])
        self._bins = bins
        self._iters = np.empty((0, len(ITERATION_COLUMNS)), dtype=np.float64)
        self._n_iters = 0
        self.iterations_mode = "binned"
        self.bin_after = None
        self._record_into_bins()

    def _stage_same(self, value: float, n: int) -> None:
        """``on_itl`` of n copies of ``value``."""
        j = self._itl_n
        if j + n > self._ITL_BUFFER:
            self._flush_itl()
            j = 0
            if n > self._ITL_BUFFER:
                self._itl_hist.add(np.full(n, value))
                return
        self._itl_buf[j : j + n] = value
        self._itl_n = j + n

    def _bin_iteration(self, replica: int, start: float, duration: float, batch: Batch, kv_blocks_used: int,
                       kv_blocks_total: int, num_waiting: int, num_running: int, num_swapped: int,
                       num_preempted: int, sched_overhead_s: float = math.nan) -> None:
        """``on_iteration`` into time bins (``iterations`` binned or off)."""
        self._busy[replica] += duration
        num_tokens = batch.num_tokens
        num_decode = batch.num_decode_tokens
        self._bins.add(replica, (  # type: ignore[union-attr]
            start, 1, duration, len(batch.num_new_tokens), num_tokens - num_decode, num_decode, num_tokens, kv_blocks_used,
            kv_blocks_total, num_waiting, num_running, num_swapped, num_preempted,
            len(batch.swap_out) + len(batch.swap_in), sched_overhead_s,
        ))  # fmt: skip

    def _decode_itls(self, starts: list[float], durations: list[float], n: int, first_itl: np.ndarray) -> None:
        """The stretch's ITLs as ``on_itl`` step by step would stage them: step 0's per row, then n
        copies of each later step's gap to the one before (its end minus the previous end), written
        a run of whole steps at a time and flushed where a step would not fit, as ``_stage_same``."""
        self.on_itl(first_itl)
        k = len(starts)
        if k < 2 or n <= 0:
            return
        ends = np.add(starts, durations)  # each step's end, the same float sums as start + duration
        gaps = ends[1:] - ends[:-1]
        buf = self._itl_buf
        size = self._ITL_BUFFER
        j = 0
        while j < k - 1:
            fit = min((size - self._itl_n) // n, k - 1 - j)  # whole steps the buffer holds as it is
            if fit == 0:  # (flushes first, or adds the step directly when it alone outgrows the buffer)
                self._stage_same(float(gaps[j]), n)
                j += 1
                continue
            i = self._itl_n
            buf[i : i + fit * n] = np.repeat(gaps[j : j + fit], n)
            self._itl_n = i + fit * n
            j += fit

    def _add_busy(self, replica: int, durations: list[float]) -> None:
        busy = self._busy[replica]
        for d in durations:  # one by one, as the plain loop's steps add them
            busy += d
        self._busy[replica] = busy

    def busy_by_replica(self) -> np.ndarray:
        """Seconds each replica spent in steps: the same in every iterations mode, fast-forward or not."""
        return np.array(self._busy)

    def iteration_summary(self) -> dict[str, float | int] | None:
        """The summary's iteration figures when iterations are binned or off (None: full rows)."""
        return None if self._bins is None else self._bins.summary()

    def on_itl(self, itl_seconds: np.ndarray) -> None:
        """Record the inter-token latencies (seconds) of the tokens emitted in one step."""
        n = len(itl_seconds)
        if n == 0:
            return
        j = self._itl_n
        if j + n > self._ITL_BUFFER:
            self._flush_itl()
            j = 0
            if n > self._ITL_BUFFER:
                self._itl_hist.add(itl_seconds)
                return
        self._itl_buf[j : j + n] = itl_seconds
        self._itl_n = j + n

    def _flush_itl(self) -> None:
        if self._itl_n:
            self._itl_hist.add(self._itl_buf[: self._itl_n])
            self._itl_n = 0

    def on_request_done(self, req: Request) -> None:
        """Record a request once, when it finishes or is rejected (the recorded ``REQUEST_SPEC`` columns)."""
        recs = self._requests
        recs.append(_record(req))
        if len(recs) == _REQUEST_CHUNK:
            self._flush_requests()

    def _flush_requests(self) -> None:
        recs = self._requests
        if not recs:
            return
        for (name, dtype), col in zip(_RECORDED_DTYPES, zip(*recs, strict=True), strict=True):
            self._req_cols[name].append(np.array(col, dtype=dtype))
        self._num_requests += len(recs)
        self._requests = []

    def request_columns(self) -> dict[str, np.ndarray]:
        """Every recorded request's ``REQUEST_SPEC`` recorded columns, in the order they were done
        (``state`` as ``RequestState`` values, ``reject_reason`` None where there is none)."""
        if self._released:
            raise RuntimeError("the request records went into requests_frame(release=True); read that frame")
        self._flush_requests()
        out = {}
        for name, dtype in _RECORDED_DTYPES:
            chunks = self._req_cols[name]
            if len(chunks) != 1:  # joined once, kept joined
                chunks[:] = [np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)]
            out[name] = chunks[0]
        return out

    def check_done(self, num_requests: int) -> None:
        """End-of-run check on the records: ``num_requests`` recorded, every finished one with all
        its output tokens, every rejected one with a reason, none left in another state."""
        cols = self.request_columns()
        if len(cols["request_id"]) != num_requests:
            raise AssertionError(f"{num_requests} requests submitted but {len(cols['request_id'])} recorded")
        state = cols["state"]
        fin = state == RequestState.FINISHED
        short = fin & (cols["num_output_tokens"] != cols["output_len"])
        if short.any():
            i = int(short.nonzero()[0][0])
            raise AssertionError(f"request {cols['request_id'][i]} finished with {cols['num_output_tokens'][i]} "
                                 f"of {cols['output_len'][i]} tokens")
        rejected = state == RequestState.REJECTED
        for i in rejected.nonzero()[0].tolist():
            if not cols["reject_reason"][i]:
                raise AssertionError(f"request {cols['request_id'][i]} rejected without a reason")
        other = ~(fin | rejected)
        if other.any():
            i = int(other.nonzero()[0][0])
            raise AssertionError(f"request {cols['request_id'][i]} left in state {RequestState(state[i]).name}")

    @property
    def itl_histogram(self) -> LogHistogram:
        """The inter-token latency histogram, with every recorded ITL in it."""
        self._flush_itl()
        return self._itl_hist

    @property
    def num_iterations(self) -> int:
        return self._n_iters if self._bins is None else int(self._bins.summary()["num_iterations"])

    def requests_frame(self, order: np.ndarray | None = None, release: bool = False) -> pd.DataFrame:
        """One row per recorded request (times in seconds, lengths in tokens), columns REQUEST_COLUMNS,
        in the order they were done, or rows ``order`` of that. ``release`` (with an order): the
        recorder lets go of each column once it is reordered, so the records are never held twice
        over (a million requests: ~100 MB less at the end of a run); its request records are gone
        after that."""
        data: dict[str, Any] = self.request_columns()
        if order is not None:
            for k in list(data):
                if release:
                    self._req_cols[k].clear()
                data[k] = data[k][order]  # (the recorder's column is freed here when released)
            self._released = release
        names = np.array([s.name.lower() for s in RequestState], dtype=object)
        data["state"] = names[data["state"]]
        for c in REQUEST_SPEC:
            if c.derive is not None:
                data[c.name] = c.derive(data)
            elif c.dtype == "object":
                data[c.name] = pd.Series(data[c.name], dtype=object)
            else:
                data[c.name] = np.asarray(data[c.name], dtype=c.dtype)
        # with an order every column is a fresh array (indexed or derived): the frame takes them as
        # they are instead of copying them again (a million requests: ~45 MB less at the end of a
        # run); without one some are the recorder's own columns, which the frame must not share
        return pd.DataFrame({k: data[k] for k in REQUEST_COLUMNS}, copy=order is None)

    def iterations_frame(self) -> pd.DataFrame:
        """One row per engine iteration (times in seconds, sizes in tokens / blocks / requests), or
        per time bin of them (``iterations`` binned; none when off)."""
        if self._bins is not None:
            return self._bins.frame()
        buf = self._iters[: self._n_iters]
        if self.num_replicas > 1:
            # in the order the steps ended: a replica's fast-forward records its steps when it
            # starts them, ahead of other replicas' steps that end in between; steps of several
            # replicas that end on one instant by replica (the order SimPy takes that instant's
            # events in depends on when they were scheduled, which a fast-forward changes)
            buf = buf[np.lexsort((buf[:, 0], buf[:, 1] + buf[:, 2]))]
        return pd.DataFrame(
            {
                name: buf[:, j].copy() if name in _FLOAT_ITER_COLUMNS else buf[:, j].astype(np.int64)
                for j, name in enumerate(ITERATION_COLUMNS)
            }
        )


def _stats_ms(values_s: np.ndarray, name: str) -> dict[str, float]:
    """mean/median/std/p90/p95/p99 in ms, vLLM key names; nan when there are no values."""
    v = np.asarray(values_s, dtype=np.float64) * 1e3
    if v.size == 0:
        return {
            f"{k}_{name}_ms": math.nan for k in ("mean", "median", "std", *(f"p{p}" for p in _PERCENTILES))
        }
    out = {f"mean_{name}_ms": float(np.mean(v)), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(np.std(v))}  # fmt: skip
    for p, x in zip(_PERCENTILES, np.percentile(v, _PERCENTILES), strict=True):
        out[f"p{p}_{name}_ms"] = float(x)
    return out


def _hist_stats_ms(hist: LogHistogram | None, name: str) -> dict[str, float]:
    if hist is None or hist.count == 0:
        return _stats_ms(np.zeros(0), name)
    qs = hist.quantile(np.array([0.5, *(p / 100 for p in _PERCENTILES)])) * 1e3
    out = {
        f"mean_{name}_ms": hist.mean * 1e3,
        f"median_{name}_ms": float(qs[0]),
        f"std_{name}_ms": hist.std * 1e3,
    }
    for p, x in zip(_PERCENTILES, qs[1:], strict=True):
        out[f"p{p}_{name}_ms"] = float(x)
    return out


def _div(a: float, b: float) -> float:
    return a / b if b > 0 and not math.isnan(b) else math.nan


def meets_slo(requests_df: pd.DataFrame, slo: Mapping[str, float] | None) -> np.ndarray:
    """Boolean per row: finished and every SLO target in ``slo`` (ms; keys ttft_ms, tpot_ms, e2el_ms) met.

    As in vLLM's ``--goodput``, a value meets its target when value <= target, and a request with
    one output token has no TPOT and passes the TPOT target.
    """
    ok = np.array(requests_df["state"] == "finished", dtype=bool)
    for key, target in (slo or {}).items():
        if key not in _SLO_KEYS:
            raise ValueError(f"unknown SLO key {key!r}; use one of {sorted(_SLO_KEYS)}")
        v = requests_df[_SLO_KEYS[key]].to_numpy(dtype=np.float64) * 1e3
        passes = v <= float(target)
        if key == "tpot_ms":
            passes |= requests_df["num_output_tokens"].to_numpy() <= 1
        ok &= passes
    return ok


def summarize(
    requests_df: pd.DataFrame,
    iterations_df: pd.DataFrame,
    itl_hist: LogHistogram | None = None,
    slo: Mapping[str, float] | None = None,
    duration_s: float | None = None,
    prefix_cache: tuple[int, int] | None = None,
    iteration_stats: Mapping[str, float | int] | None = None,
) -> dict[str, float | int]:
    """Summary of a run with vLLM ``benchmark_serving.py`` key names (latencies in ms, rates per s).

    Latency statistics use finished requests only; rejected requests count in ``rejected`` and fail
    every SLO in ``slo_attainment``. ``duration_s`` defaults to first arrival to last finish
    (seconds). ``prefix_cache`` is (prompt tokens looked up, tokens served from the cache), summed
    over replicas; without it the prefix-cache keys are nan. ``iteration_stats`` (the recorder's
    ``iteration_summary``, when iterations were binned or off) gives ``max_kv_usage``,
    ``mean_batch_size`` and ``num_iterations`` instead of ``iterations_df``. Values are plain Python ints/floats,
    nan where undefined; key order is fixed.
    """
    # the finished rows' columns, each selected on its own: a filtered frame would copy every
    # column (twice with the multi-token rows), ~290 MB at the end of a million-request run
    state = requests_df["state"].to_numpy()
    fin = state == "finished"
    completed = int(np.count_nonzero(fin))
    rejected = int(np.count_nonzero(state == "rejected"))

    def finished(name: str) -> np.ndarray:
        return requests_df[name].to_numpy()[fin]

    if duration_s is None:
        last = finished("finish_time").max() if completed else math.nan
        duration_s = float(last - requests_df["arrival_time"].min()) if completed else math.nan
    duration_s = float(duration_s)
    out_tokens = finished("num_output_tokens")
    total_in = int(finished("prompt_len").sum())
    total_out = int(out_tokens.sum())
    good = int(meets_slo(requests_df, slo).sum())

    s: dict[str, float | int] = {
        "completed": completed,
        "rejected": rejected,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "duration_s": duration_s,
        "request_throughput": _div(completed, duration_s),
        "request_goodput": _div(good, duration_s),
        "slo_attainment": _div(good, len(requests_df)),
        "output_throughput": _div(total_out, duration_s),
        "total_token_throughput": _div(total_in + total_out, duration_s),
    }
    # the latency columns' statistics, ITL (per token, from the histogram) after TPOT as vLLM prints it
    lat = LATENCY_COLUMNS
    s.update(_stats_ms(finished(lat["ttft"]), "ttft"))
    s.update(_stats_ms(finished(lat["tpot"])[out_tokens > 1], "tpot"))
    s.update(_hist_stats_ms(itl_hist, "itl"))
    s.update(_stats_ms(finished(lat["e2el"]), "e2el"))
    qd = finished(lat["queueing_delay"]).astype(np.float64, copy=False)
    s["mean_queueing_delay_ms"] = float(np.mean(qd) * 1e3) if completed else math.nan
    s["num_preemptions"] = int(requests_df["num_preemptions"].sum())
    s["preempted_requests"] = int((requests_df["num_preemptions"] > 0).sum())
    n_it = len(iterations_df)
    if iteration_stats is not None:  # binned or no iteration rows: the recorder kept the figures
        s.update({k: iteration_stats[k] for k in ("max_kv_usage", "mean_batch_size")})
        n_it = int(iteration_stats["num_iterations"])
    elif n_it:
        used = iterations_df["kv_blocks_used"].to_numpy(dtype=np.float64)
        total = iterations_df["kv_blocks_total"].to_numpy(dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            s["max_kv_usage"] = float(np.nanmax(np.where(total > 0, used / total, np.nan), initial=0.0))
        s["mean_batch_size"] = float(iterations_df["batch_size"].mean())
    else:
        s["max_kv_usage"] = math.nan
        s["mean_batch_size"] = math.nan
    s["num_iterations"] = n_it
    # vLLM's prefix_cache_hit_rate: cached prompt tokens over prompt tokens looked up
    queries, hits = prefix_cache if prefix_cache is not None else (0, math.nan)
    s["prefix_cache_hit_rate"] = _div(hits, queries)
    s["prefix_cache_hit_tokens"] = hits
    return s


def _jsonable(x: Any) -> Any:
    """Plain JSON values: numpy scalars unwrapped, nan/inf -> None, paths -> str."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple | np.ndarray):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Path):
        return str(x)
    return x


def to_json(obj: Any) -> str:
    """Deterministic JSON (insertion order, indent 2, NaN -> null, trailing newline)."""
    return json.dumps(_jsonable(obj), indent=2, allow_nan=False) + "\n"


def write_run(
    out_dir: str | Path,
    requests_df: pd.DataFrame,
    iterations_df: pd.DataFrame,
    summary: Mapping[str, Any],
    itl_hist: LogHistogram | None,
    extra: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write a run folder: requests.parquet, iterations.parquet, summary.json, itl_histogram.json.

    ``summary.json`` holds ``extra`` (run metadata: scenario, seed, scheduler...) first, then the
    summary keys, both in insertion order; a key in both is an error. Returns the written paths.
    """
    out = Path(out_dir)
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(summary))
    if clash:
        raise ValueError(f"write_run: extra keys {clash} clash with summary keys")
    paths = [
        out / "requests.parquet",
        out / "iterations.parquet",
        out / "summary.json",
        out / "itl_histogram.json",
    ]
    # summary.json is the folder's marker: removed first, written last (see sim/outputs.py)
    begin_folder(out, "summary.json")
    write_parquet(requests_df, paths[0])
    write_parquet(iterations_df, paths[1])
    write_text(paths[3], to_json((itl_hist or LogHistogram()).to_dict()))
    write_text(paths[2], to_json({**extra, **summary}))
    return paths


def load_run(out_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any], LogHistogram | None]:
    """Read a folder written by ``write_run``: (requests, iterations, summary dict, ITL histogram).

    JSON nulls in the summary come back as nan so numeric comparisons keep working.
    """
    d = Path(out_dir)
    summary = json.loads((d / "summary.json").read_text())
    summary = {k: (math.nan if v is None else v) for k, v in summary.items()}
    hist_path = d / "itl_histogram.json"
    hist = LogHistogram.from_dict(json.loads(hist_path.read_text())) if hist_path.exists() else None
    return pd.read_parquet(d / "requests.parquet"), pd.read_parquet(d / "iterations.parquet"), summary, hist


def _fmt(x: Any, spec: str = ".1f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def format_summary_table(summary: Mapping[str, Any]) -> str:
    """A compact human-readable table of a summary (latencies in ms, rates per second)."""
    g = summary.get
    lines = [
        f"requests: {g('completed', 0)} completed, {g('rejected', 0)} rejected in {_fmt(g('duration_s'), '.2f')} s",
        f"{'latency (ms)':<13}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for label, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2el")):
        cells = (g(f"{s}_{key}_ms") for s in ("mean", "median", "p90", "p99"))
        lines.append(f"{label:<13}" + "".join(f"{_fmt(c):>10}" for c in cells))
    rejected = g("rejected", 0) or 0
    # throughput counts the admitted requests only: a run that turned requests away must say so here
    admitted = f" (REJECTED {rejected} of {rejected + (g('completed', 0) or 0)} requests)" if rejected else ""
    lines.append(
        f"throughput: {_fmt(g('request_throughput'), '.2f')} req/s{admitted}, "
        f"{_fmt(g('output_throughput'))} output tok/s, {_fmt(g('total_token_throughput'))} total tok/s"
    )
    att = g("slo_attainment")
    att_s = "-" if att is None or (isinstance(att, float) and math.isnan(att)) else f"{100 * att:.1f}%"
    lines.append(f"goodput: {_fmt(g('request_goodput'), '.2f')} req/s (SLO attainment {att_s})")
    kv = g("max_kv_usage")
    kv_s = "-" if kv is None or (isinstance(kv, float) and math.isnan(kv)) else f"{100 * kv:.1f}%"
    lines.append(
        f"engine: {g('num_iterations', 0)} iterations, mean batch {_fmt(g('mean_batch_size'))}, "
        f"max KV {kv_s}, {g('num_preemptions', 0)} preemptions ({g('preempted_requests', 0)} requests)"
    )
    return "\n".join(lines)
