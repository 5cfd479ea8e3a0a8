"""Engine presets: ``scheduler: {preset: NAME, ...knobs}`` schedules the way that engine does.

Each preset is a pydantic model whose fields are the engine's own knob names, with the engine's
defaults (filled in from the hardware class where the engine does that), and a ``build`` that
maps those knobs onto servesim's building blocks. The mapping lives here and nowhere else:

=================  ===========================================  ====================================
preset             scheduler class and blocks                   knobs (engine names)
=================  ===========================================  ====================================
vllm-v1            ChunkedScheduler (decodes, partial chunks,   max_num_seqs, max_num_batched_tokens,
                   waiting chunks; no admission in a step       long_prefill_token_threshold,
                   that preempted; recompute newest/priority)   max_model_len, policy
vllm-v0            ContinuousScheduler (prefill_first, whole    max_num_seqs, max_num_batched_tokens,
                   prompts, 1% watermark, recompute or swap)    max_model_len, policy, preemption_mode
hf-transformers    ComposedScheduler (fifo: decodes, partial,   scheduler_type, max_batch_tokens,
                   waiting / prefill_first: partial first;      max_requests_per_batch, safety_margin
                   safety margin; stall, soft reset when stuck)
tensorrt-llm       ComposedScheduler (decodes, contexts; GNE:   capacity_scheduler_policy,
                   reserve to completion, never evicts; MAX_    max_batch_size, max_num_tokens,
                   UTILIZATION: pause newest, no admission)     enable_chunked_prefill, max_seq_len
triton-dynamic     DynamicBatcher (static batches by size or    max_batch_size, preferred_batch_size,
                   queue delay)                                 max_queue_delay_microseconds
sglang             RetractingScheduler (prefill-or-decode       schedule_policy, chunked_prefill_size,
                   steps, one chunked request, token-ratio      max_prefill_tokens,
                   admission, retraction; fcfs or lpm)          max_running_requests,
                                                                schedule_conservativeness,
                                                                context_length
=================  ===========================================  ====================================

KV-cache knobs stay in the ``kv_cache`` section under their vLLM names; a preset only changes the
defaults the user did not set (``block_size``: TensorRT-LLM's ``tokens_per_block``, SGLang's
``page_size``, Transformers' ``block_size``; ``enable_prefix_caching``: TensorRT-LLM's
``enable_block_reuse``, SGLang's radix cache, Transformers' ``allow_block_sharing``; ``watermark``:
1% for vLLM V0's block manager, none for the others). Writing one of
those engine names under ``scheduler`` is an error that says where it goes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Union

from pydantic import BaseModel, Discriminator, Tag, model_validator

from ..hints import did_you_mean
from ..presets import HardwareConfig
from ..schedulers import DEFAULT_POLICY, POLICIES, PolicyConfig
from .base import EnginePreset
from .hf_transformers import TransformersPreset
from .sglang import SGLangPreset
from .tensorrt_llm import TensorRTLLMPreset
from .triton_dynamic import TritonDynamicPreset
from .vllm_v0 import VllmV0Preset
from .vllm_v1 import VllmV1Preset

# scheduler.preset -> the engine; a new engine is one file and one line here
PRESETS: dict[str, type[EnginePreset]] = {
    "vllm-v1": VllmV1Preset,
    "vllm-v0": VllmV0Preset,
    "hf-transformers": TransformersPreset,
    "tensorrt-llm": TensorRTLLMPreset,
    "triton-dynamic": TritonDynamicPreset,
    "sglang": SGLangPreset,
}


# ---- the scheduler section of a scenario ------------------------------------------------------------
_UNKNOWN_PRESET = "preset"  # so an unknown name reports as "scheduler.preset: ..."
_UNKNOWN_TYPE = "type"  # ... and an unknown policy as "scheduler.type: ..."


def _unknown(key: str, what: str, names: Callable[[], list[str]], also: str = "") -> type[BaseModel]:
    """A union member that validates nothing: it names the bad ``key`` value and the ones there are."""

    class Unknown(BaseModel):
        @model_validator(mode="before")
        @classmethod
        def _reject(cls, data: Any) -> Any:
            name = str(data.get(key) if isinstance(data, dict) else data)
            raise ValueError(f"unknown {what} {name!r}{did_you_mean(name, names())}; choose one of: "
                             f"{', '.join(names())}{also}")

    return Unknown


_UnknownPreset = _unknown("preset", "engine preset", lambda: list(PRESETS))
_UnknownPolicy = _unknown("type", "scheduler type", lambda: list(POLICIES),
                          " (or an engine preset: scheduler.preset)")


def _section_tag(value: Any) -> str:
    if isinstance(value, dict):
        preset, kind = value.get("preset"), value.get("type", DEFAULT_POLICY)
    else:
        preset, kind = getattr(value, "preset", None), getattr(value, "type", DEFAULT_POLICY)
    # a name that is not a string (a list, a mapping) is as unknown as a misspelt one
    if preset is not None:
        return preset if isinstance(preset, str) and preset in PRESETS else _UNKNOWN_PRESET
    return kind if isinstance(kind, str) and kind in POLICIES else _UNKNOWN_TYPE


def scheduler_section() -> Any:
    """The type of a scenario's ``scheduler``: a policy config picked by ``type``, or an engine
    preset picked by ``preset``; built from the two registries when the schema is built."""
    return Annotated[
        Union[  # noqa: UP007 - built from the registries
            tuple(
                [Annotated[cls.config_type, Tag(name)] for name, cls in POLICIES.items()]
                + [Annotated[cls, Tag(name)] for name, cls in PRESETS.items()]
                + [Annotated[_UnknownPreset, Tag(_UNKNOWN_PRESET)], Annotated[_UnknownPolicy, Tag(_UNKNOWN_TYPE)]]
            )
        ],
        Discriminator(_section_tag),
    ]


def apply_preset_defaults(scheduler: Any, hardware: HardwareConfig, model: str, kv_cache: BaseModel) -> Any:
    """Resolve a preset's hardware defaults and set its KV defaults on fields the user left unset.

    Returns the (possibly new) scheduler section; ``kv_cache`` is updated in place.
    """
    if not isinstance(scheduler, EnginePreset):
        return scheduler
    for name, value in scheduler.KV_DEFAULTS.items():
        if name not in kv_cache.model_fields_set:
            setattr(kv_cache, name, value)
    return scheduler.resolved(hardware, model)


def resolve_policy(scheduler: PolicyConfig | EnginePreset, hardware: HardwareConfig, model: str) -> PolicyConfig:
    """The policy config a scheduler section schedules with: itself, or what its (resolved) preset translates to."""
    if isinstance(scheduler, EnginePreset):
        return scheduler.translate(hardware, model)
    return scheduler


__all__ = ["PRESETS", "EnginePreset", "apply_preset_defaults", "resolve_policy", "scheduler_section"]
