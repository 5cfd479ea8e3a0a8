"""Pictures of a run: latency CDFs, engine timelines, run-vs-run CDF overlays, latency vs rate.

Figures are built with ``matplotlib.figure.Figure`` and saved through the Agg canvas, never
through pyplot: no global backend switch, no window, safe in tests, notebooks and worker
processes. Long runs are binned by time before plotting so a million-iteration timeline still
draws in about a second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from .metrics import LogHistogram

# Above this many replicas the timeline shows the cluster sum instead of one line per replica.
MAX_REPLICA_LINES = 4
TIMELINE_BINS = 1500
DPI = 100  # pixels per inch of the saved PNGs
_LABELS = {
    "ttft": "TTFT",
    "tpot": "TPOT",
    "e2e": "E2E latency",
    "itl": "ITL",
    "queueing_delay": "queueing delay",
}


ECDF_POINTS = 4096  # most order statistics a CDF draws: a 1,000-pixel-wide panel shows no more


def _ecdf(ax: Axes, values_s: np.ndarray, label: str | None = None) -> bool:
    """Step CDF of finite positive values (seconds), drawn in ms. False when there is nothing to draw.

    Past ``ECDF_POINTS`` values the step is drawn through that many order statistics, evenly
    spaced in rank, the smallest and largest among them (each point still exactly on the CDF): a
    million requests' three CDFs drawn point by point took ~400 MB in matplotlib's paths."""
    v = np.sort(values_s[np.isfinite(values_s)])
    n = v.size
    if n == 0:
        return False
    if n > ECDF_POINTS:
        ranks = np.unique(np.linspace(0, n - 1, ECDF_POINTS).round().astype(np.int64))
        ax.step(v[ranks] * 1e3, (ranks + 1) / n, where="post", label=label)
    else:
        ax.step(v * 1e3, np.arange(1, n + 1) / n, where="post", label=label)
    if v[0] > 0 and v[-1] / v[0] > 20:
        ax.set_xscale("log")
    return True


def _finish_cdf_axes(ax: Axes, title: str, drew: bool) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests" if title != "ITL" else "fraction of tokens")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_xscale() == "log":  # labelled minor ticks on a short log axis run into each other
        ax.xaxis.set_minor_formatter(NullFormatter())
    if not drew:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _finished(requests_df: pd.DataFrame) -> pd.DataFrame:
    return requests_df[requests_df["state"] == "finished"]


def _plot_latency_cdfs(path: Path, requests_df: pd.DataFrame, itl_hist: LogHistogram | None) -> Path:
    fin = _finished(requests_df)
    fig = Figure(figsize=(10, 7), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    for ax, col in zip(axes[:3], ("ttft", "tpot", "e2e"), strict=True):
        _finish_cdf_axes(ax, _LABELS[col], _ecdf(ax, fin[col].to_numpy(dtype=np.float64)))
    ax = axes[3]
    drew = itl_hist is not None and itl_hist.count > 0
    if drew:
        edges, frac = itl_hist.cdf_points()
        ax.step(edges * 1e3, frac, where="post")
        if edges[0] > 0 and edges[-1] / edges[0] > 20:
            ax.set_xscale("log")
    _finish_cdf_axes(ax, "ITL", drew)
    rejected = int((requests_df["state"] == "rejected").sum())
    fig.suptitle(f"{len(fin)} finished requests, {rejected} rejected")
    fig.savefig(path, dpi=DPI)
    return path


def _binned(values: np.ndarray, cell: np.ndarray, shape: tuple[int, int],
            steps: np.ndarray | None = None) -> np.ndarray:
    """Mean of ``values`` per (replica, time bin) cell, as a matrix; nan where a cell is empty.
    ``steps``: how many steps each row stands for (a binned iterations table's rows are means)."""
    size = shape[0] * shape[1]
    if steps is None:
        n = np.bincount(cell, minlength=size)
        s = np.bincount(cell, weights=values, minlength=size)
    else:
        n = np.bincount(cell, weights=steps, minlength=size)
        s = np.bincount(cell, weights=values * steps, minlength=size)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, s / n, np.nan).reshape(shape)


def _plot_timeline(path: Path, it: pd.DataFrame) -> Path:
    panels = (
        ("batch size (requests)", ("batch_size",)),
        ("tokens per step", ("num_prefill_tokens", "num_decode_tokens")),
        ("KV blocks", ("kv_blocks_used", "kv_blocks_total")),
        ("waiting requests", ("num_waiting",)),
    )
    fig = Figure(figsize=(11, 11), layout="constrained")
    axes = fig.subplots(len(panels) + 1, 1, sharex=True)
    if len(it) == 0:
        for ax in axes:
            ax.text(0.5, 0.5, "no iterations", ha="center", va="center", transform=ax.transAxes)
        fig.savefig(path, dpi=DPI)
        return path

    t0, t1 = float(it["start"].min()), float((it["start"] + it["duration"]).max())
    # a binned table (servesim run --iterations binned): each row is the mean of num_steps steps
    steps = it["num_steps"].to_numpy(dtype=np.float64) if "num_steps" in it else None
    n_bins = int(min(TIMELINE_BINS, max(1, len(it) // max(1, it["replica"].nunique()))))
    edges = np.linspace(t0, max(t1, t0 + 1e-9), n_bins + 1)
    centres = 0.5 * (edges[:-1] + edges[1:])
    replicas, rep_idx = np.unique(it["replica"].to_numpy(), return_inverse=True)
    per_replica = len(replicas) <= MAX_REPLICA_LINES
    t_bin = np.clip(np.searchsorted(edges, it["start"].to_numpy(), side="right") - 1, 0, n_bins - 1)
    cell = rep_idx * n_bins + t_bin
    shape = (len(replicas), n_bins)
    # Each bin shows the mean over the iterations that started in it; with many replicas the
    # per-replica means are summed (an idle replica adds nothing) to show the cluster total.
    for ax, (title, cols) in zip(axes, panels, strict=False):
        for col in cols:
            m = _binned(it[col].to_numpy(dtype=np.float64), cell, shape, steps)
            ls = "--" if col == "kv_blocks_total" else "-"
            if per_replica:
                for r, y in zip(replicas, m, strict=True):
                    label = col if len(replicas) == 1 else f"{col} r{r}"
                    ax.plot(centres, y, lw=0.8, ls=ls, label=label)
            else:
                y = np.where(np.isnan(m).all(axis=0), np.nan, np.nansum(m, axis=0))
                ax.plot(centres, y, lw=0.8, ls=ls, label=f"{col} (sum)")
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
        if len(cols) > 1 or len(replicas) > 1:
            ax.legend(fontsize="small", loc="upper right")

    ax = axes[-1]
    order = np.argsort(it["start"].to_numpy(), kind="stable")
    t = it["start"].to_numpy()[order]
    cum = np.cumsum(it["num_preempted"].to_numpy()[order])
    idx = np.minimum(np.searchsorted(t, edges[1:], side="right"), len(t)) - 1
    ax.step(edges[1:], np.where(idx >= 0, cum[np.maximum(idx, 0)], 0), where="post")
    ax.set_ylabel("preemptions (cumulative)")
    ax.set_xlabel("time (s)")
    ax.grid(True, alpha=0.3)
    scope = "per replica" if per_replica else f"sum of {len(replicas)} replicas"
    count = f"{int(steps.sum())} iterations in {len(it)} bins" if steps is not None else f"{len(it)} iterations"
    fig.suptitle(f"{count}, {scope}, binned into {n_bins} time bins")
    fig.savefig(path, dpi=DPI)
    return path


def plot_run(
    out_dir: str | Path,
    requests_df: pd.DataFrame,
    iterations_df: pd.DataFrame,
    itl_hist: LogHistogram | None = None,
) -> list[Path]:
    """Write latency_cdf.png and timeline.png into ``out_dir``; returns their paths.

    The timeline draws one line per replica up to MAX_REPLICA_LINES replicas and the cluster sum
    above that; iterations are binned into at most TIMELINE_BINS time bins (mean per bin).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        _plot_latency_cdfs(out / "latency_cdf.png", requests_df, itl_hist),
        _plot_timeline(out / "timeline.png", iterations_df),
    ]


def plot_cdf_overlay(
    out_path: str | Path,
    frames: Mapping[str, pd.DataFrame],
    metrics: Sequence[str] = ("ttft", "tpot", "e2e"),
    itl_hists: Mapping[str, LogHistogram | None] | None = None,
) -> Path:
    """Overlaid CDFs (ms) of the finished requests of several runs, one panel per metric.

    ``frames`` maps a run label (e.g. "live", "sim") to its requests frame; ``metrics`` are
    requests-frame columns in seconds, or "itl", drawn per token from ``itl_hists`` (run label ->
    that run's ITL histogram).
    """
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(4.5 * len(metrics), 4), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(metrics)))
    for ax, col in zip(axes, metrics, strict=True):
        drew = False
        if col == "itl" and itl_hists is not None:
            lo, hi = np.inf, 0.0
            for label, hist in itl_hists.items():
                if hist is not None and hist.count > 0:
                    edges, frac = hist.cdf_points()
                    ax.step(edges * 1e3, frac, where="post", label=label)
                    lo, hi, drew = min(lo, edges[0]), max(hi, edges[-1]), True
            if drew and lo > 0 and hi / lo > 20:
                ax.set_xscale("log")
        else:
            for label, df in frames.items():
                drew |= _ecdf(ax, _finished(df)[col].to_numpy(dtype=np.float64), label=label)
        _finish_cdf_axes(ax, _LABELS.get(col, col), drew)
        if drew:
            ax.legend(fontsize="small")
    fig.savefig(out, dpi=DPI)
    return out


def plot_request_scatter(
    out_path: str | Path,
    measured: pd.DataFrame,
    simulated: pd.DataFrame,
    metrics: Sequence[str] = ("ttft", "e2e"),
    labels: tuple[str, str] = ("measured", "sim"),
) -> Path:
    """Each request's simulated latency against its measured one (ms), one panel per metric.

    Both frames hold the same requests in the same order (request_id); the diagonal is a perfect
    simulation, points above it were simulated too slow.
    """
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(4.5 * len(metrics), 4.3), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(metrics)))
    for ax, col in zip(axes, metrics, strict=True):
        x = measured[col].to_numpy(dtype=np.float64) * 1e3
        y = simulated[col].to_numpy(dtype=np.float64) * 1e3
        ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
        if ok.any():
            ax.scatter(x[ok], y[ok], s=8, alpha=0.6)
            lo, hi = min(x[ok].min(), y[ok].min()), max(x[ok].max(), y[ok].max())
            ax.plot([lo, hi], [lo, hi], color="grey", lw=1, ls="--", label="sim = measured")
            if hi / lo > 20:
                ax.set_xscale("log")
                ax.set_yscale("log")
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        name = _LABELS.get(col, col)
        ax.set_title(f"{name} per request")
        ax.set_xlabel(f"{labels[0]} {name} (ms)")
        ax.set_ylabel(f"{labels[1]} {name} (ms)")
        ax.grid(True, which="both", alpha=0.3)
    fig.savefig(out, dpi=DPI)
    return out


def plot_latency_vs_rate(
    out_path: str | Path,
    rows: pd.DataFrame,
    chosen_rate: float | None = None,
    rate_col: str = "request_rate",
    slo: Mapping[str, float] | None = None,
    hue: str | None = None,
    latencies: Sequence[str] = ("ttft", "tpot", "e2el"),
) -> Path:
    """p50/p99 TTFT, TPOT, E2E (ms) and goodput (req/s) against arrival rate (req/s).

    ``rows`` holds one summary per rate (``summarize`` keys plus ``rate_col``). ``chosen_rate``
    is marked with a vertical line; ``slo`` (ms; ttft_ms, tpot_ms, e2el_ms, itl_ms) draws the
    targets; ``hue`` names a column whose values get separate lines (e.g. the scheduler);
    ``latencies`` picks the latency panels (add "itl" for inter-token latency), goodput comes last.
    """
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    titles = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL (time between tokens)", "e2el": "E2E latency"}
    panels = [(titles.get(k, k), k, f"{k}_ms") for k in latencies]
    ncols = 2 if len(panels) + 1 <= 4 else 3
    nrows = -(-(len(panels) + 1) // ncols)
    fig = Figure(figsize=(5 * ncols, 3.5 * nrows), layout="constrained")
    all_axes = fig.subplots(nrows, ncols).ravel()
    for ax in all_axes[len(panels) + 1 :]:
        ax.set_visible(False)
    axes = all_axes[: len(panels) + 1]
    groups = [(None, rows)] if hue is None else list(rows.groupby(hue, sort=True))
    for ax, (title, key, slo_key) in zip(axes[:-1], panels, strict=True):
        for gi, (g, df) in enumerate(groups):
            df = df.sort_values(rate_col)
            prefix = "" if g is None else f"{g} "
            for stat, ls in (("median", "-"), ("p99", "--")):
                col = f"{stat}_{key}_ms"
                if col in df:
                    ax.plot(
                        df[rate_col],
                        df[col],
                        ls,
                        marker="o",
                        ms=3,
                        color=f"C{gi}",
                        label=f"{prefix}{stat.replace('median', 'p50')}",
                    )
        if slo and slo_key in slo:
            ax.axhline(slo[slo_key], color="red", lw=0.8, ls=":", label="SLO")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_ylabel("ms")
    ax = axes[-1]
    for gi, (g, df) in enumerate(groups):
        df = df.sort_values(rate_col)
        prefix = "" if g is None else f"{g} "
        if "request_goodput" in df:
            ax.plot(
                df[rate_col],
                df["request_goodput"],
                marker="o",
                ms=3,
                color=f"C{gi}",
                label=f"{prefix}goodput",
            )
        if "request_throughput" in df:
            ax.plot(df[rate_col], df["request_throughput"], ":", color=f"C{gi}", label=f"{prefix}throughput")
    ax.set_title("goodput")
    ax.set_ylabel("requests/s")
    for ax in axes:
        if chosen_rate is not None:
            ax.axvline(chosen_rate, color="black", lw=0.8, ls="-.", label=f"chosen {chosen_rate:g}/s")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.savefig(out, dpi=DPI)
    return out


def plot_sweep(
    out_path: str | Path,
    table: pd.DataFrame,
    grid_keys: Sequence[str],
    metrics: Sequence[tuple[str, str]] = (
        ("p99_ttft_ms", "p99 TTFT (ms)"),
        ("p99_tpot_ms", "p99 TPOT (ms)"),
        ("p99_itl_ms", "p99 ITL (ms)"),
        ("request_goodput", "goodput (requests/s)"),
    ),
) -> Path:
    """One bar per sweep point for each metric; bars are labelled with the point's grid values.

    Points are coloured by the first grid key, so one axis of the grid reads as groups of bars.
    Failed points have no bar and an "x" at the axis. A point that rejected requests has a hatched
    bar labelled with the count: its latencies and goodput leave those requests out.
    """
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = len(table)
    fig = Figure(figsize=(max(8.0, 0.45 * n * 2 + 2), 7), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    short = [k.rsplit(".", 1)[-1] for k in grid_keys]
    labels = ["\n".join(f"{s}={r[k]}" for s, k in zip(short, grid_keys, strict=True)) for _, r in table.iterrows()]
    groups = list(dict.fromkeys(table[grid_keys[0]].tolist())) if grid_keys else []
    colors = [f"C{groups.index(v) % 10}" for v in table[grid_keys[0]]] if grid_keys else ["C0"] * n
    ok = (table["status"] == "ok").to_numpy() if "status" in table else np.ones(n, dtype=bool)
    x = np.arange(n)
    rejected = table["rejected"].fillna(0).to_numpy(dtype=np.float64) if "rejected" in table else np.zeros(n)
    for ax, (col, title) in zip(axes, metrics, strict=False):
        y = table[col].to_numpy(dtype=np.float64) if col in table else np.full(n, np.nan)
        bars = ax.bar(x[ok], np.nan_to_num(y[ok]), color=[c for c, k in zip(colors, ok, strict=True) if k])
        for bar, r in zip(bars, rejected[ok], strict=True):
            if r > 0:
                bar.set_hatch("//")
                ax.annotate(f"{int(r)} rej.", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize="x-small", color="red")
        if (rejected[ok] > 0).any():
            ax.bar([0], [0], color="white", edgecolor="black", hatch="//", label="rejected requests")
        if (~ok).any():
            ax.plot(x[~ok], np.zeros((~ok).sum()), "x", color="red", label="failed")
        if (~ok).any() or (rejected[ok] > 0).any():
            ax.legend(fontsize="small")
        ax.set_title(title)
        ax.set_xticks(x, labels, fontsize="x-small", rotation=90 if n > 8 else 0)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"sweep over {', '.join(grid_keys)} ({n} points)")
    fig.savefig(out, dpi=DPI)
    return out
