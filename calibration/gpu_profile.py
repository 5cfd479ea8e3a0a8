"""Assemble a ``servesim-gpu-profile/1`` from public kernel measurements, with held-out error.

``servesim calibrate import`` reads the sources (``importers``), builds the tables the
``LayerCostModel`` interpolates, and measures how well they predict measurements they were not
built from:

- token tables (dense ops, LM head, sampler): a seeded 20 % of each table's interior points is
  held out; the table is rebuilt from the rest and predicts them;
- attention: a seeded 20 % of the measured 4-D points is removed, the grid rebuilt and gap-filled
  from the rest, and it predicts them; the uniform-batch times of ``skew.csv`` (other contexts,
  other sessions) are a second held-out set;
- skew alpha: fitted on a seeded 80 % of ``skew.csv``, scored on the other 20 %.

Each component is also fitted the physical way (non-negative least squares on relative error over
features: a constant, tokens, tile-padded tokens for GEMMs; rows, KV tokens, query-key pairs for
attention) and scored on the same held-out points. The fit replaces the table (tabulated on the
table's grid) only when its held-out median and p90 APE are both lower; both scores are stored.
A *step* error per regime (decode,
prefill, mixed) composes each held-out attention shape with its token and sequence costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import isotonic_regression, nnls
from servesim.sim.layer_cost_model import (
    ATTENTION_AXES,
    EXTRAPOLATION,
    EXTRAPOLATION_ROOFLINE,
    GPU_PROFILE_FORMAT,
    INTERPOLATIONS,
    AttentionGrid,
    AttentionShape,
    Curve,
    LayerCostModel,
    allreduce_seconds,
    shape_terms,
)
from servesim.sim.presets import ModelConfig

from .importers import SourceError

HOLDOUT = 0.2
SEED = 0
TILE = 64
# Decode batch-size buckets of the skew alpha (upper edges), as LLMServingSim buckets them.
# Gaps are filled along cached prefill context, then decode context, then chunk, then decode rows:
# the order with the lowest held-out error on the RTX PRO 6000 Llama-3.1-8B sweep (mixed p90 9.3 %
# vs 13.0 % for decode context first, 25 % for decode rows first).
FILL_ORDER = (1, 3, 0, 2)
SKEW_N_EDGES = (2, 4, 8, 16, 32, 64, 128, 256, 1 << 20)
SKEW_RATIO_EDGES = (0.05, 0.15, 0.4, 0.7, 1.01)  # (mean - min) / (max - min) of the decode contexts
# the longest decode context, a bucket per power of two (four coarser buckets held out 9.7-13.4 %
# p90 on the five LLMServingSim tables, these with the two prefill axes below 5.6-7.9 %)
SKEW_KV_EDGES = (256, 512, 1024, 2048, 4096, 8192, 16384, 1 << 30)
# the step's prefill chunk (0: a decode-only step) and that chunk's cached context: in a mixed step
# FA2 runs the chunk's thread blocks beside the decode rows', so how much the longest decode row
# shows depends on how much prefill work there is to hide it
SKEW_PC_EDGES = (0, 64, 512, 1 << 30)
SKEW_KP_EDGES = (0, 1024, 4096, 1 << 30)


# ---- error summaries ----


def ape_summary(pred: np.ndarray, meas: np.ndarray) -> dict[str, float | int]:
    """Median, p90 and max absolute percentage error (fractions) and the count."""
    pred, meas = np.asarray(pred, dtype=float), np.asarray(meas, dtype=float)
    if len(meas) == 0:
        return {"n": 0}
    ape = np.abs(pred - meas) / meas
    return {"n": int(len(ape)), "median_ape": round(float(np.median(ape)), 5),
            "p90_ape": round(float(np.quantile(ape, 0.9)), 5), "max_ape": round(float(ape.max()), 5)}


def split_mask(n: int, holdout: float = HOLDOUT, seed: int = SEED, keep_ends: bool = True) -> np.ndarray:
    """Boolean mask of held-out positions among ``n`` (seeded; the first and last kept in training)."""
    rng = np.random.default_rng(seed)
    candidates = np.arange(1, n - 1) if keep_ends else np.arange(n)
    k = int(round(holdout * len(candidates)))
    mask = np.zeros(n, dtype=bool)
    mask[rng.choice(candidates, size=k, replace=False)] = True
    return mask


def nnls_relative(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """argmin_c>=0 sum(((x c - t) / t)^2), columns scaled for conditioning."""
    a = x / t[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(a / scale, np.ones(len(t)))
    return coef / scale


# ---- one-axis tables (tokens, sequences) ----


def token_features(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    return np.stack([np.ones_like(x), x, np.ceil(x / TILE) * TILE], axis=1)


@dataclass
class CurveCheck:
    """Held-out error of one measured curve: the table and the physics fit."""

    table: dict[str, Any]
    fit: dict[str, Any]

    @property
    def method(self) -> str:
        return "fit" if fit_wins(self.table, self.fit) else "table"


def fit_wins(table: dict[str, Any], fit: dict[str, Any]) -> bool:
    """The physics fit replaces the table only when its held-out median AND p90 APE are both lower."""
    return all(fit.get(k, math.inf) < table.get(k, math.inf) for k in ("median_ape", "p90_ape"))


def check_curve(xs: np.ndarray, ys: np.ndarray, seed: int = SEED) -> tuple[CurveCheck, np.ndarray, np.ndarray]:
    """(errors, held-out x, table prediction at them) for one curve."""
    if len(xs) < 5:
        return CurveCheck({"n": 0}, {"n": 0}), np.zeros(0), np.zeros(0)
    held = split_mask(len(xs), seed=seed)
    table = Curve(xs[~held].tolist(), ys[~held].tolist())
    pred_t = np.array([table(x) for x in xs[held]])
    coef = nnls_relative(token_features(xs[~held]), ys[~held])
    pred_f = token_features(xs[held]) @ coef
    return CurveCheck(ape_summary(pred_t, ys[held]), ape_summary(pred_f, ys[held])), xs[held], pred_t


def monotone_seconds(seconds: np.ndarray) -> np.ndarray:
    """Times by ascending message size as the least-squares monotone curve through them (isotonic
    regression). NCCL's medians below 1 MiB jump between ~15 and ~60 us from one size to the next
    (Vidur's DGX tables); held out on those tables (TP 2/4/8, H100 and A100; median / p90 APE %),
    a running maximum carried the first high one on to every size after it (H100 0.31 / 23.7 at
    TP 8, A100 2.81 / 14.0 at TP 2), the lower envelope put every dip under all smaller sizes
    (H100 TP 4 0.34 / 61.8); this 0.31-1.25 / 2.8-21.3, the best p90 on four of the six."""
    return isotonic_regression(np.asarray(seconds, dtype=float)).x


def check_allreduce(sizes: np.ndarray, seconds: np.ndarray, seed: int = SEED) -> dict[str, Any]:
    """Held-out error of a measured all-reduce table as the profile reads it: a fifth of the
    message sizes left out, the rest made monotone (``monotone_seconds``) and read log-log
    (``allreduce_seconds``), against the left-out sizes' own medians."""
    xs, ys = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    if len(xs) < 5:
        return {"n": 0}
    held = split_mask(len(xs), seed=seed)
    train = {"type": "table", "count": 1, "bytes_per_token": 1.0, "bytes": xs[~held].tolist(),
             "seconds": monotone_seconds(ys[~held]).tolist()}
    return ape_summary(allreduce_seconds(train, xs[held]), ys[held])


def tabulate_fit(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    return token_features(xs) @ nnls_relative(token_features(xs), ys)


# ---- attention grid ----


@dataclass
class Grid:
    axes: dict[str, list[int]]
    seconds: np.ndarray
    measured: int
    filled: int
    interpolation: str = "linear"  # how gaps were filled and how LayerCostModel reads between nodes
    # the roofline's one-layer attention term for this model and GPU (cost_model.
    # reading_attention_shape), which the "roofline" reading needs; None: that reading is not offered
    shape: AttentionShape | None = None


def attention_grid(att: pd.DataFrame, axes: dict[str, list[int]] | None = None,
                   interpolation: str = "linear", shape: AttentionShape | None = None,
                   where: str = "attention table") -> Grid:
    """The product grid of every value each axis was measured at, gaps filled (``fill_gaps``).

    LLMServingSim's sweep is the union of a doubling grid and a 1.5x-spaced one, so most
    combinations of the two are unmeasured; they are filled along the smooth context axes, which
    keeps every measured chunk size as a node: attention over a long cached context steps with the
    number of thread-block waves of the chunk (on the RTX PRO 6000 it is flat from 16 to 273 tokens
    and doubles by 410), which no interpolation between 256 and 512 would reproduce.

    ``interpolation`` "roofline" (needs ``shape``): nodes with a chunk are filled as the ratio of the
    time to the roofline's attention term at that node, so the roofline's thread-block waves shape a
    gap between measured chunk sizes; nodes without one are filled linearly in time.

    ``where`` (the source file) starts the message of a ``SourceError``.
    """
    axes = axes or {a: sorted(int(v) for v in set(att[a])) for a in ATTENTION_AXES}
    for name, ax in axes.items():
        if len(ax) < 3 or ax[0] != 0:
            raise SourceError(f"{where}: axis {name} needs 0 and at least two more values, has {ax}")
    idx = [np.searchsorted(axes[a], att[a].to_numpy()) for a in ATTENTION_AXES]
    arr = np.full(tuple(len(axes[a]) for a in ATTENTION_AXES), np.nan)
    arr[tuple(idx)] = att["seconds"].to_numpy()
    measured = int(np.isfinite(arr).sum())
    term = None
    if interpolation == "roofline":
        if shape is None:
            raise SourceError(f"{where}: the 'roofline' reading needs the roofline's attention term")
        term = shape_terms([axes[a] for a in ATTENTION_AXES], shape)
        arr[1:] /= term  # a chunk's times as ratios; the slices are filled independently (fill_gaps)
    arr = fill_gaps(arr, [np.asarray(axes[a], dtype=float) for a in ATTENTION_AXES],
                    "log" if interpolation == "log" else "linear", where)
    if term is not None:
        arr[1:] *= term
    return Grid(axes, arr, measured, int(arr.size - measured), interpolation, shape)


def fill_gaps(arr: np.ndarray, axes: list[np.ndarray], interpolation: str = "linear",
              where: str = "attention table") -> np.ndarray:
    """Fill unmeasured grid points so the table is a full product grid.

    Shapes that cannot occur are copies (no chunk: cached prefill context is moot; no decodes:
    decode context is moot; a decode with no context: the first context). Every other gap is
    filled between its two nearest measured neighbours along an axis (linear in the axis, or a
    power law for ``interpolation`` "log"; axes tried in ``FILL_ORDER``), repeated
    until nothing more fills that way; only then are points beyond a line's last measured one
    extended linearly along its last step (the KV-budget corners the profiler could not fit on
    the GPU), and the rest copied from the nearest measured point of their line.
    """
    a = arr.copy()
    a[0, :] = a[0, :1]  # no chunk: kv_prefill moot
    a[:, :, 0, :] = a[:, :, 0, :1]  # no decodes: kv_decode moot
    a[:, :, 1:, 0] = a[:, :, 1:, 1]  # a decode row with no context: as the first context
    a[0, 0, 0, :] = np.nanmin(a)  # the empty step is never priced
    order = FILL_ORDER
    for mode in ("inside", "inside", "beyond", "inside", "beyond", "nearest"):
        while True:
            before = int(np.isnan(a).sum())
            for axis in order:
                # 0 on the chunk, decode-row and decode-context axes means "absent": not an anchor
                lo = 0 if axis == 1 else 1
                sl = (slice(None),) * axis + (slice(lo, None),)
                a[sl] = np.apply_along_axis(_fill_line, axis, a[sl], axes[axis][lo:], mode, interpolation)
            if mode != "inside" or not before or int(np.isnan(a).sum()) == before:
                break
        if not np.isnan(a).any():
            break
    if np.isnan(a).any():
        raise SourceError(f"{where}: {int(np.isnan(a).sum())} grid points could not be filled")
    return a


def _fill_line(y: np.ndarray, xs: np.ndarray, mode: str, interpolation: str = "linear") -> np.ndarray:
    ok = np.flatnonzero(np.isfinite(y))
    if len(ok) == len(y) or not len(ok):
        return y
    y = y.copy()
    lx = np.log(np.maximum(xs, 1.0))
    for i in np.flatnonzero(~np.isfinite(y)):
        lo, hi = ok[ok < i], ok[ok > i]
        if len(lo) and len(hi):  # between measured points: linear (or a power law) in the axis
            j, k = lo[-1], hi[0]
            if interpolation == "linear":
                y[i] = y[j] + (y[k] - y[j]) * (xs[i] - xs[j]) / (xs[k] - xs[j])
            else:
                w = (lx[i] - lx[j]) / (lx[k] - lx[j]) if lx[k] > lx[j] else 0.0
                y[i] = y[j] ** (1 - w) * y[k] ** w
        elif mode == "beyond" and len(lo) >= 2:  # past the last: linear along the last measured step
            j, k = lo[-2], lo[-1]
            y[i] = y[k] + max(y[k] - y[j], 0.0) * (xs[i] - xs[k]) / (xs[k] - xs[j])
        elif mode == "nearest":
            y[i] = y[lo[-1]] if len(lo) else y[hi[0]]
    return y


def attention_regime(pc: np.ndarray, n: np.ndarray) -> np.ndarray:
    return np.where(pc == 0, "decode", np.where(n == 0, "prefill", "mixed"))


def attention_features(pc: np.ndarray, kp: np.ndarray, n: np.ndarray, kv: np.ndarray) -> np.ndarray:
    """Physical terms of one attention call: launch, chunk tokens, query-key pairs, cached KV the
    chunk reads, decode rows, decode KV read."""
    pc, kp, n, kv = (np.asarray(v, dtype=float) for v in (pc, kp, n, kv))
    return np.stack([np.ones_like(pc), pc, pc * (kp + (pc + 1) / 2), (pc > 0) * kp, n, n * kv], axis=1)


def check_attention(grid: Grid, att: pd.DataFrame, seed: int = SEED) -> tuple[dict[str, Any], pd.DataFrame]:
    """Held-out APE per regime of the table and of a per-regime NNLS fit.

    A seeded ``HOLDOUT`` of the measured points of each regime is removed, the grid is rebuilt (and gap-filled,
    with ``grid.interpolation``) from the rest on the same axes, and both predict the removed points.
    """
    regime = attention_regime(att["prefill_chunk"].to_numpy(), att["n_decode"].to_numpy())
    held = np.zeros(len(att), dtype=bool)
    for r in ("decode", "prefill", "mixed"):  # stratified, so a small regime is tested too
        idx = np.flatnonzero(regime == r)
        held[idx] = split_mask(len(idx), seed=seed, keep_ends=False)
    train, test = att.loc[~held].reset_index(drop=True), att.loc[held].reset_index(drop=True)
    table = AttentionGrid(grid.axes, attention_grid(train, grid.axes, grid.interpolation, grid.shape).seconds,
                          grid.interpolation, grid.shape)
    cols = [test[a].to_numpy() for a in ATTENTION_AXES]
    pred_t = np.array([table(*row) for row in zip(*cols, strict=True)])
    reg_h = attention_regime(test["prefill_chunk"].to_numpy(), test["n_decode"].to_numpy())
    reg_t = attention_regime(train["prefill_chunk"].to_numpy(), train["n_decode"].to_numpy())
    pred_f = np.full(len(test), np.nan)
    for r in ("decode", "prefill", "mixed"):
        tr, te = reg_t == r, reg_h == r
        if tr.sum() < 6 or not te.any():
            continue
        x = attention_features(*(train.loc[tr, a].to_numpy() for a in ATTENTION_AXES))
        coef = nnls_relative(x, train.loc[tr, "seconds"].to_numpy())
        pred_f[te] = attention_features(*(test.loc[te, a].to_numpy() for a in ATTENTION_AXES)) @ coef
    meas = test["seconds"].to_numpy()
    out: dict[str, Any] = {}
    for r in ("decode", "prefill", "mixed"):
        m = reg_h == r
        out[r] = {"table": ape_summary(pred_t[m], meas[m]),
                  "fit": ape_summary(pred_f[m], meas[m]) if np.isfinite(pred_f[m]).all() else {"n": 0}}
    return out, test.assign(regime=reg_h, predicted=pred_t)


def choose_interpolation(grid: Grid, att: pd.DataFrame) -> tuple[Grid, dict[str, Any], pd.DataFrame, dict[str, Any]]:
    """The grid filled and read with whichever of ``INTERPOLATIONS`` predicts held-out points better
    (lower sum over regimes of median + p90 APE), its held-out errors and scored points, and the
    scores of every candidate.

    Linear in time between neighbours is exact for the KV read (linear in rows and context) and a
    chord of the quadratic causal prefill; a power law between neighbours is exact for a pure power
    law but overshoots anything with a launch floor (a + b x): on LLMServingSim's five RTX tables it
    held out 0.5-4 % high on median where linear holds out within 0.4 % (``held_out_error``).
    """
    scores: dict[str, Any] = {}
    best = None
    for mode in INTERPOLATIONS:
        if mode == "roofline" and grid.shape is None:
            continue
        g = grid if grid.interpolation == mode else attention_grid(att, grid.axes, mode, grid.shape)
        err, scored = check_attention(g, att)
        cost = sum(e["table"]["median_ape"] + e["table"]["p90_ape"] for e in err.values() if e["table"].get("n"))
        scores[mode] = {r: e["table"] for r, e in err.items()}
        if best is None or cost < best[0]:
            best = (cost, g, err, scored)
    _cost, g, err, scored = best
    return g, err, scored, {"chosen": g.interpolation, "method": "lower held-out median + p90 APE summed over regimes",
                            "candidates": scores}


def tabulate_attention_fit(grid: Grid, att: pd.DataFrame, regime: str) -> None:
    """Replace the grid's ``regime`` points by the NNLS fit to every measured point of that regime."""
    reg = attention_regime(att["prefill_chunk"].to_numpy(), att["n_decode"].to_numpy())
    m = reg == regime
    coef = nnls_relative(attention_features(*(att.loc[m, a].to_numpy() for a in ATTENTION_AXES)),
                         att.loc[m, "seconds"].to_numpy())
    mesh = np.meshgrid(*(np.asarray(grid.axes[a], dtype=float) for a in ATTENTION_AXES), indexing="ij")
    pc, n = mesh[0], mesh[2]
    on = (attention_regime(pc, n) == regime) & ((pc > 0) | (n > 0)) & ((n == 0) | (mesh[3] > 0))
    fitted = attention_features(*(x[on] for x in mesh)) @ coef
    grid.seconds[on] = np.maximum(fitted, 1e-7)


# ---- skew ----


def skew_buckets(n: np.ndarray, ratio: np.ndarray, kv_max: np.ndarray, pc: np.ndarray,
                 kp: np.ndarray) -> tuple[np.ndarray, ...]:
    """Bucket indices (rows, ratio, longest context, prefill chunk, its cached context) of decode
    batches, as ``SkewAlpha`` looks them up."""
    return tuple(np.searchsorted(np.asarray(edges), x) for edges, x in (
        (SKEW_N_EDGES, n), (SKEW_RATIO_EDGES, ratio), (SKEW_KV_EDGES, kv_max), (SKEW_PC_EDGES, pc), (SKEW_KP_EDGES, kp)))


def _bucket_alpha(buckets: tuple[np.ndarray, ...], dy: np.ndarray, dx: np.ndarray, w: np.ndarray,
                  shape: tuple[int, ...]) -> np.ndarray:
    """alpha for every cell of ``shape`` (rows, ratio, longest, chunk, cached): weighted least squares
    of ``dy`` on ``dx`` over the training rows in the cell; a cell with fewer than 3 takes the
    alpha of its coarser bucket, the axes dropped from the last (cached context, then chunk,
    longest, ratio, rows), always within decode-only or mixed steps (chunk bucket 0 or not)."""
    mixed = (buckets[3] > 0).astype(np.int64)
    keys = (mixed, *buckets[:3], *buckets[3:])  # (mixed, rows, ratio, longest, chunk, cached)
    cells = np.stack(np.meshgrid(*(np.arange(k) for k in shape), indexing="ij"), axis=-1).reshape(-1, len(shape))
    cell_keys = np.concatenate([(cells[:, 3:4] > 0).astype(np.int64), cells], axis=1)  # keys' order
    alpha = np.full(len(cells), np.nan)
    for depth in range(len(keys), 0, -1):
        rows = np.stack(keys[:depth], axis=1)
        cell = cell_keys[:, :depth]
        uniq, inv = np.unique(rows, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        num = np.bincount(inv, weights=w * dy * dx, minlength=len(uniq))
        den = np.bincount(inv, weights=w * dx * dx, minlength=len(uniq))
        cnt = np.bincount(inv, minlength=len(uniq))
        found = {tuple(u): num[i] / den[i] for i, u in enumerate(uniq) if cnt[i] >= 3 and den[i] > 0}
        for c in np.flatnonzero(np.isnan(alpha)):
            a = found.get(tuple(cell[c]))
            if a is not None:
                alpha[c] = a
    return np.clip(np.round(np.nan_to_num(alpha), 4), -1.0, 2.0).reshape(shape)


def fit_skew(skew: pd.DataFrame, grid: AttentionGrid, seed: int = SEED) -> tuple[dict[str, Any], dict[str, Any]]:
    """(profile ``skew`` section, held-out errors). alpha per (rows, ratio, longest context,
    prefill chunk, its cached context) bucket, by least squares in relative terms (each row weighted
    by 1 / t_skew^2) of t_skew - t_mean on t_max - t_mean, the file's measured uniform batches, over
    a seeded 80 % of the rows; a bucket with fewer than 3 training rows takes a coarser bucket's
    alpha (``_bucket_alpha``). The simulator prices a skewed batch as A(mean) + alpha (A(longest) -
    A(mean)), A the attention grid's reading of a uniform batch: ``skew_full_model`` scores that.

    alpha is fitted to the measured uniform times, not to A: fitted to A it held out better on these
    two-level batches (p90 6.6-8.3 % against 7.7-9.7 % on the five LLMServingSim tables) but then
    also absorbs A's chord error at the file's own mean contexts, which other batches need not
    share; replayed on the two measured vLLM runs (``benchmarks/validate_against_runs.py``) it moved
    every TPOT and E2E figure 0.8-2.4 points further from the run."""
    df = skew[(skew["t_max_s"] > skew["t_mean_s"])].reset_index(drop=True)
    held = split_mask(len(df), seed=seed, keep_ends=False)
    buckets = skew_buckets(df["n"].to_numpy(), (df["nb"] / df["n"]).to_numpy(), df["kv_big"].to_numpy(),
                           df["pc"].to_numpy(), df["kp"].to_numpy())
    ts, tm = df["t_skew_s"].to_numpy(), df["t_mean_s"].to_numpy()
    dx = df["t_max_s"].to_numpy() - tm
    shape = tuple(len(e) for e in (SKEW_N_EDGES, SKEW_RATIO_EDGES, SKEW_KV_EDGES, SKEW_PC_EDGES, SKEW_KP_EDGES))
    train = ~held
    alpha = _bucket_alpha(tuple(b[train] for b in buckets), (ts - tm)[train], dx[train], 1.0 / ts[train] ** 2, shape)
    a_row = alpha[buckets]
    te = held
    meas = ts[te]
    rows = df.loc[te]
    g_mean = np.array([grid(pc, kp, n, kvm) for pc, kp, n, kvm in
                       zip(rows["pc"], rows["kp"], rows["n"], rows["kv_mean"], strict=True)])
    g_max = np.array([grid(pc, kp, n, kvb) for pc, kp, n, kvb in
                      zip(rows["pc"], rows["kp"], rows["n"], rows["kv_big"], strict=True)])
    errors = {"skew_full_model": ape_summary(g_mean + a_row[te] * (g_max - g_mean), meas),
              "skew_alpha_measured_uniform": ape_summary(tm[te] + a_row[te] * dx[te], meas),
              "skew_mean_context_only": ape_summary(tm[te], meas),
              "skew_mean_context_grid": ape_summary(g_mean, meas),
              "uniform_mean_context_grid": ape_summary(g_mean, tm[te]),
              "uniform_max_context_grid": ape_summary(g_max, df.loc[te, "t_max_s"].to_numpy())}
    section = {"n_edges": list(SKEW_N_EDGES), "ratio_edges": list(SKEW_RATIO_EDGES), "kv_edges": list(SKEW_KV_EDGES),
               "pc_edges": list(SKEW_PC_EDGES), "kp_edges": list(SKEW_KP_EDGES),
               "alpha": alpha.tolist(), "fitted_on": int(train.sum()),
               "ratio": "(mean - shortest) / (longest - shortest) decode context: nb/n for the profiled two-level batches",
               "axes": "alpha[rows][ratio][longest decode context][prefill chunk][its cached context]; chunk 0: decode-only"}
    return section, errors


# ---- assembly ----


@dataclass
class Assembly:
    """What a profile is made of before it is written: tables, their sources and how they were joined."""

    model: ModelConfig
    hardware: str
    tp: int
    dense_tokens: list[int]
    dense_ops: dict[str, dict[str, Any]]  # name -> {"per", "count", "seconds", "source"}
    seq_sequences: list[int]
    seq_ops: dict[str, list[float]]
    seq_sources: dict[str, str]
    grid: Grid
    attention_source: str
    allreduce: dict[str, Any]
    skew: dict[str, Any] | None = None
    skew_used: bool = True  # False: skew.csv is scored but the profile prices unequal contexts at their mean
    overhead: dict[str, float] = field(default_factory=lambda: {"step_s": 0.0, "per_seq_s": 0.0})
    sources: list[dict[str, Any]] = field(default_factory=list)
    assembly_notes: list[str] = field(default_factory=list)
    held_out: dict[str, Any] = field(default_factory=dict)
    attention_check: dict[str, Any] | None = None  # held-out attention errors found while assembling
    allreduce_check: dict[str, Any] | None = None  # held-out error of a measured all-reduce table
    # per-sequence ops measured on another grid: (x, y) to hold out from; None = an estimate
    seq_native: dict[str, Any] = field(default_factory=dict)


def check_tables(asm: Assembly, attention_rows: pd.DataFrame | None, skew: pd.DataFrame | None,
                 log: Callable[[str], None] = lambda _m: None) -> None:
    """Fill ``asm.held_out`` (and choose table vs fit per curve); fits alpha when ``skew`` is given."""
    held: dict[str, Any] = {"method": "table unless the physics fit has both the lower held-out median and p90 APE",
                            "holdout_fraction": HOLDOUT, "seed": SEED}
    xs = np.asarray(asm.dense_tokens, dtype=float)
    dense = {}
    layer_sum_meas, layer_sum_pred = None, None
    for name, op in asm.dense_ops.items():
        # a table resampled from another source's grid is checked on that source's own points
        nx, ny = op.pop("native", (xs, np.asarray(op["seconds"])))
        nx, ny = np.asarray(nx, dtype=float), np.asarray(ny, dtype=float)
        chk, _hx, pred = check_curve(nx, ny)
        dense[name] = {"table": chk.table, "fit": chk.fit, "chosen": chk.method}
        if chk.method == "fit":
            op["seconds"] = (token_features(xs) @ nnls_relative(token_features(nx), ny)).tolist()
            op["method"] = "physics fit (NNLS: const, tokens, 64-padded tokens)"
        if len(pred) and len(nx) == len(xs) and np.array_equal(nx, xs):
            w = op["count"] * (asm.model.num_layers if op["per"] == "layer" else 1)
            meas = ny[split_mask(len(nx))] * w
            layer_sum_meas = meas if layer_sum_meas is None else layer_sum_meas + meas
            layer_sum_pred = pred * w if layer_sum_pred is None else layer_sum_pred + pred * w
    held["dense_ops"] = dense
    if layer_sum_meas is not None:
        held["dense_all_layers"] = ape_summary(layer_sum_pred, layer_sum_meas)
    sx = np.asarray(asm.seq_sequences, dtype=float)
    seq = {}
    for name, ys in asm.seq_ops.items():
        native = asm.seq_native.get(name, (sx, np.asarray(ys)))
        if native is None:  # an estimate, not a measurement: nothing to hold out
            seq[name] = {"table": {"n": 0}, "fit": {"n": 0}, "chosen": "estimate"}
            continue
        chk, _, _ = check_curve(np.asarray(native[0], dtype=float), np.asarray(native[1], dtype=float))
        seq[name] = {"table": chk.table, "fit": chk.fit, "chosen": chk.method}
    held["per_sequence_ops"] = seq
    if attention_rows is not None and len(attention_rows) >= 20:
        asm.grid, att_err, scored, held["attention_interpolation"] = choose_interpolation(asm.grid, attention_rows)
        held["attention"] = att_err
        held["steps"] = step_errors(asm, scored)
        chosen = {r: "fit" if fit_wins(e["table"], e["fit"]) else "table" for r, e in att_err.items()}
        for r in (r for r, c in chosen.items() if c == "fit"):
            tabulate_attention_fit(asm.grid, attention_rows, r)
        held["attention_chosen"] = chosen
    if asm.attention_check:
        held["attention"] = asm.attention_check
    if asm.allreduce_check:
        held["allreduce"] = asm.allreduce_check
    table = AttentionGrid(asm.grid.axes, asm.grid.seconds, asm.grid.interpolation, asm.grid.shape)
    if skew is not None and len(skew):
        section, held["skew"] = fit_skew(skew, table)
        asm.skew = section if asm.skew_used else None
        held["skew_used"] = asm.skew_used  # unused: skew_mean_context_grid is the profile's own error there
    asm.held_out = held


def step_errors(asm: Assembly, scored: pd.DataFrame) -> dict[str, Any]:
    """Per regime, the APE of whole steps built from each held-out attention shape: num_layers x
    attention (predicted vs measured) + the step's token costs + its LM head and sampler."""
    dense = np.zeros(len(asm.dense_tokens))
    for op in asm.dense_ops.values():
        dense += np.asarray(op["seconds"]) * op["count"] * (asm.model.num_layers if op["per"] == "layer" else 1)
    tok = Curve(asm.dense_tokens, dense.tolist())
    seq = Curve(asm.seq_sequences, np.sum([np.asarray(v) for v in asm.seq_ops.values()], axis=0).tolist())
    out = {}
    for r in ("decode", "prefill", "mixed"):
        s = scored[scored["regime"] == r]
        if s.empty:
            continue
        tokens = s["prefill_chunk"].to_numpy() + s["n_decode"].to_numpy()
        rows = s["n_decode"].to_numpy() + (s["prefill_chunk"].to_numpy() > 0)
        rest = np.array([tok(t) + seq(n) for t, n in zip(tokens, rows, strict=True)])
        layers = asm.model.num_layers
        out[r] = ape_summary(layers * s["predicted"].to_numpy() + rest, layers * s["seconds"].to_numpy() + rest)
    return out


def to_profile(asm: Assembly) -> dict[str, Any]:
    """The ``servesim-gpu-profile/1`` dict (validated by loading it)."""
    m = asm.model
    profile = {
        "format": GPU_PROFILE_FORMAT,
        "model": m.name, "hardware": asm.hardware, "tensor_parallel": asm.tp, "num_layers": m.num_layers,
        "dense": {"tokens": [int(x) for x in asm.dense_tokens],
                  "ops": {k: {"per": v["per"], "count": v["count"], "seconds": _round(v["seconds"]),
                              "source": v.get("source", "")} | ({"method": v["method"]} if "method" in v else {})
                          for k, v in asm.dense_ops.items()}},
        "per_sequence": {"sequences": [int(x) for x in asm.seq_sequences],
                         "ops": {k: _round(v) for k, v in asm.seq_ops.items()}, "sources": asm.seq_sources},
        "attention": {"axes": asm.grid.axes, "seconds": _round(asm.grid.seconds.tolist()),
                      "interpolation": asm.grid.interpolation,
                      "measured_points": asm.grid.measured, "filled_points": asm.grid.filled,
                      "source": asm.attention_source},
        "skew": asm.skew,
        "allreduce": asm.allreduce,
        "overhead": asm.overhead,
        "extrapolation": EXTRAPOLATION | ({"roofline_reading": EXTRAPOLATION_ROOFLINE}
                                          if asm.grid.interpolation == "roofline" else {}),
        "provenance": {"sources": asm.sources, "assembly": asm.assembly_notes,
                       "units": "seconds; tokens; bytes"},
        "held_out_error": asm.held_out,
    }
    LayerCostModel(profile, attention_shape=asm.grid.shape)
    return profile


def _round(values: Any) -> Any:
    if isinstance(values, list):
        return [_round(v) for v in values]
    return float(f"{float(values):.5g}")


def dense_ops_for(model: ModelConfig, available: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
    """Which measured ops one step runs and how often: (per, count) per op name."""
    per_layer = {"layernorm": 2, "qkv_proj": 1, "qk_norm": 1, "rotary_emb": 1, "o_proj": 1, "gate_up_proj": 1,
                 "act_fn": 1, "down_proj": 1}
    per_step = {"embedding": 1, "final_layernorm": 1}
    ops = {k: ("layer", c) for k, c in per_layer.items() if k in available}
    ops |= {k: ("step", c) for k, c in per_step.items() if k in available}
    return ops


def allreduce_link(model: ModelConfig, tp: int, bandwidth: float, latency_s: float, source: str,
                   hop_latency_s: float = 0.0) -> dict[str, Any]:
    """A ring all-reduce over a link (``sim.allreduce.Link``, priced by ``layer_cost_model.
    allreduce_seconds``): two per decoder layer (after O and down) and one after the
    vocabulary-parallel embedding, each of the step's hidden states. ``bandwidth`` is what the
    collective reaches (bytes/s), i.e. the link's figure times its efficiency."""
    if tp == 1:
        return {"type": "none"}
    return {"type": "link", "tp": tp, "count": 2 * model.num_layers + 1,
            "bytes_per_token": model.hidden_size * model.dtype_bytes, "latency_s": latency_s,
            "hop_latency_s": hop_latency_s, "bandwidth": bandwidth, "source": source}
