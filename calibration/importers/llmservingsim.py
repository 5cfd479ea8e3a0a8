"""casys-kaist/LLMServingSim profiles: vLLM 0.19 kernels timed one decoder layer at a time.

Folder layout (``profiler/perf/<GPU>/<org>/<model>/bf16/`` upstream)::

    meta.yaml             GPU, vLLM/CUDA versions, engine settings (hf_overrides: the profiled
                          layer's shape), the attention and skew grids
    tp<N>/dense.csv       layer,tokens,time_us        one decoder layer's token-linear ops
    tp<N>/attention.csv   prefill_chunk,kv_prefill,n_decode,kv_decode,time_us
    tp<N>/per_sequence.csv layer,sequences,time_us    lm_head, sampler
    tp<N>/skew.csv        decode attention with unequal contexts (t_mean/t_max/t_skew, us)

What a row measures: ``tp<N>`` tables were taken on ONE GPU with the layer shrunk to one rank's
shard (heads, intermediate size and vocabulary divided by N through hf_overrides), so their times
are per rank and contain no collective communication. ``layernorm`` is one RMSNorm instance (a
decoder layer runs two), ``qk_norm`` (Qwen3) both per-head norms of a layer.

Frames returned (SI units):

- dense: ``op, tokens, seconds``
- attention: ``prefill_chunk, kv_prefill, n_decode, kv_decode, seconds`` (one layer; one prefill
  chunk of ``prefill_chunk`` new tokens over ``kv_prefill`` cached ones, plus ``n_decode`` decode
  rows each with ``kv_decode`` cached tokens, in one kernel call)
- per_sequence: ``op, sequences, seconds``
- skew: ``regime, n, nb, skew, pc, kp, kvs, kv_big, kv_mean, t_mean_s, t_max_s, t_skew_s``, per
  call: the file sums ``measurement_iterations`` timed calls, so ``read_profile`` divides by it
- v0 layers: ``op, tokens, kv_cache, tp, seconds``
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from . import (
    LLMSERVINGSIM,
    Provenance,
    SourceError,
    after,
    not_a_file,
    numeric,
    one_row_per_shape,
    provenance,
    read_csv,
)

US = 1e-6
NS = 1e-9
FILES = ("dense", "attention", "per_sequence", "skew")
ATTENTION_AXES = ("prefill_chunk", "kv_prefill", "n_decode", "kv_decode")
# meta.yaml's engine_effective.hf_overrides that give the profiled layer's shape (one rank's shard)
LAYER_SHAPE = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size", "hidden_size",
               "head_dim")
SKEW_COUNTS = ("n", "nb", "pc", "kp", "kvs", "kv_big", "kv_mean")
SKEW_COLUMNS = ("regime", "n", "nb", "skew", "pc", "kp", "kvs", "kv_big", "kv_mean",
                "t_mean_us", "t_max_us", "t_skew_us")
# v0 (Hugging Face, unfused) op names -> the vLLM-style names of the current profiles
V0_OPS = {"input_layernorm": "layernorm", "post_layernorm": "layernorm_post", "rope": "rotary_emb",
          "attn": "attention"}


@dataclass
class TPTables:
    """One tensor-parallel degree's tables (per rank)."""

    tp: int
    dense: pd.DataFrame
    attention: pd.DataFrame
    per_sequence: pd.DataFrame
    skew: pd.DataFrame | None
    provenance: list[Provenance] = field(default_factory=list)


@dataclass
class LLMServingSimProfile:
    """A profile folder: ``meta`` (meta.yaml as a dict) and its tables per TP degree."""

    path: Path
    meta: dict[str, Any]
    tp: dict[int, TPTables]

    @property
    def gpu(self) -> str:
        return str(self.meta.get("gpu", ""))

    @property
    def model(self) -> str:
        return str(self.meta.get("model", ""))

    @property
    def provenance(self) -> list[Provenance]:
        meta = [provenance(LLMSERVINGSIM, self._source("meta.yaml"), self.path / "meta.yaml", self.gpu,
                           "profile metadata: GPU, vLLM version, engine settings, grids")]
        return meta + [p for t in self.tp.values() for p in t.provenance]

    def _source(self, rel: str) -> str:
        sub = after(self.path, "profiles")
        parts = sub.split("/") if sub else []
        if len(parts) >= 3:  # <GPU>/<org>/<model>
            return "profiler/perf/" + "/".join(parts[:3]) + f"/{self.meta.get('variant', 'bf16')}/" + rel
        return rel


def read_meta(path: str | Path) -> dict[str, Any]:
    """``meta.yaml`` as a dict; it must name the gpu, the model and the TP degrees."""
    path = Path(path)
    if why := not_a_file(path):
        raise SourceError(f"{path}: {why} (an LLMServingSim profile folder has a meta.yaml)")
    data = path.read_bytes()
    try:
        meta = yaml.safe_load(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                          "save it as UTF-8") from None
    except yaml.YAMLError as exc:
        raise SourceError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(meta, dict):
        raise SourceError(f"{path}: expected a mapping, got {type(meta).__name__}")
    for key in ("gpu", "model", "tp_degrees"):
        if key not in meta:
            raise SourceError(f"{path}: missing field {key!r}")
    for key in ("gpu", "model"):
        if not isinstance(meta[key], str) or not meta[key].strip():
            raise SourceError(f"{path}: {key} must be a name, got {meta[key]!r}")
    tp = meta["tp_degrees"]
    if not isinstance(tp, list) or not tp or not all(_whole(t) for t in tp):
        raise SourceError(f"{path}: tp_degrees must be a list of whole numbers >= 1 (e.g. [1, 2]), got {tp!r}")
    iters = meta.get("measurement_iterations")
    if iters is not None and not _whole(iters):
        raise SourceError(f"{path}: measurement_iterations must be a whole number >= 1 (the timed calls each "
                          f"skew.csv time sums), got {iters!r}")
    engine = meta.get("engine_effective")
    if engine is not None and not isinstance(engine, dict):
        raise SourceError(f"{path}: engine_effective must be a mapping, got {engine!r}")
    over = (engine or {}).get("hf_overrides")
    if over is not None and not isinstance(over, dict):
        raise SourceError(f"{path}: engine_effective.hf_overrides must be a mapping, got {over!r}")
    for key in LAYER_SHAPE:
        if key in (over or {}) and not _whole(over[key]):
            raise SourceError(f"{path}: hf_overrides.{key} must be a whole number >= 1, got {over[key]!r}")
    return meta


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read_dense(path: str | Path) -> pd.DataFrame:
    """``dense.csv`` -> ``op, tokens, seconds``."""
    df = numeric(read_csv(path, ("layer", "tokens", "time_us")), path, ("tokens", "time_us"), positive=("tokens", "time_us"),
                 whole=("tokens",))
    df = one_row_per_shape(df, path, ("layer", "tokens"), "time_us")
    return pd.DataFrame({"op": df["layer"].astype(str), "tokens": df["tokens"].astype(int),
                         "seconds": df["time_us"] * US})


def read_per_sequence(path: str | Path) -> pd.DataFrame:
    """``per_sequence.csv`` -> ``op, sequences, seconds``."""
    df = numeric(read_csv(path, ("layer", "sequences", "time_us")), path, ("sequences", "time_us"),
                 positive=("sequences", "time_us"), whole=("sequences",))
    df = one_row_per_shape(df, path, ("layer", "sequences"), "time_us")
    return pd.DataFrame({"op": df["layer"].astype(str), "sequences": df["sequences"].astype(int),
                         "seconds": df["time_us"] * US})


def read_attention(path: str | Path) -> pd.DataFrame:
    """``attention.csv`` -> the four axes (tokens, rows) and ``seconds`` of one layer's attention."""
    df = numeric(read_csv(path, (*ATTENTION_AXES, "time_us")), path, (*ATTENTION_AXES, "time_us"),
                 positive=("time_us",), whole=ATTENTION_AXES)
    df = one_row_per_shape(df, path, ATTENTION_AXES, "time_us")
    out = df[list(ATTENTION_AXES)].astype(int)
    out["seconds"] = df["time_us"] * US
    return out


def read_skew(path: str | Path) -> pd.DataFrame:
    """``skew.csv`` -> shape columns and ``t_mean_s, t_max_s, t_skew_s`` (one layer's attention)."""
    nums = [c for c in SKEW_COLUMNS if c != "regime"]
    df = numeric(read_csv(path, SKEW_COLUMNS), path, nums, positive=("t_mean_us", "t_max_us", "t_skew_us"),
                 whole=SKEW_COUNTS)
    out = df[["regime", "n", "nb", "skew", "pc", "kp", "kvs", "kv_big", "kv_mean"]].copy()
    for c in SKEW_COUNTS:
        out[c] = out[c].astype(int)
    for c in ("t_mean", "t_max", "t_skew"):
        out[f"{c}_s"] = df[f"{c}_us"] * US
    return out


def read_profile(path: str | Path, tp: list[int] | None = None) -> LLMServingSimProfile:
    """Read a profile folder (the one holding ``meta.yaml``); ``tp`` limits the degrees read."""
    path = Path(path)
    meta = read_meta(path / "meta.yaml")
    degrees = list(meta["tp_degrees"])
    if tp:
        unknown = [t for t in tp if t not in degrees]
        if unknown:
            raise SourceError(f"{path}: no tp{unknown[0]} tables (meta.yaml lists tp {degrees})")
        degrees = list(tp)
    prof = LLMServingSimProfile(path, meta, {})
    for t in degrees:
        d = path / f"tp{t}"
        skew = read_skew(d / "skew.csv") if (d / "skew.csv").exists() else None  # optional; a folder is an error
        if skew is not None:
            # the profiler's skew pass sums its timed iterations (skew.py `_measure`): its times
            # are meta.yaml's measurement_iterations x one call (2.97x attention.csv at the same shape)
            iters = meta.get("measurement_iterations") or 1
            for c in ("t_mean_s", "t_max_s", "t_skew_s"):
                skew[c] = skew[c] / iters
        tables = {"dense": read_dense(d / "dense.csv"), "attention": read_attention(d / "attention.csv"),
                  "per_sequence": read_per_sequence(d / "per_sequence.csv"), "skew": skew}
        what = {"dense": "one decoder layer's token-linear ops vs tokens (us, per rank)",
                "attention": "one layer's attention: prefill chunk over cached context + decode rows (us)",
                "per_sequence": "lm_head and sampler vs sequences (us, per rank)",
                "skew": "decode attention with unequal contexts: t_mean, t_max, t_skew (us)"}
        provs = [provenance(LLMSERVINGSIM, prof._source(f"tp{t}/{f}.csv"), d / f"{f}.csv", prof.gpu, what[f])
                 for f in FILES if tables[f] is not None]
        prof.tp[t] = TPTables(t, tables["dense"], tables["attention"], tables["per_sequence"], tables["skew"],
                              provs)
    return prof


def read_v0_layers(path: str | Path, gpu: str = "NVIDIA H100") -> tuple[pd.DataFrame, Provenance]:
    """The v0 ``layers.csv`` (Hugging Face layer under the PyTorch profiler) -> ``op, tokens,
    kv_cache, tp, seconds``; ops renamed to the vLLM names where one exists (``V0_OPS``)."""
    path = Path(path)
    cols = ("layer_name", "input", "kv_cache", "tp_size", "latency(ns)")
    df = numeric(read_csv(path, cols), path, cols[1:], positive=("input", "tp_size", "latency(ns)"),
                 whole=cols[1:4])
    df = one_row_per_shape(df, path, cols[:4], cols[4])
    out = pd.DataFrame({"op": df["layer_name"].astype(str).replace(V0_OPS), "tokens": df["input"].astype(int),
                        "kv_cache": df["kv_cache"].astype(int), "tp": df["tp_size"].astype(int),
                        "seconds": df["latency(ns)"] * NS})
    sub = after(path, "v0-H100-Llama-3.1-8B")
    src = "profiler/v0/perf_models/H100/meta-llama/Llama-3.1-8B/tp1/" + (sub or path.name)
    prov = provenance(LLMSERVINGSIM, src, path, gpu,
                      "v0: Hugging Face Llama-3.1-8B layer, PyTorch profiler, eager (ns per op)")
    return out, prov
