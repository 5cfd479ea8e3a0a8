"""The scenario YAML: one validated schema for everything a run needs.

Every bad field becomes one line naming the field path and what is allowed (``ScenarioError``);
the CLI prints it and exits with status 2, never a traceback. ``--set key.path=value`` overrides
are applied to the raw YAML before validation, so they are checked the same way.
"""

from __future__ import annotations

import math
import re
import types
import typing
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, Tag, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .config_model import ConfigModel
from .cost_model import CostModelConfig, build_cost_model
from .engine_presets import (
    EnginePreset,
    apply_preset_defaults,
    resolve_policy,
    scheduler_section,
)
from .engine_presets.vllm_v1 import vllm_batch_defaults
from .errors import PresetError, ScenarioError, not_a_file
from .hardware_file import is_hardware_file
from .hf_config import is_config_path
from .hints import did_you_mean
from .host_memory import (
    BLOCK_BYTES,
    REPLICA_BYTES,
    REPLICAS_FIELD,
    REQUEST_BYTES,
    ROW_BYTES,
    Demand,
    over_host_memory,
)
from .presets import HARDWARE, MODELS, HardwareConfig, get_hardware, get_model, kv_block_bytes, num_kv_blocks
from .router import ClusterConfig
from .schedulers import ChunkedConfig, ComposedConfig, PolicyConfig
from .workload import WorkloadConfig, mean_floor
from .workload import check_files as check_workload_files

# The scheduler section: a policy config by ``type`` or an engine preset by ``preset``, built from
# the two registries (sim/schedulers/__init__.py, sim/engine_presets/__init__.py).
SchedulerSection = scheduler_section()


class KVCacheConfig(ConfigModel):
    """The paged KV cache. ``num_blocks`` wins over the memory-derived count when given."""

    block_size: int = Field(16, ge=1, le=4096)
    num_blocks: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    enable_prefix_caching: bool = False
    swap_space_gb: float = Field(4.0, ge=0.0, description="host memory for swapped-out blocks, GiB per replica")
    # vLLM V0's BlockSpaceManager keeps 1% of blocks free when admitting; engine presets set their own
    watermark: float = Field(0.01, ge=0.0, lt=1.0, description="fraction of blocks kept free on admission")


# most torch CPU threads a run may ask for (live.threads, calibrate --threads): torch's thread pool
# segfaults at some tens of thousands, and past a few per core they only cost time
MAX_THREADS = 1024
# longest scenario name: it names run folders with a suffix (NAME-plan, NAME-sweep, NAME-PRESET), and
# a file name may hold 255 bytes
MAX_NAME_BYTES = 200


class LiveConfig(ConfigModel):
    """How ``servesim live`` runs the model (ignored by ``servesim run``)."""

    backend: Literal["torch", "triton"] = "torch"
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    kv_cache_memory_mb: float | None = Field(
        None, gt=0, description="memory budget for the KV cache tensor; sets num_blocks when num_blocks is unset"
    )
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="torch CPU threads (default: torch's choice)")
    warmup_steps: int = Field(2, ge=0, description="untimed forward passes before the replay starts")
    cuda_graphs: bool = Field(
        False, description="replay decode-only steps from CUDA graphs captured at start-up, one per padded batch "
        "size (1, 2, 4, 8, 16, 24, ... up to max_num_seqs, at most 512), as vLLM does by default; on a CPU the "
        "same padded decode path runs without capture")
    piecewise_graphs: bool = Field(
        False, description="run prefill and mixed steps with their layers' non-attention work replayed from CUDA "
        "graphs captured per padded token count (up to max_num_batched_tokens, at most 8192) and attention eager "
        "between them, as vLLM V1 does; not yet run on a GPU")


class Scenario(ConfigModel):
    name: str = "scenario"
    # numpy seeds are non-negative; true/false are refused as for every number (config_model.py), and
    # 1.0 is read as 1 as in every other whole-number field
    seed: int = Field(0, ge=0)
    model: str = "llama-3.1-8b"
    hardware: str = "h100-sxm"
    tensor_parallel: int = Field(1, ge=1, le=64)
    cost_model: CostModelConfig = Field(default_factory=CostModelConfig)
    # a policy config (``type: chunked`` ...; sim/schedulers) or an engine preset with its knobs
    # (``preset: vllm-v1`` ...; sim/engine_presets), which ``policy`` translates
    scheduler: SchedulerSection = Field(default_factory=ChunkedConfig)
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    workload: WorkloadConfig
    slo: dict[Literal["ttft_ms", "tpot_ms", "e2el_ms"], float] = Field(default_factory=dict)
    live: LiveConfig = Field(default_factory=LiveConfig)
    output_dir: str | None = None

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        if v in MODELS:
            return v
        if not is_config_path(v):
            raise ValueError(f"unknown model preset '{v}'{did_you_mean(v, MODELS)}; allowed: {', '.join(MODELS)}, "
                             "or the path of a Hugging Face config.json")
        try:
            get_model(v)
        except PresetError as e:
            raise ValueError(str(e)) from None
        return str(Path(v).expanduser().absolute())  # a run folder's scenario.yaml then runs from anywhere

    @field_validator("name")
    @classmethod
    def _folder_name(cls, v: str) -> str:
        # the default run folder is results/NAME: a name is one folder name, never a path
        if not v.strip() or v.strip() in (".", "..") or any(c in v for c in "/\\\0") or len(v.encode()) > MAX_NAME_BYTES:
            raise ValueError(f"{v[:60]!r}{'...' if len(v) > 60 else ''} cannot name a run folder (results/NAME): use "
                             f"letters, digits, '-', '_' or '.', at most {MAX_NAME_BYTES} bytes, no '/'")
        return v

    @field_validator("hardware")
    @classmethod
    def _known_hardware(cls, v: str) -> str:
        if v in HARDWARE:
            return v
        if not is_hardware_file(v):
            raise ValueError(f"unknown hardware preset '{v}'{did_you_mean(v, HARDWARE)}; allowed: "
                             f"{', '.join(HARDWARE)}, or the path of a hardware file (.yaml)")
        try:
            get_hardware(v)
        except PresetError as e:
            raise ValueError(str(e)) from None
        return str(Path(v).expanduser().absolute())

    @model_validator(mode="before")
    @classmethod
    def _drop_written_resolution(cls, data: Any) -> Any:
        # a run folder's scenario.yaml records what its preset resolved to; reloading recomputes it
        if isinstance(data, dict) and "resolved_scheduler" in data:
            data = {k: v for k, v in data.items() if k != "resolved_scheduler"}
        return data

    @model_validator(mode="after")
    def _resolve_engine_preset(self) -> Scenario:
        # A preset fills the knobs it derives from the hardware and sets its KV defaults (block
        # size, prefix caching, watermark) where the kv_cache section leaves them unset; its
        # translation into a policy config is checked now, so a bad combination fails at load.
        self.scheduler = apply_preset_defaults(self.scheduler, get_hardware(self.hardware), self.model, self.kv_cache)
        self.policy  # noqa: B018 - validates the translation
        return self

    @model_validator(mode="after")
    def _chunks_can_progress(self) -> Scenario:
        # A chunk that stops short of a prompt's end is cut at a multiple of the chunk unit
        # (TensorRT-LLM: tokens_per_block, microBatchScheduler.cpp FIRST_COME_FIRST_SERVED), so a
        # step budget below one unit never schedules a prompt longer than the budget: the engine
        # would wait forever, and the simulation would stop with "scheduler made no progress".
        pol = self.policy
        if not isinstance(pol, ComposedConfig) or not pol.chunked:
            return self
        unit = self.kv_cache.block_size if pol.chunk_unit == "block" else pol.chunk_unit
        if pol.max_num_batched_tokens < unit:
            field = "scheduler." + (self.scheduler.RENAMED.get("max_num_batched_tokens", "max_num_batched_tokens")
                                    if isinstance(self.scheduler, EnginePreset) else "max_num_batched_tokens")
            source = "kv_cache.block_size" if pol.chunk_unit == "block" else "scheduler.chunk_unit"
            raise PydanticCustomError(
                "value_error",
                "{value} tokens is less than one chunk unit ({unit} tokens, {source}): chunked prefill cuts a "
                "prompt at multiples of it, so a prompt longer than {value} tokens would never be scheduled; "
                "set it to at least {unit} or lower {source}",
                {"field": field, "value": pol.max_num_batched_tokens, "unit": unit, "source": source},
            )
        return self

    @model_validator(mode="after")
    def _fits_host_memory(self) -> Scenario:
        over = self.over_host_memory()
        if over is not None:
            raise PydanticCustomError("host_memory", "{reason}", {"field": over[0], "reason": over[1]})
        return self

    def over_host_memory(self) -> tuple[str, str] | None:
        """(field, reason) when simulating this scenario would not fit the host's memory, else None.
        Validation checks it; a copy made with ``model_copy(update=...)`` is not validated again."""
        return over_host_memory(self._memory_demands())

    def _memory_demands(self) -> list[Demand]:
        """What simulating this scenario allocates on the host, by the field that sets each part."""
        model, kv, replicas = get_model(self.model), self.kv_cache, self.cluster.num_replicas
        try:
            block_bytes = kv_block_bytes(model, self.tensor_parallel, kv.block_size)
        except ValueError as e:  # heads that do not split over tensor_parallel
            raise PydanticCustomError("value_error", "{reason}", {"field": "tensor_parallel", "reason": str(e)}) from None
        blocks_scale: tuple[float, str] = (1.0, "")  # blocks per unit of the field that sets them
        if kv.num_blocks is not None:
            blocks, blocks_field = float(kv.num_blocks), "kv_cache.num_blocks"
        elif self.live.kv_cache_memory_mb is not None:
            blocks, blocks_field = self.live.kv_cache_memory_mb * 2**20 / block_bytes, "live.kv_cache_memory_mb"
            blocks_scale = (2**20 / block_bytes, " MiB")
        else:
            try:
                blocks = float(self.derived_kv_blocks())
            except ValueError:  # the model does not fit: simulate says so
                blocks = 0.0
            blocks_field = "kv_cache.gpu_memory_utilization"
        seats = self.policy.max_num_seqs
        seats_field = "scheduler." + (self.scheduler.RENAMED.get("max_num_seqs", "max_num_seqs")
                                      if isinstance(self.scheduler, EnginePreset) else "max_num_seqs")
        seats_scale = (1.0, "")
        if seats is None:  # bounded by the cache (a composed policy's seats) or small (SGLang's default)
            seats, seats_field, seats_scale = blocks, blocks_field, blocks_scale
        wl = self.workload
        requests, requests_field = float(wl.num_requests or 0), "workload.num_requests"
        requests_scale = (1.0, "")
        rate = getattr(wl.arrival, "rate", None)
        if wl.duration_s is not None and rate is not None and (not requests or wl.duration_s * rate < requests):
            requests, requests_field = wl.duration_s * rate, "workload.duration_s"
            requests_scale = (rate, " s")
        turns = mean_floor(wl.sessions.turns) if wl.sessions is not None else 1.0
        if turns > 1:  # num_requests / duration_s count conversations; each sends a request per turn
            if turns >= requests:
                requests_field, requests_scale = "workload.sessions.turns", (requests, " turns per conversation")
            else:
                requests_scale = (requests_scale[0] * turns, requests_scale[1])
            requests *= turns
        swap_per_gib = 2**30 / block_bytes
        return [
            Demand(seats_field, "running-table rows", seats, ROW_BYTES, replicas, *seats_scale),
            Demand(blocks_field, "KV blocks", blocks, BLOCK_BYTES, replicas, *blocks_scale),
            Demand("kv_cache.swap_space_gb", "host KV blocks", kv.swap_space_gb * swap_per_gib, BLOCK_BYTES,
                   replicas, swap_per_gib, " GiB"),
            Demand(REPLICAS_FIELD, "replicas", 1, REPLICA_BYTES, replicas),
            Demand(requests_field, "requests", requests, REQUEST_BYTES, 1, *requests_scale),
        ]

    @property
    def policy(self) -> PolicyConfig:
        """The policy config the replicas schedule with (an engine preset's translation)."""
        return resolve_policy(self.scheduler, get_hardware(self.hardware), self.model)

    def cost_hardware(self) -> HardwareConfig:
        """The hardware the step-cost model prices: the preset's, less FlashAttention's kernel
        structure when the engine runs attention kernels of its own (``RUNS_FLASH_ATTENTION``)."""
        hw = get_hardware(self.hardware)
        if isinstance(self.scheduler, EnginePreset) and not self.scheduler.RUNS_FLASH_ATTENTION and hw.flash_attention:
            return replace(hw, flash_attention=None)
        return hw

    def start_refusal(self, num_blocks: int, block_size: int) -> str | None:
        """Why the engine the scheduler preset models would refuse to start with this KV cache
        (``EnginePreset.start_refusal``: vLLM's max_model_len check); None for a plain policy."""
        if isinstance(self.scheduler, EnginePreset):
            return self.scheduler.start_refusal(num_blocks, block_size)
        return None

    def derived_kv_blocks(self) -> int:
        """KV blocks per replica from memory when ``kv_cache.num_blocks`` is not given (``num_kv_blocks``).

        vLLM V1 profiles a step of its token budget over its seat cap: a plain policy's or the
        ``vllm-v1`` preset's own (256 seats where a policy derives them from the cache); other engine
        presets get the memory a vLLM V1 server with its defaults leaves on the hardware, the same
        for every engine. Raises ``PresetError`` when the model does not fit.
        """
        hardware = get_hardware(self.hardware)
        if isinstance(self.scheduler, EnginePreset) and not self.scheduler.KV_PROFILED_AT_OWN_BATCH:
            tokens, seats = vllm_batch_defaults(hardware)
        else:
            policy = self.policy
            tokens, seats = policy.max_num_batched_tokens, policy.max_num_seqs or 256
        return num_kv_blocks(get_model(self.model), hardware, self.tensor_parallel,
                             self.kv_cache.gpu_memory_utilization, self.kv_cache.block_size,
                             max_num_seqs=seats, max_num_batched_tokens=tokens)

    @property
    def scheduler_name(self) -> str:
        """The engine preset's name, or the policy's type (run headers, CLI lines)."""
        return self.scheduler.preset if isinstance(self.scheduler, EnginePreset) else self.scheduler.type

    @field_validator("slo", mode="before")
    @classmethod
    def _known_slo_keys(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for key in v:
                if key not in ("ttft_ms", "tpot_ms", "e2el_ms"):
                    hint = (". A per-token ITL target is a percentile term: servesim plan --slo p99_itl_ms=..."
                            if str(key).endswith("itl_ms") else "")
                    hint = hint or did_you_mean(key, ["ttft_ms", "tpot_ms", "e2el_ms"])
                    raise PydanticCustomError(  # ctx["field"]: the path ends at the key
                        "value_error", "unknown key {key}; the per-request targets (vLLM's --goodput keys) are "
                        "ttft_ms, tpot_ms and e2el_ms{hint}", {"field": str(key), "key": repr(key), "hint": hint})
        return v

    @field_validator("slo")
    @classmethod
    def _positive_slo(cls, v: dict[str, float]) -> dict[str, float]:
        for key, target in v.items():
            if not (math.isfinite(target) and target > 0):
                raise PydanticCustomError("value_error", "must be a positive number of milliseconds, got {target}",
                                          {"field": key, "target": target})
        return v


# ---- loading ------------------------------------------------------------------------------------
def load_scenario(path: str | Path, overrides: list[str] | None = None) -> Scenario:
    """Read, override and validate a scenario file. Raises ScenarioError with a one-line message."""
    p = Path(path)
    raw = read_scenario_file(p, overrides)
    sc = scenario_from_dict(raw, source=str(p))
    # trace and empirical paths are relative to the scenario file unless absolute or present here
    sc.workload = sc.workload.resolve_paths(p.parent)
    check_files(sc)
    return sc


def check_files(sc: Scenario) -> None:
    """Read the files the scenario names (traces, length CSVs, a cost-model profile) the way a run
    will, so every verb refuses a bad one before it starts: a ``WorkloadError`` or ``ProfileError``."""
    check_workload_files(sc.workload)
    build_cost_model(sc.cost_model, get_model(sc.model), sc.cost_hardware(), sc.tensor_parallel,
                     sc.kv_cache.block_size)


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping, where YAML keeps the last
    one without a word (``seed: 0`` ... ``seed: 1`` would run seed 1). Keys a merge (``<<``) brings
    in may still be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"the key {key!r} is given twice (YAML would keep the last one silently)", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def read_scenario_file(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """The scenario file as a raw mapping with ``--set`` overrides applied, not yet validated."""
    p = Path(path)
    if why := not_a_file(p):
        raise ScenarioError(f"scenario {why}")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ScenarioError(f"{p}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                            "a scenario is a YAML file saved as UTF-8") from None
    try:
        raw = _load_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ScenarioError(f"{p}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    except RecursionError:
        raise ScenarioError(f"{p}: not valid YAML: nested too deeply for a scenario") from None
    if not isinstance(raw, dict):
        raise ScenarioError(f"{p}: a scenario is a mapping of fields (name, model, scheduler, workload, ...)")
    for item in overrides or []:
        apply_override(raw, item)
    # a model config or hardware file is relative to the scenario file too (else to the working directory)
    for key, presets, is_path in (("model", MODELS, is_config_path), ("hardware", HARDWARE, is_hardware_file)):
        value = raw.get(key)
        if isinstance(value, str) and value not in presets and is_path(value):
            here = Path(value).expanduser()
            if not here.is_absolute() and (p.parent / here).exists():
                raw[key] = str(p.parent / here)
    return raw


def scenario_from_dict(raw: dict[str, Any], source: str = "scenario") -> Scenario:
    try:
        return Scenario.model_validate(raw)
    except ValidationError as e:
        raise ScenarioError(f"{source}: {format_validation_error(e)}") from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``key.path=value`` override; the value is parsed as YAML (numbers, lists, ...)."""
    if "=" not in item:
        raise ScenarioError(f"--set {item!r}: expected key.path=value, e.g. scheduler.max_num_seqs=128")
    key, _, text = item.partition("=")
    parts = [k for k in key.strip().split(".") if k]
    if not parts:
        raise ScenarioError(f"--set {item!r}: empty key")
    if len(parts) != len(key.strip().split(".")):  # ('.seed' and 'a..b' were read as 'seed' and 'a.b')
        raise ScenarioError(f"--set {item!r}: the key {key.strip()!r} has an empty name between its dots; "
                            "write key.path=value, e.g. scheduler.max_num_seqs=128")
    value = parse_yaml_value(text, f"--set {item!r}") if text.strip() else None
    node = raw
    for k in parts[:-1]:
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        if not isinstance(child, dict):
            raise ScenarioError(f"--set {item!r}: '{k}' is not a section, so it has no field '{parts[-1]}'")
        node = child
    node[parts[-1]] = value


def parse_yaml_value(text: str, where: str) -> Any:
    """One command-line value parsed as YAML (``128``, ``[1, 2]``, ``true``); ``ScenarioError`` naming
    ``where`` when it is not valid YAML or uses a tag safe YAML refuses (``!!python/...``)."""
    try:
        return _load_yaml(text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ScenarioError(f"{where}: the value {text!r} is not valid YAML ({problem}); "
                            "quote text that holds YAML syntax, e.g. name='a: b'") from None
    except RecursionError:
        raise ScenarioError(f"{where}: the value is not valid YAML (nested too deeply)") from None


def format_validation_error(err: ValidationError) -> str:
    """The first error as ``field.path: what is wrong (allowed: ...)``, plus a count of the rest.

    The path is the one the user wrote: the tags pydantic puts in the location of a tagged union
    (``workload.arrival.poisson.rate``, ``scheduler.chunked.max_num_seqs``) are left out, and the
    field a section-wide check names (``ctx["field"]``, sim/config_model.py) is added.
    """
    errors = err.errors(include_url=False)
    first = errors[0]
    ctx = first.get("ctx") or {}
    field = ctx.get("field") or (str(ctx["discriminator"]).strip("'") if "discriminator" in ctx else None)
    raw_loc = tuple(first["loc"]) + ((field,) if field else ())
    loc, parent_fields = _user_path(raw_loc)
    path = ".".join(loc) or "(top level)"
    kind = first["type"]
    if kind == "extra_forbidden":
        msg = f"unknown field '{loc[-1]}'"
        if parent_fields:
            msg += did_you_mean(loc[-1], parent_fields)
            msg += f"; allowed here: {', '.join(parent_fields)}"
    elif kind == "missing":
        msg = "required field is missing"
    elif kind == "union_tag_not_found":
        msg = "required field is missing (it picks the kind of section)"
    elif kind in ("model_type", "dict_type", "model_attributes_type"):
        msg = "expected a section (a mapping of fields)"
        if not isinstance(first.get("input"), dict | list):
            msg += f", got {first.get('input')!r}"
    elif kind == "union_tag_invalid":
        tags = [t.strip(" '") for t in str(ctx["expected_tags"]).split(",")]
        msg = f"unknown {loc[-1]} {ctx['tag']!r}{did_you_mean(str(ctx['tag']), tags)}; choose one of: {', '.join(tags)}"
    else:
        msg = first["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if kind not in _SELF_CONTAINED and "input" in first and not isinstance(first["input"], dict | list):
            msg += f" (got {first['input']!r})"
    more = f" [and {len(errors) - 1} more problem(s)]" if len(errors) > 1 else ""
    # a value the user wrote may hold a line break; the message stays one line
    return f"{path}: {msg}{more}".replace("\r", "\\r").replace("\n", "\\n")


# error kinds whose message already shows the value
_SELF_CONTAINED = ("value_error", "assertion_error", "bool_for_number", "int_too_large", "unknown_knob",
                   "host_memory")


def _user_path(loc: tuple[Any, ...]) -> tuple[list[str], list[str]]:
    """The error location without union tags, and the field names allowed where its last part sits.

    Walks the schema from ``Scenario``: a part that names a field of a model in reach is kept and
    followed; one that is the tag of a union member (a ``Tag``, or the value of its ``Literal``
    discriminator such as ``poisson``) narrows to that member and is dropped; anything else (an
    unknown key, a list index) is kept as written.
    """
    reach: list[tuple[type[BaseModel], str | None]] = [(Scenario, None)]
    path: list[str] = []
    parent_fields: list[str] = []
    for part in loc:
        name = str(part)
        # a union's tag first: the 'chunked' policy tag is also a knob of other policies
        tagged = [(m, t) for m, t in reach if name in _member_tags(m, t)] if len(reach) > 1 else []
        if tagged and len(tagged) < len(reach):
            reach = tagged
            if not any(m.model_fields for m, _ in tagged):
                path.append(name)  # an unknown-name member: its tag reads as the field (scheduler.preset)
            continue
        here = [m for m, _ in reach if name in m.model_fields]
        if here:
            parent_fields = _field_names(reach)
            path.append(name)
            reach = [pair for m in here for pair in _models_in(m.model_fields[name].annotation)]
            continue
        if not reach and _UNION_MEMBER.match(name):
            continue  # a plain union's member label (chunk_unit: int | 'block' -> 'constrained-int')
        parent_fields = _field_names(reach)
        path.append(name)
        reach = []
    return path, parent_fields


# how pydantic labels the members of an untagged union in an error location
_UNION_MEMBER = re.compile(r"^(constrained-)?(int|float|str|bool|none|bytes)$|^(literal|function-\w+|list|dict|tuple|"
                           r"is-instance|lax-or-strict|nullable)\[")


def _field_names(reach: list[tuple[type[BaseModel], str | None]]) -> list[str]:
    names: list[str] = []
    for m, _ in reach:
        names.extend(n for n in m.model_fields if n not in names)
    return names


def _member_tags(model: type[BaseModel], tag: str | None) -> set[str]:
    """The tags a union member answers to: its ``Tag``, else its Literal field values (``poisson``)."""
    if tag is not None:
        return {tag}
    tags: set[str] = set()
    for field in model.model_fields.values():
        if typing.get_origin(field.annotation) is Literal:
            tags.update(str(a) for a in typing.get_args(field.annotation))
    return tags


def _models_in(annotation: Any, tag: str | None = None) -> list[tuple[type[BaseModel], str | None]]:
    """The models a field annotation can hold, each with the union Tag it sits under (or None)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, tag)]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        args = typing.get_args(annotation)
        tags = [m.tag for m in args[1:] if isinstance(m, Tag)]
        return _models_in(args[0], tags[0] if tags else tag)
    if origin in (typing.Union, types.UnionType) or origin is not None:
        out: list[tuple[type[BaseModel], str | None]] = []
        for arg in typing.get_args(annotation):
            out.extend(_models_in(arg))
        return out
    return []


def scenario_to_yaml(sc: Scenario) -> str:
    """The fully resolved scenario, as written next to a run's results.

    An engine preset appears as written (its knobs filled in), followed by ``resolved_scheduler``:
    the policy config it translated to (ignored when the file is loaded again).
    """
    data = sc.model_dump(mode="json", exclude_none=True)
    if isinstance(sc.scheduler, EnginePreset):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out[key] = value
            if key == "scheduler":
                out["resolved_scheduler"] = sc.policy.model_dump(mode="json", exclude_none=True)
        data = out
    return yaml.safe_dump(data, sort_keys=False)
