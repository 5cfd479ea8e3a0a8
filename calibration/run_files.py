"""What every reader of a measured serving run shares (``calibration/measured_run.py`` says which
formats there are and how their clocks are aligned): the ``MeasuredRun`` they return, the
``RunFileError`` they raise (one line, naming file, line and field), model and GPU names mapped to
servesim presets, and the checks of JSON values and request columns they all make."""

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
from servesim.sim.presets import HARDWARE, MODELS
from servesim.sim.scenario import ScenarioError

# Hugging Face ids whose name does not spell the servesim preset after normalising (see model_preset)
_HF_MODELS = {
    "mistral-7b-v0.1": "mistral-7b",
    "mistral-7b-v0.3": "mistral-7b",
}
_TUNE_TAGS = re.compile(r"-(instruct|chat|hf)(?=-|$)")
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
            f"give one with --set model=NAME ({', '.join(MODELS)}) or --set model=PATH, the model's Hugging Face "
            "config.json")


def unknown_hardware_message(where: str, name: str | None) -> str:
    what = f"GPU {name!r} has no servesim hardware preset" if name else "the run does not name its GPU"
    return (f"{where}: {what}; give one with --set hardware=NAME ({', '.join(HARDWARE)}) or --set hardware=PATH, "
            "a hardware file of its figures")


# ---- shared helpers -------------------------------------------------------------------------------
def read_text(path: Path) -> str:
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


def parse_json(text: str, where: str, line: bool = True) -> Any:
    """``text`` parsed; ``RunFileError`` naming ``where`` (and the line in it when ``line``) when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RunFileError(f"{where}{f':{e.lineno}' if line else ''}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise RunFileError(f"{where}: not valid JSON (nested too deeply)") from None


def read_json(path: Path) -> Any:
    return parse_json(read_text(path), str(path))


def is_tag(value: Any) -> bool:
    """A type tag LLMServingSim's bench runner writes in place of a value it could not record: a config
    it could not list (``"<SchedulerConfig>"``), a property that raised (``"<unreadable: AttributeError>"``)
    or a value too long to keep (``"<dict len=80>"``)."""
    return isinstance(value, str) and value.startswith("<") and value.endswith(">")


def json_object(parent: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """``parent[name]`` when it is a JSON object, {} when absent, null or a type tag; else ``RunFileError``."""
    value = parent.get(name)
    if value is None or is_tag(value):
        return {}
    if not isinstance(value, dict):
        raise RunFileError(f"{where}: field '{name}' must be a JSON object, got {value!r:.60}")
    return value


def count_field(value: Any, where: str, name: str, least: int = 1, most: int = 2**32) -> int | None:
    """An optional whole number in [least, most] (a TP or DP degree, a context length, a byte count);
    None when absent or null."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise RunFileError(f"{where}: field '{name}' must be a whole number >= {least} and <= {most}, got "
                           f"{value!r:.60}; fix the file or give the value with --set")
    return value


def number_field(value: Any, where: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RunFileError(f"{where}: field '{name}' must be a finite number, got {value!r}")
    return float(value)


def token_count(value: Any, where: str, name: str, least: int) -> float:
    """A token count: a whole number in [least, 2**32] (1e30 tokens is not a length)."""
    v = number_field(value, where, name)
    if v != int(v) or not least <= v <= 2**32:
        raise RunFileError(f"{where}: field '{name}' must be a whole number of tokens in [{least}, 2**32], got {value!r}")
    return v


def itl_gaps(value: Any, where: str) -> list[float]:
    """One request's inter-token latencies (seconds): a list of finite numbers (None: none)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise RunFileError(f"{where}: field 'itls' must be a list of seconds, got {value!r}")
    gaps = [number_field(x, where, "itls") for x in value]
    if not all(0 <= x <= MAX_SIM_SECONDS for x in gaps):
        raise RunFileError(f"{where}: field 'itls' must hold seconds between 0 and {MAX_SIM_SECONDS:.0e}, "
                           f"got {min(gaps) if min(gaps) < 0 else max(gaps)!r}")
    return gaps


def requests_frame(arrival: np.ndarray, scheduled: np.ndarray, first: np.ndarray, finish: np.ndarray,
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
