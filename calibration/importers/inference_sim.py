"""inference-sim/inference-sim attention benchmarks (``bench_data/mha/{decode,prefill}/h100/``).

One layer's attention, bf16 on an H100 SXM. File names carry the head shape:
``mha_decode_h100_<q heads>-<kv heads>-<head dim>-tp<N>.csv`` (``batch_size, kv_len, latency_us``)
and ``mha_prefill_h100_<q>-<kv>-<dim>.csv`` (causal prefill from an empty cache: ``seq_len,
latency_us``). Read as ``batch, kv_len, seconds`` and ``seq_len, seconds``; ``heads`` gives
(q heads, kv heads, head dim, tp) from the name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from . import INFERENCE_SIM, Provenance, SourceError, numeric, one_row_per_shape, provenance, read_csv

US = 1e-6
_NAME = re.compile(r"mha_(decode|prefill)_(\w+?)_(\d+)-(\d+)-(\d+)(?:-tp(\d+))?\.csv$")
GPUS = {"h100": "NVIDIA H100 SXM"}


def heads(path: str | Path) -> tuple[str, str, int, int, int, int]:
    """(kind, gpu key, q heads, kv heads, head dim, tp) from a file name; ``SourceError`` if it has none."""
    m = _NAME.search(Path(path).name)
    if not m:
        raise SourceError(f"{path}: name does not read as mha_<decode|prefill>_<gpu>_<q>-<kv>-<dim>[-tp<N>].csv")
    kind, gpu, q, kv, dim, tp = m.groups()
    return kind, gpu, int(q), int(kv), int(dim), int(tp or 1)


def _prov(path: Path, kind: str, gpu: str, what: str) -> Provenance:
    return provenance(INFERENCE_SIM, f"bench_data/mha/{kind}/{gpu}/{path.name}", path, GPUS.get(gpu, gpu), what)


def read_decode(path: str | Path) -> tuple[pd.DataFrame, Provenance]:
    """``mha_decode_*.csv`` -> (``batch, kv_len, seconds``, provenance)."""
    path = Path(path)
    kind, gpu, *_ = heads(path)
    if kind != "decode":
        raise SourceError(f"{path}: a prefill file where a decode file was expected")
    df = numeric(read_csv(path, ("batch_size", "kv_len", "latency_us")), path, ("batch_size", "kv_len", "latency_us"),
                 positive=("batch_size", "kv_len", "latency_us"), whole=("batch_size", "kv_len"))
    df = one_row_per_shape(df, path, ("batch_size", "kv_len"), "latency_us")
    out = pd.DataFrame({"batch": df["batch_size"].astype(int), "kv_len": df["kv_len"].astype(int),
                        "seconds": df["latency_us"] * US})
    return out, _prov(path, kind, gpu, "one layer's decode attention vs batch and KV length (us)")


def read_prefill(path: str | Path) -> tuple[pd.DataFrame, Provenance]:
    """``mha_prefill_*.csv`` -> (``seq_len, seconds``, provenance)."""
    path = Path(path)
    kind, gpu, *_ = heads(path)
    if kind != "prefill":
        raise SourceError(f"{path}: a decode file where a prefill file was expected")
    df = numeric(read_csv(path, ("seq_len", "latency_us")), path, ("seq_len", "latency_us"),
                 positive=("seq_len", "latency_us"), whole=("seq_len",))
    df = one_row_per_shape(df, path, ("seq_len",), "latency_us")
    out = pd.DataFrame({"seq_len": df["seq_len"].astype(int), "seconds": df["latency_us"] * US})
    return out, _prov(path, kind, gpu, "one layer's causal prefill attention vs sequence length (us)")
