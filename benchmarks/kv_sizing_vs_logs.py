"""The KV cache servesim derives against the one vLLM logged: fitted constants and held-out error.

    python benchmarks/kv_sizing_vs_logs.py

Reads ``calibration/data/vllm_memory_logs.csv`` (public vLLM startup logs, source on every row) and
compares two formulas for the KV bytes of each logged row, both given the row's logged weights so
that only the reserves differ:

- before: nvidia-smi total x utilization - weights - 1 GiB - (2 I + 4 h) x tokens x 2 B / TP;
- after: ``sim.presets.num_kv_blocks``'s terms (CUDA's total, ``non_torch_reserve_bytes``,
  ``default_activation_reserve_bytes``), the constants fitted leaving the row's model out: the
  sampler bytes per logit and the forward's hidden buffers by least squares on the other vLLM 0.19
  rows' activation peaks, the non-torch reserve as the median of their TP-1 rows and the TP extra as
  the median of their TP >= 2 rows less that.

Rows from other releases are predicted with the shipped constants (all 0.19 rows). GPUs with a
hardware preset use its totals; the A30 row (no preset) uses its logged total and nvidia-smi size.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from servesim.sim.presets import (
    FORWARD_HIDDEN_BUFFERS,
    SAMPLER_BYTES_PER_LOGIT,
    GiB,
    MiB,
    ModelConfig,
    default_activation_reserve_bytes,
    get_hardware,
    kv_block_bytes,
)

DATA = Path(__file__).resolve().parents[1] / "calibration" / "data" / "vllm_memory_logs.csv"
FIT_RELEASE = "0.19.0"
PRESET_OF_GPU = {"H100 80GB HBM3": "h100-sxm"}
NVIDIA_SMI_MIB = {"A30 24GB (NVLink pairs)": 24576}  # GPUs without a preset
BLOCK_SIZE = 16


def model_of(row) -> ModelConfig:
    """The row's model shape as a ModelConfig (only the fields the sizing reads matter)."""
    return ModelConfig(row.model, int(row.num_layers), int(row.hidden_size), int(row.hidden_size // row.head_dim),
                       int(row.num_kv_heads), int(row.head_dim), int(row.intermediate_size), int(row.vocab_size),
                       tie_word_embeddings=False, rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=4096)


def totals(row) -> tuple[float, float]:
    """(CUDA's total, nvidia-smi's total) in bytes: the preset's, else the row's own."""
    preset = PRESET_OF_GPU.get(row.gpu)
    if preset is not None:
        hw = get_hardware(preset)
        return hw.cuda_total_bytes, hw.memory_bytes
    return row.cuda_total_gib * GiB, NVIDIA_SMI_MIB[row.gpu] * MiB


def activation(row, sampler: float, hidden: float) -> float:
    return default_activation_reserve_bytes(model_of(row), int(row.tp), int(row.max_num_batched_tokens),
                                            int(row.max_num_seqs), sampler_bytes_per_logit=sampler,
                                            hidden_buffers=hidden)


def fit(rows: pd.DataFrame) -> dict[str, float]:
    """The four constants from ``rows``' logged activation peaks and non-torch memory.

    Least squares over a grid; the two phases of ``default_activation_reserve_bytes`` are linear in
    the two constants, so they are evaluated as arrays here (checked against the function below).
    """
    tokens, seats = rows["max_num_batched_tokens"].to_numpy(float), rows["max_num_seqs"].to_numpy(float)
    hidden, inter = rows["hidden_size"].to_numpy(float), rows["intermediate_size"].to_numpy(float)
    tp, vocab = rows["tp"].to_numpy(float), rows["vocab_size"].to_numpy(float)
    samplers, buffers = np.arange(10.0, 20.0, 0.05), np.arange(0.0, 10.0, 0.05)
    fwd = (tokens * 3 * inter / tp * 2)[None, :] + buffers[:, None] * (tokens * hidden * 2)[None, :]
    smp = samplers[:, None] * (np.minimum(seats, tokens) * vocab)[None, :] + (tokens * hidden * 2)[None, :]
    pred = np.maximum(fwd[None, :, :], smp[:, None, :])  # sampler x buffers x rows
    sse = ((pred - rows["activation_gib"].to_numpy() * GiB) ** 2).sum(axis=2)
    i, j = np.unravel_index(np.argmin(sse), sse.shape)
    first = rows.iloc[0]
    assert math.isclose(pred[i, j, 0], activation(first, samplers[i], buffers[j]), rel_tol=1e-9)
    tp1 = rows.loc[rows["tp"] == 1, "non_torch_gib"].median() * GiB
    tpn = rows.loc[rows["tp"] > 1, "non_torch_gib"].median() * GiB
    return {"sampler": float(samplers[i]), "hidden": float(buffers[j]), "non_torch": tp1, "tp_extra": tpn - tp1}


def kv_before(row) -> float:
    _, smi = totals(row)
    act = row.max_num_batched_tokens * (2 * row.intermediate_size + 4 * row.hidden_size) * 2 / row.tp
    return smi * row.gpu_memory_utilization - row.weights_gib * GiB - 1 * GiB - act


def kv_after(row, c: dict[str, float]) -> float:
    cuda, _ = totals(row)
    non_torch = c["non_torch"] + (c["tp_extra"] if row.tp > 1 and row.gpu in PRESET_OF_GPU else 0.0)
    return (cuda * row.gpu_memory_utilization - row.weights_gib * GiB - non_torch
            - activation(row, c["sampler"], c["hidden"]))


def blocks(row, kv_bytes: float) -> int:
    return math.floor(kv_bytes / kv_block_bytes(model_of(row), int(row.tp), BLOCK_SIZE))


def error_rows(df: pd.DataFrame, constants_for) -> pd.DataFrame:
    out = []
    for row in df[df["kv_gib"].notna()].itertuples():
        logged = row.kv_gib * GiB
        logged_blocks = (int(row.kv_tokens) // BLOCK_SIZE if not pd.isna(row.kv_tokens) else blocks(row, logged))
        before, after = kv_before(row), kv_after(row, constants_for(row))
        out.append({
            "row": row.row, "vllm": row.vllm_version, "gpu": row.gpu.split(" (")[0], "model": row.model.split("/")[-1],
            "tp": row.tp, "KV GiB": row.kv_gib,
            "before GiB": (before - logged) / GiB, "after GiB": (after - logged) / GiB,
            "before % blocks": 100 * (blocks(row, before) - logged_blocks) / logged_blocks,
            "after % blocks": 100 * (blocks(row, after) - logged_blocks) / logged_blocks,
        })
    return pd.DataFrame(out)


def summary(t: pd.DataFrame, label: str) -> str:
    parts = []
    for side in ("before", "after"):
        gib, pct = t[f"{side} GiB"].abs(), t[f"{side} % blocks"].abs()
        parts.append(f"{side}: median |error| {gib.median():.2f} GiB / {pct.median():.1f} % of blocks, "
                     f"worst {gib.max():.2f} GiB / {pct.max():.1f} %")
    return f"{label} ({len(t)} rows) -- " + "; ".join(parts)


def main() -> None:
    df = pd.read_csv(DATA)
    fit_rows = df[df["vllm_version"] == FIT_RELEASE]
    shipped = fit(fit_rows)
    print(f"{DATA.name}: {len(df)} rows, {len(fit_rows)} from vLLM {FIT_RELEASE}")
    print(f"fit on every {FIT_RELEASE} row: sampler {shipped['sampler']:.2f} B per logit, forward hidden buffers "
          f"{shipped['hidden']:.2f}, non-torch {shipped['non_torch'] / GiB:.2f} GiB + {shipped['tp_extra'] / GiB:.2f} "
          f"GiB at TP >= 2 on NVSwitch (shipped: {SAMPLER_BYTES_PER_LOGIT}, {FORWARD_HIDDEN_BUFFERS}, "
          f"{get_hardware('h100-sxm').non_torch_bytes / GiB:.2f} + {get_hardware('h100-sxm').tp_non_torch_bytes / GiB:.2f})")
    held_out = {m: fit(fit_rows[fit_rows["model"] != m]) for m in fit_rows["model"].unique()}
    acts = []
    for row in fit_rows.itertuples():
        c = held_out[row.model]
        acts.append(abs(activation(row, c["sampler"], c["hidden"]) / GiB - row.activation_gib))
    print(f"activation peak, each model held out ({len(acts)} rows): median |error| {np.median(acts):.3f} GiB, "
          f"worst {max(acts):.3f} GiB")
    fmt = {"float_format": lambda v: f"{v:+.2f}"}
    t19 = error_rows(fit_rows, lambda r: held_out[r.model])
    print(f"\nKV cache, vLLM {FIT_RELEASE} rows, each model held out of the fit:")
    print(t19.to_string(index=False, **fmt))
    print(summary(t19, f"vLLM {FIT_RELEASE}, held out"))
    other = error_rows(df[df["vllm_version"] != FIT_RELEASE], lambda r: shipped)
    print("\nKV cache, other releases, shipped constants:")
    print(other.to_string(index=False, **fmt))
    print(summary(other, "other releases"))


if __name__ == "__main__":
    main()
