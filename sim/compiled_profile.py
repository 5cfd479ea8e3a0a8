"""A GPU profile's price of a step over plain arrays, for the compiled engine's loop (large runs).

``LayerCostModel.iteration_time`` (``layer_cost_model.py``) under ``SimExecutor.price``, written
out for numba: the token and sequence curves, the attention grid read as the profile reads it
(``linear``, or ``roofline``: the ratio to the roofline's one-layer attention term, which is
``compiled_price``'s arithmetic with float arguments), the skew α (``layer_cost_model.skew_alpha``
itself) and the grid's own reading (``layer_cost_model.grid_inside`` itself), the extra prefill
rows, the overheads, and the host overlap of async scheduling. ``pack`` reads a profile into one
float and one int array; it answers None for what this does not price (a ``log`` reading, a skew
table of the layout before the prefill axes, a grid whose axes do not start at 0), which keeps
the Python call. Like ``compiled_price``, this is a twin: ``tests/test_compiled_price.py``
compares it with ``SimExecutor.price`` on every shipped GPU profile, each float to the bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .compiled_price import F_L2_BYTES, I_LAYERS, roofline_constants
from .compiled_price import attention as _attention
from .layer_cost_model import _pairs
from .layer_cost_model import grid_inside as _grid_inside
from .layer_cost_model import skew_alpha as _skew_alpha

# ints: the host overlapped, the roofline reading on, skew on; lengths of the token and sequence
# curves, of the grid's axes (padded width, each axis), its strides; the skew edges' lengths; where
# each float section starts
(G_OVERLAP, G_SHAPE, G_SKEW, G_NTOK, G_NSEQ, G_WIDTH, G_LEN, G_S0, G_S1, G_S2, G_EDGES, G_TOK, G_SEQ, G_AXES,
 G_BLEND, G_SK) = (0, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13, 18, 19, 20, 21, 22)
_NGI = 23
# floats at the start: token curve's slope, sequence curve's slope, layers, step and per-sequence
# overheads, the prompt-step overhead, the smallest chunk, the smallest decode context, each axis's
# largest and second-largest node, the grid's prefill base
(GF_TSLOPE, GF_SSLOPE, GF_LAYERS, GF_STEP, GF_PER_SEQ, GF_PROMPT, GF_PC_MIN, GF_KV_MIN, GF_MAX, GF_PREV,
 GF_BASE) = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
_NGF = 17


def pack(executor: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(floats, ints, the roofline's floats, its ints) that ``price`` reads for ``executor``'s steps,
    or None when its cost model is not a GPU profile this module prices."""
    from .cost_model import RooflineCostModel
    from .engine import SimExecutor
    from .layer_cost_model import LayerCostModel

    cm = getattr(executor, "cost_model", None)
    if type(executor) is not SimExecutor or type(cm) is not LayerCostModel:
        return None
    grid, alpha = cm.attention, cm.alpha
    if grid._packed is None or (alpha is not None and alpha._packed is None):
        return None
    rf, ri = np.zeros(1), np.zeros(1, dtype=np.int64)
    if grid._shape is not None:
        roof = getattr(grid._shape, "__self__", None)
        if type(roof) is not RooflineCostModel or grid._shape.__func__ is not RooflineCostModel.attention_layer_s:
            return None
        got = roofline_constants(roof)
        if got is None:
            return None
        rf, ri = got
    gi = np.zeros(_NGI, dtype=np.int64)
    head = np.zeros(_NGF)
    gi[G_OVERLAP] = executor._host is not None
    gi[G_SHAPE] = grid._shape is not None
    gi[G_SKEW] = alpha is not None
    tok, seq = cm.token_cost, cm.sequence_cost
    gi[G_NTOK], gi[G_NSEQ] = len(tok.xs), len(seq.xs)
    head[GF_TSLOPE], head[GF_SSLOPE] = tok.slope, seq.slope
    head[GF_LAYERS] = cm._layers
    head[GF_STEP], head[GF_PER_SEQ], head[GF_PROMPT] = cm._step_s, cm._per_seq_s, cm._prompt_step_s
    head[GF_PC_MIN], head[GF_KV_MIN] = grid._pc_min, grid._kv_min
    head[GF_MAX:GF_MAX + 4] = grid._max
    head[GF_PREV:GF_PREV + 4] = grid._prev
    head[GF_BASE] = grid.prefill_base
    axes, lens, blend = grid._packed
    gi[G_WIDTH] = axes.shape[1]
    gi[G_LEN:G_LEN + 4] = lens
    gi[G_S0], gi[G_S1], gi[G_S2] = grid._strides[:3]
    sections = [head, np.asarray(tok.xs + tok.ys, dtype=np.float64), np.asarray(seq.xs + seq.ys, dtype=np.float64),
                axes.ravel(), blend]
    if alpha is not None:
        edges = alpha._packed[:5]
        gi[G_EDGES:G_EDGES + 5] = [len(e) for e in edges]
        sections += [*edges, alpha._packed[5].ravel()]
    starts = np.cumsum([0] + [len(x) for x in sections])
    gi[G_TOK], gi[G_SEQ], gi[G_AXES], gi[G_BLEND] = starts[1:5]
    gi[G_SK] = starts[5] if alpha is not None else 0
    gf = np.concatenate(sections).astype(np.float64)
    if not np.isfinite(gf).all():
        return None
    if grid._shape is not None and not np.isfinite(np.delete(rf, F_L2_BYTES)).all():  # (an L2 may be unbounded)
        return None
    return gf, gi, rf, ri


def _curve(gf: np.ndarray, start: int, m: int, slope: float, x: float) -> float:
    """``Curve.__call__`` at x over its points (xs then ys from ``start``)."""
    if x <= 0:
        return 0.0
    x_last = gf[start + m - 1]
    if x >= x_last:
        return gf[start + 2 * m - 1] + slope * (x - x_last)
    if x <= gf[start]:
        return gf[start + m]
    lo, hi = 0, m
    while lo < hi:  # bisect_right
        mid = (lo + hi) // 2
        if x < gf[start + mid]:
            hi = mid
        else:
            lo = mid + 1
    x0, x1 = gf[start + lo - 1], gf[start + lo]
    y0 = gf[start + m + lo - 1]
    return y0 + (gf[start + m + lo] - y0) * (x - x0) / (x1 - x0)


def _inside(gf: np.ndarray, gi: np.ndarray, pc: float, kp: float, n: float, kv: float) -> float:
    """``AttentionGrid._inside`` of a linear reading: ``grid_inside`` over the packed grid."""
    w = gi[G_WIDTH]
    axes = gf[gi[G_AXES]:gi[G_AXES] + 4 * w].reshape((4, w))
    lens = gi[G_LEN:G_LEN + 4]
    end = gi[G_SK] if gi[G_SKEW] else gf.shape[0]
    blend = gf[gi[G_BLEND]:end]
    return _grid_inside(axes, lens, blend, gi[G_S0], gi[G_S1], gi[G_S2], pc, kp, n, kv)


def _shape(rf: np.ndarray, ri: np.ndarray, pc: float, kp: float, n: float, kv: float) -> float:
    """``RooflineCostModel.attention_layer_s`` (pc > 0): its ``_attention`` with float arguments."""
    pairs = pc * kp + pc * (pc + 1) / 2
    return _attention(rf, ri, n + 1.0, n, pc + n, pairs, n * (kv + 1), kp + pc, 0) / ri[I_LAYERS]


def _grid(gf: np.ndarray, gi: np.ndarray, rf: np.ndarray, ri: np.ndarray, pc: float, kp: float, n: float,
          kv: float) -> float:
    """``AttentionGrid.__call__``: one layer's attention seconds."""
    pmax, kpmax, nmax, kvmax = gf[GF_MAX], gf[GF_MAX + 1], gf[GF_MAX + 2], gf[GF_MAX + 3]
    if pc and pc < gf[GF_PC_MIN]:
        pc = gf[GF_PC_MIN]
    if n and kv < gf[GF_KV_MIN]:
        kv = gf[GF_KV_MIN]
    if not n:
        kv = 0.0
    if not pc:
        kp = 0.0
    cpc, ckp, cn, ckv = min(pc, pmax), min(kp, kpmax), min(n, nmax), min(kv, kvmax)
    if pc and gi[G_SHAPE]:
        return _inside(gf, gi, cpc, ckp, cn, ckv) * _shape(rf, ri, pc, kp, n, kv)
    t = _inside(gf, gi, cpc, ckp, cn, ckv)
    if kv > kvmax:
        d = t - _inside(gf, gi, cpc, ckp, cn, gf[GF_PREV + 3])
        t += (kv - kvmax) * (d if d > 0.0 else 0.0) / (kvmax - gf[GF_PREV + 3])
    if n > nmax:
        d = t - _inside(gf, gi, cpc, ckp, gf[GF_PREV + 2], ckv)
        t += (n - nmax) * (d if d > 0.0 else 0.0) / (nmax - gf[GF_PREV + 2])
    if kp > kpmax:
        d = t - _inside(gf, gi, cpc, gf[GF_PREV + 1], cn, ckv)
        t += (kp - kpmax) * (d if d > 0.0 else 0.0) / (kpmax - gf[GF_PREV + 1])
    if pc > pmax:
        p0 = gf[GF_PREV]
        d = t - _inside(gf, gi, p0, ckp, cn, ckv)
        per_pair = (d if d > 0.0 else 0.0) / (_pairs(pmax, ckp) - _pairs(p0, ckp))
        t += per_pair * (_pairs(pc, kp) - _pairs(pmax, kp))
    return t


def _alpha(gf: np.ndarray, gi: np.ndarray, n: float, mean: float, shortest: float, longest: float, pc: float,
           kp: float) -> float:
    """``SkewAlpha.__call__`` (the prefill-axes layout): ``skew_alpha`` over the packed table."""
    o = gi[G_SK]
    e0, e1, e2, e3, e4 = gi[G_EDGES], gi[G_EDGES + 1], gi[G_EDGES + 2], gi[G_EDGES + 3], gi[G_EDGES + 4]
    n_edges = gf[o:o + e0]
    o += e0
    ratio_edges = gf[o:o + e1]
    o += e1
    kv_edges = gf[o:o + e2]
    o += e2
    pc_edges = gf[o:o + e3]
    o += e3
    kp_edges = gf[o:o + e4]
    o += e4
    alpha = gf[o:o + e0 * e1 * e2 * e3 * e4].reshape((e0, e1, e2, e3, e4))
    return _skew_alpha(n_edges, ratio_edges, kv_edges, pc_edges, kp_edges, alpha, n, mean, shortest, longest, pc, kp)


def price(gf: np.ndarray, gi: np.ndarray, rf: np.ndarray, ri: np.ndarray, n: int, n_dec: int, tokens: int,
          decode_kv: int, q: np.ndarray, ctx: np.ndarray) -> float:
    """``SimExecutor.price`` of a step (n >= 1 rows ``q`` new tokens over ``ctx`` cached ones, no
    swaps) priced by the packed GPU profile."""
    layers = gf[GF_LAYERS]
    # LayerCostModel.attention_time
    if n_dec == n:
        mean = decode_kv / n - 1.0
        t = _grid(gf, gi, rf, ri, 0.0, 0.0, float(n), mean)
        if gi[G_SKEW] and n > 1:
            top = float(ctx[0])
            low = float(ctx[0])
            for j in range(1, n):
                c = float(ctx[j])
                if c > top:
                    top = c
                if c < low:
                    low = c
            if top > mean:
                a = _alpha(gf, gi, float(n), mean, low, top, 0.0, 0.0)
                if a:
                    t += a * (_grid(gf, gi, rf, ri, 0.0, 0.0, float(n), top) - t)
        attn = layers * t
    else:
        best = -1.0
        jb = -1
        m = 0
        top = low = 0.0
        for j in range(n):
            if q[j] == 1:
                c = float(ctx[j])
                if m == 0 or c > top:
                    top = c
                if m == 0 or c < low:
                    low = c
                m += 1
                continue
            key = q[j] * (ctx[j] + (q[j] + 1) / 2)
            if jb < 0 or key > best:
                best, jb = key, j
        pc, kp = float(q[jb]), float(ctx[jb])
        if n_dec:
            mean = decode_kv / n_dec - 1.0
            t = _grid(gf, gi, rf, ri, pc, kp, float(n_dec), mean)
            if gi[G_SKEW] and n_dec > 1 and top > mean:
                a = _alpha(gf, gi, float(n_dec), mean, low, top, pc, kp)
                if a:
                    t += a * (_grid(gf, gi, rf, ri, pc, kp, float(n_dec), top) - t)
        else:
            t = _grid(gf, gi, rf, ri, pc, kp, 0.0, 0.0)
        if n - n_dec > 1:
            base = gf[GF_BASE]
            for j in range(n):
                if q[j] != 1 and j != jb:
                    d = _grid(gf, gi, rf, ri, float(q[j]), float(ctx[j]), 0.0, 0.0) - base
                    t += d if d > 0.0 else 0.0
        attn = layers * t
    # LayerCostModel.iteration_time
    t = (_curve(gf, gi[G_TOK], gi[G_NTOK], gf[GF_TSLOPE], tokens) + _curve(gf, gi[G_SEQ], gi[G_NSEQ], gf[GF_SSLOPE], n)
         + attn + gf[GF_STEP] + gf[GF_PER_SEQ] * n + (gf[GF_PROMPT] if n_dec < n else 0.0) + 0.0)
    if gi[G_OVERLAP] and t > 0:  # (the host term: loop_overhead)
        step = gf[GF_STEP] + gf[GF_PER_SEQ] * n
        a = t - step
        t = step if step > a else a
    return t


# the plain functions, callees first, for ``compiled_engine._load`` to compile in place
PLAIN = {"_attention": _attention, "_grid_inside": _grid_inside, "_skew_alpha": _skew_alpha, "_curve": _curve,
         "_inside": _inside, "_shape": _shape, "_pairs": _pairs, "_grid": _grid, "_alpha": _alpha, "price": price}
# the files whose code ``price`` runs (``compiled_engine._drop_stale_cache``)
SOURCES = ("compiled_profile.py", "layer_cost_model.py")
