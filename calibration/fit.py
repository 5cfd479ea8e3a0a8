"""Fit a ``FittedCostModel`` to measured steps and report its error on held-out shapes.

Per regime (prefill, decode, mixed) the step time is a non-negative combination of the cost
model's physical features (``servesim.sim.cost_model.FEATURE_NAMES``): linear-layer tokens, their
tile-padded count, prefill attention pairs, decode KV tokens, rows, prefill rows, a constant,
and the PyTorch reference kernels' paged-attention terms. The fit is non-negative least squares
on *relative* residuals (each row divided by its measured time), so a 2 ms decode step counts as
much as a 200 ms prefill, which is what a percentage-error target asks for.

Honest error: a seeded fraction of the shapes of each regime (``holdout``) is set aside before
fitting; the error reported and stored in the profile is measured on those shapes only. The GEMM
tile for ``tokens_tiled`` is chosen by k-fold cross-validation inside the training shapes.

Host floor: an engine that launches every kernel from Python (servesim's eager live engine on a
GPU) cannot take less than its CPU needs to launch a step, so its small steps sit on a flat floor
(~33 ms on the H200) with the device-bound ones rising above it; no sum of features bends like
that. Per regime the fit also tries step time = max(floor, the features' terms), the terms fitted
to the shapes above the floor (alternating: measured above it first, then predicted above it), for
floors at quantiles of the regime's measured times, and keeps the floor (0: none) with the lowest
k-fold error (mean of median and p90 APE) inside the training shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import nnls
from scipy.stats import trim_mean
from servesim.sim.cost_model import FEATURE_NAMES, REGIMES, GemmTables, step_features

TILE_CANDIDATES = (1, 16, 32, 64, 128)
TRIM = 0.1
MIN_ROWS_PER_FEATURE = 2  # a regime with fewer shapes than this many per feature falls back to "all"
# Host-floor candidates: these quantiles of a regime's step times (and 0, no floor). Shapes within
# FLOOR_MARGIN of a floor are left out of the device terms' fit (host-bound steps jitter by ~15 %).
FLOOR_QUANTILES = tuple(q / 20 for q in range(1, 13))  # 0.05 ... 0.6
FLOOR_MARGIN = 0.25
FLOOR_MIN_GAIN = 0.005  # a floor is kept only when it lowers the cross-validated error by this much
FLOOR_ITERATIONS = 5


def parse_shape(key: str) -> tuple[np.ndarray, np.ndarray]:
    """``q=1 1 5;ctx=9 3 0`` (a Shape.key) -> (q, ctx) int64 arrays."""
    q_part, ctx_part = key.split(";")
    q = np.array(q_part.removeprefix("q=").split(), dtype=np.int64)
    ctx = np.array(ctx_part.removeprefix("ctx=").split(), dtype=np.int64)
    return q, ctx


def shape_table(raw: pd.DataFrame, trim: float = TRIM) -> pd.DataFrame:
    """Seconds per shape from the raw per-run rows (columns shape, regime, seconds): the mean with
    the fastest and slowest ``trim`` fraction dropped.

    A mean, not a median, because a run's latencies are sums of many steps (a TPOT is the mean of
    a request's steps); trimmed, so one context switch in a handful of runs does not move it.
    """
    g = raw.groupby("shape", sort=True)
    return pd.DataFrame({"regime": g["regime"].first(),
                         "seconds": g["seconds"].agg(lambda s: float(trim_mean(s.to_numpy(), trim))),
                         "runs": g["seconds"].size()}).reset_index()


def round_deviation(raw: pd.DataFrame) -> dict[str, float]:
    """Per regime, how far one round of a shape lies from that shape's mean over all rounds.

    A round's value is the mean of the shape's timed steps in it; the figure is the median over
    shapes and rounds of |round - mean| / mean. It is the timing noise a fit's held-out error is
    read against (a fit cannot agree with the measurements better than the rounds agree with each
    other). Empty with fewer than two rounds.
    """
    if raw["round"].nunique() < 2:
        return {}
    per_round = raw.groupby(["regime", "shape", "round"])["seconds"].mean()
    mean = per_round.groupby(level=["regime", "shape"]).transform("mean")
    dev = (per_round - mean).abs() / mean
    out = dev.groupby(level="regime").median().to_dict()
    return {**{str(k): float(v) for k, v in out.items()}, "all": float(dev.median())}


def feature_matrix(shapes: pd.Series, tile: int, gemm: GemmTables | None = None) -> np.ndarray:
    return np.stack([step_features(*parse_shape(k), tile=tile, gemm=gemm) for k in shapes])


def _nnls_relative(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """argmin_c>=0 sum(((x c - t) / t)^2), with column scaling for conditioning."""
    a = x / t[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(a / scale, np.ones(len(t)), maxiter=50 * a.shape[1])
    return coef / scale


def ape(pred: np.ndarray, t: np.ndarray) -> np.ndarray:
    return np.abs(pred - t) / t


@dataclass
class Fit:
    tile: int
    coefs: dict[str, np.ndarray]  # regime -> coefficient per feature (seconds per unit)
    floors: dict[str, float] = field(default_factory=dict)  # regime -> host floor (s); absent = none
    held_out: dict[str, dict] = field(default_factory=dict)  # regime/"all" -> error figures
    train: dict[str, dict] = field(default_factory=dict)
    predictions: pd.DataFrame | None = None  # shape, regime, seconds, predicted, held_out


def _enough(rows: int) -> bool:
    return rows >= MIN_ROWS_PER_FEATURE * len(FEATURE_NAMES)


def _fit_regimes(table: pd.DataFrame, x: np.ndarray, floors: dict[str, float] | None = None
                 ) -> dict[str, np.ndarray]:
    coefs = {"all": _nnls_relative(x, table["seconds"].to_numpy())}
    for r in REGIMES:
        m = (table["regime"] == r).to_numpy()
        if _enough(m.sum()):
            coefs[r] = _fit_above(x[m], table["seconds"].to_numpy()[m], (floors or {}).get(r, 0.0))
    return coefs


def _fit_above(x: np.ndarray, t: np.ndarray, floor: float) -> np.ndarray:
    """The device terms under ``floor`` (all shapes when it is 0): fitted first to the shapes
    measured clearly above it, then, alternating, to those the terms themselves put above it
    (the hinge max(floor, terms) fitted by its two pieces) until that set stops changing."""
    if not floor:
        return _nnls_relative(x, t)
    above = t > floor * (1 + FLOOR_MARGIN)
    if not _enough(above.sum()):
        return _nnls_relative(x, t)
    coef = _nnls_relative(x[above], t[above])
    for _ in range(FLOOR_ITERATIONS):
        now = x @ coef > floor
        if not _enough(now.sum()) or np.array_equal(now, above):
            break
        above = now
        coef = _nnls_relative(x[above], t[above])
    return coef


def _predict(coefs: dict[str, np.ndarray], regimes: pd.Series, x: np.ndarray,
             floors: dict[str, float] | None = None) -> np.ndarray:
    if len(regimes) == 0:  # (a fold or held-out set of a tiny grid may be empty)
        return np.zeros(0)
    c = np.stack([coefs.get(r, coefs["all"]) for r in regimes])
    pred = (x * c).sum(axis=1)
    if floors:
        floor = np.array([floors.get(r, 0.0) if r in coefs else 0.0 for r in regimes])
        pred = np.maximum(pred, floor)
    return pred


def _choose_floors(table: pd.DataFrame, x: np.ndarray, folds: int, seed: int) -> dict[str, float]:
    """Per regime with coefficients of its own, the host floor (see the module docstring) with the
    lowest k-fold error inside ``table``, the mean of the median and the 90th-percentile APE (the
    two figures the calibration target names: a floor trades the small steps' error against the
    knee's); regimes where no floor beats none are left out."""
    rng = np.random.default_rng(seed + 2)
    floors = {}
    for r in REGIMES:
        m = (table["regime"] == r).to_numpy()
        if not _enough(m.sum()):
            continue
        xr, tr = x[m], table["seconds"].to_numpy()[m]
        fold = rng.integers(0, folds, len(tr))
        candidates = [0.0, *sorted({float(np.quantile(tr, q)) for q in FLOOR_QUANTILES})]
        errs = []
        for floor in candidates:
            e = []
            for f in range(folds):
                fit_rows = fold != f
                if not _enough(fit_rows.sum()):
                    continue
                coef = _fit_above(xr[fit_rows], tr[fit_rows], floor)
                e.append(ape(np.maximum(xr[~fit_rows] @ coef, floor), tr[~fit_rows]))
            e = np.concatenate(e) if e else None
            errs.append(float(np.median(e) + np.percentile(e, 90)) / 2 if e is not None else np.inf)
        best = int(np.argmin(errs))
        if candidates[best] and errs[best] < errs[0] - FLOOR_MIN_GAIN:
            floors[r] = candidates[best]
    return floors


def split_held_out(table: pd.DataFrame, holdout: float, seed: int) -> np.ndarray:
    """Boolean mask of held-out shapes: a seeded ``holdout`` fraction of each regime."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(len(table), dtype=bool)
    for r in REGIMES:
        idx = np.flatnonzero((table["regime"] == r).to_numpy())
        k = int(round(holdout * len(idx)))
        if len(idx) >= 4 and k:
            mask[rng.choice(idx, k, replace=False)] = True
    return mask


def _choose_tile(table: pd.DataFrame, folds: int, seed: int, gemm: GemmTables | None) -> int:
    """The tile with the lowest k-fold median APE over the training shapes."""
    rng = np.random.default_rng(seed + 1)
    fold = rng.integers(0, folds, len(table))
    t = table["seconds"].to_numpy()
    best, best_err = TILE_CANDIDATES[0], np.inf
    for tile in TILE_CANDIDATES:
        x = feature_matrix(table["shape"], tile, gemm)
        errs = []
        for f in range(folds):
            tr = fold != f
            coefs = _fit_regimes(table[tr], x[tr])
            errs.append(ape(_predict(coefs, table["regime"][~tr], x[~tr]), t[~tr]))
        err = float(np.median(np.concatenate(errs)))
        if err < best_err - 1e-4:  # prefer the smaller tile unless a larger one is clearly better
            best, best_err = tile, err
    return best


def _errors(pred: np.ndarray, t: np.ndarray, regimes: pd.Series) -> dict[str, dict]:
    out = {}
    for r in (*REGIMES, "all"):
        m = np.ones(len(t), dtype=bool) if r == "all" else (regimes == r).to_numpy()
        if m.any():
            e = ape(pred[m], t[m])
            out[r] = {"median_ape": float(np.median(e)), "mean_ape": float(e.mean()),
                      "p90_ape": float(np.percentile(e, 90)), "max_ape": float(e.max()), "n": int(m.sum())}
    return out


def fit(raw: pd.DataFrame, *, holdout: float = 0.2, seed: int = 0, tile: int | None = None, folds: int = 5,
        gemm: GemmTables | None = None, floors: bool = True) -> Fit:
    """Fit on the training shapes of ``raw`` (per-run rows); held-out error on the rest.

    ``gemm``: the measured GEMM tables behind the ``*_measured_s`` features (none: those are 0).
    ``floors``: try a host floor per regime (module docstring); False fits the plain terms.
    """
    table = shape_table(raw)
    held = split_held_out(table, holdout, seed)
    train = table[~held].reset_index(drop=True)
    tile = tile or _choose_tile(train, folds, seed, gemm)
    x_all = feature_matrix(table["shape"], tile, gemm)
    floors = _choose_floors(train, x_all[~held], folds, seed) if floors else {}
    coefs = _fit_regimes(train, x_all[~held], floors)
    pred = _predict(coefs, table["regime"], x_all, floors)
    t = table["seconds"].to_numpy()
    predictions = table.assign(predicted=pred, held_out=held)
    return Fit(tile, coefs, floors, held_out=_errors(pred[held], t[held], table["regime"][held]),
               train=_errors(pred[~held], t[~held], table["regime"][~held]), predictions=predictions)


def plot_fit(result: Fit, path: str | Path, title: str = "") -> Path:
    """Predicted vs measured step time, log-log, per regime; held-out shapes filled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = result.predictions
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    colors = {"prefill": "tab:blue", "decode": "tab:orange", "mixed": "tab:green"}
    for r, c in colors.items():
        for held, marker in ((False, "o"), (True, "s")):
            d = df[(df["regime"] == r) & (df["held_out"] == held)]
            if len(d):
                e = result.held_out.get(r, {}).get("median_ape") if held else None
                label = f"{r} held-out (median APE {100 * e:.1f} %)" if held and e is not None else \
                    f"{r} {'held-out' if held else 'train'}"
                ax.scatter(d["seconds"] * 1e3, d["predicted"] * 1e3, s=18 if held else 8, marker=marker,
                           facecolors=c if held else "none", edgecolors=c, label=label, alpha=0.8)
    lo, hi = df[["seconds", "predicted"]].min().min() * 1e3 * 0.8, df[["seconds", "predicted"]].max().max() * 1e3 * 1.2
    xs = np.array([lo, hi])
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, xs * 0.97, xs * 1.03, color="0.85", label="±3 %")
    ax.set(xscale="log", yscale="log", xlabel="measured step (ms)", ylabel="predicted step (ms)",
           title=title or "calibration fit")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
