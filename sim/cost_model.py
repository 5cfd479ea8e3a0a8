"""Step shape -> seconds: how long one engine iteration takes.

A step is described by two int arrays, one row per scheduled sequence: ``q_lens[i]`` new tokens
computed this step (1 for a decode) and ``ctx_lens[i]`` tokens already in the KV cache (so row i
attends over ``ctx + q`` keys), plus the KV bytes swapped between host and device before it.

Three models share the interface ``iteration_time(q_lens, ctx_lens, swap_bytes=0.0) -> seconds``:

- ``RooflineCostModel``: datasheet peaks times per-GPU measured fractions, kernel by kernel; the
  default, and the model for hardware nobody has profiled.
- ``FittedCostModel``: non-negative coefficients fitted to measured steps (``calibration/fit.py``).
- ``ConstantCostModel``: closed form, for tests.

A GPU profile built from published kernel tables (format ``servesim-gpu-profile/1``) loads as
``LayerCostModel`` (``sim/layer_cost_model.py``): ``build_cost_model`` picks the class from the
profile file's ``format``.

Both real models use the same physical terms, ``step_features`` (names in ``FEATURE_NAMES``):

=====================  =========================================================  ==============
feature                what it is                                                 unit
=====================  =========================================================  ==============
tokens                 T = sum(q): rows through every linear layer                tokens
tokens_tiled           ceil(T / tile) * tile: the GEMM M dimension after padding  tokens
prefill_attn_pairs     sum over prefill rows of q * (ctx + (q + 1) / 2)            query-key pairs
decode_kv_tokens       sum over decode rows (q == 1) of ctx + 1: KV read          tokens
seqs                   rows in the step (lm head, sampler, per-request CPU work)  sequences
prefill_seqs           rows with q != 1 (varlen attention launch, prompt setup)   sequences
const                  1 for a non-empty step: weight read, launches, scheduler   1
decode_padded_kv       decode rows * the longest decode context (ctx + 1): the    tokens
                       KV a padded decode kernel reads (PyTorch reference on CPU)
paged_prefill_kv       sum over prefill rows of ctx + q, in steps that read the   tokens
                       paged cache (some row has ctx > 0): K/V gathered per row
paged_prefill_pairs    sum over those rows of q * (ctx + q): masked attention     query-key pairs
                       computes the full rectangle, not the causal half
paged_prefill_seqs     prefill rows in such steps (one gather + attention each)   sequences
linear_measured_s      the decoder layers' GEMMs at M = tokens, looked up in the  seconds
                       profile's measured ``gemm_tables`` (0 without tables)
lm_head_measured_s     the LM-head GEMM at M = rows, from the same tables         seconds
=====================  =========================================================  ==============

The first seven are the physical terms of any backend; the next four describe how the PyTorch
reference kernels (kernels/attention.py) do paged attention on a CPU, and a GPU fit typically
gives them zero weight. The last two carry measured GEMM curves: a GEMM's time is not linear in
its M dimension at small M (on this project's CPU, M = 3 rows took 3.4x the time of M = 1 and
1.7x that of M = 4: different kernels per shape), which no tile rounding describes; calibration
times the model's own linear layers at every small M and the fit weighs the curve (~1).

A step is *decode* when every row has q == 1, *prefill* when none has, else *mixed*.

Profile file (JSON), written by ``save_profile`` and read by ``FittedCostModel.from_profile``::

    {
      "format": "servesim-profile/2",
      "features": [...FEATURE_NAMES, in order...],
      "tile_tokens": 64,                      # the tile used for tokens_tiled
      "regimes": {                            # "prefill", "decode", "mixed", and/or "all";
        "decode": {"coef": [13 floats >= 0]}, # a missing regime falls back to "all", so either
        "prefill": {"coef": [...]},           # "all" or all three must be present; coefficients
        "mixed": {"coef": [...],              # are seconds per unit of each feature;
                  "floor_s": 0.033}           # optional host floor of the regime (below)
      },
      "overhead": {"step_s": 0.0, "per_seq_s": 0.0, "swap_bandwidth": null},
      "gemm_tables": {"tokens": [1, 2, ...], "linear_s": [...], "lm_head_s": [...]},  # or null
      "provenance": {...free-form: device, backend, model, date, commit, samples...},
      "held_out_error": {...free-form: e.g. "mape": 0.04, "p90_ape": 0.09, "n": 200...}
    }

``overhead`` holds host-side time the kernel timings did not see (seconds per step, seconds per
sequence) and the swap bandwidth in bytes/s (null: use the hardware preset's PCIe figure).
Step time = max(floor_s[regime], coef[regime] . step_features) + overhead.step_s + overhead.per_seq_s
* seqs + swap_bytes / swap_bandwidth. ``floor_s`` (default 0) is the time below which an engine's
steps do not go however small they are: an eager GPU engine that is host-bound below ~1.5k tokens
takes what its CPU needs to launch ~1,100 kernels, and the fitted terms describe the device above
it (calibration chooses it by cross-validation, README "Calibration"). ``servesim-profile/1`` files
(the first seven features only) still load: their missing coefficients are zero.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import importlib.util
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np
from pydantic import ValidationInfo, field_validator, model_validator

from .allreduce import Link
from .batch import StepSums
from .batch import step_sums as _step_sums
from .config_model import ConfigModel
from .errors import PresetError, ProfileError
from .layer_cost_model import GPU_PROFILE_FORMAT, LayerCostModel, whole_number
from .presets import (
    MODELS,
    HardwareConfig,
    ModelConfig,
    get_hardware,
    get_model,
    hardware_preset,
    kv_heads_per_rank,
)
from .varlen_attention import FA2VarlenAttention

PROFILE_FORMAT = "servesim-profile/2"
BASE_FEATURE_NAMES: tuple[str, ...] = (
    "tokens", "tokens_tiled", "prefill_attn_pairs", "decode_kv_tokens", "seqs", "prefill_seqs", "const",
)
EXTRA_FEATURE_NAMES: tuple[str, ...] = (
    "decode_padded_kv", "paged_prefill_kv", "paged_prefill_pairs", "paged_prefill_seqs",
    "linear_measured_s", "lm_head_measured_s",
)
FEATURE_NAMES = BASE_FEATURE_NAMES + EXTRA_FEATURE_NAMES
LEGACY_FORMATS = {"servesim-profile/1": BASE_FEATURE_NAMES}
REGIMES = ("prefill", "decode", "mixed")
TILE_TOKENS = 64


class CostModel(Protocol):
    def iteration_time(self, q_lens: np.ndarray, ctx_lens: np.ndarray, swap_bytes: float = 0.0) -> float:
        """Seconds one step takes; ``q_lens``/``ctx_lens`` are 1-D int arrays (tokens)."""
        ...


# The shipped models also answer ``step_time(sums, swap_bytes)`` from a step's ``Batch.sums``
# (``batch.step_sums`` of its rows), so the simulator computes each step's aggregates once and
# shares them with the metrics; ``iteration_time`` is the same computation from the raw rows. A
# model whose ``needs_rows`` is True prices from the rows and accepts ``sums=`` (the same
# aggregates) so the simulator does not compute them a second time.


def classify_step(q_lens: np.ndarray) -> Literal["prefill", "decode", "mixed", "empty"]:
    """Which regime a step belongs to: decode if every row has q == 1, prefill if none has."""
    n = len(q_lens)
    n_dec = int(np.count_nonzero(np.asarray(q_lens) == 1))
    if n == 0:
        return "empty"
    return "decode" if n_dec == n else "prefill" if n_dec == 0 else "mixed"


def _extra_sums(q: np.ndarray, ctx: np.ndarray, n_dec: int) -> tuple[int, int, int, int]:
    """(decode_padded_kv, paged_prefill_kv, paged_prefill_pairs, paged_prefill_seqs) of a step."""
    dec = q == 1
    padded = n_dec * (int(ctx[dec].max()) + 1) if n_dec else 0
    if n_dec == q.shape[0] or not ctx.any():  # no prefill rows, or a prefill-only step (no cache read)
        return padded, 0, 0, 0
    pre = ~dec
    qp, kv = q[pre], ctx[pre] + q[pre]
    return padded, int(kv.sum()), int(np.dot(qp, kv)), int(qp.shape[0])


class GemmTables:
    """Measured GEMM seconds against the M dimension: the decoder layers' and the LM head's.

    ``tokens`` ascending; between points linear interpolation, past the last point the last
    segment's slope (large-M GEMMs are linear in M) or flat where timing noise made that slope
    negative (a short, noisy table would otherwise price big steps below zero), at M = 0 zero.
    """

    def __init__(self, tokens: Sequence[int], linear_s: Sequence[float], lm_head_s: Sequence[float]) -> None:
        m = np.asarray(tokens, dtype=np.float64)
        lin, head = np.asarray(linear_s, dtype=np.float64), np.asarray(lm_head_s, dtype=np.float64)
        if m.ndim != 1 or len(m) < 2 or lin.shape != m.shape or head.shape != m.shape:
            raise ProfileError("gemm_tables needs tokens, linear_s and lm_head_s lists of one length (>= 2)")
        if not (np.all(np.diff(m) > 0) and m[0] >= 1):
            raise ProfileError("gemm_tables.tokens must be ascending integers >= 1")
        if not (np.all(np.isfinite(lin)) and np.all(np.isfinite(head)) and (lin >= 0).all() and (head >= 0).all()):
            raise ProfileError("gemm_tables seconds must be finite and >= 0")
        self.tokens, self.linear_s, self.lm_head_s = m, lin, head
        self._m, self._lin, self._head = m.tolist(), lin.tolist(), head.tolist()

    def _at(self, ys: list[float], x: int) -> float:
        m = self._m
        if x <= 0:
            return 0.0
        if x >= m[-1]:
            return ys[-1] + max(0.0, (ys[-1] - ys[-2]) / (m[-1] - m[-2])) * (x - m[-1])
        if x <= m[0]:
            return ys[0] * x / m[0]
        i = bisect.bisect_right(m, x)
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - m[i - 1]) / (m[i] - m[i - 1])

    def linear(self, tokens: int) -> float:
        return self._at(self._lin, tokens)

    def lm_head(self, rows: int) -> float:
        return self._at(self._head, rows)

    def to_dict(self) -> dict[str, list]:
        return {"tokens": [int(x) for x in self._m], "linear_s": self._lin, "lm_head_s": self._head}


def step_features(q_lens: np.ndarray, ctx_lens: np.ndarray, tile: int = TILE_TOKENS,
                  gemm: GemmTables | None = None) -> np.ndarray:
    """The ``FEATURE_NAMES`` vector (float64) of one step; all zeros for an empty step."""
    q = np.asarray(q_lens, dtype=np.int64)
    ctx = np.asarray(ctx_lens, dtype=np.int64)
    if q.shape[0] == 0:
        return np.zeros(len(FEATURE_NAMES))
    n, n_dec, tokens, pairs, decode_kv, _ = _step_sums(q, ctx)
    tiled = -(-tokens // tile) * tile
    measured = (gemm.linear(tokens), gemm.lm_head(n)) if gemm else (0.0, 0.0)
    return np.array([tokens, tiled, pairs, decode_kv, n, n - n_dec, 1.0, *_extra_sums(q, ctx, n_dec), *measured],
                    dtype=np.float64)


# --------------------------------------------------------------------------------------------------
# Roofline


# Terms of a roofline step, in ``RooflineCostModel.breakdown`` order.
ROOFLINE_TERMS = ("linear", "lm_head", "sampler", "small_ops", "attention", "all_reduce", "swap", "host")
# vLLM's sampler on a step's logits: a handful of kernels (fp32 cast, penalties/temperature,
# softmax, top-k/p, the draw) and about two full passes over the fp32 logits. LLMServingSim's
# per_sequence.csv sampler rows (RTX PRO 6000 and RTX 4090): ~25 us at 1 sequence (eight 3 us
# floors) and, from 64 to 256 sequences, 1.9-2.4 passes of n x vocab x 4 bytes at peak bandwidth.
SAMPLER_KERNELS = 8
SAMPLER_LOGIT_PASSES = 2
# A GEMM's memory and compute times combine as (mem^p + compute^p)^(1/p): the larger of the two
# far from the ridge point, 2^(1/p) times it at the ridge, where measured GEMMs are slower than
# either bound (RTX PRO 6000 Llama-3.1-8B gate_up at 256 rows: 206 us against 154 / 149 us; H100
# gate at 512 rows: 93 us against 39 / 78 us) -- but not everywhere as much (RTX 4090 gate_up at
# 256 rows: 378 us against 245 / 364 us). Of p = 2, 2.5, 3, 4, 2.5 leaves the fewest points of
# benchmarks/roofline_vs_measured.py outside +-10 % and the smallest worst error.
GEMM_BLEND = 2.5
_INV_BLEND = 1 / GEMM_BLEND
_FIXED_CACHE = 4096  # (rows, tokens) shapes whose size-only terms a roofline keeps


class RooflineCostModel:
    """Datasheet peaks times measured fractions, kernel by kernel, summed over one step.

    The kernels of a vLLM-style Llama step and what bounds each (T = tokens, n = sequences):

    - linear: the decoder layers' four GEMMs (QKV, O, gate/up, down) stream the weights once per
      step and do 2 FLOPs per weight per token (T padded to the GEMM tile). Memory and compute
      times combine as a ``GEMM_BLEND``-norm: the larger far from the ridge point, more than
      either near it, as measured GEMMs are.
    - lm_head: the same for the vocabulary projection at n rows (logits of each sequence's last
      position only); sampler: a few kernels plus ``SAMPLER_LOGIT_PASSES`` fp32 passes over n x vocab.
    - small_ops: per layer two fused residual-add + RMSNorms, rotary on q and k, the SwiGLU
      activation (and Qwen3's q/k norms), plus the embedding gather and final norm per step:
      memory-bound passes over the activations.
    - attention: decode rows read their KV (ctx + 1 tokens each); prefill rows are compute-bound
      (4 * heads * head_dim FLOPs per query-key pair per layer, floored by their KV read); every
      new token's K and V is written to the cache. On hardware where vLLM runs FlashAttention 2
      (``HardwareConfig.flash_attention``), a step with a prefill row is instead priced as FA2's
      varlen kernel runs it (``sim/varlen_attention.py``): thread blocks of 64 query rows per
      sequence and query head on the SMs, no KV split, so each decode row next to a prefill chunk
      is a block per query head walking its whole context alone. Decode-only steps keep the KV
      read (FA2's split-KV decode path reaches it).
    - all_reduce: with tensor parallelism, two ring all-reduces of the hidden states per layer and
      one after the embedding, each a per-call latency plus the ring's bytes over the hardware's
      link (``sim/allreduce.py``).
    - swap (KV bytes over PCIe) and host (scheduler and launch per step, per sequence).

    Every kernel also pays the hardware's ``kernel_floor_s`` (launch, ramp-up, tail). Rates are the
    peaks times the hardware's measured fractions (``HardwareConfig``); ``flops_efficiency`` and
    ``bandwidth_efficiency`` override the GEMM FLOP/s and weight-streaming fractions. With tensor
    parallelism compute, weights, heads and the intermediate size are split over ``tp`` ranks;
    norms and the embedding are replicated, and the vocabulary is split for the LM head.
    """

    def __init__(self, model: ModelConfig, hardware: HardwareConfig, tensor_parallel: int = 1,
                 flops_efficiency: float | None = None, bandwidth_efficiency: float | None = None,
                 # vLLM v1 with CUDA graphs: the CPU schedules, prepares inputs and launches the
                 # graph in ~0.3-1 ms per step on a modern host; per-request bookkeeping (input
                 # tensors, sampler, output processing) adds a few us per sequence, so a batch of
                 # 256 pays ~1.3 ms. Whole-ms figures belong to pre-v0.6 vLLM.
                 step_overhead_s: float = 0.5e-3, per_seq_overhead_s: float = 5e-6,
                 # TP all-reduce: the hardware's link (sim/allreduce.py, fitted to Vidur's NCCL
                 # timings where measured); these two override its efficiency and per-call latency.
                 tp_comm_efficiency: float | None = None, tp_comm_latency_s: float | None = None,
                 tile_tokens: int | None = None) -> None:
        tp, m, hw = tensor_parallel, model, hardware
        kv_per_rank = kv_heads_per_rank(model, tp)
        self.model, self.hardware, self.tp = model, hardware, tp
        self.flops_efficiency = hw.gemm_flops_fraction if flops_efficiency is None else flops_efficiency
        self.bandwidth_efficiency = hw.weight_bandwidth_fraction if bandwidth_efficiency is None \
            else bandwidth_efficiency
        self.step_overhead_s, self.per_seq_overhead_s = step_overhead_s, per_seq_overhead_s
        link = Link.of(hw)
        self.link = Link(link.bandwidth, link.efficiency if tp_comm_efficiency is None else tp_comm_efficiency,
                         link.latency_s if tp_comm_latency_s is None else tp_comm_latency_s, link.hop_latency_s)
        self.tp_comm_efficiency, self.tp_comm_latency_s = self.link.efficiency, self.link.latency_s
        self.tile = tile_tokens or hw.gemm_tile_tokens
        floor, dt, L = hw.kernel_floor_s, m.dtype_bytes, m.num_layers
        h, d, inter = m.hidden_size, m.head_dim, m.intermediate_size / tp
        q_heads, kv_heads = m.num_heads / tp, kv_per_rank

        self._flops_rate = hw.peak_flops * self.flops_efficiency
        self._weight_rate = hw.hbm_bandwidth * self.bandwidth_efficiency
        self._stream_rate = hw.hbm_bandwidth * hw.stream_bandwidth_fraction
        self._attn_rate = hw.peak_flops * hw.attention_flops_fraction
        # linear: weights once per step, activations in and out of every GEMM per token
        qkv = (q_heads + 2 * kv_heads) * d
        gemm_act = (h + qkv) + (q_heads * d + h) + (h + 2 * inter) + (inter + h)
        self._layer_weight_s = L * m.layer_matmul_params / tp * dt / self._weight_rate
        self._layer_act_s = L * gemm_act * dt / self._weight_rate
        self._layer_flop_s = 2 * L * m.layer_matmul_params / tp / self._flops_rate
        self._gemm_floors = 4 * L * floor
        # LM head (vocab split over ranks, then gathered) and sampler on the full vocabulary
        self._head_weight_s = m.embedding_params / tp * dt / self._weight_rate
        self._head_floor = floor
        self._head_flop_s = 2 * m.embedding_params / tp / self._flops_rate
        self._sampler_fixed = SAMPLER_KERNELS * floor
        self._sampler_per_seq = SAMPLER_LOGIT_PASSES * m.vocab_size * 4 / self._stream_rate
        # small ops: 2 x (add + RMSNorm: read x and residual, write both), rotary (read and write q,
        # k), SwiGLU (read gate and up, write), Qwen3's q/k norms; embedding gather and final norm
        per_layer = 2 * 4 * h + 2 * (q_heads + kv_heads) * d + 3 * inter
        kernels = 4
        if m.qk_norm:
            per_layer += 2 * (q_heads + kv_heads) * d
            kernels += 1
        self._small_fixed = (kernels * L + 2) * floor
        self._small_per_token = (L * per_layer + 2 * h + 4 * h) * dt / self._stream_rate
        # attention: KV cache write and the attention kernel per layer
        self._kv_bytes_per_token = 2 * L * kv_per_rank * d * dt
        self._kv_s = self._kv_bytes_per_token / self._stream_rate
        self._attn_fixed = 2 * L * floor
        self._pair_s = m.attention_flops_per_pair / tp / self._attn_rate
        self._varlen = FA2VarlenAttention(m, hw, kv_per_rank, m.num_heads // tp, self._stream_rate) \
            if hw.flash_attention == 2 and hw.sm_count else None
        # decode-only steps as FA2's thread-block waves, on GPUs whose decode latency was measured
        self._decode_waves = self._varlen if self._varlen is not None and hw.fa2_decode_tile_s else None
        self._pcie = hw.pcie_bandwidth
        # all-reduces of the hidden states: two per layer (after O and after down) and one after the
        # vocabulary-parallel embedding, as the GPU profiles' link spec counts them; 0 at tp 1
        n_ar = 2 * L + 1
        self._ar_fixed = n_ar * self.link.call_s(tp)
        self._ar_per_token = n_ar * self.link.per_byte_s(tp) * h * dt
        # a step's (linear + head + sampler + small, comm, host) by its rows and tokens: only its
        # attention (and swaps) depend on more
        self._fixed: dict[tuple[int, int], tuple[float, float, float]] = {}

    @property
    def mixed_needs_rows(self) -> bool:
        """True when a step with both decode and prefill rows is priced better from its rows (the
        FA2 varlen term reads the longest decode context): the engine then prices such steps with
        ``iteration_time(q, ctx, sums=...)``, every other step with ``step_time``."""
        return self._varlen is not None

    def iteration_time(self, q_lens: np.ndarray, ctx_lens: np.ndarray, swap_bytes: float = 0.0,
                       sums: StepSums | None = None, longest_decode_kv: int | None = None) -> float:
        """Seconds for one step (see the class docstring); 0 for an empty step without swaps.
        ``sums``: the rows' ``step_sums`` when the caller has them already; ``longest_decode_kv``:
        likewise the largest ctx + 1 of a row with q == 1 (``Batch.longest_decode_kv``)."""
        if q_lens.shape[0] == 0:
            return swap_bytes / self._pcie if swap_bytes else 0.0
        if sums is None:
            sums = _step_sums(q_lens, ctx_lens)
        longest = None
        if self._varlen is not None and sums[3] and sums[1]:
            longest = longest_decode_kv
            if longest is None:
                longest = int(np.maximum.reduce(ctx_lens[q_lens == 1])) + 1
        return self.step_time(sums, swap_bytes, longest)

    def step_time(self, sums: tuple[int, int, int, int, int, int], swap_bytes: float = 0.0,
                  longest_decode_kv: int | None = None) -> float:
        """``iteration_time`` from a step's ``step_sums``: the sum of ``_terms``, added in the same
        order, with the terms that depend only on the step's rows and tokens looked up.
        ``longest_decode_kv``: the largest decode ctx + 1 of a mixed step (None: the mean).
        The compiled engine prices large runs' steps with a twin of this arithmetic
        (``compiled_price.price``): a change here goes there too (``tests/test_compiled_price.py``)."""
        n, n_dec, tokens, pairs, decode_kv, prefill_kv = sums
        if n == 0:
            return sum(self._terms(sums, swap_bytes, longest_decode_kv))
        # every term but attention and swap depends on (rows, tokens) alone: looked up, then added
        # in _terms' order, so the sum is the same float
        key = (n, tokens)
        fixed = self._fixed.get(key)
        if fixed is None:
            linear, head, sampler, small, _, comm, _, host = self._terms((n, n, tokens, 0, 0, 0), 0.0)
            fixed = (linear + head + sampler + small, comm, host)
            if len(self._fixed) >= _FIXED_CACHE:
                self._fixed.clear()
            self._fixed[key] = fixed
        lead, comm, host = fixed
        swap = swap_bytes / self._pcie if swap_bytes else 0.0
        if pairs or self._decode_waves is not None:
            attn = self._attention(n, n_dec, tokens, pairs, decode_kv, prefill_kv, longest_decode_kv)
        else:
            attn = self._attn_fixed + (decode_kv + tokens) * self._kv_s
        return lead + attn + comm + swap + host

    def breakdown(self, sums: tuple[int, int, int, int, int, int], swap_bytes: float = 0.0,
                  longest_decode_kv: int | None = None) -> dict[str, float]:
        """``step_time`` split into its terms (seconds), named in ``ROOFLINE_TERMS``."""
        return dict(zip(ROOFLINE_TERMS, self._terms(sums, swap_bytes, longest_decode_kv), strict=True))

    def _terms(self, sums: tuple[int, int, int, int, int, int], swap_bytes: float,
               longest_decode_kv: int | None = None) -> tuple[float, ...]:
        swap = swap_bytes / self._pcie if swap_bytes else 0.0
        n, n_dec, tokens, pairs, decode_kv, prefill_kv = sums
        if n == 0:
            return 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, swap, 0.0
        mem = self._layer_weight_s + tokens * self._layer_act_s
        flop = -(-tokens // self.tile) * self.tile * self._layer_flop_s
        linear = (mem ** GEMM_BLEND + flop ** GEMM_BLEND) ** _INV_BLEND + self._gemm_floors
        head_flop = n * self._head_flop_s
        head = (self._head_weight_s ** GEMM_BLEND + head_flop ** GEMM_BLEND) ** _INV_BLEND + self._head_floor
        sampler = self._sampler_fixed + n * self._sampler_per_seq
        small = self._small_fixed + tokens * self._small_per_token
        attn = self._attention(n, n_dec, tokens, pairs, decode_kv, prefill_kv, longest_decode_kv)
        comm = self._ar_fixed + tokens * self._ar_per_token
        host = self.step_overhead_s + n * self.per_seq_overhead_s
        return linear, head, sampler, small, attn, comm, swap, host

    def _attention(self, n: int, n_dec: int, tokens: int, pairs: int, decode_kv: float, prefill_kv: int,
                   longest_decode_kv: int | None = None) -> float:
        """The attention term of ``_terms``: every layer's KV write, launch floors and kernel."""
        if pairs and self._varlen is not None:
            return self._attn_fixed + tokens * self._kv_s \
                + self.model.num_layers * self._varlen.layer_s(n, n_dec, tokens, decode_kv, prefill_kv,
                                                               longest_decode_kv)
        if not pairs and decode_kv and self._decode_waves is not None:
            # the KV read, or FA2's decode blocks in waves where they take longer (short contexts)
            layers = self.model.num_layers
            waves, merge = self._decode_waves.decode_waves_s(n_dec, decode_kv)
            return self._attn_fixed + tokens * self._kv_s + max(decode_kv * self._kv_s, layers * waves) \
                + layers * merge
        attn = self._attn_fixed + (decode_kv + tokens) * self._kv_s
        if pairs:
            attn += max(pairs * self._pair_s, prefill_kv * self._kv_s)
        return attn

    def attention_layer_s(self, pc: float, kp: float, n: float, kv: float) -> float:
        """One layer's attention term for the shape of a GPU profile's attention table: a ``pc``-token
        prefill chunk over ``kp`` cached tokens beside ``n`` decode rows of ``kv`` cached tokens each
        (``pc`` or ``n`` 0: that part absent). The shape a profile's ``roofline`` reading follows
        between its measured nodes (``sim/layer_cost_model.py``)."""
        kp = kp if pc else 0.0
        pairs = pc * kp + pc * (pc + 1) / 2
        return self._attention(n + (pc > 0), n, pc + n, pairs, n * (kv + 1), kp + pc) / self.model.num_layers

    def loop_overhead(self, rows: int) -> float:
        """Seconds of host (scheduler, engine loop) time that ``iteration_time`` adds to a step."""
        return self.step_overhead_s + rows * self.per_seq_overhead_s

    def describe(self) -> dict[str, Any]:
        """The constants behind the predictions (rates in FLOP/s and bytes/s, times in seconds)."""
        hw = self.hardware
        return {
            "type": "roofline", "model": self.model.name, "hardware": hw.name,
            "tensor_parallel": self.tp, "flops_efficiency": self.flops_efficiency,
            "bandwidth_efficiency": self.bandwidth_efficiency, "effective_flops": self._flops_rate,
            "effective_bandwidth": self._weight_rate, "stream_bandwidth": self._stream_rate,
            "attention_flops": self._attn_rate, "kernel_floor_s": hw.kernel_floor_s, "tile_tokens": self.tile,
            "weight_bytes_per_rank": self.model.streamed_weight_bytes / self.tp,
            "kv_bytes_per_token_per_rank": self._kv_bytes_per_token,
            "step_overhead_s": self.step_overhead_s, "per_seq_overhead_s": self.per_seq_overhead_s,
            "tp_comm_efficiency": self.tp_comm_efficiency, "tp_comm_latency_s": self.tp_comm_latency_s,
            "tp_comm_hop_latency_s": self.link.hop_latency_s, "interconnect": hw.interconnect,
            "pcie_bandwidth": self._pcie,
            "varlen_attention": None if self._varlen is None else {
                "kernel": "flash-attention 2 varlen", "sm_count": self._varlen.sms,
                "tile_s": self._varlen.tile_s, "empty_cta_s": self._varlen.empty_cta_s,
                # decode-only steps as thread-block waves (None: priced as a KV read)
                "decode_tile_s": self._varlen.decode_tile_s,
                "decode_merge_s": self._varlen.decode_merge_s if self._varlen.decode_tile_s else None},
        }


# --------------------------------------------------------------------------------------------------
# Fitted profile


def _check_floor(regime: str, floor: Any) -> float:
    if isinstance(floor, bool) or not isinstance(floor, int | float) or not (math.isfinite(floor) and floor >= 0):
        raise ProfileError(f"regimes.{regime}.floor_s must be a number of seconds >= 0, got {floor!r}")
    return float(floor)


MAX_COEF_S = 1e3  # seconds per unit of any feature a fitted profile may weigh


def _overhead_seconds(overhead: Mapping[str, Any], key: str) -> float:
    value = overhead.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
        raise ProfileError(f"overhead.{key} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _check_coef(regime: str, coef: Any, num_features: int = len(FEATURE_NAMES)) -> tuple[float, ...]:
    if not isinstance(coef, Sequence) or len(coef) != num_features:
        raise ProfileError(f"regimes.{regime}.coef must be a list of {num_features} numbers "
                           f"(one per feature), got {coef!r}")
    try:
        values = tuple(float(c) for c in coef)
    except (TypeError, ValueError):
        raise ProfileError(f"regimes.{regime}.coef must hold numbers, got {coef!r}") from None
    if not all(math.isfinite(c) and c >= 0.0 for c in values):
        raise ProfileError(f"regimes.{regime}.coef must be finite and >= 0, got {list(values)}")
    if max(values, default=0.0) > MAX_COEF_S:  # (1e300 overflowed every step time to inf)
        raise ProfileError(f"regimes.{regime}.coef holds {max(values):g} seconds per unit of a feature; no step "
                           f"costs more than {MAX_COEF_S:g} s a token, pair or row: the profile is corrupt, refit it")
    # a legacy profile's missing features get zero weight
    return values + (0.0,) * (len(FEATURE_NAMES) - num_features)


class Coefficients(NamedTuple):
    """One regime's seconds per unit of each feature, named as in ``FEATURE_NAMES``."""

    tokens: float
    tokens_tiled: float
    prefill_attn_pairs: float
    decode_kv_tokens: float
    seqs: float
    prefill_seqs: float
    const: float
    decode_padded_kv: float
    paged_prefill_kv: float
    paged_prefill_pairs: float
    paged_prefill_seqs: float
    linear_measured_s: float
    lm_head_measured_s: float


assert Coefficients._fields == FEATURE_NAMES, "Coefficients must name FEATURE_NAMES in order"


class FittedCostModel:
    """Per-regime non-negative coefficients dotted with ``step_features`` (see module docstring)."""

    def __init__(self, coefs: Mapping[str, Sequence[float]], *, tile_tokens: int = TILE_TOKENS,
                 overhead: Mapping[str, Any] | None = None, swap_bandwidth: float | None = None,
                 provenance: Mapping[str, Any] | None = None,
                 held_out_error: Mapping[str, Any] | None = None, num_features: int = len(FEATURE_NAMES),
                 gemm_tables: GemmTables | Mapping[str, Any] | None = None,
                 floors: Mapping[str, float] | None = None) -> None:
        """``coefs`` maps regime ("prefill"/"decode"/"mixed"/"all") to one coefficient per feature;
        ``floors`` a regime to its host floor in seconds (absent: 0).

        ``swap_bandwidth`` (bytes/s) is used when the profile's overhead does not name one;
        ``num_features`` < 13 reads a legacy coefficient list (the first features only).
        """
        unknown = set(coefs) - {*REGIMES, "all"}
        if unknown:
            raise ProfileError(f"unknown regime(s) {sorted(unknown)}; use prefill, decode, mixed or all")
        checked = {r: _check_coef(r, c, num_features) for r, c in coefs.items()}
        missing = [r for r in REGIMES if r not in checked]
        if missing and "all" not in checked:
            raise ProfileError(f"profile lacks regime(s) {missing} and has no 'all' regime to fall back on")
        if not isinstance(tile_tokens, int) or tile_tokens < 1:
            raise ProfileError(f"tile_tokens must be a positive integer, got {tile_tokens!r}")
        self.coefs = checked
        self.floors = {r: v for r, f in (floors or {}).items() if f is not None and (v := _check_floor(r, f))}
        if set(self.floors) - set(checked):
            raise ProfileError(f"floor_s given for regime(s) without coefficients: {sorted(set(self.floors) - set(checked))}")
        self.tile = tile_tokens
        self.overhead = dict(overhead or {})
        self.provenance = dict(provenance or {})
        self.held_out_error = dict(held_out_error or {})
        unknown = set(self.overhead) - {"step_s", "per_seq_s", "swap_bandwidth"}
        if unknown:
            raise ProfileError(f"unknown overhead key(s) {sorted(unknown)}; use step_s, per_seq_s, swap_bandwidth")
        self._step_s = _overhead_seconds(self.overhead, "step_s")
        self._per_seq_s = _overhead_seconds(self.overhead, "per_seq_s")
        bw = self.overhead.get("swap_bandwidth")
        if bw is not None and (isinstance(bw, bool) or not isinstance(bw, int | float) or not bw > 0):
            raise ProfileError(f"overhead.swap_bandwidth must be > 0 bytes/s, got {bw!r}")
        bw = bw or swap_bandwidth
        self._swap_bw = float(bw) if bw else math.inf
        self._dec, self._pre, self._mix = (Coefficients(*checked.get(r, checked.get("all")))
                                           for r in ("decode", "prefill", "mixed"))
        # a regime without coefficients of its own falls back to "all", and so does its floor
        self._floor_dec, self._floor_pre, self._floor_mix = (
            self.floors.get(r if r in checked else "all", 0.0) for r in ("decode", "prefill", "mixed"))
        self._extras = any(any(c[len(BASE_FEATURE_NAMES):]) for c in checked.values())
        if isinstance(gemm_tables, Mapping):
            try:
                gemm_tables = GemmTables(gemm_tables["tokens"], gemm_tables["linear_s"], gemm_tables["lm_head_s"])
            except (KeyError, TypeError, ValueError) as exc:
                if isinstance(exc, ProfileError):
                    raise
                raise ProfileError(f"gemm_tables must have tokens, linear_s and lm_head_s lists: {exc}") from None
        self.gemm = gemm_tables
        measured = [n for i, n in enumerate(FEATURE_NAMES) if n.endswith("_measured_s")
                    and any(c[i] for c in checked.values())]
        if measured and gemm_tables is None:
            raise ProfileError(f"the coefficients weigh {', '.join(measured)} (read from the measured GEMM tables) "
                               "but the profile has no gemm_tables; restore them or refit the profile")

    @classmethod
    def from_profile(cls, path: str | Path, swap_bandwidth: float | None = None) -> FittedCostModel:
        """Load a ``servesim-profile/2`` (or /1) JSON file; ``ProfileError`` says what is wrong with it."""
        path = Path(path)
        data = read_profile_json(path)
        try:
            return cls.from_profile_dict(data, swap_bandwidth=swap_bandwidth)
        except ProfileError as exc:
            raise ProfileError(f"{path}: {exc}") from None

    @classmethod
    def from_profile_dict(cls, data: Any, swap_bandwidth: float | None = None) -> FittedCostModel:
        """Build from an already-parsed profile dict (same checks as ``from_profile``)."""
        fmt = data.get("format") if isinstance(data, dict) else type(data).__name__
        features = FEATURE_NAMES if fmt == PROFILE_FORMAT else LEGACY_FORMATS.get(fmt)
        if features is None:
            raise ProfileError(f"not a servesim profile: format is {fmt!r}, expected {PROFILE_FORMAT!r}")
        if data.get("features") != list(features):
            raise ProfileError(f"features {data.get('features')!r} do not match {fmt}'s "
                               f"{list(features)}; refit the profile")
        regimes = data.get("regimes")
        if not isinstance(regimes, dict) or not regimes:
            raise ProfileError("regimes must be a non-empty object like {\"all\": {\"coef\": [...]}}")
        coefs, floors = {}, {}
        for name, body in regimes.items():
            if not isinstance(body, dict) or "coef" not in body:
                raise ProfileError(f"regimes.{name} must be an object with a 'coef' list")
            unknown = set(body) - {"coef", "floor_s"}
            if unknown:
                raise ProfileError(f"regimes.{name}: unknown key(s) {sorted(unknown)}; use coef and floor_s")
            coefs[name] = body["coef"]
            floors[name] = body.get("floor_s", 0.0)
        return cls(coefs, tile_tokens=data.get("tile_tokens", TILE_TOKENS), overhead=data.get("overhead"),
                   swap_bandwidth=swap_bandwidth, provenance=data.get("provenance"),
                   held_out_error=data.get("held_out_error"), num_features=len(features),
                   gemm_tables=data.get("gemm_tables"), floors=floors)

    def to_profile_dict(self) -> dict[str, Any]:
        """This model as a profile dict (what ``save_profile`` writes)."""
        return to_profile_dict(self.coefs, tile_tokens=self.tile, overhead=self.overhead,
                               provenance=self.provenance, held_out_error=self.held_out_error,
                               gemm_tables=self.gemm.to_dict() if self.gemm else None, floors=self.floors)

    @property
    def needs_rows(self) -> bool:
        """True when a non-zero coefficient weighs a row-level feature (padded decode KV, paged
        prefill, measured GEMMs): then only ``iteration_time`` (the rows), not ``step_time`` (the
        step's sums), can price a step."""
        return self._extras

    def loop_overhead(self, rows: int) -> float:
        """Seconds of engine-loop work (outside the executor) that ``iteration_time`` adds to a step."""
        return self._step_s + self._per_seq_s * rows

    def iteration_time(self, q_lens: np.ndarray, ctx_lens: np.ndarray, swap_bytes: float = 0.0,
                       sums: StepSums | None = None) -> float:
        """Seconds for one step: coef[regime] . step_features + overheads + swap. ``sums``: the rows'
        ``step_sums`` when the caller has them already (``Batch.sums``), else computed here."""
        if q_lens.shape[0] == 0:
            return swap_bytes / self._swap_bw if swap_bytes else 0.0
        if sums is None:
            sums = _step_sums(q_lens, ctx_lens)
        t = self._base_time(sums, swap_bytes)
        if self._extras:
            n, n_dec, tokens = sums.seqs, sums.decode_seqs, sums.tokens
            c = self._dec if n_dec == n else self._pre if n_dec == 0 else self._mix
            padded, pkv, ppairs, pseqs = _extra_sums(q_lens, ctx_lens, n_dec)
            t += (c.decode_padded_kv * padded + c.paged_prefill_kv * pkv + c.paged_prefill_pairs * ppairs
                  + c.paged_prefill_seqs * pseqs)
            if self.gemm is not None:
                t += c.linear_measured_s * self.gemm.linear(tokens) + c.lm_head_measured_s * self.gemm.lm_head(n)
        return self._floored(t, sums, swap_bytes) if self.floors else t

    def step_time(self, sums: StepSums, swap_bytes: float = 0.0) -> float:
        """``iteration_time`` from a step's ``step_sums``; only for profiles without row-level terms."""
        if self._extras:
            raise ValueError("this profile weighs row-level features; price the step with iteration_time(q, ctx)")
        t = self._base_time(sums, swap_bytes)
        return self._floored(t, sums, swap_bytes) if self.floors and sums[0] else t

    def _floored(self, t: float, sums: StepSums, swap_bytes: float) -> float:
        """``t`` with its executor part (all but the engine loop and the swap) raised to the regime's floor."""
        n, n_dec = sums[0], sums[1]
        floor = self._floor_dec if n_dec == n else self._floor_pre if n_dec == 0 else self._floor_mix
        if not floor:
            return t
        outside = self._step_s + self._per_seq_s * n + (swap_bytes / self._swap_bw if swap_bytes else 0.0)
        return max(t - outside, floor) + outside

    def _base_time(self, sums: StepSums, swap_bytes: float) -> float:
        swap = swap_bytes / self._swap_bw if swap_bytes else 0.0
        n, n_dec, tokens, pairs, decode_kv, _ = sums
        if n == 0:
            return swap
        c = self._dec if n_dec == n else self._pre if n_dec == 0 else self._mix
        tiled = -(-tokens // self.tile) * self.tile
        return (c.tokens * tokens + c.tokens_tiled * tiled + c.prefill_attn_pairs * pairs
                + c.decode_kv_tokens * decode_kv + c.seqs * n + c.prefill_seqs * (n - n_dec) + c.const
                + self._step_s + self._per_seq_s * n + swap)

    def describe(self) -> dict[str, Any]:
        return {"type": "profile", **self.to_profile_dict()}


def to_profile_dict(coefs: Mapping[str, Sequence[float]], *, tile_tokens: int = TILE_TOKENS,
                    overhead: Mapping[str, Any] | None = None, provenance: Mapping[str, Any] | None = None,
                    held_out_error: Mapping[str, Any] | None = None,
                    gemm_tables: Mapping[str, Any] | None = None,
                    floors: Mapping[str, float] | None = None) -> dict[str, Any]:
    """A ``servesim-profile/2`` dict from fitted coefficients (seconds per feature unit) and the
    regimes' host floors (seconds; written only where non-zero)."""
    floors = floors or {}
    return {
        "format": PROFILE_FORMAT,
        "features": list(FEATURE_NAMES),
        "tile_tokens": int(tile_tokens),
        "regimes": {r: {"coef": [float(c) for c in cs], **({"floor_s": float(floors[r])} if floors.get(r) else {})}
                    for r, cs in coefs.items()},
        "overhead": {"step_s": 0.0, "per_seq_s": 0.0, "swap_bandwidth": None, **(overhead or {})},
        "gemm_tables": dict(gemm_tables) if gemm_tables else None,
        "provenance": dict(provenance or {}),
        "held_out_error": dict(held_out_error or {}),
    }


def save_profile(path: str | Path, profile: Mapping[str, Any]) -> Path:
    """Validate ``profile`` (a dict from ``to_profile_dict``) and write it as JSON; returns the path."""
    FittedCostModel.from_profile_dict(dict(profile))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n")
    return path


# --------------------------------------------------------------------------------------------------
# Constant


class ConstantCostModel:
    """step_s + per_token_s * total tokens per non-empty step; swaps at ``swap_bandwidth`` bytes/s."""

    def __init__(self, step_s: float, per_token_s: float = 0.0, swap_bandwidth: float = math.inf) -> None:
        self.step_s, self.per_token_s, self.swap_bandwidth = step_s, per_token_s, swap_bandwidth

    def iteration_time(self, q_lens: np.ndarray, ctx_lens: np.ndarray, swap_bytes: float = 0.0) -> float:
        swap = swap_bytes / self.swap_bandwidth if swap_bytes else 0.0
        if q_lens.shape[0] == 0:
            return swap
        return self.step_s + self.per_token_s * int(q_lens.sum()) + swap

    def step_time(self, sums: StepSums, swap_bytes: float = 0.0) -> float:
        """``iteration_time`` from a step's ``step_sums``."""
        swap = swap_bytes / self.swap_bandwidth if swap_bytes else 0.0
        if sums.seqs == 0:
            return swap
        return self.step_s + self.per_token_s * sums.tokens + swap

    def describe(self) -> dict[str, Any]:
        return {"type": "constant", "step_s": self.step_s, "per_token_s": self.per_token_s}


# --------------------------------------------------------------------------------------------------
# Config


class CostModelConfig(ConfigModel):
    """The ``cost_model:`` section of a scenario. Times in milliseconds."""

    type: Literal["roofline", "profile", "constant"] = "roofline"
    path: str | None = None  # profile JSON; relative paths also searched in servesim.calibration
    flops_efficiency: float | None = None
    bandwidth_efficiency: float | None = None
    step_overhead_ms: float | None = None
    per_seq_overhead_ms: float | None = None
    step_ms: float | None = None
    per_token_ms: float | None = None

    @field_validator("flops_efficiency", "bandwidth_efficiency")
    @classmethod
    def _efficiency(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is not None and not 0.0 < v <= 1.0:
            raise ValueError(f"{info.field_name} must be in (0, 1], got {v}")
        return v

    @field_validator("step_overhead_ms", "per_seq_overhead_ms", "step_ms", "per_token_ms")
    @classmethod
    def _non_negative(cls, v: float | None, info: ValidationInfo) -> float | None:
        if v is not None and not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{info.field_name} must be a finite number >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _fields_match_type(self) -> CostModelConfig:
        if self.type == "profile" and not self.path:
            raise ValueError("path is required when type is 'profile' (e.g. path: profiles/cpu-tiny.json)")
        if self.type == "constant" and self.step_ms is None:
            raise ValueError("step_ms is required when type is 'constant'")
        own = {"roofline": {"flops_efficiency", "bandwidth_efficiency", "step_overhead_ms", "per_seq_overhead_ms"},
               "profile": {"path"}, "constant": {"step_ms", "per_token_ms"}}
        stray = sorted(f for t, fs in own.items() if t != self.type for f in fs if getattr(self, f) is not None)
        if stray:
            raise ValueError(f"{', '.join(stray)} set but type is '{self.type}': remove it or change type")
        return self


def resolve_profile_path(path: str | Path) -> Path:
    """Find a profile: as given (absolute or from the current dir), then inside servesim.calibration.

    ``profiles/cpu-tiny.json`` and ``cpu-tiny.json`` both find the shipped
    ``calibration/profiles/cpu-tiny.json`` from any directory.
    """
    path = Path(path)
    tried = [path if path.is_absolute() else Path.cwd() / path]
    spec = importlib.util.find_spec("servesim.calibration")
    if not path.is_absolute() and spec and spec.submodule_search_locations:
        pkg = Path(next(iter(spec.submodule_search_locations)))
        tried += [pkg / path, pkg / "profiles" / path]
    for candidate in tried:
        if candidate.is_file():
            return candidate
    raise ProfileError(f"profile {str(path)!r} not found; tried: {', '.join(map(str, dict.fromkeys(tried)))}")


def read_profile_json(path: Path) -> Any:
    """A profile file's parsed JSON; ``ProfileError`` when it is missing or not JSON."""
    return _parse_profile(path, _profile_bytes(path))


def _profile_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ProfileError(f"profile file {str(path)!r} not found") from None
    except OSError as exc:
        raise ProfileError(f"cannot read profile {str(path)!r}: {exc}") from None


def _parse_profile(path: Path, raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ProfileError(f"profile {str(path)!r} is not UTF-8 JSON (byte 0x{exc.object[exc.start]:02x} at offset "
                           f"{exc.start}); profiles are written by servesim calibrate") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"cannot read profile {str(path)!r}: {exc}") from None
    except RecursionError:
        raise ProfileError(f"cannot read profile {str(path)!r}: JSON nested too deeply") from None


def load_profile(path: str | Path, swap_bandwidth: float | None = None) -> LayerCostModel | FittedCostModel:
    """The cost model a profile file describes: ``LayerCostModel`` for ``servesim-gpu-profile/1``,
    ``FittedCostModel`` for ``servesim-profile/*`` (the JSON is read once).

    A GPU profile's model is kept per process while its file is unchanged (path and bytes):
    one read ``roofline`` prices the roofline at every node of its table when built (~0.2 s), and a
    scenario's check, its simulation and every point of a plan or sweep load the same file.
    ``LayerCostModel`` is read-only once built (``describe`` hands out copies)."""
    path = Path(path)
    raw = _profile_bytes(path)  # read once: the cache key hashes these bytes, the parse reads them
    # (the bytes, not the mtime: a file rewritten within the clock's tick keeps its mtime)
    key = (str(path.resolve()), hashlib.sha1(raw).hexdigest(), swap_bandwidth)
    if (model := _GPU_PROFILES.get(key)) is not None:
        return model
    data = _parse_profile(path, raw)
    try:
        if isinstance(data, Mapping) and data.get("format") == GPU_PROFILE_FORMAT:
            model = LayerCostModel(data, swap_bandwidth=swap_bandwidth, attention_shape=roofline_attention_shape(data))
            if len(_GPU_PROFILES) >= 16:
                _GPU_PROFILES.pop(next(iter(_GPU_PROFILES)))
            _GPU_PROFILES[key] = model
            return model
        return FittedCostModel.from_profile_dict(data, swap_bandwidth=swap_bandwidth)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise ProfileError(f"{path}: malformed profile ({type(exc).__name__}: {exc})") from None


_GPU_PROFILES: dict[tuple[str, str, float | None], LayerCostModel] = {}


def roofline_attention_shape(profile: Mapping[str, Any]) -> Any:
    """The roofline's one-layer attention term for a GPU profile's model, GPU and TP degree when its
    attention table is read ``roofline`` (``sim/layer_cost_model.py``), else None."""
    att = profile.get("attention")
    if not isinstance(att, Mapping) or att.get("interpolation") != "roofline":
        return None
    try:
        model, hardware = get_model(str(profile.get("model"))), get_hardware(str(profile.get("hardware")))
    except PresetError as exc:
        raise ProfileError(f"attention.interpolation 'roofline' reads the table against servesim's roofline for the "
                           f"profile's model and hardware, which must be presets: {exc}") from None
    tp = whole_number("tensor_parallel", profile.get("tensor_parallel"), 64)  # as LayerCostModel reads it
    return reading_attention_shape(model, hardware, tp)


def reading_attention_shape(model: ModelConfig, hardware: HardwareConfig, tp: int) -> Any:
    """The term a profile's ``roofline`` reading divides its attention nodes by (and the importer
    fills gaps with): the roofline's one-layer attention term for this model, GPU and TP degree, with
    decode rows' KV read once however large it is (an unbounded L2).

    The roofline itself re-reads decode KV once per query head when one KV head's share of it no
    longer fits the L2 (``FA2VarlenAttention``): a cliff at one batch size x context. The measured
    tables rise gradually there instead (RTX PRO 6000 Llama-3.1-8B TP 2, a 64-token chunk beside 128
    decode rows: 359, 777, 2,176 us at 1k, 2k, 4k contexts), so a ratio taken on both sides of the
    cliff and read between them put nodes up to 45 % under the measured times near it (skew.csv's
    uniform batches of 128 rows at 1,792 tokens: 380 us read, 650-680 measured). Without the cliff
    in the divisor the measured nodes carry the re-reads, and the term keeps what the reading is for:
    the thread-block waves of the chunk. Held out on the five LLMServingSim tables: skew.csv p90 7.7-
    9.7 -> 7.0-9.3 %, mixed attention p90 within +0.2 points (README, GPU profiles)."""
    return RooflineCostModel(model, dataclasses.replace(hardware, l2_bytes=math.inf), tp).attention_layer_s


def same_shapes(preset: Any, model: ModelConfig) -> bool:
    """Whether ``model``, read from a config.json rather than a preset, has every priced shape of the
    preset named ``preset`` (a profile measured for that preset then prices it); False for a preset
    ``model`` (two presets are two models) or a name that is no preset."""
    theirs = MODELS.get(preset) if isinstance(preset, str) else None
    if theirs is None or model.name in MODELS and MODELS[model.name] is model:
        return False
    return dataclasses.replace(theirs, name=model.name, rope_theta=model.rope_theta, rms_norm_eps=model.rms_norm_eps,
                               max_position_embeddings=model.max_position_embeddings) == model


def check_profile_matches(cost: Any, path: str | Path, model: ModelConfig, hardware: HardwareConfig,
                          tensor_parallel: int, block_size: int | None = None) -> None:
    """A profile measured for another model, hardware, TP degree or KV block size than the
    scenario's is a ``ProfileError`` naming both. A GPU profile states model, hardware and TP; a
    fitted one (``servesim calibrate``) its model, the device it ran on and the block size of its
    paged kernels, on one device (TP 1)."""
    gpu = getattr(cost, "hardware", None) is not None
    prov = getattr(cost, "provenance", {}) or {}
    theirs = {"model": getattr(cost, "model", None) if gpu else prov.get("model"),
              "hardware": getattr(cost, "hardware", None) if gpu else prov.get("hardware"),
              "tensor_parallel": getattr(cost, "tp", None) if gpu else prov.get("tensor_parallel")}
    on_cpu = not gpu and prov.get("device") == "cpu"
    if not gpu and prov.get("device") in ("cpu", "cuda"):
        theirs["tensor_parallel"] = theirs["tensor_parallel"] or 1  # calibrate measures one device
        if theirs["hardware"] is None and prov.get("device") == "cuda" and prov.get("device_name"):
            theirs["hardware"] = hardware_preset(str(prov["device_name"]))
    ours = {"model": model.name, "hardware": hardware.name, "tensor_parallel": tensor_parallel}
    for key, value in theirs.items():
        if key == "hardware" and on_cpu and value is None and not hardware.name.startswith("cpu"):
            raise ProfileError(f"profile {path} was measured on a CPU ({prov.get('cpu_model') or 'cpu'}) but the "
                               f"scenario runs {hardware.name!r}; use a profile measured on {hardware.name!r} or a "
                               "cpu hardware preset")
        if key == "model" and value is not None and value != ours[key] and same_shapes(value, model):
            continue  # a config.json model (sim/hf_config.py) with the shapes of the profile's preset
        if value is not None and value != ours[key]:
            raise ProfileError(f"profile {path} is for {key} {value!r} but the scenario runs {ours[key]!r}; "
                               f"use a profile for {ours[key]!r} or change the scenario's {key}")
    measured_bs = None if gpu else prov.get("block_size")
    if block_size is not None and isinstance(measured_bs, int) and measured_bs != block_size:
        raise ProfileError(f"profile {path} timed paged kernels with KV blocks of {measured_bs} tokens but the "
                           f"scenario's kv_cache.block_size is {block_size}; set kv_cache.block_size: {measured_bs} "
                           "or calibrate with --block-size")
    layers = getattr(cost, "num_layers", None) if gpu else None
    if layers is not None and layers != model.num_layers:  # its per-layer tables would be summed over the wrong depth
        raise ProfileError(f"profile {path} gives num_layers {layers} but {model.name} has {model.num_layers}; "
                           "the profile was not measured for this model: re-import it")


def build_cost_model(cfg: CostModelConfig, model: ModelConfig, hardware: HardwareConfig,
                     tensor_parallel: int = 1, block_size: int | None = None) -> CostModel:
    """The cost model a scenario asks for. A profile for another model, hardware, TP degree or
    (``block_size``: the scenario's KV block size) block size than the scenario's is a
    ``ProfileError``."""
    if cfg.type == "constant":
        return ConstantCostModel(cfg.step_ms / 1e3, (cfg.per_token_ms or 0.0) / 1e3, hardware.pcie_bandwidth)
    if cfg.type == "profile":
        path = resolve_profile_path(cfg.path)
        cost = load_profile(path, swap_bandwidth=hardware.pcie_bandwidth)
        check_profile_matches(cost, cfg.path, model, hardware, tensor_parallel, block_size)
        return cost
    kw: dict[str, float] = {}
    for field, arg, scale in (("flops_efficiency", "flops_efficiency", 1.0),
                              ("bandwidth_efficiency", "bandwidth_efficiency", 1.0),
                              ("step_overhead_ms", "step_overhead_s", 1e-3),
                              ("per_seq_overhead_ms", "per_seq_overhead_s", 1e-3)):
        value = getattr(cfg, field)
        if value is not None:
            kw[arg] = value * scale
    return RooflineCostModel(model, hardware, tensor_parallel, **kw)
