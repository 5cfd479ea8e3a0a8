"""Reader of an LLMServingSim run folder (``requests.jsonl``, ``meta.json``, optional
``llmservingsim_config.json``, ``timeseries.csv`` and ``llmservingsim_summary.txt``; the format
and the clock alignment are in ``calibration/measured_run.py``'s docstring)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from servesim.sim.config_model import MAX_SIM_SECONDS
from servesim.sim.presets import hardware_preset

from .run_files import (
    MeasuredRun,
    RunFileError,
    count_field,
    is_tag,
    json_object,
    model_preset,
    number_field,
    parse_json,
    read_json,
    read_text,
    requests_frame,
    token_count,
)

LLMSERVINGSIM_FIELDS = ("input_toks", "output_toks", "arrival_time", "queued_ts", "first_token_ts", "last_token_ts")
# LLMServingSim's summary rows -> servesim summary keys
_REF_FAMILIES = {"TTFT": "ttft", "TPOT": "tpot", "ITL": "itl", "Latency": "e2el"}
_REF_STATS = {"Mean": "mean", "Median": "median"}
_REF_ROW = re.compile(r"^(?P<fam>TTFT|TPOT|ITL|Latency)\s+(?P<stat>Mean|Median|P\d+)\s+(?P<real>[-+0-9.eE]+)\s+"
                      r"(?P<sim>[-+0-9.eE]+)\s+(?P<diff>[-+0-9.eE]+)%\s*$")


# most seconds from a request's arrival_time to its queued_ts past the smallest such gap: the way into the
# engine waits at most a step (the shipped runs: 0.11 s and 0.37 s); more is a clock mixed up
MAX_WAY_IN_S = 30.0


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


# ---- LLMServingSim runs ---------------------------------------------------------------------------
def read_llmservingsim(folder: str | Path) -> MeasuredRun:
    """Read an LLMServingSim run folder (see the module docstring); ``RunFileError`` names file, line, field."""
    root = Path(folder)
    if not root.is_dir():
        raise RunFileError(f"{root}: not a run folder (expected requests.jsonl and meta.json inside)")
    data, cluster_path, run_name = _layout(root)
    meta_path = data / "meta.json"
    if not meta_path.exists() and (data / "engine_start.json").exists():
        # LLMServingSim's runner writes engine_start.json at boot and meta.json + requests.jsonl at the end
        raise RunFileError(f"{data}: engine_start.json but no meta.json: the run stopped before it wrote its "
                           "requests (the harness writes them when the replay ends); nothing to compare")
    meta = read_json(meta_path)
    if not isinstance(meta, dict):
        raise RunFileError(f"{meta_path}: expected a JSON object")
    if meta.get("resolve_only") is True:
        blocks = json_object(meta, "kv_cache", str(meta_path)).get("num_gpu_blocks")
        raise RunFileError(f"{meta_path}: a resolve-only boot (resolve_only true) replays no requests; what it measured "
                           f"is the KV cache (num_gpu_blocks {blocks}): give a run of that engine its block count with "
                           "--set kv_cache.num_blocks=N")
    kwargs = meta.get("engine_kwargs")
    if not isinstance(kwargs, dict):
        raise RunFileError(f"{meta_path}: missing field 'engine_kwargs' (the engine's arguments)")
    model_source = meta.get("model") or kwargs.get("model")
    if not model_source:
        raise RunFileError(f"{meta_path}: missing field 'model'")
    notes: list[str] = []
    # newer bench runs also record what vLLM resolved: the KV cache it allocated and its scheduler config
    resolved = json_object(meta, "resolved_config", str(meta_path))
    sched_cfg = _section(resolved, "scheduler_config", meta_path)
    model_cfg = _section(resolved, "model_config", meta_path)
    cache_cfg = _section(resolved, "cache_config", meta_path)
    batch = _batch_limits(kwargs, sched_cfg, meta_path, notes)
    kv_cache_dtype = _precision(kwargs, model_cfg, cache_cfg, meta_path, notes)
    kv_budget = count_field(kwargs.get("kv_cache_memory_bytes"), str(meta_path),
                            "engine_kwargs.kv_cache_memory_bytes", most=2**50)

    rows, unrecorded, tokenless = _read_jsonl(data / "requests.jsonl")
    if unrecorded:
        notes.append(f"{unrecorded} requests have no timestamps at all (vLLM returned no metrics for them): "
                     "left out of both sides")
    if tokenless:
        notes.append(f"{len(tokenless)} requests ended without a first token (first_token_ts null or vLLM's unset "
                     f"0.0, and output_toks 0 or no last_token_ts: failed or aborted; line {', '.join(map(str, tokenless[:5]))}"
                     f"{', ...' if len(tokenless) > 5 else ''}): left out of both sides, so the simulation does not "
                     "carry the engine time they took before they ended")
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
            f"{data / 'requests.jsonl'}: queued_ts - arrival_time (the two clocks' offset plus a request's way into "
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
            f"{data / 'requests.jsonl'}: the run spans {cols['last_token_ts'][last] - t0:.3g} s from the first "
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
    df = requests_frame(arrival_engine - t0, sched - t0, cols["first_token_ts"] - t0, cols["last_token_ts"] - t0,
                        cols["input_toks"], cols["output_toks"])
    df["ttft_from_queued"] = cols["first_token_ts"] - cols["queued_ts"]
    df["source_id"] = [str(i if rows[i].get("request_id") is None else rows[i]["request_id"]) for i in order]
    df["source_line"] = [rows[i]["_line"] for i in order]

    hw_source, tp = _llmservingsim_gpu(cluster_path)
    cuda_total = None
    if isinstance(meta.get("hardware"), str) and not is_tag(meta["hardware"]):  # the GPU's name
        hw_source = meta["hardware"]
    else:  # newer bench runs record torch's device name and total memory
        hardware = json_object(meta, "hardware", str(meta_path))
        name = hardware.get("device_name")
        if name is not None and not isinstance(name, str):
            raise RunFileError(f"{meta_path}: field 'hardware.device_name' must be the GPU's name, got {name!r:.60}")
        hw_source = name or hw_source
        cuda_total = count_field(hardware.get("device_total_memory_bytes"), str(meta_path),
                                 "hardware.device_total_memory_bytes", least=2**30, most=2**45)
    if hw_source is None:  # a GPU named anywhere in the folder's name (<GPU>-<model>, <model>-<gpu>-tp1)
        hw_source = run_name if hardware_preset(run_name) else (run_name.split("-")[0] if "-" in run_name else None)
    tp_kwarg = count_field(kwargs.get("tensor_parallel_size"), str(meta_path), "engine_kwargs.tensor_parallel_size")
    if tp_kwarg is not None and tp is not None and tp_kwarg != tp:  # (the engine's silently won)
        raise RunFileError(f"{meta_path}: engine_kwargs.tensor_parallel_size {tp_kwarg} and llmservingsim_config.json's "
                           f"nodes[0].instances[0].tp_size {tp} disagree; a run has one TP degree: fix the wrong one")
    dp_kwarg = count_field(kwargs.get("data_parallel_size"), str(meta_path), "engine_kwargs.data_parallel_size")
    parallel = _section(resolved, "parallel_config", meta_path)
    for name, ours in (("tensor_parallel_size", tp_kwarg), ("data_parallel_size", dp_kwarg)):
        theirs = count_field(parallel.get(name), str(meta_path), f"resolved_config.parallel_config.{name}")
        if ours is not None and theirs is not None and ours != theirs:  # (vLLM keeps both as given)
            raise RunFileError(f"{meta_path}: engine_kwargs.{name} {ours} and resolved_config.parallel_config.{name} "
                               f"{theirs} disagree; a run has one degree: fix the wrong one")
    tp = tp_kwarg or parallel.get("tensor_parallel_size") or tp
    dp = dp_kwarg or parallel.get("data_parallel_size")
    stated = {k: v for k, v in (("tensor_parallel", tp), ("cluster.num_replicas", dp)) if v is not None}
    tp, dp = tp or 1, dp or 1
    scheduler = dict(batch)
    max_len = (count_field(kwargs.get("max_model_len"), str(meta_path), "engine_kwargs.max_model_len")
               or count_field(model_cfg.get("max_model_len"), str(meta_path), "resolved_config.model_config.max_model_len"))
    if max_len is not None:
        scheduler["max_model_len"] = max_len
    scheduler |= _resolved_schedule(sched_cfg, kwargs, meta_path, notes)
    _refuse_unmodelled(parallel, resolved, kwargs, meta_path)
    kv: dict[str, Any] = {}
    cache = json_object(meta, "kv_cache", str(meta_path))
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
        name=run_name, path=root, format="llmservingsim", model_source=str(model_source),
        model=model_preset(model_source), hardware_source=hw_source,
        hardware=hardware_preset(hw_source) if hw_source else None, tensor_parallel=tp, scheduler=scheduler,
        kv_cache=kv, requests=df, itl_hist=None, vllm_version=meta.get("vllm_version"), data_parallel=dp,
        clock=clock, notes=notes,
        reference=reference, reference_source=str(ref_path) if reference else None, kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory_bytes=kv_budget,
        enforce_eager=_flag(kwargs, model_cfg, "enforce_eager", meta_path),
        engine_counters=_engine_counters(data / "timeseries.csv", meta.get("tick_seconds"), notes),
        cuda_total_bytes=cuda_total, stated=stated,
    )


def _flag(kwargs: dict[str, Any], model_cfg: dict[str, Any], name: str, meta_path: Path) -> bool | None:
    """A true/false engine argument as recorded (``engine_kwargs``, else what vLLM resolved in
    ``resolved_config.model_config``); None when neither records it, ``RunFileError`` when it is not
    a JSON boolean (a text "false" would otherwise be read as not recorded, or as true)."""
    for where, value in ((f"engine_kwargs.{name}", kwargs.get(name)),
                         (f"resolved_config.model_config.{name}", model_cfg.get(name))):
        if value is None:
            continue
        if not isinstance(value, bool):
            raise RunFileError(f"{meta_path}: field '{where}' must be true, false or null, got {value!r:.60}")
        return value
    return None


def _batch_limits(kwargs: dict[str, Any], sched_cfg: dict[str, Any], meta_path: Path,
                  notes: list[str]) -> dict[str, int]:
    """``max_num_seqs`` and ``max_num_batched_tokens`` as vLLM ran with them: the engine argument, or what
    vLLM resolved (``resolved_config.scheduler_config``) where the argument is absent or vLLM changed
    it (then with a note); ``RunFileError`` when neither states one, or one is not a whole number."""
    out = {}
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        found = [(w, v) for w, v in ((f"engine_kwargs.{key}", kwargs.get(key)),
                                     (f"resolved_config.scheduler_config.{key}", sched_cfg.get(key))) if v is not None]
        if not found:
            raise RunFileError(f"{meta_path}: missing field 'engine_kwargs.{key}' (an integer)")
        for where, value in found:
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**32:  # ("8": not missing)
                raise RunFileError(f"{meta_path}: field '{where}' must be a whole number >= 1 and <= 2**32, "
                                   f"got {value!r:.60}")
        (asked_where, asked), (_, ran) = found[0], found[-1]
        if ran != asked:
            notes.append(f"{asked_where} is {asked} but vLLM ran with {ran} (resolved_config.scheduler_config): "
                         f"simulated with {ran}")
        out[key] = ran
    return out


def _section(resolved: dict[str, Any], name: str, meta_path: Path) -> dict[str, Any]:
    """One section of ``resolved_config`` without the fields the runner wrote as type tags (read as not
    recorded, like the section itself when it is a tag)."""
    return {k: v for k, v in json_object(resolved, name, f"{meta_path}: resolved_config").items() if not is_tag(v)}


def _resolved_schedule(sched_cfg: dict[str, Any], kwargs: dict[str, Any], meta_path: Path,
                       notes: list[str]) -> dict[str, Any]:
    """The scheduler settings beyond the batch limits that vLLM resolved (``resolved_config.scheduler_config``,
    else the engine argument in ``engine_kwargs``: ``scheduling_policy`` for ``policy``) and the
    ``vllm-v1`` preset models: async scheduling, the cap on one request's chunk, the queue policy,
    chunked prefill turned off."""
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
    if count_field(cap, str(meta_path), where, least=0):
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
        out["enable_chunked_prefill"] = False
    return out


def _refuse_unmodelled(parallel: dict[str, Any], resolved: dict[str, Any], kwargs: dict[str, Any],
                       meta_path: Path) -> None:
    """``RunFileError`` for a run servesim cannot simulate as it ran: pipeline parallelism (servesim splits
    a model by TP only) or speculative decoding (servesim makes one token per request a step).
    ``parallel``: ``resolved_config.parallel_config`` as ``_section`` read it (type tags dropped)."""
    for where, pp in (("resolved_config.parallel_config.pipeline_parallel_size", parallel.get("pipeline_parallel_size")),
                      ("engine_kwargs.pipeline_parallel_size", kwargs.get("pipeline_parallel_size"))):
        if not is_tag(pp) and (count_field(pp, str(meta_path), where) or 1) > 1:  # (a tag: not recorded)
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


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int, list[int]]:
    """The request lines; how many lines had no timestamps at all (a request vLLM kept no metrics for); and
    the line numbers of requests that ended without a token (failed or aborted, ``_ended_without_a_token``).
    A line with tokens but a missing timestamp is an error."""
    rows = []
    unrecorded = 0
    tokenless: list[int] = []
    seen: dict[str, int] = {}  # request_id -> its line
    for lineno, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        row = parse_json(line, where, line=False)
        if not isinstance(row, dict):
            raise RunFileError(f"{where}: expected a JSON object per line")
        if all(name in row and row[name] is None for name in LLMSERVINGSIM_FIELDS[2:]):
            unrecorded += 1
            continue
        if all(name in row for name in LLMSERVINGSIM_FIELDS) and _ended_without_a_token(row):
            tokenless.append(lineno)
            continue
        for name in LLMSERVINGSIM_FIELDS:
            if name not in row:
                raise RunFileError(f"{where}: missing field '{name}'")
            number_field(row[name], where, name)
        if row["input_toks"] < 1 or row["output_toks"] < 1:
            raise RunFileError(f"{where}: input_toks and output_toks must be >= 1")
        for name in ("input_toks", "output_toks"):
            token_count(row[name], where, name, 1)
        if not row["queued_ts"] <= row["first_token_ts"] <= row["last_token_ts"]:
            raise RunFileError(f"{where}: timestamps out of order (need queued_ts <= first_token_ts <= "
                               "last_token_ts)")
        if row.get("scheduled_ts") is not None:
            number_field(row["scheduled_ts"], where, "scheduled_ts")
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
        failed = f" ({len(tokenless)} ended without a first token)" if tokenless else ""
        raise RunFileError(f"{path}: no requests with timestamps{failed}")
    return rows, unrecorded, tokenless


def _unset(row: dict[str, Any], name: str) -> bool:
    """``row[name]`` was never stamped: null, or the 0.0 vLLM's ``RequestStateStats`` starts every
    timestamp at, on a line whose ``queued_ts`` is a later time (a real stamp cannot precede it)."""
    value, queued = row.get(name), row.get("queued_ts")
    if value is None:
        return True
    return (type(value) in (int, float) and value == 0 and type(queued) in (int, float)
            and math.isfinite(queued) and queued > 0)


def _ended_without_a_token(row: dict[str, Any]) -> bool:
    """A failed or aborted request: no first token, and no tokens or no last token either."""
    return _unset(row, "first_token_ts") and (row["output_toks"] == 0 or _unset(row, "last_token_ts"))


def _layout(root: Path) -> tuple[Path, Path, str]:
    """(folder of meta.json / requests.jsonl / timeseries.csv, the LLMServingSim cluster config, the run's
    name) of a run folder in either layout: flat (the runs in shared/data, a bench harness output
    directory ``bench/results/<id>/``: the cluster config is ``llmservingsim_config.json``) or as
    LLMServingSim commits its examples (``bench/examples/<GPU>/<model>/``: the vLLM files in ``vllm/``,
    the cluster config ``config.json``, named ``<GPU>-<model>`` after its two folders)."""
    flat = any((root / f).exists() for f in ("meta.json", "requests.jsonl", "engine_start.json"))
    if flat or not (root / "vllm").is_dir():
        return root, root / "llmservingsim_config.json", root.name
    cluster = root / "llmservingsim_config.json"
    return root / "vllm", cluster if cluster.exists() else root / "config.json", f"{root.parent.name}-{root.name}"


def _llmservingsim_gpu(path: Path) -> tuple[str | None, int | None]:
    """(GPU name, TP degree) from the cluster config (``_layout``), (None, None) when absent or when it
    names no instance. A file of another shape is an error: the GPU would silently come from the folder's
    name."""
    if not path.is_file():
        return None, None
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise RunFileError(f"{path}: expected a JSON object")
    node = _first(cfg, "nodes", str(path))
    inst = _first(node, "instances", f"{path}: nodes[0]") if node is not None else None
    if inst is None:
        return None, None
    hardware = inst.get("hardware")
    if hardware is not None and not isinstance(hardware, str):
        raise RunFileError(f"{path}: field 'nodes[0].instances[0].hardware' must be the GPU's name, got {hardware!r:.60}")
    return hardware, count_field(inst.get("tp_size"), str(path), "nodes[0].instances[0].tp_size")


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
    for line in read_text(Path(path)).splitlines():
        m = _REF_ROW.match(line.strip())
        if m is None:
            continue
        stat = _REF_STATS.get(m["stat"], m["stat"].lower())
        out[f"{stat}_{_REF_FAMILIES[m['fam']]}_ms"] = {
            "real": float(m["real"]), "sim": float(m["sim"]), "error_pct": float(m["diff"])}
    return out
