"""A GPU step priced from measured per-layer operator tables (``servesim-gpu-profile/1``).

Built from public kernel measurements (``servesim calibrate import``; LLMServingSim, Vidur,
inference-sim), one step of ``q_lens``/``ctx_lens`` rows costs, in seconds::

    token_cost(T)                       every token-linear op: num_layers x (norms, QKV, rotary, O,
                                        gate/up, activation, down, ...) + embedding + final norm
                                        + tensor-parallel all-reduces, at T = sum(q)
  + num_layers x attention(step shape)  one kernel call per layer over every row (below)
  + sequence_cost(n)                    LM head and sampler, n = rows (vLLM computes logits for
                                        each scheduled row's last position)
  + step_s + per_seq_s x n              host time the kernel timings did not see
  + prompt_step_s                       device time a step with a prompt row (q > 1) costs beyond
                                        its kernel tables (0 unless the profile sets it; see below)

Attention is a 4-D table measured by LLMServingSim: one prefill chunk of ``prefill_chunk`` new
tokens over ``kv_prefill`` cached ones, plus ``n_decode`` decode rows of ``kv_decode`` cached
tokens each, in one FlashAttention varlen call. The axes are what a vLLM v1 mixed step needs:
decode rows inside a mixed step are not priced as a separate decode kernel (on the RTX PRO 6000
128 decodes at 4k context cost 1.5 ms alone and 4.3 ms next to a 16-token chunk). A step maps on
it as follows:

- decode rows (q == 1): ``n_decode`` = their count, ``kv_decode`` their mean context; unequal
  contexts add ``alpha x (A(max context) - A(mean context))``, alpha per bucket of (rows, where the
  mean sits between the shortest and longest context, longest context, the step's prefill chunk
  (0 in a decode-only step), that chunk's cached context) fitted to LLMServingSim's ``skew.csv``
  (how far a skewed batch sits between its mean and its longest row; behind a prefill chunk the
  longest decode row shows less or more depending on how much prefill work there is beside it),
  read in log2 between the power-of-two rows and longest contexts it was measured at;
- the prefill row with the most query-key pairs is the table's chunk; every further prefill row
  adds its own prefill-only time less the table's smallest prefill (the launch it shares).

Between grid points the table is read multilinearly as ``attention.interpolation`` says: ``log``
(log time against log axis: power laws between neighbours), ``linear`` (linear in time), or
``roofline``: decode-only shapes linear in time, and shapes with a prefill chunk linear in the
*ratio* of the table to the roofline's attention term for the same shape
(``RooflineCostModel.attention_layer_s`` of the profile's model and GPU, without its L2 re-read
cliff: ``cost_model.reading_attention_shape``), times that term at the query. The FA2 kernel's time steps with the thread-block waves of the chunk, which fall between
the measured chunk sizes; the roofline's varlen term has those steps, so the ratio reading puts
them where a chord would cut across (the importer picks the reading by held-out error).
Chunks shorter than the grid's first chunk and decode contexts below its first context use that
first point (launch-bound there). Beyond the grid (stated in ``EXTRAPOLATION``): decode rows,
decode context and cached prefill context grow linearly in time along the slope of the grid's
last segment; a prefill chunk longer than the grid grows with its query-key pairs at the cost
per pair of the grid's last segment (under the ``roofline`` reading, a step with a chunk keeps the
ratio at the nearest grid point and follows the roofline's term). Token tables (one axis) continue linearly with the slope of
their top quarter, so a GEMM at 8k tokens costs what 2k did plus 6k tokens at the marginal rate.

Nothing here touches pandas: tables are Python lists read with ``bisect``, because this runs
once per simulated step.
"""

from __future__ import annotations

import bisect
import copy
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import row_kernels as rk
from .allreduce import Link
from .batch import StepSums
from .batch import step_sums as _step_sums
from .config_model import INT_MAX, MAX_SIM_SECONDS
from .errors import ProfileError

GPU_PROFILE_FORMAT = "servesim-gpu-profile/1"
ATTENTION_AXES = ("prefill_chunk", "kv_prefill", "n_decode", "kv_decode")
# How the attention table is read between nodes: "log" a power law between neighbours, "linear" linear
# in time, "roofline" linear in time for decode-only steps and, for steps with a prefill chunk, linear
# in the ratio of the measured time to the roofline's attention term for the same shape (so that the
# roofline's FA2 thread-block waves shape the table between measured chunk sizes).
INTERPOLATIONS = ("log", "linear", "roofline")
# Shape of the "roofline" reading: seconds of one layer's attention for (chunk, its cached context,
# decode rows, their context), RooflineCostModel.attention_layer_s of the profile's model and GPU.
AttentionShape = Callable[[float, float, float, float], float]
EXTRAPOLATION = {
    "tokens": "linear in tokens with the slope of the top quarter of the measured grid",
    "sequences": "linear in sequences with the slope of the top quarter of the measured grid",
    "n_decode": "linear in decode rows with the slope of the last grid segment",
    "kv_decode": "linear in decode context with the slope of the last grid segment",
    "kv_prefill": "linear in cached prefill context with the slope of the last grid segment",
    "prefill_chunk": "linear in query-key pairs q*(ctx+(q+1)/2) at the last grid segment's cost per pair",
    "below_grid": "chunks and decode contexts below the first grid point take that point's time",
}
# what the "roofline" reading does instead for a step with a prefill chunk, on every axis
EXTRAPOLATION_ROOFLINE = ("steps with a prefill chunk (attention.interpolation 'roofline'): the ratio of the table "
                          "to the roofline's attention term at the nearest grid point, times that term at the "
                          "step's own shape, beyond the grid as inside it")


def _floats(name: str, values: Any, n: int | None = None, most: float = MAX_SIM_SECONDS) -> list[float]:
    """A list of numbers in [0, most] (seconds unless ``most`` says otherwise), ``n`` of them if given."""
    try:
        if isinstance(values, str | bytes | Mapping) or any(isinstance(v, bool | str) for v in values):
            raise TypeError(name)  # float() would take "1.5" and True
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ProfileError(f"{name} must be a list of numbers") from None
    if n is not None and len(out) != n:
        raise ProfileError(f"{name} has {len(out)} values, expected {n}")
    if not all(math.isfinite(v) and 0 <= v <= most for v in out):
        raise ProfileError(f"{name} must hold finite numbers in [0, {most:.3g}]")
    return out


def _number(name: str, value: Any, least: float = 0.0, most: float = MAX_SIM_SECONDS) -> float:
    """One number in [least, most] (bounds inclusive), not a boolean or a string."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not least <= value <= most:
        raise ProfileError(f"{name} must be a number in [{least:.3g}, {most:.3g}], got {value!r:.60}")
    return float(value)


def whole_number(name: str, value: Any, most: int = INT_MAX) -> int:
    """A whole count >= 1 (layers, TP degree)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= most:
        raise ProfileError(f"{name} must be a whole number in [1, {most}], got {value!r:.60}")
    return int(value)


def _grid(name: str, values: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A nested list of numbers of ``shape`` as a float array."""
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise ProfileError(f"{name} must be nested lists of numbers of shape {shape}") from None
    if arr.shape != shape:
        raise ProfileError(f"{name} has shape {arr.shape}, the axes need {shape}")
    return arr


def _axis(name: str, values: Any) -> list[float]:
    xs = _floats(name, values, most=INT_MAX)  # tokens, sequences, contexts
    if len(xs) < 2 or any(b <= a for a, b in zip(xs, xs[1:], strict=False)):
        raise ProfileError(f"{name} must be at least two ascending numbers")
    return xs


class Curve:
    """Seconds against one integer axis (tokens or sequences): linear between points, linear
    beyond the last with the least-squares slope of the top quarter, 0 at x <= 0."""

    __slots__ = ("xs", "ys", "_x_last", "_y_last", "slope")

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        self.xs, self.ys = list(xs), list(ys)
        self._x_last, self._y_last = self.xs[-1], self.ys[-1]
        self.slope = tail_slope(self.xs, self.ys)

    def __call__(self, x: float) -> float:
        xs = self.xs
        if x <= 0:
            return 0.0
        if x >= self._x_last:
            return self._y_last + self.slope * (x - self._x_last)
        if x <= xs[0]:
            return self.ys[0]
        i = bisect.bisect_right(xs, x)
        x0, x1 = xs[i - 1], xs[i]
        y0 = self.ys[i - 1]
        return y0 + (self.ys[i] - y0) * (x - x0) / (x1 - x0)


def tail_slope(xs: Sequence[float], ys: Sequence[float], fraction: float = 0.25) -> float:
    """Least-squares slope (>= 0) of the points in the top ``fraction`` of the x range."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    top = x >= x[-1] - fraction * (x[-1] - x[0])
    if top.sum() < 2:
        top[-2:] = True
    slope = np.polyfit(x[top], y[top], 1)[0]
    return max(float(slope), 0.0)


class AttentionGrid:
    """One layer's attention seconds on the product grid ``ATTENTION_AXES`` (see module docstring)."""

    def __init__(self, axes: Mapping[str, Sequence[float]], seconds: Any, interpolation: str = "log",
                 shape: AttentionShape | None = None) -> None:
        if interpolation not in INTERPOLATIONS:
            raise ProfileError(f"attention.interpolation must be one of {', '.join(INTERPOLATIONS)}, got {interpolation!r}")
        if interpolation == "roofline" and shape is None:
            raise ProfileError("attention.interpolation 'roofline' needs the roofline's attention term of the "
                               "profile's model and GPU (load the profile with servesim's load_profile)")
        self.interpolation = interpolation
        self._linear = interpolation != "log"
        self._shape = shape if interpolation == "roofline" else None
        self.axes = [_axis(f"attention.axes.{a}", axes[a]) for a in ATTENTION_AXES]
        shape = tuple(len(a) for a in self.axes)
        arr = _grid("attention.seconds", seconds, shape)
        if not (np.isfinite(arr).all() and (arr > 0).all() and (arr <= MAX_SIM_SECONDS).all()):
            raise ProfileError(f"attention.seconds must be finite, > 0 and at most {MAX_SIM_SECONDS:.0e}")
        self.seconds = arr
        pc, kp, n, kv = self.axes
        if pc[0] != 0 or n[0] != 0 or kp[0] != 0:
            raise ProfileError("attention axes prefill_chunk, kv_prefill and n_decode must start at 0 (absent)")
        # the corner values blended: times (linear), log times (log: a power law between neighbours), or
        # (roofline) times where there is no chunk and times over the roofline's term where there is one
        blend = arr if self._linear else np.log(arr)
        if self._shape is not None:
            blend = arr.copy()
            blend[1:] /= shape_terms(self.axes, self._shape)
        self._log = blend.ravel().tolist()
        self._strides = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
        # the same grid packed for the compiled reading (``grid_inside``): axes padded into rows,
        # their lengths, the blended corner values; used for a linear reading whose axes all start
        # at 0 (no coordinate then falls below its axis)
        self._packed = None
        if self._linear and all(a[0] == 0 for a in self.axes):
            width = max(len(a) for a in self.axes)
            packed = np.zeros((4, width))
            for k, a in enumerate(self.axes):
                packed[k, :len(a)] = a
            self._packed = (packed, np.array([len(a) for a in self.axes], dtype=np.int64),
                            np.asarray(self._log, dtype=np.float64))
        self._logx = [[math.log(v) if v > 0 else 0.0 for v in a] for a in self.axes]
        self._pc_min, self._kv_min = pc[1], kv[1] if kv[0] == 0 else kv[0]
        self._max = [a[-1] for a in self.axes]
        self._prev = [a[-2] for a in self.axes]
        self.prefill_base = float(arr[1, 0, 0, 0])  # smallest chunk, no context, no decodes

    def _bracket(self, k: int, x: float) -> tuple[int, float]:
        """(index, weight of index + 1) of ``x`` on axis k; weights in log(x) between non-zero points."""
        xs = self.axes[k]
        i = bisect.bisect_right(xs, x) - 1
        if i >= len(xs) - 1:
            return len(xs) - 2, 1.0
        x0 = xs[i]
        if x == x0:
            return i, 0.0
        if x0 == 0:  # between "absent" and the first point: linear
            return i, x / xs[1]
        if self._linear:
            return i, (x - x0) / (xs[i + 1] - x0)
        lx = self._logx[k]
        return i, (math.log(x) - lx[i]) / (lx[i + 1] - lx[i])

    def _inside(self, pc: float, kp: float, n: float, kv: float) -> float:
        """Seconds at a point inside the grid (every coordinate already clamped). With the compiled
        step loops on, a linear reading takes ``grid_inside``: the same arithmetic compiled."""
        if rk.ON and self._packed is not None:
            axes, lens, blend = self._packed
            s0, s1, s2, _ = self._strides
            return rk.grid_inside(axes, lens, blend, s0, s1, s2, float(pc), float(kp), float(n), float(kv))
        (i0, w0), (i1, w1), (i2, w2), (i3, w3) = (self._bracket(0, pc), self._bracket(1, kp),
                                                  self._bracket(2, n), self._bracket(3, kv))
        s0, s1, s2, _ = self._strides
        log = self._log
        acc = 0.0
        for a, wa in ((0, 1.0 - w0), (1, w0)):
            if wa == 0.0:
                continue
            ba = (i0 + a) * s0
            for b, wb in ((0, 1.0 - w1), (1, w1)):
                if wb == 0.0:
                    continue
                bb = ba + (i1 + b) * s1
                wab = wa * wb
                for c, wc in ((0, 1.0 - w2), (1, w2)):
                    if wc == 0.0:
                        continue
                    base = bb + (i2 + c) * s2 + i3
                    if w3 == 0.0:
                        acc += wab * wc * log[base]
                    else:
                        acc += wab * wc * ((1.0 - w3) * log[base] + w3 * log[base + 1])
        return acc if self._linear else math.exp(acc)

    def __call__(self, pc: float, kp: float, n: float, kv: float) -> float:
        """Seconds of one layer's attention: a ``pc``-token chunk over ``kp`` cached tokens plus ``n``
        decode rows of ``kv`` cached tokens each (pc = 0 or n = 0: that part absent)."""
        pmax, kpmax, nmax, kvmax = self._max
        if pc and pc < self._pc_min:
            pc = self._pc_min
        if n and kv < self._kv_min:
            kv = self._kv_min
        if not n:
            kv = 0.0
        if not pc:
            kp = 0.0
        cpc, ckp, cn, ckv = min(pc, pmax), min(kp, kpmax), min(n, nmax), min(kv, kvmax)
        if pc and self._shape is not None:  # the ratio to the roofline's term, at the nearest grid point
            return self._inside(cpc, ckp, cn, ckv) * self._shape(pc, kp, n, kv)
        t = self._inside(cpc, ckp, cn, ckv)
        if kv > kvmax:
            t += (kv - kvmax) * max(t - self._inside(cpc, ckp, cn, self._prev[3]), 0.0) / (kvmax - self._prev[3])
        if n > nmax:
            t += (n - nmax) * max(t - self._inside(cpc, ckp, self._prev[2], ckv), 0.0) / (nmax - self._prev[2])
        if kp > kpmax:
            t += (kp - kpmax) * max(t - self._inside(cpc, self._prev[1], cn, ckv), 0.0) / (kpmax - self._prev[1])
        if pc > pmax:
            p0 = self._prev[0]
            per_pair = max(t - self._inside(p0, ckp, cn, ckv), 0.0) / (_pairs(pmax, ckp) - _pairs(p0, ckp))
            t += per_pair * (_pairs(pc, kp) - _pairs(pmax, kp))
        return t


@rk.compile_with_loops("grid_inside", (np.array([[0.0, 1.0, 2.0]] * 4), np.full(4, 3, dtype=np.int64),
                                        np.ones(81), 27, 9, 3, 0.5, 1.0, 1.5, 2.0))
def grid_inside(axes: np.ndarray, lens: np.ndarray, blend: np.ndarray, s0: int, s1: int, s2: int, pc: float,
                kp: float, n: float, kv: float) -> float:
    """``AttentionGrid._inside`` of a linear reading written out over plain arrays (the grid's
    ``_packed``: axes padded into rows, their lengths, the corner values), with ``_bracket``'s
    arithmetic in the same order, so that ``row_kernels`` can compile it for large runs
    (``row_kernels.grid_inside``); every axis starts at 0 and every coordinate is >= 0."""
    i0 = i1 = i2 = i3 = 0
    w0 = w1 = w2 = w3 = 0.0
    for k in range(4):
        x = (pc, kp, n, kv)[k]
        m = lens[k]
        lo, hi = 0, m
        while lo < hi:  # bisect_right
            mid = (lo + hi) // 2
            if x < axes[k, mid]:
                hi = mid
            else:
                lo = mid + 1
        i = lo - 1
        if i >= m - 1:
            i, w = m - 2, 1.0
        else:
            x0 = axes[k, i]
            if x == x0:
                w = 0.0
            elif x0 == 0:
                w = x / axes[k, 1]
            else:
                w = (x - x0) / (axes[k, i + 1] - x0)
        if k == 0:
            i0, w0 = i, w
        elif k == 1:
            i1, w1 = i, w
        elif k == 2:
            i2, w2 = i, w
        else:
            i3, w3 = i, w
    acc = 0.0
    for a in range(2):
        wa = 1.0 - w0 if a == 0 else w0
        if wa == 0.0:
            continue
        ba = (i0 + a) * s0
        for b in range(2):
            wb = 1.0 - w1 if b == 0 else w1
            if wb == 0.0:
                continue
            bb = ba + (i1 + b) * s1
            wab = wa * wb
            for c in range(2):
                wc = 1.0 - w2 if c == 0 else w2
                if wc == 0.0:
                    continue
                base = bb + (i2 + c) * s2 + i3
                if w3 == 0.0:
                    acc += wab * wc * blend[base]
                else:
                    acc += wab * wc * ((1.0 - w3) * blend[base] + w3 * blend[base + 1])
    return acc


def shape_terms(axes: Sequence[Sequence[float]], shape: AttentionShape) -> np.ndarray:
    """``shape`` (the roofline's one-layer attention term) at every node of a grid on ``axes`` (in
    ``ATTENTION_AXES`` order) that has a chunk (prefill_chunk > 0): the divisor of the ``roofline``
    reading. ``ProfileError`` when a term is not a positive finite number."""
    pc, kp, n, kv = axes
    out = np.empty((len(pc) - 1, len(kp), len(n), len(kv)))
    for i, j, k, m in np.ndindex(*out.shape):
        term = out[i, j, k, m] = shape(pc[i + 1], kp[j], n[k], kv[m])
        if not (math.isfinite(term) and term > 0):
            raise ProfileError(f"the roofline's attention term is {term!r} at chunk {pc[i + 1]:g}, context "
                               f"{kp[j]:g}, {n[k]:g} decode rows of {kv[m]:g}")
    return out


def _pairs(q: float, ctx: float) -> float:
    """Query-key pairs of a causal chunk of q new tokens over ctx cached ones."""
    return q * (ctx + (q + 1) / 2)


def _edge_weight(edges: list[float], x: float) -> tuple[int, float]:
    """(bucket of ``x`` among ascending upper ``edges``, weight of that bucket's value; the rest is the
    bucket below's): linear in log2 between the edge below and the bucket's own edge, 1 at an edge,
    in the first bucket and in the last (its edge a sentinel, nothing measured there)."""
    k = min(bisect.bisect_left(edges, x), len(edges) - 1)
    if k == 0 or k == len(edges) - 1 or x >= edges[k] or edges[k - 1] <= 0:
        return k, 1.0
    lo, hi = math.log2(edges[k - 1]), math.log2(edges[k])
    return k, (math.log2(max(x, edges[k - 1])) - lo) / (hi - lo)


@rk.compile_with_loops("skew_alpha", tuple(np.array([1.0, 2.0, 4.0]) for _ in range(5)) + (
    np.zeros((3, 3, 3, 3, 3)), 2.0, 1.5, 1.0, 3.0, 0.0, 0.0))
def skew_alpha(n_edges: np.ndarray, ratio_edges: np.ndarray, kv_edges: np.ndarray, pc_edges: np.ndarray,
               kp_edges: np.ndarray, alpha: np.ndarray, n: float, mean: float, shortest: float, longest: float,
               pc: float, kp: float) -> float:
    """``SkewAlpha.__call__`` of the prefill-axes layout written out over arrays, ``_edge_weight``'s
    and the blend's arithmetic in the same order, so that ``row_kernels`` can compile it for large
    runs (``row_kernels.skew_alpha``)."""
    def _left(edges: np.ndarray, x: float) -> int:  # bisect.bisect_left
        lo, hi = 0, edges.shape[0]
        while lo < hi:
            mid = (lo + hi) // 2
            if edges[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        return lo

    ratio = (mean - shortest) / (longest - shortest)
    weights = np.empty(2)
    buckets = np.empty(2, dtype=np.int64)
    for t in range(2):
        edges, x = (n_edges, n) if t == 0 else (kv_edges, longest)
        m = edges.shape[0]
        k = min(_left(edges, x), m - 1)
        if k == 0 or k == m - 1 or x >= edges[k] or edges[k - 1] <= 0:
            w = 1.0
        else:
            lo, hi = math.log2(edges[k - 1]), math.log2(edges[k])
            w = (math.log2(max(x, edges[k - 1])) - lo) / (hi - lo)
        buckets[t], weights[t] = k, w
    i, k = buckets[0], buckets[1]
    wi, wk = weights[0], weights[1]
    j = min(_left(ratio_edges, ratio), ratio_edges.shape[0] - 1)
    p = min(_left(pc_edges, pc), pc_edges.shape[0] - 1)
    q = min(_left(kp_edges, kp), kp_edges.shape[0] - 1)
    value = alpha[i, j, k, p, q]
    if wi < 1.0:
        value = wi * value + (1.0 - wi) * alpha[i - 1, j, k, p, q]
        if wk < 1.0:
            value = wk * value + (1.0 - wk) * (wi * alpha[i, j, k - 1, p, q] + (1.0 - wi) * alpha[i - 1, j, k - 1, p, q])
    elif wk < 1.0:
        value = wk * value + (1.0 - wk) * alpha[i, j, k - 1, p, q]
    return value


class SkewAlpha:
    """alpha: where a decode batch with unequal contexts sits between its mean-context and its
    longest-context time, per bucket of (decode rows, ratio = (mean - shortest) / (longest -
    shortest), longest context, the step's prefill chunk, that chunk's cached context);
    ``*_edges`` are ascending upper edges. A profile without ``pc_edges`` (written before the
    prefill axes) has one alpha per (pure or mixed step, rows, ratio, longest context)."""

    def __init__(self, section: Mapping[str, Any]) -> None:
        self.n_edges = _axis("skew.n_edges", section["n_edges"])
        self.ratio_edges = _axis("skew.ratio_edges", section["ratio_edges"])
        self.kv_edges = _axis("skew.kv_edges", section["kv_edges"])
        self.by_prefill = "pc_edges" in section
        if self.by_prefill:
            self.pc_edges = _axis("skew.pc_edges", section["pc_edges"])
            self.kp_edges = _axis("skew.kp_edges", section.get("kp_edges", []))
            shape: tuple[int, ...] = (len(self.n_edges), len(self.ratio_edges), len(self.kv_edges),
                                      len(self.pc_edges), len(self.kp_edges))
        else:
            shape = (2, len(self.n_edges), len(self.ratio_edges), len(self.kv_edges))
        arr = _grid("skew.alpha", section["alpha"], shape)
        if not (np.isfinite(arr).all() and (arr >= -1).all() and (arr <= 2).all()):
            raise ProfileError("skew alphas must be finite numbers in [-1, 2]")
        self.alpha = arr.tolist()
        # for the compiled reading (``skew_alpha``, the prefill-axes layout): edges as arrays, alpha
        self._packed = (tuple(np.asarray(e, dtype=np.float64) for e in (
            self.n_edges, self.ratio_edges, self.kv_edges, self.pc_edges, self.kp_edges)) + (arr,)
            if self.by_prefill else None)

    def __call__(self, n: int, mean: float, shortest: float, longest: float, pc: float = 0,
                 kp: float = 0) -> float:
        """alpha of ``n`` decode rows of mean / shortest / longest context in a step whose prefill
        chunk is ``pc`` tokens (0: decode-only) over ``kp`` cached ones.

        Rows and the longest context are measured at their bucket edges (``skew.csv``'s powers of
        two), so between two edges alpha is interpolated in log2 of the value, as the attention grid
        is between its nodes; at an edge, in the first bucket and past the last finite edge it is the
        bucket's own. (A step function there let one row passing 4,096 tokens take the alpha measured
        at 8,192: 46.5 -> 73.1 ms for a 127-row mixed step of the RTX PRO 6000 Llama run, which its own
        timestamps do not show.) Ratio, chunk and cached context stay buckets: their measured values
        fall inside them. With the compiled step loops on, the prefill-axes layout takes
        ``skew_alpha``: the same arithmetic compiled."""
        if rk.ON and self._packed is not None:
            return rk.skew_alpha(*self._packed, float(n), float(mean), float(shortest), float(longest), float(pc),
                                 float(kp))
        ratio = (mean - shortest) / (longest - shortest)
        i, wi = _edge_weight(self.n_edges, n)
        j = min(bisect.bisect_left(self.ratio_edges, ratio), len(self.ratio_edges) - 1)
        k, wk = _edge_weight(self.kv_edges, longest)
        if self.by_prefill:
            p = min(bisect.bisect_left(self.pc_edges, pc), len(self.pc_edges) - 1)
            q = min(bisect.bisect_left(self.kp_edges, kp), len(self.kp_edges) - 1)
            at = lambda a, b: self.alpha[a][j][b][p][q]  # noqa: E731
        else:
            table = self.alpha[pc > 0]
            at = lambda a, b: table[a][j][b]  # noqa: E731
        value = at(i, k)
        if wi < 1.0:
            value = wi * value + (1.0 - wi) * at(i - 1, k)
            if wk < 1.0:
                value = wk * value + (1.0 - wk) * (wi * at(i, k - 1) + (1.0 - wi) * at(i - 1, k - 1))
        elif wk < 1.0:
            value = wk * value + (1.0 - wk) * at(i, k - 1)
        return value


REQUIRED_SECTIONS = ("dense", "per_sequence", "attention")  # objects; the rest may be absent or null
OPTIONAL_SECTIONS = ("skew", "overhead", "allreduce", "extrapolation", "provenance", "held_out_error")


def check_sections(p: Mapping[str, Any]) -> None:
    """Every key a GPU profile needs present, and each section an object (null or a list there was
    an AttributeError deep in the loader)."""
    for key in ("model", "hardware", "tensor_parallel", "num_layers", *REQUIRED_SECTIONS):
        if key not in p:
            raise ProfileError(f"GPU profile lacks {key!r}")
    for key in (*REQUIRED_SECTIONS, *OPTIONAL_SECTIONS):
        value = p.get(key)
        if not isinstance(value, Mapping) and (key in REQUIRED_SECTIONS or value is not None):
            need = "an object" if key in REQUIRED_SECTIONS else "an object or null"
            raise ProfileError(f"{key} must be {need}, got {type(value).__name__ if value is not None else 'null'}")


class LayerCostModel:
    """A ``servesim-gpu-profile/1`` file as a cost model (see the module docstring)."""

    needs_rows = True  # the longest decode context and each prefill row's shape, not just the sums

    def __init__(self, profile: Mapping[str, Any], swap_bandwidth: float | None = None,
                 attention_shape: AttentionShape | None = None) -> None:
        """``attention_shape``: the roofline's attention term for the profile's model and GPU, which a
        profile read ``roofline`` needs (``cost_model.load_profile`` supplies it)."""
        p = dict(profile)
        fmt = p.get("format")
        if fmt != GPU_PROFILE_FORMAT:
            raise ProfileError(f"not a servesim GPU profile: format is {fmt!r}, expected {GPU_PROFILE_FORMAT!r}")
        check_sections(p)
        self.profile = p
        self.model, self.hardware = str(p["model"]), str(p["hardware"])
        self.tp, self.num_layers = whole_number("tensor_parallel", p["tensor_parallel"], 64), whole_number("num_layers", p["num_layers"])
        self.provenance = dict(p.get("provenance") or {})
        self.held_out_error = dict(p.get("held_out_error") or {})
        self.token_cost = self._token_curve(p["dense"], p.get("allreduce") or {"type": "none"})
        seq = p["per_sequence"]
        xs = _axis("per_sequence.sequences", seq.get("sequences", []))
        total = np.zeros(len(xs))
        for name, ys in (seq.get("ops") or {}).items():
            total += _floats(f"per_sequence.ops.{name}", ys, len(xs))
        self.sequence_cost = Curve(xs, total.tolist())
        att = p["attention"]
        self.attention = AttentionGrid(att.get("axes", {}), att.get("seconds"), str(att.get("interpolation", "log")),
                                       attention_shape)
        sk = p.get("skew")
        self.alpha = SkewAlpha(sk) if sk else None
        ov = dict(p.get("overhead") or {})
        self._step_s = _number("overhead.step_s", ov.get("step_s") or 0.0)
        self._per_seq_s = _number("overhead.per_seq_s", ov.get("per_seq_s") or 0.0)
        # A compiled engine may run a step with prompt rows slower than its eager per-layer kernels
        # add up to (vLLM 0.19's RTX PRO 6000 runs: ~5 ms, README "Against a measured vLLM run").
        # Device time, so not part of loop_overhead, which async scheduling hides behind the device.
        self._prompt_step_s = _number("overhead.prompt_step_s", ov.get("prompt_step_s") or 0.0)
        bw = ov.get("swap_bandwidth")
        self._swap_bw = (_number("overhead.swap_bandwidth", bw, least=1.0, most=math.inf) if bw is not None
                         else float(swap_bandwidth or math.inf))
        self._layers = float(self.num_layers)

    def _token_curve(self, dense: Mapping[str, Any], allreduce: Mapping[str, Any]) -> Curve:
        xs = _axis("dense.tokens", dense.get("tokens", []))
        total = np.zeros(len(xs))
        ops = dense.get("ops") or {}
        if not ops:
            raise ProfileError("dense.ops is empty")
        for name, op in ops.items():
            ys = np.asarray(_floats(f"dense.ops.{name}.seconds", op.get("seconds", []), len(xs)))
            per = op.get("per", "layer")
            if per not in ("layer", "step"):
                raise ProfileError(f"dense.ops.{name}.per must be 'layer' or 'step', got {per!r}")
            count = _number(f"dense.ops.{name}.count", op.get("count", 1), most=INT_MAX)
            total += ys * count * (self.num_layers if per == "layer" else 1)
        total += allreduce_seconds(allreduce, np.asarray(xs))
        return Curve(xs, total.tolist())

    # ---- pricing ----

    def attention_time(self, q: np.ndarray, ctx: np.ndarray, sums: tuple[int, ...]) -> float:
        """Seconds of all layers' attention for the step's rows."""
        n, n_dec = sums[0], sums[1]
        grid = self.attention
        if n_dec == n:  # decode-only: the common step
            mean = sums[4] / n - 1.0
            t = grid(0, 0, n, mean)
            if self.alpha is not None and n > 1:
                top = float(ctx.max())
                if top > mean:
                    a = self.alpha(n, mean, float(ctx.min()), top)
                    if a:
                        t += a * (grid(0, 0, n, top) - t)
            return self._layers * t
        dec = q == 1
        pre_q, pre_c = q[~dec].tolist(), ctx[~dec].tolist()
        j = max(range(len(pre_q)), key=lambda i: pre_q[i] * (pre_c[i] + (pre_q[i] + 1) / 2))
        pc, kp = pre_q[j], pre_c[j]
        if n_dec:
            mean = sums[4] / n_dec - 1.0
            t = grid(pc, kp, n_dec, mean)
            if self.alpha is not None and n_dec > 1:
                dctx = ctx[dec]
                top = float(dctx.max())
                if top > mean:
                    a = self.alpha(n_dec, mean, float(dctx.min()), top, pc, kp)
                    if a:
                        t += a * (grid(pc, kp, n_dec, top) - t)
        else:
            t = grid(pc, kp, 0, 0)
        if len(pre_q) > 1:
            base = grid.prefill_base
            for i, (qi, ci) in enumerate(zip(pre_q, pre_c, strict=True)):
                if i != j:
                    t += max(grid(qi, ci, 0, 0) - base, 0.0)
        return self._layers * t

    def iteration_time(self, q_lens: np.ndarray, ctx_lens: np.ndarray, swap_bytes: float = 0.0,
                       sums: StepSums | None = None) -> float:
        """Seconds for one step (module docstring); 0 for an empty step without swaps. ``sums``: the
        rows' ``step_sums`` when the caller has them already (``Batch.sums``), else computed here.
        The compiled engine prices large runs' steps with a twin of this arithmetic, of
        ``attention_time``, ``AttentionGrid.__call__`` and ``Curve`` (``compiled_profile.price``):
        a change here goes there too (``tests/test_compiled_price.py``)."""
        swap = swap_bytes / self._swap_bw if swap_bytes else 0.0
        n = q_lens.shape[0]
        if n == 0:
            return swap
        if sums is None:
            sums = _step_sums(q_lens, ctx_lens)
        return (self.token_cost(sums[2]) + self.sequence_cost(n) + self.attention_time(q_lens, ctx_lens, sums)
                + self._step_s + self._per_seq_s * n + (self._prompt_step_s if sums[1] < n else 0.0) + swap)

    def loop_overhead(self, rows: int) -> float:
        """Seconds of host time that ``iteration_time`` adds to a step."""
        return self._step_s + self._per_seq_s * rows

    def describe(self) -> dict[str, Any]:
        return {"type": "profile", "format": GPU_PROFILE_FORMAT, "model": self.model, "hardware": self.hardware,
                "tensor_parallel": self.tp, "num_layers": self.num_layers,
                "overhead": {"step_s": self._step_s, "per_seq_s": self._per_seq_s,
                             **({"prompt_step_s": self._prompt_step_s} if self._prompt_step_s else {})},
                # copies: a loaded profile is shared by every simulation of the process (load_profile)
                "provenance": copy.deepcopy(self.provenance), "held_out_error": copy.deepcopy(self.held_out_error)}


def allreduce_seconds(spec: Mapping[str, Any], tokens: np.ndarray) -> np.ndarray:
    """Per-step seconds of the tensor-parallel all-reduces at each token count.

    ``{"type": "none"}``; ``{"type": "link", "count", "bytes_per_token", "latency_s", "bandwidth"}``
    (ring all-reduce, ``sim/allreduce.py``: each of ``count`` collectives moves 2 (tp-1)/tp of its
    message over a link of ``bandwidth`` bytes/s after ``latency_s`` plus the optional
    ``hop_latency_s`` per further GPU; ``tp`` in the spec); or ``{"type": "table", "count",
    "bytes_per_token", "bytes": [...], "seconds": [...]}`` (measured, interpolated in log-log and,
    beyond the largest message, linear in bytes with the least-squares slope of the largest quarter
    of the sizes, at least three: NCCL's medians step, so the last two alone can share one time).
    """
    kind = spec.get("type", "none")
    tokens = np.asarray(tokens, dtype=float)
    if kind == "none":
        return np.zeros_like(tokens)
    count = _number("allreduce.count", spec["count"], most=INT_MAX)
    per_token = _number("allreduce.bytes_per_token", spec["bytes_per_token"], most=math.inf)
    size = tokens * per_token
    if kind == "link":
        link = Link(_number("allreduce.bandwidth", spec["bandwidth"], least=1.0, most=math.inf), 1.0,
                    _number("allreduce.latency_s", spec["latency_s"]),
                    _number("allreduce.hop_latency_s", spec.get("hop_latency_s", 0.0)))
        return count * link.seconds(size, whole_number("allreduce.tp", spec["tp"], 64))
    if kind == "table":
        xs = np.asarray(_axis("allreduce.bytes", spec["bytes"]))
        ys = np.asarray(_floats("allreduce.seconds", spec["seconds"], len(xs)))
        if xs[0] <= 0 or ys.min() <= 0:  # interpolated in log-log
            raise ProfileError("allreduce.bytes and allreduce.seconds must be > 0")
        inside = np.exp(np.interp(np.log(np.clip(size, xs[0], xs[-1])), np.log(xs), np.log(ys)))
        top = max(3, len(xs) // 4)  # the largest quarter of the sizes (log-spaced tables: >= 3 of them)
        return count * (inside + np.maximum(size - xs[-1], 0.0) * tail_slope(xs[-top:], ys[-top:], fraction=1.0))
    raise ProfileError(f"allreduce.type must be none, link or table, got {kind!r}")
