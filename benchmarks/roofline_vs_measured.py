"""The roofline against kernel times measured on real GPUs (issue #13's table).

For each GPU x model the public data in ``../shared/data/gpu`` covers (see its SOURCES.md for
origin, units and licenses), a *measured* step time is assembled from per-kernel timings and set
against ``RooflineCostModel`` (the scenario default, ``build_cost_model(CostModelConfig())``) for
the same step shape. Printed per row: min-max of predicted / measured over the row's points.

measured step = embedding + layers x (norms, QKV, rotary, O, gate/up, activation, down, residual
adds, attention) + final norm + LM head (+ sampler), each at the step's token count (LM head and
sampler at its sequence count), summed. Kernel time only: the roofline's host term (scheduler,
launch of the step) is left out of the prediction, and so is every kernel the source did not
measure (listed per column below), so both sides always price the same work. The files are read
by ``calibration/importers``, the readers the shipped GPU profiles are built with.

Columns and where each term comes from (files relative to the data folder):

- H100 llama-3.1-8b: GEMMs (q, k, v, o, gate, up, down) and LM head from
  ``llmservingsim/v0-H100-Llama-3.1-8B/layers.csv`` (LM head at M = sequences: vLLM computes
  logits for each sequence's last position only); norms, rotary, activation and residual adds
  from Vidur's H100 Llama-2-7b table (same hidden size 4096; activation scaled by the
  intermediate sizes 14336 / 11008, rotary by the q + k heads 40 / 64) because v0's are unfused
  Hugging Face kernels; attention from ``inference-sim/h100/mha_*_32-8-128*.csv``. No sampler.
- H100 llama-2-7b: ``vidur/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv`` (TP 1, medians),
  attention from ``inference-sim/h100/mha_*_32-32-128*.csv``. Vidur has no LM head: it is the
  measured gate/up GEMM at the same M scaled by N (vocab / (2 x intermediate), same K = hidden).
  No sampler.
- A100 llama-3-8b: ``vidur/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv``, LM head as above.
  No attention table exists for the A100: attention is left out of BOTH sides, so this column
  checks the linear layers, small ops and LM head only (decode at 1k and 4k context differ only
  in batch size there). No sampler.
- RTX PRO 6000 llama-3.1-8b / qwen3-32b, RTX 4090 llama-3.1-8b: LLMServingSim's vLLM 0.19
  profiles (``llmservingsim/profiles/<GPU>/<org>/<model>/tp1``): ``dense.csv`` (``layernorm`` is
  one RMSNorm call, a layer makes two; vLLM fuses the residual add into it), ``attention.csv``,
  ``per_sequence.csv`` (LM head and sampler).

Rows (decode rows all at one context; ``kv`` = context + 1, the keys the new token attends to):
decode batch <= 32 at kv 1024 (1, 2, 4, ..., 32), decode batch >= 64 at kv 4096 (64 ... 512),
one prefill of 128-512 tokens, one prefill of 1k-8k tokens (no cached context). A point is used
only where every measured term exists on its source's grid (no extrapolation), with two stated
exceptions: inference-sim's prefill attention at 2048 tokens is interpolated log-log between its
1024 and 4096 points, and attention is left out of both sides for H100 prefills under 1024
tokens (inference-sim starts at 1024; flash attention is a few % of such a step). The first
decode row (batch 1, kv 1024) of inference-sim's 32-8-128 table is a warm-up outlier (SOURCES.md)
and is skipped.

A second table sets the roofline against Vidur's per-rank times at TP 1, 2, 4 and 8 (``tp_columns``:
H100 Llama-2-7B and -70B, A100 Llama-3-8B and -70B; linear layers, small ops and LM head).

    python benchmarks/roofline_vs_measured.py [--data ../shared/data/gpu] [--out points.csv]
    python benchmarks/roofline_vs_measured.py --constants   # the figures behind sim/presets.py's fractions
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from servesim.calibration.importers import inference_sim, llmservingsim, vidur
from servesim.sim.batch import step_sums
from servesim.sim.cost_model import CostModelConfig, build_cost_model
from servesim.sim.presets import get_hardware, get_model

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu"

ROWS: dict[str, tuple[str, list[int], int]] = {
    # row key: (label, batch sizes or prefill tokens, decode kv)
    "decode_small": ("decode, batch ≤ 32, 1k context", [1, 2, 4, 8, 16, 32], 1024),
    "decode_large": ("decode, batch ≥ 64, 4k context", [64, 128, 256, 512], 4096),
    "prefill_small": ("prefill 128–512 tokens", [128, 256, 512], 0),
    "prefill_large": ("prefill 1k–8k tokens", [1024, 2048, 4096, 8192], 0),
}


# --------------------------------------------------------------------------------------------------
# The three public formats, read by calibration/importers (op names as there: vLLM-style), as
# exact-grid lookups: None where a point is missing, so nothing is extrapolated


class OpTable:
    """Seconds of named ops against an integer size (tokens or sequences); exact points only."""

    def __init__(self, frame: pd.DataFrame, size: str) -> None:
        self.ops: dict[str, dict[int, float]] = {}
        for op, n, sec in zip(frame["op"], frame[size], frame["seconds"], strict=True):
            self.ops.setdefault(op, {})[int(n)] = float(sec)

    def at(self, op: str, size: int) -> float | None:
        return self.ops.get(op, {}).get(size)


def llmservingsim_tp1(folder: Path) -> tuple[OpTable, OpTable, dict[tuple[int, int, int, int], float]]:
    """The tp1 tables of an LLMServingSim profile folder (its meta.yaml's): dense ops, per-sequence ops,
    attention (one layer)."""
    t = llmservingsim.read_profile(folder, tp=[1]).tp[1]
    attn = {tuple(int(v) for v in axes): float(sec) for *axes, sec in
            t.attention[[*llmservingsim.ATTENTION_AXES, "seconds"]].itertuples(index=False)}
    return OpTable(t.dense, "tokens"), OpTable(t.per_sequence, "sequences"), attn


def llmservingsim_v0(path: Path) -> OpTable:
    """v0 ``layers.csv``, TP 1, no cached context."""
    df, _ = llmservingsim.read_v0_layers(path)
    return OpTable(df[(df["tp"] == 1) & (df["kv_cache"] == 0)], "tokens")


@functools.cache
def _vidur_frame(path: Path) -> pd.DataFrame:
    return vidur.read_mlp(path)[0]  # (read once: the TP table takes four degrees from one file)


def vidur_mlp(path: Path, tp: int = 1) -> OpTable:
    """Vidur ``mlp.csv`` medians at one TP degree (each op timed on one rank's shard)."""
    df = _vidur_frame(path)
    return OpTable(df[df["tp"] == tp], "tokens")


def _within(points: list[dict]) -> int:
    """Points whose predicted / measured is within ±10 %."""
    return sum(abs(p["ratio"] - 1) <= 0.10 for p in points)


def inference_sim_h100(folder: Path, heads: str) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
    """inference-sim H100 attention, one layer: decode (batch, kv_len) and prefill seq_len -> seconds."""
    dec, _ = inference_sim.read_decode(folder / f"mha_decode_h100_{heads}-tp1.csv")
    pre, _ = inference_sim.read_prefill(folder / f"mha_prefill_h100_{heads}.csv")
    return ({(int(b), int(k)): float(t) for b, k, t in dec[["batch", "kv_len", "seconds"]].itertuples(index=False)},
            {int(n): float(t) for n, t in pre[["seq_len", "seconds"]].itertuples(index=False)})


def _loglog(x: int, table: dict[int, float]) -> float | None:
    """``table`` at x, interpolated log-log between its neighbours; None outside the grid."""
    if x in table:
        return table[x]
    xs = sorted(table)
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    i = int(np.searchsorted(xs, x))
    x0, x1 = xs[i - 1], xs[i]
    w = math.log(x / x0) / math.log(x1 / x0)
    return math.exp((1 - w) * math.log(table[x0]) + w * math.log(table[x1]))


# --------------------------------------------------------------------------------------------------
# Columns: one GPU x model each, answering the measured time of a step shape


@dataclass
class Column:
    """One GPU x model: the presets to predict with and the measured terms of a step."""

    label: str
    model: str
    hardware: str
    # tokens -> seconds of everything but attention, LM head and sampler, whole step (None: off grid)
    dense: Callable[[int], float | None]
    lm_head: Callable[[int], float | None]
    sampler: Callable[[int], float | None] | None = None
    decode_attn: Callable[[int, int], float | None] | None = None  # (batch, kv) -> seconds, one layer
    prefill_attn: Callable[[int], float | None] | None = None  # tokens -> seconds, one layer
    notes: list[str] = field(default_factory=list)
    tp: int = 1  # tensor-parallel degree: every term is one rank's

    def measured(self, row: str, size: int, kv: int) -> tuple[float, set[str]] | None:
        """Measured seconds of the row's step at ``size``, and the terms it leaves out; None if off grid."""
        layers = get_model(self.model).num_layers
        decode = row.startswith("decode")
        tokens, seqs = (size, size) if decode else (size, 1)
        parts = [self.dense(tokens), self.lm_head(seqs)]
        omitted: set[str] = set()
        if self.sampler is None:
            omitted.add("sampler")
        else:
            parts.append(self.sampler(seqs))
        attn_fn = self.decode_attn if decode else self.prefill_attn
        if attn_fn is None or (not decode and "h100" in self.hardware and size < 1024):
            omitted.add("attention")
        else:
            attn = attn_fn(size, kv) if decode else attn_fn(size)
            parts.append(None if attn is None else layers * attn)
        if any(p is None for p in parts):
            return None
        return sum(parts), omitted


def _sum_ops(table: OpTable, ops: dict[str, float], tokens: int) -> float | None:
    """sum of weight * table[op](tokens); None if any op lacks the point."""
    total = 0.0
    for op, weight in ops.items():
        t = table.at(op, tokens)
        if t is None:
            return None
        total += weight * t
    return total


def llmservingsim_column(data: Path, label: str, gpu: str, repo_model: str, model: str) -> Column:
    folder = data / "llmservingsim" / "profiles" / gpu / repo_model
    dense, per_seq, attn = llmservingsim_tp1(folder)
    layers = get_model(model).num_layers
    per_layer = {"layernorm": 2, "qkv_proj": 1, "rotary_emb": 1, "o_proj": 1, "gate_up_proj": 1, "act_fn": 1,
                 "down_proj": 1}
    if "qk_norm" in dense.ops:
        per_layer["qk_norm"] = 1

    def dense_s(tokens: int) -> float | None:
        body = _sum_ops(dense, per_layer, tokens)
        ends = _sum_ops(dense, {"embedding": 1, "final_layernorm": 1}, tokens)
        return None if body is None or ends is None else layers * body + ends

    return Column(label, model, gpu_preset(gpu), dense_s,
                  lm_head=lambda n: per_seq.at("lm_head", n), sampler=lambda n: per_seq.at("sampler", n),
                  decode_attn=lambda n, kv: attn.get((0, 0, n, kv)),
                  prefill_attn=lambda t: attn.get((t, 0, 0, 0)))


def gpu_preset(gpu: str) -> str:
    return {"RTXPRO6000": "rtx-pro-6000", "RTX4090": "rtx-4090"}[gpu]


def vidur_column(data: Path, label: str, gpu: str, repo_model: str, model: str,
                 attention: tuple[dict[tuple[int, int], float], dict[int, float]] | None, tp: int = 1) -> Column:
    table = vidur_mlp(data / "vidur" / "compute" / gpu / "meta-llama" / repo_model / "mlp.csv", tp)
    m = get_model(model)
    per_layer = {"layernorm": 1, "qkv_proj": 1, "rotary_emb": 1, "o_proj": 1, "layernorm_post": 1,
                 "gate_up_proj": 1, "act_fn": 1, "down_proj": 1, "add": 2}
    head_scale = m.vocab_size / (2 * m.intermediate_size)

    def dense_s(tokens: int) -> float | None:
        body = _sum_ops(table, per_layer, tokens)
        ends = _sum_ops(table, {"embedding": 1, "layernorm": 1}, tokens)  # final norm: the same op
        return None if body is None or ends is None else m.num_layers * body + ends

    def lm_head(n: int) -> float | None:
        up = table.at("gate_up_proj", n)
        return None if up is None else up * head_scale

    col = Column(label, model, gpu + ("-80g" if gpu == "a100" else "-sxm"), dense_s, lm_head, tp=tp)
    if attention is not None:
        dec, pre = attention
        col.decode_attn = lambda n, kv: dec.get((n, kv))
        col.prefill_attn = lambda t: _loglog(t, pre)
    return col


def h100_llama31_column(data: Path, attention: tuple[dict[tuple[int, int], float], dict[int, float]]) -> Column:
    v0 = llmservingsim_v0(data / "llmservingsim" / "v0-H100-Llama-3.1-8B" / "layers.csv")
    small = vidur_mlp(data / "vidur" / "compute" / "h100" / "meta-llama" / "Llama-2-7b-hf" / "mlp.csv")
    m, donor = get_model("llama-3.1-8b"), get_model("llama-2-7b")
    gemms = {op: 1 for op in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
    small_ops = {"layernorm": 1, "layernorm_post": 1, "add": 2,
                 "act_fn": m.intermediate_size / donor.intermediate_size,
                 "rotary_emb": (m.num_heads + m.num_kv_heads) / (donor.num_heads + donor.num_kv_heads)}

    def dense_s(tokens: int) -> float | None:
        g = _sum_ops(v0, gemms, tokens)
        s = _sum_ops(small, small_ops, tokens)
        ends = _sum_ops(small, {"embedding": 1, "layernorm": 1}, tokens)
        return None if g is None or s is None or ends is None else m.num_layers * (g + s) + ends

    dec, pre = attention
    dec = {k: v for k, v in dec.items() if k != (1, 1024)}  # warm-up outlier (SOURCES.md)
    return Column("H100 llama-3.1-8b", "llama-3.1-8b", "h100-sxm", dense_s, lambda n: v0.at("lm_head", n),
                  decode_attn=lambda n, kv: dec.get((n, kv)), prefill_attn=lambda t: _loglog(t, pre))


def columns(data: Path) -> list[Column]:
    isim = data / "inference-sim" / "h100"
    return [
        h100_llama31_column(data, inference_sim_h100(isim, "32-8-128")),
        vidur_column(data, "H100 llama-2-7b", "h100", "Llama-2-7b-hf", "llama-2-7b",
                     inference_sim_h100(isim, "32-32-128")),
        vidur_column(data, "A100 llama-3-8b", "a100", "Meta-Llama-3-8B", "llama-3-8b", None),
        llmservingsim_column(data, "RTX PRO 6000 llama-3.1-8b", "RTXPRO6000", "meta-llama/Llama-3.1-8B",
                             "llama-3.1-8b"),
        llmservingsim_column(data, "RTX PRO 6000 qwen3-32b", "RTXPRO6000", "Qwen/Qwen3-32B", "qwen3-32b"),
        llmservingsim_column(data, "RTX 4090 llama-3.1-8b", "RTX4090", "meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
    ]


# The tensor-parallel table: Vidur timed every op of one decoder layer on one rank's shard at TP 1,
# 2, 4 and 8, for the two 8B-class models above and two 70B ones. Its attention is not in the data
# (nor inference-sim's beyond TP 1) and the all-reduces are NCCL's own table (benchmarks/
# allreduce_vs_nccl.py checks the roofline's link against it), so both stay out of both sides:
# this table checks the roofline's linear layers, small ops and LM head on sharded shapes, the
# per-rank GEMMs getting narrower (TP 8 leaves an 8B model's o_proj 4096 x 512) as TP grows.
TP_MODELS = (("h100", "Llama-2-7b-hf", "llama-2-7b"), ("h100", "Llama-2-70b-hf", "llama-2-70b"),
             ("a100", "Meta-Llama-3-8B", "llama-3-8b"), ("a100", "Meta-Llama-3-70B", "llama-3-70b"))
TP_DEGREES = (1, 2, 4, 8)


def tp_columns(data: Path) -> list[Column]:
    return [vidur_column(data, f"{gpu.upper()} {model} TP {tp}", gpu, repo_model, model, None, tp)
            for gpu, repo_model, model in TP_MODELS for tp in TP_DEGREES]


# --------------------------------------------------------------------------------------------------


def predicted(col: Column, row: str, size: int, kv: int, omitted: set[str]) -> float:
    """The default roofline's kernel time for the row's step, less the host term and ``omitted`` terms."""
    cost = build_cost_model(CostModelConfig(), get_model(col.model), get_hardware(col.hardware),
                            tensor_parallel=col.tp)
    if row.startswith("decode"):
        q, ctx = np.ones(size, dtype=np.int64), np.full(size, kv - 1, dtype=np.int64)
    else:
        q, ctx = np.array([size], dtype=np.int64), np.zeros(1, dtype=np.int64)
    parts = cost.breakdown(step_sums(q, ctx))
    # (no source times the all-reduce inside a step: it is 0 at TP 1, and out of both sides above it)
    return sum(v for k, v in parts.items() if k not in omitted and k not in ("host", "all_reduce"))


def compare(data: Path, cols: list[Column] | None = None) -> list[dict]:
    """Every (column, row, point) with measured and predicted seconds."""
    points = []
    for col in columns(data) if cols is None else cols:
        for row, (_, sizes, kv) in ROWS.items():
            for size in sizes:
                got = col.measured(row, size, kv)
                if got is None:
                    continue
                measured, omitted = got
                pred = predicted(col, row, size, kv, omitted)
                points.append({"column": col.label, "tp": col.tp, "row": row, "size": size,
                               "kv": kv if row.startswith("decode")
                               else 0, "measured_s": measured, "predicted_s": pred, "ratio": pred / measured,
                               "omitted": "+".join(sorted(omitted))})
    return points


def markdown(points: list[dict]) -> str:
    labels = list(dict.fromkeys(p["column"] for p in points))
    lines = ["| step | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for row, (label, _, _) in ROWS.items():
        cells = []
        for col in labels:
            r = [p for p in points if p["column"] == col and p["row"] == row]
            if not r:
                cells.append("–")
                continue
            lo, hi = min(p["ratio"] for p in r), max(p["ratio"] for p in r)
            sizes = sorted(p["size"] for p in r)
            cells.append(f"{lo:.2f}–{hi:.2f} ({sizes[0]}–{sizes[-1]}, n={len(r)})" if len(r) > 1
                         else f"{lo:.2f} ({sizes[0]}, n=1)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    worst = max(points, key=lambda p: abs(p["ratio"] - 1))
    lines.append("")
    lines.append(f"predicted / measured, min–max over the row's points (batch sizes or prefill tokens, "
                 f"number of points). Worst point: {worst['column']} {worst['row']} at {worst['size']}: "
                 f"{worst['ratio']:.3f}; {_within(points)} of {len(points)} "
                 f"points within ±10 %.")
    return "\n".join(lines)


def tp_markdown(points: list[dict]) -> str:
    """The tensor-parallel table: one line per model x TP degree, a column per step row."""
    heads = {"decode_small": "decode, batch ≤ 32", "decode_large": "decode, batch ≥ 64",
             "prefill_small": "prefill 128–512 tokens", "prefill_large": "prefill 1k–8k tokens"}
    lines = ["| GPU, model | TP | " + " | ".join(heads.values()) + " |", "|---|---|" + "---|" * len(heads)]
    for label in dict.fromkeys(p["column"] for p in points):
        mine = [p for p in points if p["column"] == label]
        cells = []
        for row in heads:
            r = [p["ratio"] for p in mine if p["row"] == row]
            cells.append(f"{min(r):.2f}–{max(r):.2f}" if r else "–")
        lines.append(f"| {label.rsplit(' TP ', 1)[0]} | {mine[0]['tp']} | " + " | ".join(cells) + " |")
    worst = max(points, key=lambda p: abs(p["ratio"] - 1))
    within = _within(points)
    by_tp = ", ".join(f"TP {tp} {_within([p for p in points if p['tp'] == tp])}/"
                      f"{sum(p['tp'] == tp for p in points)}" for tp in TP_DEGREES)
    lines.append("")
    lines.append(f"predicted / measured, one rank's linear layers, small ops and LM head (Vidur's mlp.csv at "
                 f"that TP; no attention, no all-reduce on either side), min–max over the row's points. "
                 f"{within} of {len(points)} points within ±10 % ({by_tp}); worst: {worst['column']} "
                 f"{worst['row']} at {worst['size']}: {worst['ratio']:.3f}.")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# --constants: the per-hardware fractions of sim/presets.py, recomputed from the same files


def _gemm_weights(model: str) -> dict[str, int]:
    """Weight elements of the model's fused GEMMs (one rank) and of its LM head."""
    m = get_model(model)
    h, d = m.hidden_size, m.head_dim
    return {"qkv": h * (m.num_heads + 2 * m.num_kv_heads) * d, "o": m.num_heads * d * h,
            "gate_up": 2 * h * m.intermediate_size, "down": m.intermediate_size * h, "lm_head": h * m.vocab_size}


def gemm_fit(model: str, hardware: str, time_of: Callable[[str, int], float | None],
             ops: list[str], big: int) -> tuple[float, float, int, float]:
    """(weight fraction, floor seconds, points) of time = floor + bytes / (bw x fraction), least squares
    over ``ops`` at 1-8 rows, and the layer GEMMs' FLOP/s fraction at ``big`` rows."""
    hw, w = get_hardware(hardware), _gemm_weights(model)
    rows = [(2 * w[op], t) for op in ops for m in (1, 2, 4, 8) if (t := time_of(op, m)) is not None]
    a = np.c_[np.ones(len(rows)), [b / hw.hbm_bandwidth for b, _ in rows]]
    (floor, inv), *_ = np.linalg.lstsq(a, [t for _, t in rows], rcond=None)
    layer_ops = [op for op in ops if op != "lm_head"]
    flops = sum(2 * big * w[op] for op in layer_ops)
    secs = sum(time_of(op, big) or math.nan for op in layer_ops)
    return 1 / inv, floor, len(rows), flops / secs / hw.peak_flops


def _fit_text(fit: tuple[float, float, int, float], big: int) -> str:
    weight, floor, n, flops = fit
    return f"GEMM fit weight {weight:.3f}, floor {floor * 1e6:.1f} us ({n} points); GEMM FLOP/s at {big} rows {flops:.3f}"


def decode_stream(model: str, hardware: str, table: dict[tuple[int, int], float], kvs: tuple[int, ...]) -> str:
    """KV bytes / time / peak bandwidth for decode batches >= 64 at the given kv lengths."""
    m, hw = get_model(model), get_hardware(hardware)
    per_token = 2 * m.num_kv_heads * m.head_dim * m.dtype_bytes
    fr = [n * kv * per_token / t / hw.hbm_bandwidth for (n, kv), t in table.items() if n >= 64 and kv in kvs]
    return f"stream (decode attention, batch >= 64, kv {'/'.join(map(str, kvs))}) {min(fr):.2f}-{max(fr):.2f}"


def prefill_flops(model: str, hardware: str, tokens: int, seconds: float) -> str:
    m, hw = get_model(model), get_hardware(hardware)
    flops = m.attention_flops_per_pair / m.num_layers * tokens * (tokens + 1) / 2
    return f"attention at {tokens} tokens {flops / seconds / hw.peak_flops:.3f}"


def constants(data: Path) -> list[str]:
    """One line per source: the figures behind the HARDWARE fractions in sim/presets.py."""
    lines = []
    for gpu, repo_model, model in (("RTXPRO6000", "meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
                                   ("RTXPRO6000", "Qwen/Qwen3-32B", "qwen3-32b"),
                                   ("RTX4090", "meta-llama/Llama-3.1-8B", "llama-3.1-8b")):
        folder = data / "llmservingsim" / "profiles" / gpu / repo_model
        dense, per_seq, attn = llmservingsim_tp1(folder)
        names = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}
        hw = gpu_preset(gpu)

        def time_of(op: str, m: int, dense=dense, per_seq=per_seq, names=names) -> float | None:
            return per_seq.at("lm_head", m) if op == "lm_head" else dense.at(names[op], m)

        fit = _fit_text(gemm_fit(model, hw, time_of, [*names, "lm_head"], 2048), 2048)
        dec = {(n, kv): t for (c, kp, n, kv), t in attn.items() if c == 0 and kp == 0 and n}
        small = [dense.at(op, 1) for op in ("layernorm", "rotary_emb", "act_fn", "embedding")]
        lines.append(f"{gpu} {model} (llmservingsim): {fit}; {decode_stream(model, hw, dec, (4096,))}; "
                     f"{prefill_flops(model, hw, 2048, attn[(2048, 0, 0, 0)])}; small ops at 1 token "
                     f"{min(small) * 1e6:.1f}-{max(small) * 1e6:.1f} us")
    v0 = llmservingsim_v0(data / "llmservingsim" / "v0-H100-Llama-3.1-8B" / "layers.csv")
    v0_ops = {"o": ["o_proj"], "down": ["down_proj"], "lm_head": ["lm_head"], "qkv": ["q_proj", "k_proj", "v_proj"],
              "gate_up": ["gate_proj", "up_proj"]}

    def v0_time(op: str, m: int) -> float | None:
        ts = [v0.at(x, m) for x in v0_ops[op]]
        return None if None in ts else sum(ts)

    # v0's q/k/v and gate/up are separate (unfused) GEMMs: only the single ones enter the weight fit
    weight, floor, n, _ = gemm_fit("llama-3.1-8b", "h100-sxm", v0_time, ["o", "down", "lm_head"], 2048)
    flops = gemm_fit("llama-3.1-8b", "h100-sxm", v0_time, list(v0_ops), 2048)[3]
    lines.append(f"H100 llama-3.1-8b (v0 layers.csv): {_fit_text((weight, floor, n, flops), 2048)}")
    for gpu, repo_model, model, hw in (("h100", "Llama-2-7b-hf", "llama-2-7b", "h100-sxm"),
                                       ("a100", "Meta-Llama-3-8B", "llama-3-8b", "a100-80g")):
        table = vidur_mlp(data / "vidur" / "compute" / gpu / "meta-llama" / repo_model / "mlp.csv")
        names = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}
        def time_of(op: str, m: int, table=table, names=names) -> float | None:
            return table.at(names[op], m)

        fits = [gemm_fit(model, hw, time_of, list(names), big) for big in (1024, 4096)]
        m = get_model(model)
        adds = [3 * t_ * m.hidden_size * m.dtype_bytes / table.at("add", t_) / get_hardware(hw).hbm_bandwidth
                for t_ in (4096, 8192, 16384, 32768) if table.at("add", t_)]
        lines.append(f"{gpu.upper()} {model} (vidur mlp.csv): {_fit_text(fits[0], 1024)}, at 4096 rows "
                     f"{fits[1][3]:.3f}; "
                     f"stream (residual add, >= 4096 tokens) {min(adds):.2f}-{max(adds):.2f}; norm at 1 token "
                     f"{table.at('layernorm', 1) * 1e6:.1f} us")
    for heads, model in (("32-8-128", "llama-3.1-8b"), ("32-32-128", "llama-2-7b")):
        dec, pre = inference_sim_h100(data / "inference-sim" / "h100", heads)
        lines.append(f"H100 {heads} (inference-sim): {decode_stream(model, 'h100-sxm', dec, (1024, 4096))}; "
                     f"{prefill_flops(model, 'h100-sxm', 8192, pre[8192])}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared gpu data folder (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="write every point (measured, predicted, ratio) to this CSV")
    ap.add_argument("--constants", action="store_true",
                    help="print the measured fractions behind the HARDWARE presets instead of the table")
    args = ap.parse_args()
    if not (args.data / "SOURCES.md").is_file():
        raise SystemExit(f"error: {args.data} is not the shared GPU data folder (no SOURCES.md); pass --data")
    if args.constants:
        print("\n".join(constants(args.data)))
        return
    points = compare(args.data)
    print(markdown(points))
    tp_points = compare(args.data, tp_columns(args.data))
    print("\nTensor-parallel shards (Vidur, one rank):\n")
    print(tp_markdown(tp_points))
    points += tp_points
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(points[0]))
            w.writeheader()
            w.writerows(points)


if __name__ == "__main__":
    main()
