"""vLLM V0 with chunked prefill off: prefill-first continuous batching (``ContinuousConfig``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from ..presets import HardwareConfig, get_model
from ..schedulers import ContinuousConfig
from .base import EnginePreset, vllm_batch_refusal, vllm_max_len_refusal


class VllmV0Preset(EnginePreset):
    """vLLM's V0 scheduler with chunked prefill off (``vllm/core/scheduler.py``, ``_schedule_default``).

    Modelled on vLLM v0.6 (the V0 engine up to v0.10). Prefill-prioritised continuous batching:
    whenever a whole prompt can be admitted (token budget, ``max_num_seqs``, and the block
    manager's 1% watermark) the step prefills only; otherwise every running request decodes;
    swapped requests come back before any new prompt. Preemption by recompute (default) or swap,
    newest first. With chunking off vLLM sets ``max_num_batched_tokens = max(max_model_len,
    2048)``, ``max_model_len`` being the model's context length. No prefix caching by default.
    Not modelled: vLLM v0.6's OpenAI server turned chunked prefill on for contexts over 32k
    (this preset is the chunking-off path); beam search / n > 1 sequence groups.
    """

    ENGINE: ClassVar[str] = "vLLM V0"
    MODELLED: ClassVar[str] = "vLLM V0 scheduler (v0.6.x, chunked prefill off)"
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {"block_size": 16, "enable_prefix_caching": False, "watermark": 0.01}
    NOT_MODELLED: ClassVar[dict[str, str]] = {
        "enable_chunked_prefill": "this preset is V0 with chunked prefill off; use preset vllm-v1 or "
        "scheduler.type: chunked for chunked prefill",
        "long_prefill_token_threshold": "V0 without chunked prefill schedules whole prompts",
    }
    VARIANT_KNOB: ClassVar[str | None] = "preemption_mode"

    preset: Literal["vllm-v0"] = "vllm-v0"
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1, description="default max(max_model_len, 2048)")
    max_model_len: int | None = Field(None, ge=1, description="default: the model's context length")
    policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_mode: Literal["recompute", "swap"] = "recompute"

    def start_refusal(self, num_blocks: int, block_size: int) -> str | None:
        # vLLM V0: `CacheEngine` start-up, `raise_if_cache_size_invalid` in vllm/worker/worker.py; the
        # batch limits are SchedulerConfig's check, as in V1
        return (vllm_batch_refusal(self.max_num_batched_tokens, self.max_num_seqs)
                or vllm_max_len_refusal(self.max_model_len, num_blocks, block_size))

    def resolved(self, hardware: HardwareConfig, model: str) -> VllmV0Preset:
        max_len = self.max_model_len or get_model(model).max_position_embeddings
        return self.model_copy(update={
            "max_model_len": max_len,
            "max_num_batched_tokens": self.max_num_batched_tokens or max(max_len, 2048),
        })

    def translate(self, hardware: HardwareConfig, model: str) -> ContinuousConfig:
        return ContinuousConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens or 2048,
            max_model_len=self.max_model_len, policy=self.policy, preemption_mode=self.preemption_mode,
            schedule_order="prefill_first",
            # V0's prefix caching (off by default) is not modelled: a victim finds only shared blocks
            cache_preempted_blocks="none",
        )
