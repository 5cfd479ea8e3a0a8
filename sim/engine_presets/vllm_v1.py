"""vLLM V1: chunked prefill under one token budget (``ChunkedConfig``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from ..presets import GiB, HardwareConfig, get_model
from ..schedulers import ChunkedConfig
from .base import EnginePreset, vllm_batch_refusal, vllm_max_len_refusal


def vllm_batch_defaults(hardware: HardwareConfig) -> tuple[int, int]:
    """vLLM's (max_num_batched_tokens, max_num_seqs) for the OpenAI server on this hardware class.

    ``EngineArgs.get_batch_defaults``: devices with >= 70 GiB that are not A100s get 8192 / 1024,
    the rest 2048 / 256 (vLLM measured large budgets to lose throughput on A100, PR #17885). vLLM
    reads the CUDA device name, so a hardware file based on ``a100-80g`` is an A100 whatever it is
    called (it keeps the base's ``device_name`` unless it gives its own).
    """
    device = (hardware.device_name or hardware.name).lower()
    if hardware.memory_bytes >= 70 * GiB and "a100" not in device:
        return 8192, 1024
    return 2048, 256


class VllmV1Preset(EnginePreset):
    """vLLM's V1 engine scheduler (``vllm/v1/core/sched/scheduler.py``, ``kv_cache_manager.py``).

    Modelled on vllm-project/vllm main as stored at commit 00024d3 (the V1 engine since v0.8;
    batch defaults from ``EngineArgs.get_batch_defaults``). One token budget per step; running
    requests first, then waiting ones, chunked prefill on unless ``enable_chunked_prefill: false``
    (then a waiting request is taken in only when it fits the budget left whole, the budget defaults
    to at least max_model_len, and a budget below it is a server vLLM refuses to start),
    ``long_prefill_token_threshold`` caps one request's chunk; prefix caching on with 16-token blocks; under KV pressure the tail
    of the running queue (or the lowest priority under ``policy: priority``) is preempted by
    recompute, its fully computed blocks, prompt and generated, left in the prefix cache
    (``_preempt_request`` -> ``KVCacheManager.free``), so it comes back to those not yet evicted;
    a step that preempted admits nothing new. No watermark (V1 has none).
    ``async_scheduling``: the Replica loop admits a step late and host time overlaps the device.
    Not modelled: vLLM walks its running list in admission order while servesim serves decodes
    before partial prefills (they differ only when several partial prefills exhaust the budget).
    """

    ENGINE: ClassVar[str] = "vLLM V1"
    MODELLED: ClassVar[str] = "vLLM V1 engine (v0.8+; main @ 00024d3)"
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {"block_size": 16, "enable_prefix_caching": True, "watermark": 0.0}
    KV_PROFILED_AT_OWN_BATCH: ClassVar[bool] = True
    NOT_MODELLED: ClassVar[dict[str, str]] = {
        "preemption_mode": "V1 preempts by recompute only",
    }
    VARIANT_KNOB: ClassVar[str | None] = "policy"

    preset: Literal["vllm-v1"] = "vllm-v1"
    max_num_seqs: int | None = Field(None, ge=1, description="default by hardware: 1024 (>= 70 GiB, not A100) else 256")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="default by hardware: 8192 or 2048")
    long_prefill_token_threshold: int = Field(0, ge=0, description="cap on one request's prefill tokens per step")
    enable_chunked_prefill: bool = Field(True, description="False: prompts are scheduled whole")
    max_model_len: int | None = Field(None, ge=1, description="default: the model's context length")
    policy: Literal["fcfs", "priority"] = "fcfs"
    # vLLM's --async-scheduling (vllm/v1/core/sched/async_scheduler.py; EngineCore.step_with_batch_queue
    # keeps two batches in flight): the CPU schedules step n+1 while the GPU runs step n, so a request
    # arriving during step n is first scheduled into step n+2, and host time overlaps device time.
    # vLLM turns it on when left unset since PR #27614 ("Enable async scheduling by default", late
    # 2025; on in 0.19); off here so scenarios of earlier releases keep their meaning.
    async_scheduling: bool = False

    def batch_refusal(self) -> str | None:
        return vllm_batch_refusal(self.max_num_batched_tokens, self.max_num_seqs)

    def start_refusal(self, num_blocks: int, block_size: int) -> str | None:
        # vLLM V1: `KVCacheManager` start-up, `check_enough_kv_cache_memory` in vllm/v1/core/kv_cache_utils.py;
        # without chunked prefill SchedulerConfig refuses a token budget below max_model_len
        budget, max_len = self.max_num_batched_tokens, self.max_model_len
        if why := self.batch_refusal():
            return why
        if not self.enable_chunked_prefill and budget is not None and max_len is not None and budget < max_len:
            return (f"vLLM would not start this server: with enable_chunked_prefill false max_num_batched_tokens "
                    f"{budget} must be at least max_model_len {max_len}; raise the one or lower the other")
        return vllm_max_len_refusal(self.max_model_len, num_blocks, block_size)

    def resolved(self, hardware: HardwareConfig, model: str) -> VllmV1Preset:
        tokens, seqs = vllm_batch_defaults(hardware)
        # ModelConfig._get_and_verify_max_len: the model's max_position_embeddings when not given
        max_len = self.max_model_len or get_model(model).max_position_embeddings
        if not self.enable_chunked_prefill:  # SchedulerConfig: a budget that holds one whole request
            tokens = max(tokens, max_len)
        return self.model_copy(update={
            "max_num_batched_tokens": self.max_num_batched_tokens or tokens,
            "max_num_seqs": self.max_num_seqs or seqs,
            "max_model_len": max_len,
        })

    def translate(self, hardware: HardwareConfig, model: str) -> ChunkedConfig:
        return ChunkedConfig(
            max_num_seqs=self.max_num_seqs or 256, max_num_batched_tokens=self.max_num_batched_tokens or 2048,
            long_prefill_token_threshold=self.long_prefill_token_threshold, max_model_len=self.max_model_len,
            policy=self.policy, preemption_mode="recompute", async_scheduling=self.async_scheduling,
            cache_preempted_blocks="all", chunked_prefill=self.enable_chunked_prefill,
        )
