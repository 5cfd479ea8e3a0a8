"""SGLang: prefill-or-decode steps, token-ratio admission, retraction (``RetractingConfig``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from ..presets import GiB, HardwareConfig, get_model
from ..schedulers import RetractingConfig
from .base import EnginePreset


def _sglang_chunked_prefill_size(hardware: HardwareConfig) -> int:
    """``ServerArgs``' default by GPU memory: < 35 GiB 2048, < 60 GiB 4096, < 160 GiB 8192, else 16384."""
    mem = hardware.memory_bytes
    if mem < 35 * GiB:
        return 2048
    if mem < 60 * GiB:
        return 4096
    if mem < 160 * GiB:
        return 8192
    return 16384


class SGLangPreset(EnginePreset):
    """SGLang's scheduler (``managers/scheduler.py``, ``schedule_policy.py`` ``PrefillAdder``,
    ``schedule_batch.py`` ``retract_decode``; constants from ``global_config.py``).

    Modelled on SGLang v0.4.9-v0.5 (schedule_policy.py at 00550cd as stored). A step is a prefill
    step whenever something can be prefilled, else a decode step of every running request (no mixed
    steps). Prefill: the one partly prefilled request continues, then waiting requests in ``fcfs``
    or ``lpm`` order (most cached prompt tokens first; fcfs above 128 waiting; requests sharing an
    uncached prefix with an earlier one wait a round) while ``chunked_prefill_size`` tokens and the
    KV estimate allow: free tokens minus ``min(outputs left, 4096) * new_token_ratio`` per running
    request must exceed a newcomer's prompt + ``min(max output, 4096)``. Decode out of KV: retract
    the requests with the fewest outputs (longest prompt among equals) until 20 tokens per request
    are free; they are recomputed later from the back of the queue, their prompt still cached
    (``release_req`` frees only what the radix tree does not hold: the decoded tokens). Radix-cache
    prefix reuse (through servesim's block hash chain) with page size 1. ``max_running_requests`` defaults to
    ``min(max(pool tokens / context length * 512, 2048), 4096)``.
    Not modelled: ``--enable-mixed-chunk``, caching of generated tokens for later turns (the radix
    tree stores outputs too; servesim caches prompt blocks only), hierarchical cache, priority
    scheduling, the overlap scheduler's one-step lag.
    """

    ENGINE: ClassVar[str] = "SGLang"
    MODELLED: ClassVar[str] = "SGLang v0.4.9-v0.5 scheduler"
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {"block_size": 1, "enable_prefix_caching": True, "watermark": 0.0}
    RENAMED: ClassVar[dict[str, str]] = {
        "max_num_seqs": "max_running_requests",
        "max_num_batched_tokens": "chunked_prefill_size",
        "policy": "schedule_policy",
        "max_model_len": "context_length",
    }
    NOT_MODELLED: ClassVar[dict[str, str]] = {
        "enable_mixed_chunk": "mixed prefill + decode steps are not modelled (SGLang's default is off)",
    }
    VARIANT_KNOB: ClassVar[str | None] = "schedule_policy"

    preset: Literal["sglang"] = "sglang"
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    # SGLang turns chunking off for any value <= 0 (scheduler.py init_chunked_prefill: "if
    # self.chunked_prefill_size <= 0: # -1 means disable"), so 0 is off, not "unset"
    chunked_prefill_size: int | None = Field(None, description="default by GPU memory; <= 0 turns chunking off")
    max_prefill_tokens: int = Field(16384, ge=1)
    max_running_requests: int | None = Field(None, ge=1)
    schedule_conservativeness: float = Field(1.0, ge=0.0)
    context_length: int | None = Field(None, ge=1)

    def resolved(self, hardware: HardwareConfig, model: str) -> SGLangPreset:
        return self.model_copy(update={
            "chunked_prefill_size": (self.chunked_prefill_size if self.chunked_prefill_size is not None
                                     else _sglang_chunked_prefill_size(hardware)),
        })

    def translate(self, hardware: HardwareConfig, model: str) -> RetractingConfig:
        chunk = self.chunked_prefill_size if self.chunked_prefill_size is not None else 8192
        chunked = chunk > 0
        return RetractingConfig(
            max_num_seqs=self.max_running_requests,  # None: SGLang's default from the pool and the context
            max_num_batched_tokens=chunk if chunked else self.max_prefill_tokens,
            max_model_len=self.context_length, preemption_mode="recompute",  # a retracted request is recomputed
            waiting_order=self.schedule_policy, max_prefill_tokens=self.max_prefill_tokens, chunked=chunked,
            conservativeness=self.schedule_conservativeness,
            context_length=self.context_length or get_model(model).max_position_embeddings,
            cache_preempted_blocks="prompt",  # retract_decode keeps the radix-tree prefix, frees the rest
        )
