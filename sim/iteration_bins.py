"""Engine iterations kept as time bins instead of one row per step (``--iterations binned|off``).

A run of millions of steps would hold ~120 bytes a step as full rows. Here each replica's steps
are added into time bins of one width (seconds, starting at 0.01 and doubling, neighbours
merged, whenever a step starts past the last bin), so memory stays a few MB whatever the length
of the run. The summary's iteration figures (step count, mean batch size, peak KV usage) are
kept exactly on the side, so ``summary.json`` is the same in every mode.

A binned frame has the columns of the full one: ``start`` and ``duration`` are the bin's, the
per-step levels (batch size, tokens, KV blocks, queue lengths) are means over the steps that
started in the bin, ``num_preempted`` and ``num_swap_blocks`` are sums, and ``num_steps`` says how
many steps the row stands for (``busy_s``: their summed durations).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

# per-bin sums, in this order; every one is a mean per step in the frame except the SUMMED ones
SUM_COLUMNS = (
    "num_steps", "busy_s", "batch_size", "num_prefill_tokens", "num_decode_tokens", "num_tokens",
    "kv_blocks_used", "kv_blocks_total", "num_waiting", "num_running", "num_swapped", "num_preempted",
    "num_swap_blocks", "sched_overhead_s",
)  # fmt: skip
SUMMED = frozenset({"num_steps", "busy_s", "num_preempted", "num_swap_blocks"})
_START_WIDTH = 0.01  # seconds
_BINS = 2048  # per replica; the width doubles when a step starts past the last one
_PENDING = 4096  # steps staged before they are added to the bins


class IterationBins:
    """Per-replica time bins of iteration records, plus the exact summary figures."""

    def __init__(self, num_replicas: int, keep_bins: bool = True) -> None:
        self.keep_bins = keep_bins
        self.width = _START_WIDTH
        self._inv = 1.0 / self.width
        self.sums = np.zeros((num_replicas, _BINS if keep_bins else 1, len(SUM_COLUMNS)), dtype=np.float64)
        self.num_steps = 0
        self.batch_size_total = 0
        self.max_kv_usage = 0.0  # summarize's nanmax starts at 0 too
        # staged steps per replica: rows already written into a block (``_staged[r]`` of them, in
        # ``_blocks[r]``, made at a replica's first stretch), then tuples added after them
        self._pending: list[list[tuple[float, ...]]] = [[] for _ in range(num_replicas)]
        self._blocks: list[np.ndarray | None] = [None] * num_replicas
        self._staged = [0] * num_replicas

    def add(self, replica: int, row: tuple[float, ...]) -> None:
        """One step: ``row`` holds its start (seconds), then SUM_COLUMNS' values for it (num_steps 1,
        busy_s its duration). Staged as tuples and added a few thousand at a time."""
        pending = self._pending[replica]
        pending.append(row)
        if len(pending) + self._staged[replica] == _PENDING:
            self._flush(replica)

    def add_block(self, replica: int, rows: np.ndarray) -> None:
        """Several steps of one replica, ``rows[j]`` as ``add`` takes step j's row, staged in the same
        order and added at the same points: a stretch of steps bins exactly as its steps one by one
        would (the bins' float sums are added in the same groups)."""
        block = self._blocks[replica]
        if block is None:
            block = self._blocks[replica] = np.empty((_PENDING, 1 + len(SUM_COLUMNS)), dtype=np.float64)
        self._settle(replica)
        i, k = 0, len(rows)
        while i < k:
            f = self._staged[replica]
            m = min(_PENDING - f, k - i)
            block[f : f + m] = rows[i : i + m]
            self._staged[replica] = f + m
            i += m
            if f + m == _PENDING:
                self._flush(replica)

    def _settle(self, replica: int) -> None:
        """Write the replica's staged tuples into its block, after the rows there."""
        pending = self._pending[replica]
        if pending:
            f = self._staged[replica]
            self._blocks[replica][f : f + len(pending)] = pending  # type: ignore[index]
            self._staged[replica] = f + len(pending)
            self._pending[replica] = []

    def _flush(self, replica: int) -> None:
        if self._blocks[replica] is None:
            pending = self._pending[replica]
            if not pending:
                return
            block = np.array(pending, dtype=np.float64)
            self._pending[replica] = []
        else:
            self._settle(replica)
            block = self._blocks[replica][: self._staged[replica]]  # type: ignore[index]
            self._staged[replica] = 0
            if not len(block):
                return
        self.add_many(replica, block[:, 0], block[:, 1:])

    def add_many(self, replica: int, starts: np.ndarray, rows: np.ndarray) -> None:
        """Several steps of one replica at once; ``rows`` is (steps, SUM_COLUMNS)."""
        self.num_steps += len(rows)
        self.batch_size_total += int(rows[:, 2].sum())
        total = rows[:, 7]
        if (total > 0).any():
            self.max_kv_usage = max(self.max_kv_usage, float((rows[:, 6][total > 0] / total[total > 0]).max()))
        if self.keep_bins:
            while int(starts[-1] * self._inv) >= _BINS:
                self._coarsen()
            b = (starts * self._inv).astype(np.int64)  # in time order: equal bins are neighbours
            cut = np.flatnonzero(np.diff(b)) + 1
            heads = np.concatenate(([0], cut))
            self.sums[replica, b[heads]] += np.add.reduceat(rows, heads, axis=0)

    def _coarsen(self) -> None:
        s = self.sums
        half = _BINS // 2
        s[:, :half] = s[:, 0::2] + s[:, 1::2]
        s[:, half:] = 0.0
        self.width *= 2
        self._inv = 1.0 / self.width

    def flush(self) -> None:
        """Add every staged step (before reading the bins or the summary)."""
        for replica in range(len(self._pending)):
            self._flush(replica)

    def summary(self) -> dict[str, float | int]:
        """The iteration keys of ``metrics.summarize``, exactly as it computes them from full rows."""
        self.flush()
        n = self.num_steps
        return {
            "max_kv_usage": float(self.max_kv_usage) if n else math.nan,
            "mean_batch_size": self.batch_size_total / n if n else math.nan,
            "num_iterations": n,
        }

    def frame(self) -> pd.DataFrame:
        """One row per nonempty (replica, bin), in time order; see the module docstring."""
        self.flush()
        if not self.keep_bins:
            return pd.DataFrame({c: np.zeros(0) for c in ("replica", "start", "duration", *SUM_COLUMNS)})
        rep, b = (self.sums[:, :, 0] > 0).nonzero()
        order = np.lexsort((rep, b))
        rep, b = rep[order], b[order]
        cells = self.sums[rep, b]
        steps = cells[:, 0]
        data: dict[str, np.ndarray] = {
            "replica": rep.astype(np.int64),
            "start": b * self.width,
            "duration": np.full(len(b), self.width),
        }
        for j, name in enumerate(SUM_COLUMNS):
            col = cells[:, j]
            data[name] = col.astype(np.int64) if name == "num_steps" else col if name in SUMMED else col / steps
        return pd.DataFrame(data)
