"""What every engine preset shares: knob checking with hints, and the translator interface.

An engine preset is a pydantic model whose fields are the engine's own knob names, with the
engine's defaults. ``resolved`` fills the knobs the engine derives from the hardware or the model;
``translate`` turns the knobs into one of servesim's policy configs (``sim/schedulers``);
``KV_DEFAULTS`` are the ``kv_cache`` defaults it sets where the user left them unset. The scenario
does both when it loads (``sim/engine_presets/__init__.py``: ``resolve_scheduler``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import model_validator
from pydantic_core import PydanticCustomError

from ..config_model import ConfigModel
from ..hints import did_you_mean
from ..presets import HardwareConfig
from ..schedulers import PolicyConfig

# Knobs that belong in the kv_cache section, under the names engines give them.
_KV_KNOBS = {
    "block_size": "kv_cache.block_size",
    "tokens_per_block": "kv_cache.block_size",
    "page_size": "kv_cache.block_size",
    "enable_prefix_caching": "kv_cache.enable_prefix_caching",
    "enable_block_reuse": "kv_cache.enable_prefix_caching",
    "allow_block_sharing": "kv_cache.enable_prefix_caching",
    "disable_radix_cache": "kv_cache.enable_prefix_caching (false)",
    "num_blocks": "kv_cache.num_blocks",
    "gpu_memory_utilization": "kv_cache.gpu_memory_utilization",
    "free_gpu_memory_fraction": "kv_cache.gpu_memory_utilization",
    "mem_fraction_static": "kv_cache.gpu_memory_utilization",
    "max_memory_percent": "kv_cache.gpu_memory_utilization",
    "swap_space": "kv_cache.swap_space_gb",
    "watermark": "kv_cache.watermark",
}



class EnginePreset(ConfigModel):
    """What every preset shares: knob checking, hardware defaults, the KV defaults it sets, ``build``."""

    ENGINE: ClassVar[str] = ""
    MODELLED: ClassVar[str] = ""  # engine version / source modelled (README table)
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {}
    # knob names of other engines (mostly vLLM's) -> what this engine calls them
    RENAMED: ClassVar[dict[str, str]] = {}
    NOT_MODELLED: ClassVar[dict[str, str]] = {}
    VARIANT_KNOB: ClassVar[str | None] = None  # the knob `servesim engines NAME:VALUE` sets
    # Derived KV blocks model vLLM V1's memory profile (presets.num_kv_blocks). True: profiled at this
    # preset's own seats and token budget; False: at vLLM V1's defaults for the hardware, the memory
    # a vLLM server would leave, so every engine is compared on the same memory.
    KV_PROFILED_AT_OWN_BATCH: ClassVar[bool] = False
    # Whether the engine's attention runs as FlashAttention, so the roofline prices it as the GPU's
    # FlashAttention version does (HardwareConfig.flash_attention: FA2's varlen kernel on A100 / L40S
    # / RTX parts). False: the engine ships its own attention kernels, and a step with prefill rows
    # is priced as separate prefill and decode parts (Scenario.cost_hardware).
    RUNS_FLASH_ATTENTION: ClassVar[bool] = True

    @model_validator(mode="before")
    @classmethod
    def _known_knobs(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        allowed = [k for k in cls.model_fields if k != "preset"]
        for key in data:
            if key == "preset" or key in cls.model_fields:
                continue
            name = data.get("preset", "?")
            if key in cls.RENAMED:
                hint = f"{cls.ENGINE} calls it {cls.RENAMED[key]}"
            elif key in cls.NOT_MODELLED:
                hint = cls.NOT_MODELLED[key]
            elif key in _KV_KNOBS:
                hint = f"KV-cache knobs go in the kv_cache section: set {_KV_KNOBS[key]}"
            elif key == "type":
                hint = "a preset picks its own scheduler; drop 'type'"
            else:
                hint = did_you_mean(key, allowed).strip(" ()") or "not a knob of this preset"
            raise PydanticCustomError(  # ctx["field"]: the error's path ends at the knob (sim/config_model.py)
                "unknown_knob", "unknown knob '{field}' for preset {name} ({hint}); its knobs: {knobs}",
                {"field": key, "name": name, "hint": hint, "knobs": ", ".join(allowed)},
            )
        return data

    # ---- resolution and construction --------------------------------------------------------
    def start_refusal(self, num_blocks: int, block_size: int) -> str | None:
        """Why the engine would refuse to start with this KV cache (None: it starts). vLLM checks at
        start-up that one request of ``max_model_len`` tokens fits the cache and stops otherwise;
        the engines without that check (or that cap a request instead) start."""
        return None

    def resolved(self, hardware: HardwareConfig, model: str) -> EnginePreset:
        """A copy with every knob left unset filled in as the engine would on ``hardware`` for ``model``."""
        return self

    def translate(self, hardware: HardwareConfig, model: str) -> PolicyConfig:  # pragma: no cover - abstract
        """The policy config this (resolved) preset schedules with: the translation of its knobs."""
        raise NotImplementedError


def vllm_batch_refusal(max_num_batched_tokens: int | None, max_num_seqs: int | None) -> str | None:
    """vLLM's ``SchedulerConfig`` check of the batch limits (V0 and V1): every running request takes at
    least one token a step, so a token budget below the seats is a server vLLM refuses to start."""
    if max_num_batched_tokens is None or max_num_seqs is None or max_num_batched_tokens >= max_num_seqs:
        return None
    return (f"vLLM would not start this server: max_num_batched_tokens {max_num_batched_tokens} must be at least "
            f"max_num_seqs {max_num_seqs} (every running request takes a token a step); raise the one or lower the "
            "other")


def vllm_max_len_refusal(max_model_len: int | None, num_blocks: int, block_size: int) -> str | None:
    """vLLM's start-up check: one request of ``max_model_len`` tokens must fit the KV cache (V1
    ``check_enough_kv_cache_memory``, V0 ``raise_if_cache_size_invalid``); the message names the
    knob to lower. None when it fits or no ``max_model_len`` is set."""
    if max_model_len is None:
        return None
    need = -(-max_model_len // block_size)
    if need <= num_blocks:
        return None
    return (f"vLLM would not start this server: one request of max_model_len {max_model_len} tokens needs {need} KV "
            f"blocks of {block_size}, the cache holds {num_blocks} ({num_blocks * block_size} tokens); set "
            f"scheduler.max_model_len to at most {num_blocks * block_size} (vLLM's advice too) or give the cache more "
            "memory")
