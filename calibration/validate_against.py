"""``servesim validate --against RUN``: a measured vLLM run against the simulation of the same workload.

Offline: nothing runs live. The run (``calibration/measured_run.py``) gives each request's arrival
and lengths and the engine's settings. They become an ordinary scenario, built at the YAML level
so ``sim/scenario.yaml`` in the output repeats the simulated side with ``servesim run``:

- ``scheduler: {preset: vllm-v1, max_num_seqs, max_num_batched_tokens[, max_model_len]}`` from the
  run's engine arguments;
- ``kv_cache``: the run's block size, prefix caching and block count where it records them, else
  vLLM V1's defaults (16-token blocks, prefix caching on) and the block count vLLM's memory
  accounting gives on the hardware preset (``gpu_memory_utilization`` x CUDA's total - weights / TP
  - non-torch memory - the activation peak of its profile run at the run's ``max_num_batched_tokens``
  and ``max_num_seqs``; ``presets.num_kv_blocks``);
- ``workload: {trace: {format: csv, path: ../workload.csv}}``: the measured arrivals (on the engine
  clock, see measured_run's docstring) and lengths, written beside it;
- model, hardware and TP from the run; ``--profile`` as the cost model.

An optional SCENARIO supplies what the run does not say (hardware and engine knobs for a
``vllm bench`` JSON, a cost model, an SLO); the run's own facts win over it, and ``--set`` over both.
The table is ``servesim validate``'s (``calibration/validate.py``), with the measured run in the
place of the live one and, where the run ships LLMServingSim's own result, its error beside ours.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from servesim.calibration.measured_run import (
    MeasuredRun,
    RunFileError,
    read_run,
    unknown_hardware_message,
    unknown_model_message,
)
from servesim.calibration.run_steps import StepTiming, engine_times, step_timing
from servesim.calibration.validate import (
    CDF_METRICS,
    METRICS,
    error_table,
    failures,
    format_markdown,
    parse_max_error,
    servesim_commit,
)
from servesim.sim.cost_model import ProfileError, build_cost_model, read_profile_json, resolve_profile_path
from servesim.sim.engine_presets.vllm_v1 import vllm_batch_defaults
from servesim.sim.errors import PresetError, ScenarioError
from servesim.sim.hf_config import config_file
from servesim.sim.metrics import summarize, to_json
from servesim.sim.presets import HARDWARE, get_hardware, get_model, kv_block_bytes, num_kv_blocks
from servesim.sim.scenario import (
    Scenario,
    apply_override,
    read_scenario_file,
    scenario_from_dict,
    scenario_to_yaml,
)
from servesim.sim.simulate import RunResult, simulate, write_results

REFERENCE_COLUMN = "llmservingsim_error_pct"
TABLE_ATTRS = {"labels": {"live": "measured"}, "extra_columns": {REFERENCE_COLUMN: "llmservingsim error %"}}
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
TRACE_FILE = "workload.csv"
ASYNC_DEFAULT_SINCE = (0, 14)  # vLLM release from which async scheduling is on unless disabled
# vLLM's DP coordinator publishes the engines' request counts to the front end every 100 ms
# (DPCoordinator's stats_update_interval_ms default)
DP_STATS_INTERVAL_S = 0.1


@dataclass
class AgainstResult:
    table: pd.DataFrame
    provenance: dict[str, Any]
    thresholds: dict[str, float]
    run: MeasuredRun
    measured: dict[str, Any]  # the run's summary, servesim's keys
    sim: RunResult
    scenario: Scenario  # as written to sim/scenario.yaml (trace path relative to it)
    out: Path
    failed: list[str] = field(default_factory=list)
    # the run's steps timed from its engine timestamps against the cost model (run_steps); None: not readable
    step_timing: StepTiming | None = None

    @property
    def passed(self) -> bool:
        return not self.failed


# ---- the scenario ---------------------------------------------------------------------------------
def vllm_kv_blocks(model: str, hardware: str, tp: int, block_size: int, max_num_batched_tokens: int,
                   max_num_seqs: int, gpu_memory_utilization: float = VLLM_DEFAULT_GPU_MEMORY_UTILIZATION,
                   cuda_total_bytes: int | None = None) -> int:
    """KV blocks per GPU the way vLLM sizes its cache (see ``presets.num_kv_blocks``), for a run
    whose files do not record the count: the profile run is that of the run's own budget and seats.
    ``cuda_total_bytes``: the GPU's memory as the run's CUDA reported it, in place of the preset's."""
    hw = get_hardware(hardware)
    if cuda_total_bytes is not None:
        hw = dataclasses.replace(hw, cuda_memory_bytes=cuda_total_bytes)
    return num_kv_blocks(get_model(model), hw, tp, gpu_memory_utilization, block_size,
                         max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)


def async_by_default(vllm_version: str | None) -> bool:
    """Whether a vLLM release schedules asynchronously when not told otherwise.

    vLLM PR #27614 ("Enable async scheduling by default") landed around the turn of 2025/26; by
    the dates of the PRs around it the first release with it is 0.14. Unknown versions: False.
    """
    m = re.match(r"^v?(\d+)\.(\d+)", str(vllm_version or ""))
    return m is not None and (int(m[1]), int(m[2])) >= ASYNC_DEFAULT_SINCE


def local_config(path: str) -> bool:
    """Whether ``path`` is a model checkout (or its config.json) on this machine."""
    try:
        config_file(path)
    except PresetError:
        return False
    return True


def shipped_profile(model: str, hardware: str, tensor_parallel: int) -> str | None:
    """The name of the GPU profile servesim ships for this hardware x model x TP
    (``calibration/profiles/HARDWARE-MODEL-tpN.json``), or None."""
    name = f"{hardware}-{model}-tp{tensor_parallel}.json"
    try:
        resolve_profile_path(name)
    except ProfileError:
        return None
    return name


def profile_hardware(profile: str | None) -> str | None:
    """The hardware preset a profile file names (its ``hardware`` field), or None: no profile, one that
    cannot be read (loading it later says why) or a name that is no preset."""
    if not profile:
        return None
    try:
        data = read_profile_json(resolve_profile_path(profile))
    except ProfileError:
        return None
    hw = data.get("hardware") if isinstance(data, dict) else None
    return hw if isinstance(hw, str) and hw in HARDWARE else None


def scenario_dict(run: MeasuredRun, base: dict[str, Any] | None = None, profile: str | None = None,
                  overrides: Sequence[str] = ()) -> tuple[dict[str, Any], list[str]]:
    """The raw scenario (before validation) that simulates ``run``, and notes on what was filled in.

    ``base`` is an optional scenario's raw mapping (what the run does not say); the run's facts win
    over it and ``overrides`` (``--set``) over both. Raises ``RunFileError`` for a model or GPU
    without a preset that nothing else supplies.
    """
    raw = dict(base or {})
    notes: list[str] = []
    raw["name"] = raw.get("name") or f"against-{run.name}"
    raw.pop("output_dir", None)
    raw["workload"] = {"trace": {"format": "csv", "path": f"../{TRACE_FILE}"}}
    # vLLM's data-parallel front end sends each request to the engine with the least 4 x waiting + running
    # in the DP coordinator's snapshot, which it publishes every 0.1 s (DP_STATS_INTERVAL_S): vllm_dp
    raw["cluster"] = ({"num_replicas": 1} if run.data_parallel == 1 else
                      {"num_replicas": run.data_parallel, "router": "vllm_dp", "router_refresh_s": DP_STATS_INTERVAL_S})
    for key, value in (("model", run.model), ("hardware", run.hardware), ("tensor_parallel", run.tensor_parallel)):
        if value is not None:
            raw[key] = value
    sched = raw.get("scheduler") if isinstance(raw.get("scheduler"), dict) else {}
    if sched.get("preset") != "vllm-v1":
        if sched:
            notes.append(f"the scenario's scheduler ({sched.get('preset') or sched.get('type')}) is not used: the run "
                         "was served by vLLM, simulated with the vllm-v1 preset")
        sched = {}
    raw["scheduler"] = {**sched, "preset": "vllm-v1", **run.scheduler}
    if "async_scheduling" not in raw["scheduler"]:
        raw["scheduler"]["async_scheduling"] = async_by_default(run.vllm_version)
        notes.append(f"async_scheduling {raw['scheduler']['async_scheduling']}: vLLM "
                     f"{run.vllm_version or '(version unknown)'}'s default")
    kv = dict(raw.get("kv_cache") or {})
    kv.update(run.kv_cache)
    kv.setdefault("block_size", 16)  # vLLM V1's defaults, for a run that does not record them
    kv.setdefault("enable_prefix_caching", True)
    raw["kv_cache"] = kv
    if profile:
        raw["cost_model"] = {"type": "profile", "path": str(profile)}
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key.split(".")[0] == "workload":  # the run's own requests are what is compared
            raise ScenarioError(f"--set {item!r}: validate --against replays the run's requests as measured, so "
                                "the workload cannot be changed; leave workload.* out")
        apply_override(raw, item)
        got = raw
        for part in key.split("."):
            got = got.get(part) if isinstance(got, dict) else None
        if key in run.stated and got != run.stated[key]:
            raise ScenarioError(f"--set {item!r}: the run states {key} {run.stated[key]}; validate --against simulates "
                                "the engine as it ran, so leave it out (for a what-if: servesim run OUT/sim/scenario.yaml "
                                f"--set {key}=...)")
    where = str(run.path)
    if raw.get("model") is None and local_config(run.model_source):
        raw["model"] = run.model_source  # vLLM served a local checkout that is here too: its config.json
    if raw.get("model") is None:
        raise RunFileError(unknown_model_message(where, run.model_source))
    if raw.get("hardware") is None and run.hardware_source is None and (hw := profile_hardware(profile)):
        raw["hardware"] = hw  # the GPU the profile was measured on, for a run that names none
        notes.append(f"hardware: the run does not name its GPU; {hw}, the profile's, used (--set hardware=NAME "
                     "for another)")
    if raw.get("hardware") is None:
        hint = "" if run.hardware_source or profile else "; or --profile P: a GPU profile's own GPU is used"
        raise RunFileError(unknown_hardware_message(where, run.hardware_source) + hint)
    # what the run and --set give is checked before anything is derived from it: a bad value is an
    # error naming its field, not a traceback of the block count's arithmetic
    source = f"{where} (validate --against)"
    sc = scenario_from_dict(raw, source=source)
    if why := sc.scheduler.batch_refusal():  # a run vLLM could not have served, or a --set that makes one
        raise RunFileError(f"{where}: {why.replace('this server', 'the engine the run and --set describe')}")
    if run.model is None:
        named = get_model(sc.model).name
        notes.append(f"model: the run's {run.model_source!r} has no preset; {sc.model}"
                     f"{f' (its config.json names it {named})' if named != sc.model else ''} used")
    if "cost_model" not in raw:
        shipped = shipped_profile(get_model(sc.model).name, get_hardware(sc.hardware).name, sc.tensor_parallel)
        if shipped is not None:
            raw["cost_model"] = {"type": "profile", "path": shipped}
            notes.append(f"cost model: the shipped profile {shipped} for this GPU, model and TP (no --profile "
                         "given; --set cost_model.type=roofline for the roofline)")
        else:
            notes.append(f"cost model: the roofline (no shipped profile for {sc.hardware} x {sc.model} "
                         f"tp{sc.tensor_parallel}; give one with --profile)")
    cost = raw.get("cost_model") if isinstance(raw.get("cost_model"), dict) else {}
    if cost.get("type") == "profile" and run.enforce_eager is False:
        notes.append("the run served with CUDA graphs and torch.compile (engine_kwargs.enforce_eager false), while "
                     "GPU profiles are kernel timings of an eager engine; no correction is applied for the difference")
    kv = raw["kv_cache"]
    if kv.get("num_blocks") is None and run.kv_cache_memory_bytes is not None:
        # vLLM skips its memory profile and sizes the cache from this budget: whole blocks of every layer
        # (kv_cache_utils.get_num_blocks), per GPU; an 8-bit cache holds twice the blocks
        per_block = kv_block_bytes(get_model(sc.model), sc.tensor_parallel, sc.kv_cache.block_size)
        if run.kv_cache_dtype is not None:
            per_block //= 2
        kv["num_blocks"] = run.kv_cache_memory_bytes // per_block
        if kv["num_blocks"] < 1:
            raise RunFileError(f"{where}: engine_kwargs.kv_cache_memory_bytes {run.kv_cache_memory_bytes} holds no "
                               f"KV block of {per_block} bytes")
        notes.append(f"KV blocks not in the run: {kv['num_blocks']} from engine_kwargs.kv_cache_memory_bytes "
                     f"({run.kv_cache_memory_bytes} bytes per GPU / {per_block} bytes per block of every layer)")
    if kv.get("num_blocks") is None and run.kv_cache_dtype is not None:
        raise RunFileError(f"{where}: the run's KV cache is {run.kv_cache_dtype} and it does not record its block "
                           "count, which servesim would derive for a 16-bit cache (half the blocks): give the run's "
                           "own with --set kv_cache.num_blocks=N (vLLM logs 'GPU KV cache size: T tokens': N = T / "
                           "block size)")
    if kv.get("num_blocks") is None:
        gpu = get_hardware(sc.hardware)
        if run.cuda_total_bytes is not None and run.cuda_total_bytes > gpu.memory_bytes * 1.02:
            raise RunFileError(f"{where}: hardware.device_total_memory_bytes {run.cuda_total_bytes / 2**30:.2f} GiB is more "
                               f"than {sc.hardware}'s {gpu.memory_bytes / 2**30:.2f} GiB of memory; a GPU reports less: fix "
                               "the field, or give the run's block count with --set kv_cache.num_blocks=N")
        default_budget, default_seats = vllm_batch_defaults(gpu)
        budget = sc.scheduler.max_num_batched_tokens or default_budget
        seats = sc.scheduler.max_num_seqs or default_seats
        util = sc.kv_cache.gpu_memory_utilization
        try:
            kv["num_blocks"] = vllm_kv_blocks(sc.model, sc.hardware, sc.tensor_parallel, sc.kv_cache.block_size,
                                              budget, seats, util, run.cuda_total_bytes)
        except PresetError as e:  # the model does not fit the GPU
            raise ScenarioError(f"{source}: kv_cache: {e}") from None
        total = (f"the run's {run.cuda_total_bytes / 2**30:.2f} GiB (hardware.device_total_memory_bytes)"
                 if run.cuda_total_bytes is not None else "")
        notes.append(f"KV blocks not in the run: {kv['num_blocks']} derived as vLLM sizes them (CUDA's memory "
                     f"total{' ' + total if total else ''} x {util} - weights / TP - non-torch memory - the activation "
                     f"peak of its profile run, a {budget}-token step over {seats} requests)")
    if sc.start_refusal(int(kv["num_blocks"]), sc.kv_cache.block_size):
        # the run started, so vLLM found room for one request of max_model_len
        recorded = "the run's" if raw["scheduler"].get("max_model_len") else "the model's context (the run records none):"
        notes.append(f"max_model_len is {recorded} {sc.scheduler.max_model_len} tokens, more than the "
                     f"{kv['num_blocks']} KV blocks simulated hold ({int(kv['num_blocks']) * sc.kv_cache.block_size} "
                     "tokens), yet vLLM started, which it does only when one request of max_model_len fits: the block "
                     "count is likely low, or the engine lowered max_model_len itself (--max-model-len auto)")
    return raw, notes


def counter_notes(counters: dict[str, float], sim_summary: dict[str, Any]) -> list[str]:
    """What vLLM's own counters in the run (``MeasuredRun.engine_counters``) say beside the simulation's:
    preemptions, and the prompt tokens the real prefix cache served (the simulation has no token ids)."""
    notes = []
    if "preemptions" in counters:
        notes.append(f"preemptions: {int(counters['preemptions'])} in the run (timeseries.csv 'preempted'), "
                     f"{int(sim_summary.get('num_preemptions') or 0)} simulated")
    if "peak_kv_usage" in counters:
        notes.append(f"KV cache use: at most {100 * counters['peak_kv_usage']:.1f} % in the run (timeseries.csv "
                     f"kv_cache_pct, each tick's last step), {100 * float(sim_summary.get('max_kv_usage') or 0):.1f} % "
                     "simulated (any step)")
    cached, prompt = counters.get("cached_prompt_tokens"), counters.get("prompt_tokens")
    if cached is not None:
        # prompt_throughput credits a request's whole prompt when its prefill ends, cache hits included
        share = f" ({100 * cached / prompt:.1f} % of its prompt tokens)" if prompt else ""
        notes.append(f"prefix cache: the run served {int(cached)} prompt tokens from its cache{share}; the simulation "
                     f"{int(sim_summary.get('prefix_cache_hit_tokens') or 0)} (the run's token ids are not in it, so "
                     "shared prefixes cannot be found)")
    return notes


def check_fits(run: MeasuredRun, sc: Scenario) -> None:
    """Every request the run served must fit the simulated KV cache and context; else one-line RunFileError."""
    bs, blocks = sc.kv_cache.block_size, sc.kv_cache.num_blocks
    df = run.requests
    need = -(-(df["prompt_len"] + df["output_len"]) // bs)
    limit = sc.policy.max_model_len
    for i in np.flatnonzero((need > blocks).to_numpy() | (
            (df["prompt_len"] + df["output_len"] > limit).to_numpy() if limit else False)):
        row = df.iloc[int(i)]
        line = f" (line {int(row['source_line'])})" if "source_line" in df and row["source_line"] > 0 else ""
        tokens = int(row["prompt_len"] + row["output_len"])
        what = (f"needs {int(need.iloc[i])} KV blocks ({tokens} tokens) but the run's KV cache has {blocks}"
                if need.iloc[i] > blocks else f"has {tokens} tokens, more than max_model_len {limit}")
        raise RunFileError(f"{run.path}: request {row.get('source_id', i)}{line} {what}; a served request must "
                           "fit, so the cache size is wrong: set kv_cache.num_blocks (--set) to the run's own")


def peak_kv_blocks(run: MeasuredRun, block_size: int, samples: int = 400) -> int:
    """The most KV blocks the measured run's requests held at once, from their timestamps.

    A request holds its prompt's blocks from its first scheduling (or first token) and grows by one
    token per output token, evenly between its first and last token, until it finishes.
    """
    df = run.requests
    start = df["first_scheduled_time"].fillna(df["first_token_time"]).to_numpy()
    first, last = df["first_token_time"].to_numpy(), df["finish_time"].to_numpy()
    prompt, out = df["prompt_len"].to_numpy(), df["output_len"].to_numpy()
    t = np.linspace(start.min(), last.max(), samples)[:, None]
    frac = np.clip((t - first) / np.maximum(last - first, 1e-9), 0.0, 1.0)
    held = np.where((t >= start) & (t < last), np.ceil((prompt + out * frac) / block_size), 0.0)
    return int(held.sum(axis=1).max())


# ---- the run --------------------------------------------------------------------------------------
def measured_summary(run: MeasuredRun) -> dict[str, Any]:
    """The measured run summarised with the simulator's own code (same keys, same percentiles).

    No request file records preemptions: the count is vLLM's own counter where timeseries.csv has it
    (which requests it hit is never known), else None — not the 0 the empty column would sum to."""
    s = summarize(run.requests, pd.DataFrame(), run.itl_hist)
    counted = run.engine_counters.get("preemptions")
    s["num_preemptions"] = None if counted is None else int(counted)
    s["preempted_requests"] = None
    return s


def write_trace(run: MeasuredRun, path: Path) -> Path:
    """The run's arrivals (seconds, engine clock, first = 0) and lengths as a csv-format trace.

    Arrivals are written to the last bit (shortest round-trip form): rounded to the nanosecond, two
    requests a few ns apart became one instant, or one landed on the other side of a step's end,
    and the simulation was no longer of the measured arrivals."""
    path.parent.mkdir(parents=True, exist_ok=True)
    df = run.requests
    pd.DataFrame({"arrival_time": df["arrival_time"], "prompt_len": df["prompt_len"],
                  "output_len": df["output_len"]}).to_csv(path, index=False)
    return path


def validate_against(
    run_path: str | Path,
    out_dir: str | Path,
    fmt: str | None = None,
    profile: str | None = None,
    scenario_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    max_error: Sequence[str] = (),
    plots: bool = True,
    progress: bool | None = None,
    log: Callable[[str], None] | None = print,
) -> AgainstResult:
    """Read the run, simulate its workload under the vllm-v1 preset, write the comparison into ``out_dir``."""
    say = log or (lambda _msg: None)
    thresholds = parse_max_error(max_error)
    run = read_run(run_path, fmt)
    measured = measured_summary(run)
    unmeasured = [m for m in thresholds if not math.isfinite(measured.get(m, math.nan))]
    if unmeasured:  # (exit 1, 'FAIL ... error undefined', after the whole simulation, before)
        raise ScenarioError(f"--max-error: the run ({run.format}) does not measure {', '.join(unmeasured)}; "
                            "set thresholds on what it measures")
    base = read_scenario_file(scenario_file) if scenario_file else None
    raw, notes = scenario_dict(run, base, profile, overrides)
    source = f"{run.path} (validate --against)"
    sc = scenario_from_dict(raw, source=source)
    check_fits(run, sc)
    out = Path(out_dir)
    write_trace(run, out / TRACE_FILE)
    (out / "sim").mkdir(parents=True, exist_ok=True)  # the trace path resolves through it
    sc_run = sc.model_copy(update={"workload": sc.workload.resolve_paths(out / "sim")})
    n = len(run.requests)
    say(f"sim: {n} requests of {run.name} on {sc.model} / {sc.hardware} tp={sc.tensor_parallel}, vllm-v1 "
        f"(max_num_seqs {sc.policy.max_num_seqs}, max_num_batched_tokens {sc.policy.max_num_batched_tokens}), "
        f"{sc.kv_cache.num_blocks} KV blocks of {sc.kv_cache.block_size}, cost model {sc.cost_model.type}"
        f"{f' ({sc.cost_model.path})' if sc.cost_model.path else ''} ...")
    sim = simulate(sc_run, progress=progress)
    if len(sim.requests_df) != n or not np.array_equal(sim.requests_df["prompt_len"], run.requests["prompt_len"]):
        raise RuntimeError("validate --against: the simulated workload differs from the run's (a servesim bug)")
    write_results(sim, out / "sim", plots=plots)
    (out / "sim" / "scenario.yaml").write_text(scenario_to_yaml(sc))  # the trace path relative to it

    table = error_table(measured, sim.summary, thresholds)
    table[REFERENCE_COLUMN] = [run.reference.get(m, {}).get("error_pct", math.nan) for m in METRICS]
    table.attrs.update(TABLE_ATTRS)
    peak = peak_kv_blocks(run, sc.kv_cache.block_size)
    capacity = sc.kv_cache.num_blocks * sc.cluster.num_replicas
    if peak > capacity:
        notes.append(f"the run held up to {peak} KV blocks by its timestamps, more than the {capacity} simulated: "
                     "the block count is too small (or the run preempted)")
    notes.extend(counter_notes(run.engine_counters, sim.summary))
    timing = run_step_timing(run, sc)
    commit, dirty = servesim_commit()
    provenance = {
        "run": str(run.path), "format": run.format, "vllm_version": run.vllm_version,
        "num_requests": n, "model": sc.model, "model_in_run": run.model_source, "hardware": sc.hardware,
        "hardware_in_run": run.hardware_source, "tensor_parallel": sc.tensor_parallel,
        "engine_preset": "vllm-v1", "max_num_seqs": sc.policy.max_num_seqs,
        "max_num_batched_tokens": sc.policy.max_num_batched_tokens,
        "kv_num_blocks": sc.kv_cache.num_blocks, "kv_block_size": sc.kv_cache.block_size,
        "enable_prefix_caching": sc.kv_cache.enable_prefix_caching, "measured_peak_kv_blocks": peak,
        "scenario_file": str(scenario_file) if scenario_file else None, "overrides": list(overrides),
        "sim_cost_model": sc.cost_model.type,
        "profile": str(resolve_profile_path(sc.cost_model.path)) if sc.cost_model.path else None,
        "clock": run.clock, "arrivals_exact": run.arrivals_exact, "notes": [*run.notes, *notes],
        "engine_counters": run.engine_counters,
        "itl": "measured" if run.itl_hist is not None else "n/a (not in this run format)",
        "reference": run.reference_source, "sim_wall_s": sim.wall_s,
        "step_timing": timing.summary() if timing else None,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "servesim_commit": commit, "servesim_dirty": dirty,
    }  # fmt: skip
    result = AgainstResult(table, provenance, thresholds, run, measured, sim, sc, out, failures(table), timing)
    write_against(result, plots=plots)
    return result


def run_step_timing(run: MeasuredRun, sc: Scenario) -> StepTiming | None:
    """The run's decode and mixed steps timed from its engine timestamps against the scenario's cost
    model (``run_steps``; with or without async scheduling, as the scenario runs the engine), where
    the run has those timestamps and one engine (the reading follows one engine loop: data-parallel
    engines' timestamps interleave); else None."""
    times = engine_times(run.requests)
    if times is None or run.data_parallel != 1:
        return None
    cost = build_cost_model(sc.cost_model, get_model(sc.model), sc.cost_hardware(), sc.tensor_parallel,
                            sc.kv_cache.block_size)
    return step_timing(times, cost, sc.policy.max_num_batched_tokens, sc.policy.max_num_seqs,
                       bool(getattr(sc.policy, "async_scheduling", False)))


# ---- outputs --------------------------------------------------------------------------------------
def per_request_frame(result: AgainstResult) -> pd.DataFrame:
    """Measured and simulated times of every request, side by side (seconds)."""
    m, s = result.run.requests, result.sim.requests_df
    df = pd.DataFrame({"request_id": m["request_id"], "prompt_len": m["prompt_len"], "output_len": m["output_len"],
                       "arrival_time": m["arrival_time"]})
    if "source_id" in m:
        df.insert(1, "source_id", m["source_id"])
    for col in ("ttft", "tpot", "e2e"):
        df[f"measured_{col}"] = m[col].to_numpy()
        df[f"sim_{col}"] = s[col].to_numpy()
    return df


def write_against(result: AgainstResult, plots: bool = True) -> Path:
    """validation.json / .csv / .md, per_request.csv, the CDF overlays and the per-request scatter."""
    out = result.out
    out.mkdir(parents=True, exist_ok=True)
    result.table.to_csv(out / "validation.csv", index=False)
    rows = json.loads(result.table.to_json(orient="records"))  # nan -> null
    (out / "validation.json").write_text(to_json({
        "provenance": result.provenance, "max_error_pct": result.thresholds, "passed": result.passed,
        "failed": result.failed, "metrics": rows, "measured_summary": result.measured,
        "llmservingsim": result.run.reference,
    }))
    per_request_frame(result).to_csv(out / "per_request.csv", index=False, float_format="%.6f")
    if result.step_timing is not None:
        result.step_timing.frame().to_csv(out / "step_timing.csv", index=False, float_format="%.6f")
    (out / "validation.md").write_text(format_report_markdown(result))
    if plots:
        from servesim.sim.plots import plot_cdf_overlay, plot_request_scatter

        frames = {"measured": result.run.requests, "sim": result.sim.requests_df}
        hists = {"measured": result.run.itl_hist, "sim": result.sim.itl_hist}
        for suffix, col in CDF_METRICS.items():
            if col == "itl" and result.run.itl_hist is None:
                continue  # nothing measured to overlay
            plot_cdf_overlay(out / f"cdf_{suffix}.png", frames, metrics=(col,), itl_hists=hists)
        plot_request_scatter(out / "scatter_requests.png", result.run.requests, result.sim.requests_df)
    return out


def format_report_markdown(result: AgainstResult) -> str:
    p = result.provenance
    lines = [f"# validate --against {Path(p['run']).name}", "",
             f"{p['num_requests']} requests measured ({p['format']}, vLLM {p['vllm_version'] or '?'}) and simulated: "
             f"{p['model']} on {p['hardware']} tp={p['tensor_parallel']}, vllm-v1 preset (max_num_seqs "
             f"{p['max_num_seqs']}, max_num_batched_tokens {p['max_num_batched_tokens']}), {p['kv_num_blocks']} KV "
             f"blocks of {p['kv_block_size']}, cost model {p['sim_cost_model']}"
             f"{' ' + p['profile'] if p['profile'] else ''}. Error = (sim - measured) / measured; "
             "`llmservingsim error %` is LLMServingSim's own on this run (its summary file). "
             f"ITL: {p['itl']}.", "", format_markdown(result.table), "",
             f"Clock: {p['clock'].get('alignment')}.", ""]
    lines += [f"- {note}" for note in p["notes"]]
    if result.step_timing is not None:
        lines += ["", "Steps timed from the run's engine timestamps (`calibration/run_steps.py`), "
                  "measured / the cost model's price of the same rows (`step_timing.csv`):", "",
                  *(result.step_timing.markdown() or ["- no step of the run could be read that way"])]
    if result.thresholds:
        lines += ["", "**passed**" if result.passed else "**failed**: " + "; ".join(result.failed)]
    lines += ["", f"servesim {p['servesim_commit'] or 'commit unknown'}{' (dirty)' if p['servesim_dirty'] else ''}, "
              f"{p['date']}", ""]
    return "\n".join(lines)
