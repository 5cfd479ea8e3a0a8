"""microsoft/vidur profiling tables.

- ``compute/<gpu>/<org>/<model>/mlp.csv``: one decoder layer's ops, milliseconds (min/max/mean/
  median/std columns ``time_stats.<op>.<stat>``) at ``num_tokens`` and ``num_tensor_parallel_workers``.
  Read as ``op, tokens, tp, seconds`` (the median), ops renamed to vLLM's names (``OPS``).
- ``network/<cluster>/all_reduce.csv``: NCCL all-reduce, ``size`` in bytes, milliseconds. Read as
  ``bytes, num_workers, devices_per_node, seconds`` (the median).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from . import VIDUR, Provenance, SourceError, after, numeric, provenance, read_csv

MS = 1e-3
# Vidur op -> the vLLM-style op name used by servesim GPU profiles
OPS = {"emb": "embedding", "input_layernorm": "layernorm", "attn_pre_proj": "qkv_proj", "attn_rope": "rotary_emb",
       "attn_post_proj": "o_proj", "post_attention_layernorm": "layernorm_post", "mlp_up_proj": "gate_up_proj",
       "mlp_act": "act_fn", "mlp_down_proj": "down_proj", "add": "add"}
GPUS = {"a100": "NVIDIA A100 80GB (DGX)", "h100": "NVIDIA H100 (DGX)"}


def _gpu(path: Path, marker: str) -> str:
    sub = after(path, marker)
    key = sub.split("/")[0].split("_")[0] if sub else ""
    return GPUS.get(key, key or "unknown")


def read_mlp(path: str | Path) -> tuple[pd.DataFrame, Provenance]:
    """``mlp.csv`` -> (``op, tokens, tp, seconds`` long frame, provenance)."""
    path = Path(path)
    df = read_csv(path, ("num_tokens", "num_tensor_parallel_workers"))
    stats = [c for c in df.columns if c.startswith("time_stats.") and c.endswith(".median")]
    if not stats:
        raise SourceError(f"{path}: missing column 'time_stats.<op>.median' (has: {', '.join(df.columns[:6])}, ...)")
    df = numeric(df, path, ["num_tokens", "num_tensor_parallel_workers", *stats],
                 positive=["num_tokens", "num_tensor_parallel_workers", *stats],
                 whole=("num_tokens", "num_tensor_parallel_workers"))
    frames = []
    for c in stats:
        op = c.removeprefix("time_stats.").removesuffix(".median")
        frames.append(pd.DataFrame({"op": OPS.get(op, op), "tokens": df["num_tokens"].astype(int),
                                    "tp": df["num_tensor_parallel_workers"].astype(int), "seconds": df[c] * MS}))
    out = pd.concat(frames, ignore_index=True).sort_values(["op", "tp", "tokens"], ignore_index=True)
    sub = after(path, "compute")
    prov = provenance(VIDUR, "data/profiling/compute/" + (sub or path.name), path, _gpu(path, "compute"),
                      "one decoder layer's ops vs num_tokens and TP (ms, median of repeats)")
    return out, prov


def read_all_reduce(path: str | Path) -> tuple[pd.DataFrame, Provenance]:
    """``all_reduce.csv`` -> (``bytes, num_workers, devices_per_node, seconds``, provenance)."""
    path = Path(path)
    cols = ("size", "num_workers", "devices_per_node", "time_stats.all_reduce.median")
    df = numeric(read_csv(path, cols), path, cols, positive=cols, whole=cols[:3])
    out = pd.DataFrame({"bytes": df["size"].astype(int), "num_workers": df["num_workers"].astype(int),
                        "devices_per_node": df["devices_per_node"].astype(int),
                        "seconds": df["time_stats.all_reduce.median"] * MS})
    sub = after(path, "network")
    prov = provenance(VIDUR, "data/profiling/network/" + (sub or path.name), path, _gpu(path, "network"),
                      "NCCL all-reduce vs message size (bytes) and GPUs (ms, median)")
    return out.sort_values(["num_workers", "bytes"], ignore_index=True), prov
