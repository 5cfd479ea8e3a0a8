"""The roofline's price of a step over plain scalars, for the compiled engine's loop (large runs).

The compiled engine (``compiled_engine.py``) runs a run's events in one numba call per step and
returns to Python for each step's price (``SimExecutor.price``). That round trip — the call, the
step's sums as a ``StepSums``, the cost model's own Python — is ~5-7 µs, more than the rest of a
step, so a run of 30 million short steps (light traffic) spends minutes there. For the model most
runs price with, ``RooflineCostModel`` under a ``SimExecutor``, ``price`` here is the same
arithmetic over the model's constants (``pack``): ``RooflineCostModel.step_time`` (its terms
added in the same order, FA2's varlen term by ``varlen_attention.layer_seconds`` itself and
FA2's decode-only waves as ``FA2VarlenAttention.decode_waves_s``), then ``SimExecutor.price``'s
overlap of the host term under async scheduling; so the engine prices a step inside its loop
and every duration is the same float. Other cost models (a GPU profile's tables, a fitted CPU
profile) keep the Python call: ``pack`` answers None for them.

Like the engine, this is a twin: a change to the roofline's arithmetic must be made here too,
which ``tests/test_compiled_price.py`` checks on every hardware preset (each float to the bit).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .varlen_attention import layer_seconds as _layer_seconds
from .varlen_attention import num_splits as _num_splits

# float constants (``pack``): the roofline's, its FA2 varlen term's, the executor's
(F_LAYER_WEIGHT, F_LAYER_ACT, F_LAYER_FLOP, F_GEMM_FLOORS, F_HEAD_WEIGHT, F_HEAD_FLOOR, F_HEAD_FLOP, F_SAMPLER_FIXED,
 F_SAMPLER_PER_SEQ, F_SMALL_FIXED, F_SMALL_PER_TOKEN, F_KV_S, F_ATTN_FIXED, F_PAIR_S, F_AR_FIXED, F_AR_PER_TOKEN,
 F_STEP_OVERHEAD, F_PER_SEQ_OVERHEAD, F_BLEND, F_INV_BLEND, F_TILE_S, F_EMPTY_CTA_S, F_KV_TOKEN_S,
 F_HEAD_TOKEN_BYTES, F_L2_BYTES, F_DECODE_TILE_S, F_DECODE_MERGE_S) = range(27)
_NF = 27
# int constants: GEMM tile, layers, FA2 varlen term on, decode waves on, host overlapped, query
# heads, SMs, keys per block, query heads per KV head, KV heads (one TP rank)
(I_TILE, I_LAYERS, I_VARLEN, I_WAVES, I_OVERLAP, I_HEADS, I_SMS, I_BLOCK_N, I_GROUP, I_KV_HEADS) = range(10)
_NI = 10


def pack(executor: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """The constants ``price`` reads for ``executor``'s steps: (floats, ints), or None when its cost
    model is not one this module prices (only a ``RooflineCostModel`` under a ``SimExecutor``)."""
    from .cost_model import RooflineCostModel
    from .engine import SimExecutor

    cm = getattr(executor, "cost_model", None)
    if type(executor) is not SimExecutor or type(cm) is not RooflineCostModel:
        return None
    packed = roofline_constants(cm)
    if packed is None or not np.isfinite(packed[0]).all():
        return None
    packed[1][I_OVERLAP] = executor._host is not None
    return packed


def roofline_constants(cm: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """``pack``'s constants of a ``RooflineCostModel`` itself (the host overlap off), None where an
    int the arithmetic multiplies by is not an int; an L2 may be infinite (a GPU profile's reading
    divides by the roofline's term with an unbounded L2: ``cost_model.reading_attention_shape``)."""
    from .cost_model import _INV_BLEND, GEMM_BLEND

    f = np.zeros(_NF)
    i = np.zeros(_NI, dtype=np.int64)
    for k, v in ((F_LAYER_WEIGHT, cm._layer_weight_s), (F_LAYER_ACT, cm._layer_act_s),
                 (F_LAYER_FLOP, cm._layer_flop_s), (F_GEMM_FLOORS, cm._gemm_floors),
                 (F_HEAD_WEIGHT, cm._head_weight_s), (F_HEAD_FLOOR, cm._head_floor), (F_HEAD_FLOP, cm._head_flop_s),
                 (F_SAMPLER_FIXED, cm._sampler_fixed), (F_SAMPLER_PER_SEQ, cm._sampler_per_seq),
                 (F_SMALL_FIXED, cm._small_fixed), (F_SMALL_PER_TOKEN, cm._small_per_token), (F_KV_S, cm._kv_s),
                 (F_ATTN_FIXED, cm._attn_fixed), (F_PAIR_S, cm._pair_s), (F_AR_FIXED, cm._ar_fixed),
                 (F_AR_PER_TOKEN, cm._ar_per_token), (F_STEP_OVERHEAD, cm.step_overhead_s),
                 (F_PER_SEQ_OVERHEAD, cm.per_seq_overhead_s), (F_BLEND, GEMM_BLEND), (F_INV_BLEND, _INV_BLEND)):
        f[k] = v
    for k, v in ((I_TILE, cm.tile), (I_LAYERS, cm.model.num_layers)):
        if type(v) is not int:  # (an int the arithmetic multiplies by: a float would round elsewhere)
            return None
        i[k] = v
    va = cm._varlen
    if va is not None:
        i[I_VARLEN] = 1
        i[I_WAVES] = cm._decode_waves is not None
        for k, v in ((I_HEADS, va.heads), (I_SMS, va.sms), (I_BLOCK_N, va.block_n), (I_GROUP, va.group),
                     (I_KV_HEADS, va.kv_heads)):
            if type(v) is not int:
                return None
            i[k] = v
        for k, v in ((F_TILE_S, va.tile_s), (F_EMPTY_CTA_S, va.empty_cta_s), (F_KV_TOKEN_S, va.kv_token_s),
                     (F_HEAD_TOKEN_BYTES, va.head_token_bytes), (F_L2_BYTES, va.l2_bytes),
                     (F_DECODE_TILE_S, va.decode_tile_s or 0.0), (F_DECODE_MERGE_S, va.decode_merge_s)):
            f[k] = v
    return f, i


def attention(f: np.ndarray, i: np.ndarray, n: float, n_dec: float, tokens: float, pairs: float, decode_kv: float,
              prefill_kv: float, longest: int) -> float:
    """``RooflineCostModel._attention``: every layer's KV write, launch floors and kernel for a
    step's sums (ints from a step, floats from a GPU profile's reading), ``longest`` the largest
    decode ctx + 1 (0: none given; ``layer_seconds`` reads it only beside decode rows)."""
    layers = i[I_LAYERS]
    kv_s = f[F_KV_S]
    if pairs and i[I_VARLEN]:
        layer = _layer_seconds(i[I_HEADS], i[I_SMS], f[F_TILE_S], i[I_BLOCK_N], f[F_EMPTY_CTA_S], i[I_GROUP],
                               f[F_KV_TOKEN_S], f[F_HEAD_TOKEN_BYTES], f[F_L2_BYTES], n, n_dec, tokens, decode_kv,
                               prefill_kv, longest)
        return f[F_ATTN_FIXED] + tokens * kv_s + layers * layer
    if not pairs and decode_kv and i[I_WAVES]:
        # FA2VarlenAttention.decode_waves_s(n_dec, decode_kv)
        bn = i[I_BLOCK_N]
        tiles = math.ceil(decode_kv / n_dec / bn)
        blocks = n_dec * i[I_KV_HEADS]
        sms = i[I_SMS]
        splits = _num_splits(blocks, 2 * sms, tiles, 128)
        nwaves = -(-(blocks * splits) // sms)
        waves = nwaves * -(-tiles // splits) * f[F_DECODE_TILE_S]
        merge = f[F_DECODE_MERGE_S] if splits > 1 else 0.0
        read = decode_kv * kv_s
        lw = layers * waves
        return f[F_ATTN_FIXED] + tokens * kv_s + (lw if lw > read else read) + layers * merge
    attn = f[F_ATTN_FIXED] + (decode_kv + tokens) * kv_s
    if pairs:
        a, b = pairs * f[F_PAIR_S], prefill_kv * kv_s
        attn += b if b > a else a
    return attn


def price(f: np.ndarray, i: np.ndarray, n: int, n_dec: int, tokens: int, pairs: int, decode_kv: int,
          prefill_kv: int, longest: int) -> float:
    """``SimExecutor.price`` of a step (n >= 1 rows, no swaps) from its sums and its longest decode
    ctx + 1 (0: none), with ``pack``'s constants."""
    # _terms' size-only terms, added as step_time adds them
    mem = f[F_LAYER_WEIGHT] + tokens * f[F_LAYER_ACT]
    tile = i[I_TILE]
    flop = -(-tokens // tile) * tile * f[F_LAYER_FLOP]
    blend, inv = f[F_BLEND], f[F_INV_BLEND]
    linear = (mem ** blend + flop ** blend) ** inv + f[F_GEMM_FLOORS]
    head_flop = n * f[F_HEAD_FLOP]
    head = (f[F_HEAD_WEIGHT] ** blend + head_flop ** blend) ** inv + f[F_HEAD_FLOOR]
    sampler = f[F_SAMPLER_FIXED] + n * f[F_SAMPLER_PER_SEQ]
    small = f[F_SMALL_FIXED] + tokens * f[F_SMALL_PER_TOKEN]
    lead = linear + head + sampler + small
    comm = f[F_AR_FIXED] + tokens * f[F_AR_PER_TOKEN]
    host = f[F_STEP_OVERHEAD] + n * f[F_PER_SEQ_OVERHEAD]
    attn = attention(f, i, n, n_dec, tokens, pairs, decode_kv, prefill_kv, longest)
    t = lead + attn + comm + 0.0 + host
    if i[I_OVERLAP] and t > 0:  # (the host term is the executor's loop_overhead)
        a = t - host
        t = host if host > a else a
    return t


# the plain functions, callees first, for ``compiled_engine._load`` to compile in place (it
# replaces these names on this module with their compiled versions, so ``price`` binds to them)
PLAIN = {"_layer_seconds": _layer_seconds, "_num_splits": _num_splits, "attention": attention, "price": price}
# the files whose code ``price`` runs: its compiled callers' on-disk cache is kept only for these
# files as they were (``compiled_engine._load``: numba notices only a change in a function's own file)
SOURCES = ("compiled_price.py", "varlen_attention.py")
