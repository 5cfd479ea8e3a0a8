"""Readers for measured serving runs: what a real vLLM server did, request by request.

Two formats:

- ``llmservingsim``: a folder as LLMServingSim ships its real vLLM runs (``bench/examples/<GPU>/<model>/``):
  ``requests.jsonl`` (one request a line: ``input_toks``, ``output_toks``, ``arrival_time`` on the
  client's wall clock, ``queued_ts``, ``scheduled_ts``, ``first_token_ts``, ``last_token_ts`` on the
  engine's monotonic clock, seconds), ``meta.json`` (model, vLLM version, engine kwargs), and
  optionally ``llmservingsim_config.json`` (the GPU) and ``llmservingsim_summary.txt`` (LLMServingSim's
  own error on the run).
- ``vllm-bench``: the JSON ``vllm bench serve --save-result --save-detailed`` writes
  (``vllm/benchmarks/serve.py``): ``input_lens``, ``output_lens``, ``ttfts``, ``itls`` and, in
  recent versions, ``start_times`` (the client's ``perf_counter`` at send) and ``latencies``; plus
  ``model_id``, ``request_rate``, ``burstiness``, ``max_concurrency``. It is the client's view only:
  no engine settings, no GPU.

Clocks. ``arrival_time`` and the engine timestamps come from two clocks with an unknown offset.
Each request's ``queued_ts - arrival_time`` is that offset plus the request's transport (HTTP,
tokenisation, IPC) plus the wait until the engine's busy loop next drains its input queue, which
happens between steps. The smallest of them over the run is the offset plus the bare transport
of a request that found the engine between steps; every client arrival is moved onto the engine
clock by that one constant. TTFT and E2E are then measured from that engine-side arrival, like
the simulator measures them (a request arriving during a step waits for the next one in both).
LLMServingSim measures from ``queued_ts`` instead, which leaves out the wait for the step
boundary; both figures are kept (``ttft_from_queued``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from servesim.sim.config_model import MAX_SIM_SECONDS
from servesim.sim.hints import did_you_mean
from servesim.sim.metrics import REQUEST_COLUMNS, LogHistogram
from servesim.sim.presets import HARDWARE, MODELS, hardware_preset
from servesim.sim.scenario import ScenarioError

FORMATS = ("llmservingsim", "vllm-bench")
LLMSERVINGSIM_FIELDS = ("input_toks", "output_toks", "arrival_time", "queued_ts", "first_token_ts", "last_token_ts")

# Hugging Face ids whose name does not spell the servesim preset after normalising (see model_preset)
_HF_MODELS = {
    "mistral-7b-v0.1": "mistral-7b",
    "mistral-7b-v0.3": "mistral-7b",
}
_TUNE_TAGS = re.compile(r"-(instruct|chat|hf)(?=-|$)")
# LLMServingSim's summary rows -> servesim summary keys
_REF_FAMILIES = {"TTFT": "ttft", "TPOT": "tpot", "ITL": "itl", "Latency": "e2el"}
_REF_STATS = {"Mean": "mean", "Median": "median"}
_REF_ROW = re.compile(r"^(?P<fam>TTFT|TPOT|ITL|Latency)\s+(?P<stat>Mean|Median|P\d+)\s+(?P<real>[-+0-9.eE]+)\s+"
                      r"(?P<sim>[-+0-9.eE]+)\s+(?P<diff>[-+0-9.eE]+)%\s*$")


# most seconds from a request's arrival_time to its queued_ts past the smallest such gap: the way into the
# engine waits at most a step (the shipped runs: 0.11 s and 0.37 s); more is a clock mixed up
MAX_WAY_IN_S = 30.0


class RunFileError(ScenarioError):
    """A measured run file that is missing, malformed or lacks a field; the message is one line (exit 2)."""


@dataclass
class MeasuredRun:
    """One measured run, with every time on one clock (seconds from the first arrival)."""

    name: str
    path: Path
    format: str
    model_source: str  # the model as the run names it
    model: str | None  # the servesim preset, None when there is none
    hardware_source: str | None
    hardware: str | None
    tensor_parallel: int | None
    scheduler: dict[str, Any]  # vllm-v1 preset knobs the run states (engine names)
    kv_cache: dict[str, Any]  # kv_cache fields the run states
    requests: pd.DataFrame  # REQUEST_COLUMNS, one row per served request, sorted by arrival
    itl_hist: LogHistogram | None  # per-token gaps, when the run recorded them
    vllm_version: str | None = None
    data_parallel: int = 1  # engines behind vLLM's data-parallel coordinator
    clock: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the run lacks and how it was filled in
    reference: dict[str, dict[str, float]] = field(default_factory=dict)  # metric -> LLMServingSim's figures
    reference_source: str | None = None
    arrivals_exact: bool = True  # False when arrivals were drawn from the run's rate (no start times)
    kv_cache_dtype: str | None = None  # an 8-bit KV cache the run states (``fp8``...); None: 16-bit
    # engine_kwargs.kv_cache_memory_bytes: the KV budget per GPU the run gave vLLM instead of profiling
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool | None = None  # engine_kwargs.enforce_eager as recorded (None: not recorded)
    # totals of vLLM's own per-tick counters where timeseries.csv has them: preemptions, prompt tokens
    # and the prompt tokens its prefix cache served (newer bench runs)
    engine_counters: dict[str, float] = field(default_factory=dict)
    # the GPU's memory as CUDA reports it (hardware.device_total_memory_bytes of newer bench runs)
    cuda_total_bytes: int | None = None
    # the engine's parallelism as the run's files state it (scenario keys: tensor_parallel, cluster.num_replicas);
    # a --set that contradicts it would simulate another engine than the measured one
    stated: dict[str, int] = field(default_factory=dict)


# what servesim's presets and profiles price: 16-bit weights, activations and KV cache
_SIXTEEN_BIT = {None, "auto", "bfloat16", "bf16", "float16", "fp16", "half"}


def _precision(kwargs: dict[str, Any], model_cfg: dict[str, Any], cache_cfg: dict[str, Any], meta_path: Path,
               notes: list[str]) -> str | None:
    """Refuse a run whose weights are not 16-bit (every step would be priced wrong); return its KV
    cache dtype when that is 8-bit (the block count then needs the run's own, see ``scenario_dict``).
    Each is read from ``engine_kwargs`` and from what vLLM resolved (``resolved_config``: it also takes
    them from the checkpoint), the dtype as torch names it (``torch.bfloat16``) too."""
    for where, dtype in (("engine_kwargs.dtype", kwargs.get("dtype")),
                         ("resolved_config.model_config.dtype", model_cfg.get("dtype"))):
        name = dtype.lower().removeprefix("torch.") if isinstance(dtype, str) else dtype
        if not isinstance(name, str | None) or name not in _SIXTEEN_BIT:
            raise RunFileError(f"{meta_path}: {where} {dtype!r:.60} is not modelled: servesim's model presets and GPU "
                               "profiles price 16-bit (bfloat16/float16) weights and activations")
    for where, quant in (("engine_kwargs.quantization", kwargs.get("quantization")),
                         ("resolved_config.model_config.quantization", model_cfg.get("quantization"))):
        if quant not in (None, "", "none"):
            raise RunFileError(f"{meta_path}: {where} {quant!r:.60} is not modelled: servesim's model presets and GPU "
                               "profiles price 16-bit weights (their bytes, GEMMs and the KV memory left)")
    where, kv_dtype = next(((w, v) for w, v in (("resolved_config.cache_config.cache_dtype", cache_cfg.get("cache_dtype")),
                                                ("engine_kwargs.kv_cache_dtype", kwargs.get("kv_cache_dtype")))
                            if v not in (None, "auto")), ("engine_kwargs.kv_cache_dtype", None))
    if not isinstance(kv_dtype, str | None):
        raise RunFileError(f"{meta_path}: {where} must be a name like 'auto' or 'fp8', got {kv_dtype!r:.60}")
    recorded = kv_dtype
    if isinstance(kv_dtype, str):
        kv_dtype = kv_dtype.lower().removeprefix("torch.")
    if kv_dtype in _SIXTEEN_BIT:
        return None
    notes.append(f"{where} {recorded!r}: servesim prices a 16-bit KV cache, so "
                 "attention's KV reads are priced at twice their bytes; the block count must be the run's own")
    return str(kv_dtype)


# ---- names ----------------------------------------------------------------------------------------
def model_preset(name: str) -> str | None:
    """The servesim model preset a Hugging Face id (or a path ending in one) names, or None.

    ``meta-llama/Llama-3.1-8B`` -> ``llama-3.1-8b``, ``Qwen/Qwen3-32B`` -> ``qwen3-32b``,
    ``meta-llama/Meta-Llama-3-8B-Instruct`` -> ``llama-3-8b`` (instruct tunes share the shapes).
    """
    base = str(name).rstrip("/").split("/")[-1].lower()
    # tune and format tags anywhere in the name: Llama-2-7b-chat-hf, Mistral-7B-Instruct-v0.3
    base = _TUNE_TAGS.sub("", base)
    base = base.removeprefix("meta-")
    base = _HF_MODELS.get(base, base)
    return base if base in MODELS else None


def unknown_model_message(where: str, name: str) -> str:
    return (f"{where}: model {name!r} has no servesim preset{did_you_mean(model_preset(name) or name, MODELS)}; "
            f"give one with --set model=NAME ({', '.join(MODELS)})")


def unknown_hardware_message(where: str, name: str | None) -> str:
    what = f"GPU {name!r} has no servesim hardware preset" if name else "the run does not name its GPU"
    return f"{where}: {what}; give one with --set hardware=NAME ({', '.join(HARDWARE)})"


# ---- shared helpers -------------------------------------------------------------------------------
def _read_text(path: Path) -> str:
    """A run file's text; ``RunFileError`` when it is missing or not UTF-8 (a UTF-16 or binary file)."""
    if path.is_dir():
        raise RunFileError(f"{path}: a folder, not a file (an LLMServingSim run folder is read without "
                           "--format vllm-bench)")
    if not path.is_file():
        raise RunFileError(f"{path}: file not found")
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")  # (a byte order mark, as Windows editors save UTF-8, dropped)
    except UnicodeDecodeError as e:
        raise RunFileError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                           "save the run's files as UTF-8") from None


def _parse_json(text: str, where: str, line: bool = True) -> Any:
    """``text`` parsed; ``RunFileError`` naming ``where`` (and the line in it when ``line``) when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RunFileError(f"{where}{f':{e.lineno}' if line else ''}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise RunFileError(f"{where}: not valid JSON (nested too deeply)") from None


def _read_json(path: Path) -> Any:
    return _parse_json(_read_text(path), str(path))


def _is_tag(value: Any) -> bool:
    """A type tag LLMServingSim's bench runner writes in place of a value it could not record: a config
    it could not list (``"<SchedulerConfig>"``), a property that raised (``"<unreadable: AttributeError>"``)
    or a value too long to keep (``"<dict len=80>"``)."""
    return isinstance(value, str) and value.startswith("<") and value.endswith(">")


def _object(parent: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """``parent[name]`` when it is a JSON object, {} when absent, null or a type tag; else ``RunFileError``."""
    value = parent.get(name)
    if value is None or _is_tag(value):
        return {}
    if not isinstance(value, dict):
        raise RunFileError(f"{where}: field '{name}' must be a JSON object, got {value!r:.60}")
    return value


def _count(value: Any, where: str, name: str, least: int = 1, most: int = 2**32) -> int | None:
    """An optional whole number in [least, most] (a TP or DP degree, a context length, a byte count);
    None when absent or null."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise RunFileError(f"{where}: field '{name}' must be a whole number >= {least} and <= {most}, got "
                           f"{value!r:.60}; fix the file or give the value with --set")
    return value


def _number(value: Any, where: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RunFileError(f"{where}: field '{name}' must be a finite number, got {value!r}")
    return float(value)


def _tokens(value: Any, where: str, name: str, least: int) -> float:
    """A token count: a whole number in [least, 2**32] (1e30 tokens is not a length)."""
    v = _number(value, where, name)
    if v != int(v) or not least <= v <= 2**32:
        raise RunFileError(f"{where}: field '{name}' must be a whole number of tokens in [{least}, 2**32], got {value!r}")
    return v


def _gaps(value: Any, where: str) -> list[float]:
    """One request's inter-token latencies (seconds): a list of finite numbers (None: none)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RunFileError(f"{where}: field 'itls' must be a list of seconds, got {value!r}")
    gaps = [_number(x, where, "itls") for x in value]
    if not all(0 <= x <= MAX_SIM_SECONDS for x in gaps):
        raise RunFileError(f"{where}: field 'itls' must hold seconds between 0 and {MAX_SIM_SECONDS:.0e}, "
                           f"got {min(gaps) if min(gaps) < 0 else max(gaps)!r}")
    return gaps


def _requests_frame(arrival: np.ndarray, scheduled: np.ndarray, first: np.ndarray, finish: np.ndarray,
                    prompt: np.ndarray, output: np.ndarray) -> pd.DataFrame:
    """A requests frame like a servesim run's (REQUEST_COLUMNS), times already on one clock."""
    n = arrival.size
    out = output.astype(np.int64)
    ttft, e2e = first - arrival, finish - arrival
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(out > 1, (finish - first) / (out - 1), np.nan)
    data = {
        "request_id": np.arange(n, dtype=np.int64), "replica": np.zeros(n, dtype=np.int64),
        "arrival_time": arrival, "first_scheduled_time": scheduled, "first_token_time": first,
        "finish_time": finish, "prompt_len": prompt.astype(np.int64), "output_len": out,
        "num_output_tokens": out, "ttft": ttft, "tpot": tpot, "e2e": e2e, "queueing_delay": scheduled - arrival,
        "num_preemptions": np.zeros(n, dtype=np.int64), "num_cached_tokens": np.zeros(n, dtype=np.int64),
        "state": pd.Series(["finished"] * n, dtype=object), "reject_reason": pd.Series([None] * n, dtype=object),
    }  # fmt: skip
    return pd.DataFrame({k: data[k] for k in REQUEST_COLUMNS})


# ---- LLMServingSim runs ---------------------------------------------------------------------------
def read_llmservingsim(folder: str | Path) -> MeasuredRun:
    """Read an LLMServingSim run folder (see the module docstring); ``RunFileError`` names file, line, field."""
    root = Path(folder)
    if not root.is_dir():
        raise RunFileError(f"{root}: not a run folder (expected requests.jsonl and meta.json inside)")
    meta_path = root / "meta.json"
    if not meta_path.exists() and (root / "engine_start.json").exists():
        # LLMServingSim's runner writes engine_start.json at boot and meta.json + requests.jsonl at the end
        raise RunFileError(f"{root}: engine_start.json but no meta.json: the run stopped before it wrote its "
                           "requests (the harness writes them when the replay ends); nothing to compare")
    meta = _read_json(meta_path)
    if not isinstance(meta, dict):
        raise RunFileError(f"{meta_path}: expected a JSON object")
    if meta.get("resolve_only") is True:
        blocks = _object(meta, "kv_cache", str(meta_path)).get("num_gpu_blocks")
        raise RunFileError(f"{meta_path}: a resolve-only boot (resolve_only true) replays no requests; what it measured "
                           f"is the KV cache (num_gpu_blocks {blocks}): give a run of that engine its block count with "
                           "--set kv_cache.num_blocks=N")
    kwargs = meta.get("engine_kwargs")
    if not isinstance(kwargs, dict):
        raise RunFileError(f"{meta_path}: missing field 'engine_kwargs' (the engine's arguments)")
    model_source = meta.get("model") or kwargs.get("model")
    if not model_source:
        raise RunFileError(f"{meta_path}: missing field 'model'")
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        value = kwargs.get(key)
        if value is None:
            raise RunFileError(f"{meta_path}: missing field 'engine_kwargs.{key}' (an integer)")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**32:  # ("8": not missing)
            raise RunFileError(f"{meta_path}: field 'engine_kwargs.{key}' must be a whole number >= 1 and <= 2**32, "
                               f"got {value!r:.60}")
    notes: list[str] = []
    # newer bench runs also record what vLLM resolved: the KV cache it allocated and its scheduler config
    resolved = _object(meta, "resolved_config", str(meta_path))
    sched_cfg = _section(resolved, "scheduler_config", meta_path)
    model_cfg = _section(resolved, "model_config", meta_path)
    cache_cfg = _section(resolved, "cache_config", meta_path)
    kv_cache_dtype = _precision(kwargs, model_cfg, cache_cfg, meta_path, notes)
    kv_budget = _count(kwargs.get("kv_cache_memory_bytes"), str(meta_path), "engine_kwargs.kv_cache_memory_bytes",
                       most=2**50)

    rows, unrecorded = _read_jsonl(root / "requests.jsonl")
    if unrecorded:
        notes.append(f"{unrecorded} requests have no timestamps at all (vLLM returned no metrics for them): "
                     "left out of both sides")
    cols = {k: np.array([r[k] for r in rows], dtype=np.float64) for k in LLMSERVINGSIM_FIELDS}
    sched = np.array([r.get("scheduled_ts", math.nan) for r in rows], dtype=np.float64)
    order = np.argsort(cols["arrival_time"], kind="stable")
    cols = {k: v[order] for k, v in cols.items()}
    sched = sched[order]
    offsets = cols["queued_ts"] - cols["arrival_time"]
    offset = float(offsets.min())
    if offsets.max() - offset > MAX_WAY_IN_S:  # (every arrival would be moved by a wrong offset)
        low, high = (rows[order[int(f(offsets))]]["_line"] for f in (np.argmin, np.argmax))
        raise RunFileError(
            f"{root / 'requests.jsonl'}: queued_ts - arrival_time (the two clocks' offset plus a request's way into "
            f"the engine, at most a step) spans {offsets.max() - offset:.3g} s, from line {low} to line {high}, more "
            f"than the {MAX_WAY_IN_S:g} s a request takes to reach the engine's queue; arrival_time and the engine "
            "timestamps must each be seconds of one clock, a constant apart (is one in ms, or a line's arrival_time "
            "wrong?)")
    arrival_engine = cols["arrival_time"] + offset
    t0 = float(arrival_engine[0])
    wait = offsets - offset
    last = int(np.argmax(cols["last_token_ts"]))
    if cols["last_token_ts"][last] - t0 > MAX_SIM_SECONDS:  # servesim's clock resolves steps up to there
        raise RunFileError(
            f"{root / 'requests.jsonl'}: the run spans {cols['last_token_ts'][last] - t0:.3g} s from the first "
            f"arrival (line {rows[order[0]]['_line']}) to the last token (line {rows[order[last]]['_line']}), past "
            f"the {MAX_SIM_SECONDS:.0e} s servesim simulates; arrival_time (the client's clock) and the engine "
            "timestamps must each be seconds of one clock")
    clock = {
        "alignment": "client arrival + min(queued_ts - arrival_time); TTFT and E2E from that arrival",
        "offset_s": offset,
        "queued_after_arrival_ms": {q: float(np.percentile(wait, p) * 1e3)
                                    for q, p in (("p50", 50), ("p90", 90), ("max", 100))},
        "engine_t0": t0,
    }
    df = _requests_frame(arrival_engine - t0, sched - t0, cols["first_token_ts"] - t0, cols["last_token_ts"] - t0,
                         cols["input_toks"], cols["output_toks"])
    df["ttft_from_queued"] = cols["first_token_ts"] - cols["queued_ts"]
    df["source_id"] = [str(i if rows[i].get("request_id") is None else rows[i]["request_id"]) for i in order]
    df["source_line"] = [rows[i]["_line"] for i in order]

    hw_source, tp = _llmservingsim_gpu(root)
    cuda_total = None
    if isinstance(meta.get("hardware"), str) and not _is_tag(meta["hardware"]):  # the GPU's name
        hw_source = meta["hardware"]
    else:  # newer bench runs record torch's device name and total memory
        hardware = _object(meta, "hardware", str(meta_path))
        name = hardware.get("device_name")
        if name is not None and not isinstance(name, str):
            raise RunFileError(f"{meta_path}: field 'hardware.device_name' must be the GPU's name, got {name!r:.60}")
        hw_source = name or hw_source
        cuda_total = _count(hardware.get("device_total_memory_bytes"), str(meta_path),
                            "hardware.device_total_memory_bytes", least=2**30, most=2**45)
    if hw_source is None:  # a GPU named anywhere in the folder's name (<GPU>-<model>, <model>-<gpu>-tp1)
        hw_source = root.name if hardware_preset(root.name) else (
            root.name.split("-")[0] if "-" in root.name else None)
    tp_kwarg = _count(kwargs.get("tensor_parallel_size"), str(meta_path), "engine_kwargs.tensor_parallel_size")
    if tp_kwarg is not None and tp is not None and tp_kwarg != tp:  # (the engine's silently won)
        raise RunFileError(f"{meta_path}: engine_kwargs.tensor_parallel_size {tp_kwarg} and llmservingsim_config.json's "
                           f"nodes[0].instances[0].tp_size {tp} disagree; a run has one TP degree: fix the wrong one")
    dp_kwarg = _count(kwargs.get("data_parallel_size"), str(meta_path), "engine_kwargs.data_parallel_size")
    parallel = _section(resolved, "parallel_config", meta_path)
    for name, ours in (("tensor_parallel_size", tp_kwarg), ("data_parallel_size", dp_kwarg)):
        theirs = _count(parallel.get(name), str(meta_path), f"resolved_config.parallel_config.{name}")
        if ours is not None and theirs is not None and ours != theirs:  # (vLLM keeps both as given)
            raise RunFileError(f"{meta_path}: engine_kwargs.{name} {ours} and resolved_config.parallel_config.{name} "
                               f"{theirs} disagree; a run has one degree: fix the wrong one")
    tp = tp_kwarg or parallel.get("tensor_parallel_size") or tp
    dp = dp_kwarg or parallel.get("data_parallel_size")
    stated = {k: v for k, v in (("tensor_parallel", tp), ("cluster.num_replicas", dp)) if v is not None}
    tp, dp = tp or 1, dp or 1
    scheduler = {"max_num_seqs": kwargs["max_num_seqs"], "max_num_batched_tokens": kwargs["max_num_batched_tokens"]}
    max_len = (_count(kwargs.get("max_model_len"), str(meta_path), "engine_kwargs.max_model_len")
               or _count(model_cfg.get("max_model_len"), str(meta_path), "resolved_config.model_config.max_model_len"))
    if max_len is not None:
        scheduler["max_model_len"] = max_len
    scheduler |= _resolved_schedule(sched_cfg, kwargs, meta_path, notes)
    _refuse_unmodelled(resolved, kwargs, meta_path)
    kv: dict[str, Any] = {}
    cache = _object(meta, "kv_cache", str(meta_path))
    # the same facts in the resolved CacheConfig (cache_cfg), for a run whose kv_cache snapshot came out empty
    sources = (("kv_cache", cache), ("resolved_config.cache_config", cache_cfg), ("engine_kwargs", kwargs))
    # each with the type vLLM writes: a string such as "false" or "16" would be read as a value otherwise
    for ours, theirs, types, kind in (("num_blocks", "num_gpu_blocks", int, "an integer"),
                                      ("block_size", "block_size", int, "an integer"),
                                      ("enable_prefix_caching", "enable_prefix_caching", bool, "true or false"),
                                      ("gpu_memory_utilization", "gpu_memory_utilization", int | float, "a number")):
        where, value = next(((w, d.get(theirs)) for w, d in sources if d.get(theirs) is not None), (None, None))
        if value is None:
            continue
        if not isinstance(value, types) or (types is not bool and isinstance(value, bool)):
            raise RunFileError(f"{meta_path}: field '{where}.{theirs}' must be {kind}, got {value!r:.60}")
        kv[ours] = value
    missing = [k for k in ("num_blocks", "block_size", "enable_prefix_caching") if k not in kv]
    if missing:
        notes.append(f"meta.json does not record {', '.join(missing)}: vLLM V1's defaults are used (block size 16, "
                     "prefix caching on) and the KV block count is derived from the GPU's memory")
    # LLMServingSim's own error on the run: as copied here, or where its bench harness writes it
    found = [root / "llmservingsim_summary.txt", root / "validation" / "summary.txt",
             *sorted((root / "validation").glob("*summary.txt"))]
    ref_path = next((p for p in found if p.is_file()), found[0])
    reference = read_llmservingsim_summary(ref_path) if ref_path.is_file() else {}
    return MeasuredRun(
        name=root.name, path=root, format="llmservingsim", model_source=str(model_source),
        model=model_preset(model_source), hardware_source=hw_source,
        hardware=hardware_preset(hw_source) if hw_source else None, tensor_parallel=tp, scheduler=scheduler,
        kv_cache=kv, requests=df, itl_hist=None, vllm_version=meta.get("vllm_version"), data_parallel=dp,
        clock=clock, notes=notes,
        reference=reference, reference_source=str(ref_path) if reference else None, kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory_bytes=kv_budget,
        enforce_eager=kwargs["enforce_eager"] if isinstance(kwargs.get("enforce_eager"), bool) else None,
        engine_counters=_engine_counters(root / "timeseries.csv", meta.get("tick_seconds"), notes),
        cuda_total_bytes=cuda_total, stated=stated,
    )


def _section(resolved: dict[str, Any], name: str, meta_path: Path) -> dict[str, Any]:
    """One section of ``resolved_config`` without the fields the runner wrote as type tags (read as not
    recorded, like the section itself when it is a tag)."""
    return {k: v for k, v in _object(resolved, name, f"{meta_path}: resolved_config").items() if not _is_tag(v)}


def _resolved_schedule(sched_cfg: dict[str, Any], kwargs: dict[str, Any], meta_path: Path,
                       notes: list[str]) -> dict[str, Any]:
    """The scheduler settings beyond the batch limits that vLLM resolved (``resolved_config.scheduler_config``,
    else the engine argument in ``engine_kwargs``: ``scheduling_policy`` for ``policy``) and the ``vllm-v1`` preset models: async scheduling, the cap on
    one request's chunk, the queue policy. A run that turned chunked prefill off gets a note: the preset
    always chunks."""
    out: dict[str, Any] = {}

    def value(name: str) -> tuple[str, Any]:
        if sched_cfg.get(name) is not None:
            return f"resolved_config.scheduler_config.{name}", sched_cfg[name]
        arg = {"policy": "scheduling_policy"}.get(name, name)  # EngineArgs' name where it differs
        return f"engine_kwargs.{arg}", kwargs.get(arg)

    where, flag = value("async_scheduling")
    if flag is not None and not isinstance(flag, bool):
        raise RunFileError(f"{meta_path}: field '{where}' must be true, false or null, got {flag!r:.60}")
    if flag is not None:
        out["async_scheduling"] = flag
    where, cap = value("long_prefill_token_threshold")
    if _count(cap, str(meta_path), where, least=0):
        out["long_prefill_token_threshold"] = cap
    where, policy = value("policy")
    if policy is not None:
        if policy not in ("fcfs", "priority"):
            raise RunFileError(f"{meta_path}: field '{where}' must be 'fcfs' or 'priority', got {policy!r:.60}")
        out["policy"] = policy
    where, chunked = value("enable_chunked_prefill")
    if chunked is not None and not isinstance(chunked, bool):
        raise RunFileError(f"{meta_path}: field '{where}' must be true, false or null, got {chunked!r:.60}")
    if chunked is False:
        notes.append(f"{where} is false: vLLM scheduled each prompt whole, while servesim's vllm-v1 preset chunks a "
                     "prompt that does not fit the step's remaining token budget; steps taking in new prompts differ")
    return out


def _refuse_unmodelled(resolved: dict[str, Any], kwargs: dict[str, Any], meta_path: Path) -> None:
    """``RunFileError`` for a run servesim cannot simulate as it ran: pipeline parallelism (servesim splits
    a model by TP only) or speculative decoding (servesim makes one token per request a step)."""
    # (a harness that could not list a config's fields writes a "<ParallelConfig>" tag: nothing to read)
    parallel = resolved.get("parallel_config") if isinstance(resolved.get("parallel_config"), dict) else {}
    for where, pp in (("resolved_config.parallel_config.pipeline_parallel_size", parallel.get("pipeline_parallel_size")),
                      ("engine_kwargs.pipeline_parallel_size", kwargs.get("pipeline_parallel_size"))):
        if not _is_tag(pp) and (_count(pp, str(meta_path), where) or 1) > 1:  # (a tag: not recorded)
            raise RunFileError(f"{meta_path}: {where} is {pp}: pipeline parallelism is not modelled (servesim splits "
                               "a model by tensor_parallel only), so this run cannot be simulated as it ran")
    for where, spec in (("resolved_config.speculative_config", resolved.get("speculative_config")),
                        ("engine_kwargs.speculative_config", kwargs.get("speculative_config"))):
        if spec not in (None, {}, "None"):
            raise RunFileError(f"{meta_path}: {where} is set: speculative decoding is not modelled (servesim makes one "
                               "token per request a step), so this run cannot be simulated as it ran")


def _engine_counters(path: Path, tick_s: Any, notes: list[str]) -> dict[str, float]:
    """Totals of vLLM's per-tick counters in an LLMServingSim ``timeseries.csv`` (optional: a missing or
    unreadable file, or one without the columns, gives none): ``preempted`` (requests preempted per
    tick), ``prompt_throughput`` (whole prompts of the prefills that ended in the tick, cache hits
    included) and ``prompt_cached_throughput`` (the prompt tokens the prefix cache served), per second
    times ``tick_seconds``; and the largest ``kv_cache_pct`` (the KV cache's use at each tick's last
    step) as a fraction (LLMServingSim's ``bench/core/stat_logger.py``)."""
    if not path.is_file():
        return {}
    try:
        ts = pd.read_csv(path)
    except (ValueError, OSError, UnicodeDecodeError) as e:
        notes.append(f"{path.name} unreadable ({str(e).splitlines()[0][:80]}): vLLM's own counters not compared")
        return {}
    tick: float | None = 1.0  # (the harness's default, for a meta.json without it)
    if tick_s is not None:
        is_seconds = isinstance(tick_s, int | float) and not isinstance(tick_s, bool) and 0 < tick_s <= 86400
        tick = float(tick_s) if is_seconds else None
    out: dict[str, float] = {}
    unusable = []
    for name, column, scale in (("preemptions", "preempted", 1.0), ("prompt_tokens", "prompt_throughput", tick),
                                ("cached_prompt_tokens", "prompt_cached_throughput", tick)):
        if column in ts:
            values = pd.to_numeric(ts[column], errors="coerce")
            if values.notna().all() and np.isfinite(values).all() and (values >= 0).all():
                with np.errstate(over="ignore"):
                    total = float(values.sum() * scale) if scale is not None else math.nan
                if math.isfinite(total):
                    out[name] = total
                    continue
            unusable.append(column)
    if unusable:
        why = (f"meta.json's tick_seconds {tick_s!r:.40} is not a duration in seconds" if tick is None
               else "their totals are not finite numbers >= 0")
        notes.append(f"{path.name} {', '.join(unusable)}: {why}; vLLM's own counters of them not compared")
    if "kv_cache_pct" in ts:  # all 0.0 in runs before the harness read vLLM's field right: left out
        pct = pd.to_numeric(ts["kv_cache_pct"], errors="coerce")
        if pct.notna().all() and ((pct >= 0) & (pct <= 100)).all() and pct.max() > 0:
            out["peak_kv_usage"] = float(pct.max() / 100)
    return out


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The request lines, and how many lines had no timestamps at all (a request vLLM kept no metrics for)."""
    rows = []
    unrecorded = 0
    seen: dict[str, int] = {}  # request_id -> its line
    for lineno, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        row = _parse_json(line, where, line=False)
        if not isinstance(row, dict):
            raise RunFileError(f"{where}: expected a JSON object per line")
        if all(name in row and row[name] is None for name in LLMSERVINGSIM_FIELDS[2:]):
            unrecorded += 1
            continue
        for name in LLMSERVINGSIM_FIELDS:
            if name not in row:
                raise RunFileError(f"{where}: missing field '{name}'")
            _number(row[name], where, name)
        if row["input_toks"] < 1 or row["output_toks"] < 1:
            raise RunFileError(f"{where}: input_toks and output_toks must be >= 1")
        for name in ("input_toks", "output_toks"):
            _tokens(row[name], where, name, 1)
        if not row["queued_ts"] <= row["first_token_ts"] <= row["last_token_ts"]:
            raise RunFileError(f"{where}: timestamps out of order (need queued_ts <= first_token_ts <= "
                               "last_token_ts)")
        if row.get("scheduled_ts") is not None:
            _number(row["scheduled_ts"], where, "scheduled_ts")
            if not row["queued_ts"] <= row["scheduled_ts"] <= row["first_token_ts"]:
                raise RunFileError(f"{where}: timestamps out of order (need queued_ts <= scheduled_ts <= "
                                   "first_token_ts)")
        if row["last_token_ts"] - row["queued_ts"] > MAX_SIM_SECONDS:
            raise RunFileError(f"{where}: the request took {row['last_token_ts'] - row['queued_ts']:.3g} s from "
                               f"queued_ts to last_token_ts, past the {MAX_SIM_SECONDS:.0e} s servesim simulates; "
                               "the engine timestamps must be seconds of one clock")
        if row.get("request_id") is not None:  # a line written twice would count its request twice
            rid = str(row["request_id"])
            if rid in seen:
                raise RunFileError(f"{where}: request_id {rid!r:.60} repeats line {seen[rid]}; each request is "
                                   "one line: remove the duplicate")
            seen[rid] = lineno
        rows.append({**row, "_line": lineno})
    if not rows:
        raise RunFileError(f"{path}: no requests with timestamps")
    return rows, unrecorded


def _llmservingsim_gpu(root: Path) -> tuple[str | None, int | None]:
    """(GPU name, TP degree) from llmservingsim_config.json, (None, None) when absent or when it names
    no instance. A file of another shape is an error: the GPU would silently come from the folder's name."""
    path = root / "llmservingsim_config.json"
    if not path.is_file():
        return None, None
    cfg = _read_json(path)
    if not isinstance(cfg, dict):
        raise RunFileError(f"{path}: expected a JSON object")
    node = _first(cfg, "nodes", str(path))
    inst = _first(node, "instances", f"{path}: nodes[0]") if node is not None else None
    if inst is None:
        return None, None
    hardware = inst.get("hardware")
    if hardware is not None and not isinstance(hardware, str):
        raise RunFileError(f"{path}: field 'nodes[0].instances[0].hardware' must be the GPU's name, got {hardware!r:.60}")
    return hardware, _count(inst.get("tp_size"), str(path), "nodes[0].instances[0].tp_size")


def _first(parent: dict[str, Any], name: str, where: str) -> dict[str, Any] | None:
    """The first entry of the list ``parent[name]`` when it is a JSON object; None when the list is
    absent, null or empty; else ``RunFileError``."""
    items = parent.get(name)
    if items is None or items == []:
        return None
    if not isinstance(items, list) or not isinstance(items[0], dict):
        raise RunFileError(f"{where}: field '{name}' must be a list of JSON objects, got {items!r:.60}")
    return items[0]


def read_llmservingsim_summary(path: str | Path) -> dict[str, dict[str, float]]:
    """LLMServingSim's error table (``llmservingsim_summary.txt``) as {servesim key: {real, sim, error_pct}}."""
    out: dict[str, dict[str, float]] = {}
    for line in _read_text(Path(path)).splitlines():
        m = _REF_ROW.match(line.strip())
        if m is None:
            continue
        stat = _REF_STATS.get(m["stat"], m["stat"].lower())
        out[f"{stat}_{_REF_FAMILIES[m['fam']]}_ms"] = {
            "real": float(m["real"]), "sim": float(m["sim"]), "error_pct": float(m["diff"])}
    return out


# ---- vllm bench serve JSON ------------------------------------------------------------------------
def read_vllm_bench(path: str | Path, seed: int = 0) -> MeasuredRun:
    """Read ``vllm bench serve --save-result --save-detailed`` output (see the module docstring).

    Without ``start_times`` (vLLM releases before they were saved) the arrivals are unknown: at an
    infinite ``request_rate`` every request is sent at once (exact); otherwise they are drawn from
    the benchmark's own process (gamma gaps of shape ``burstiness`` at ``request_rate``, seeded),
    which matches the traffic but not each request, and ``arrivals_exact`` is False.
    """
    p = Path(path)
    data = _read_json(p)
    if not isinstance(data, dict):
        raise RunFileError(f"{p}: expected the JSON object vllm bench serve writes")
    for name in ("input_lens", "output_lens", "ttfts"):
        if data.get(name) is None:
            raise RunFileError(f"{p}: missing field '{name}' (run vllm bench serve with --save-result --save-detailed)")
        if not isinstance(data[name], list):
            raise RunFileError(f"{p}: field '{name}' must be a list with one entry per request, got {data[name]!r:.60}")
    n = len(data["input_lens"])
    if n == 0:  # (an empty 'latencies' list read as a missing field)
        raise RunFileError(f"{p}: the run has no requests (input_lens is empty)")
    latencies = data["latencies"] if data.get("latencies") is not None else data.get("e2els")
    if latencies is None and not isinstance(data.get("itls"), list):
        raise RunFileError(f"{p}: missing field 'latencies' (or 'itls' to add up): the requests' end-to-end times")
    per_request = {k: data.get(k) for k in ("output_lens", "ttfts", "itls", "start_times", "errors")}
    per_request["latencies"] = latencies
    for k, v in per_request.items():
        if v is not None and not isinstance(v, list):
            raise RunFileError(f"{p}: field '{k}' must be a list with one entry per request, got {v!r:.60}")
        if v is not None and len(v) != n:
            raise RunFileError(f"{p}: field '{k}' has {len(v)} entries, input_lens has {n}")
    errors = per_request["errors"] or [""] * n
    ok = [i for i in range(n) if not errors[i]]
    notes = []
    if len(ok) < n:
        notes.append(f"{n - len(ok)} failed requests (non-empty 'errors') left out")
    if not ok:
        raise RunFileError(f"{p}: no successful requests")

    def col(name: str, i: int) -> float:
        return _number(per_request[name][i], f"{p}: request {i}", name)

    def seconds(name: str, i: int, least: float = 0.0) -> float:
        """A duration of request i: at least ``least`` (its TTFT for its latency), at most MAX_SIM_SECONDS."""
        v = col(name, i)
        if not least <= v <= MAX_SIM_SECONDS:
            bound = "its TTFT" if least else "0"
            raise RunFileError(f"{p}: request {i}: field '{name}' must be seconds between {bound} and "
                               f"{MAX_SIM_SECONDS:.0e}, got {v!r}")
        return v

    prompt = np.array([_tokens(data["input_lens"][i], f"{p}: request {i}", "input_lens", 1) for i in ok])
    output = np.array([_tokens(per_request["output_lens"][i], f"{p}: request {i}", "output_lens", 0) for i in ok])
    ttft = np.array([seconds("ttfts", i) for i in ok])
    itls = per_request["itls"]
    gaps_of = {i: _gaps(itls[i], f"{p}: request {i}") for i in ok} if isinstance(itls, list) else {}
    for j, i in enumerate(ok):  # a gap per streamed chunk after the first: at most one per token after it
        if len(gaps_of.get(i, ())) > max(int(output[j]) - 1, 0):
            raise RunFileError(f"{p}: request {i}: {len(gaps_of[i])} itls for output_lens {int(output[j])} (at most "
                               f"{max(int(output[j]) - 1, 0)}: a gap between consecutive tokens)")
    if latencies is not None:
        e2e = np.array([seconds("latencies", i, least=t) for i, t in zip(ok, ttft, strict=True)])
    else:
        e2e = ttft + np.array([float(sum(gaps_of[i])) for i in ok])
    hist = None
    gaps = [x for i in ok for x in gaps_of.get(i, [])]
    if gaps:
        hist = LogHistogram()
        hist.add(np.asarray(gaps, dtype=np.float64))
    rate = data.get("request_rate", "inf")
    if rate in ("inf", "Infinity", None) or (isinstance(rate, float) and math.isinf(rate) and rate > 0):
        rate = math.inf
    elif isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf:
        raise RunFileError(f"{p}: field 'request_rate' must be a number > 0 or \"inf\", got {rate!r}")
    exact = True
    if per_request["start_times"] is not None:
        start = np.array([col("start_times", i) for i in ok])
    elif math.isinf(rate):
        start = np.zeros(len(ok))
        notes.append("no start_times: request_rate inf, every request sent at t = 0")
    else:
        burst = 1.0 if data.get("burstiness") is None else _number(data["burstiness"], str(p), "burstiness")
        if not burst > 0:
            raise RunFileError(f"{p}: field 'burstiness' must be > 0, got {burst!r}")
        rng = np.random.default_rng(seed)
        start = np.concatenate([[0.0], np.cumsum(rng.gamma(burst, 1.0 / (rate * burst), len(ok) - 1))])
        exact = False
        notes.append(f"no start_times (vLLM before they were saved): arrivals drawn from gamma gaps, "
                     f"rate {rate:g}/s, burstiness {burst:g}, seed {seed}: the traffic, not each request")
    if start.max() - start.min() > MAX_SIM_SECONDS:  # servesim's clock resolves steps up to there
        first, last = ok[int(np.argmin(start))], ok[int(np.argmax(start))]
        what = (f"field 'start_times' spans {start.max() - start.min():.3g} s (request {first} to request {last})"
                if exact else f"field 'request_rate' {rate:g} spreads the arrivals over {start.max():.3g} s")
        raise RunFileError(f"{p}: {what}, past the {MAX_SIM_SECONDS:.0e} s servesim simulates; "
                           f"{'they must be seconds of one clock' if exact else 'the rate must be requests per second'}")
    conc = data.get("max_concurrency")
    if conc is not None and (isinstance(conc, bool) or not isinstance(conc, int) or conc < 1):
        raise RunFileError(f"{p}: field 'max_concurrency' must be a whole number >= 1 or null, got {conc!r:.60}")
    if conc:
        notes.append(f"max_concurrency {data['max_concurrency']}: the client's own queue is replayed as the "
                     "measured send times, not as a closed loop")
    order = np.argsort(start, kind="stable")
    start, prompt, output, ttft, e2e = (a[order] for a in (start - start.min(), prompt, output, ttft, e2e))
    df = _requests_frame(start, np.full(len(ok), np.nan), start + ttft, start + e2e, prompt, output)
    df["source_id"] = [str(ok[i]) for i in order]
    df["source_line"] = 0  # one JSON document: requests are list positions
    model_source = str(data.get("model_id") or data.get("tokenizer_id") or "")
    if not model_source:
        raise RunFileError(f"{p}: missing field 'model_id'")
    notes.append("client-side times: TTFT and E2E include the HTTP round trip and detokenisation")
    return MeasuredRun(
        name=p.stem, path=p, format="vllm-bench", model_source=model_source, model=model_preset(model_source),
        hardware_source=data.get("gpu") or data.get("hardware"), hardware=None, tensor_parallel=None,
        scheduler={}, kv_cache={}, requests=df, itl_hist=hist, clock={"alignment": "client clock (start_times)"},
        notes=notes, arrivals_exact=exact,
    )


def read_run(path: str | Path, fmt: str | None = None) -> MeasuredRun:
    """Read a measured run; ``fmt`` None guesses it (a folder: llmservingsim, a .json file: vllm-bench)."""
    p = Path(path)
    if fmt is None:
        if p.is_dir():
            fmt = "llmservingsim"
        elif p.suffix == ".json":
            fmt = "vllm-bench"
        elif not p.exists():
            raise RunFileError(f"{p}: not found")
        else:
            raise RunFileError(f"{p}: cannot tell the format; give --format ({', '.join(FORMATS)})")
    if fmt == "llmservingsim":
        run = read_llmservingsim(p)
    elif fmt == "vllm-bench":
        run = read_vllm_bench(p)
    else:
        raise RunFileError(f"unknown --format {fmt!r}{did_you_mean(fmt, FORMATS)}; use {' or '.join(FORMATS)}")
    if run.hardware is None and run.hardware_source:
        run.hardware = hardware_preset(run.hardware_source)
    return run
