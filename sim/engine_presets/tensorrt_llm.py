"""TensorRT-LLM in-flight batching: capacity + micro-batch scheduler over a composed policy (``ComposedConfig``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from ..presets import HardwareConfig, get_model
from ..schedulers import ComposedConfig
from .base import EnginePreset


class TensorRTLLMPreset(EnginePreset):
    """TensorRT-LLM's in-flight batching: capacity scheduler + micro-batch scheduler
    (``cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp``, ``tensorrt_llm/_torch/pyexecutor/scheduler.py``).

    Modelled on TensorRT-LLM 1.x (llm_args ``SchedulerConfig``/``KvCacheConfig`` defaults as stored).
    Context and generation requests share a step: generation requests one token each, then
    contexts, within ``max_num_tokens`` and ``max_batch_size``; without ``enable_chunked_prefill``
    (the default) a context runs only whole, and a prompt longer than ``max_num_tokens`` is
    rejected; with it, contexts are cut first-come-first-served at KV-block boundaries.
    ``GUARANTEED_NO_EVICT`` (default) starts a request only if the blocks for its prompt plus its
    whole output are free after every running request's own remaining need, in arrival order
    (head-of-line), and so never evicts. ``MAX_UTILIZATION`` admits whatever fits the next step
    and, short of blocks, pauses the latest-arrived running request (its KV freed but stored for
    reuse, its generated tokens kept as prompt, back to the head of the queue, where it finds the
    blocks not yet evicted); a step that paused admits nothing new.
    32-token blocks with block reuse.
    Not modelled: a paused request reclaiming its place ahead of newer running ones, the
    ``EQUAL_PROGRESS`` chunking policy, ``STATIC_BATCH``, KV-cache offload to host, beam width > 1.
    """

    ENGINE: ClassVar[str] = "TensorRT-LLM"
    MODELLED: ClassVar[str] = "TensorRT-LLM 1.x capacity + micro-batch scheduler"
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {"block_size": 32, "enable_prefix_caching": True, "watermark": 0.0}
    RENAMED: ClassVar[dict[str, str]] = {
        "max_num_seqs": "max_batch_size",
        "max_num_batched_tokens": "max_num_tokens",
        "max_model_len": "max_seq_len",
        "scheduler_policy": "capacity_scheduler_policy",
        "policy": "capacity_scheduler_policy",
    }
    NOT_MODELLED: ClassVar[dict[str, str]] = {
        "context_chunking_policy": "only FIRST_COME_FIRST_SERVED chunking is modelled (the default)",
    }
    VARIANT_KNOB: ClassVar[str | None] = "capacity_scheduler_policy"
    # TensorRT-LLM's attention op runs a step's context requests through its own FMHA kernels and its
    # generation requests through XQA / masked MHA (cpp/tensorrt_llm/common/attentionOp.cpp:
    # enqueueContext, enqueueGeneration), not one FlashAttention varlen call over the whole step.
    RUNS_FLASH_ATTENTION: ClassVar[bool] = False

    preset: Literal["tensorrt-llm"] = "tensorrt-llm"
    capacity_scheduler_policy: Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"] = "GUARANTEED_NO_EVICT"
    max_batch_size: int = Field(2048, ge=1)
    max_num_tokens: int = Field(8192, ge=1)
    enable_chunked_prefill: bool = False
    max_seq_len: int | None = Field(None, ge=1, description="default: the model's context length")

    @property
    def preemption_mode(self) -> str:
        """MAX_UTILIZATION pauses by soft reset; GUARANTEED_NO_EVICT never preempts."""
        return "soft_reset" if self.capacity_scheduler_policy == "MAX_UTILIZATION" else "recompute"

    def resolved(self, hardware: HardwareConfig, model: str) -> TensorRTLLMPreset:
        # the LLM API takes max_seq_len from the model's config (max_position_embeddings) when not given
        return self.model_copy(update={"max_seq_len": self.max_seq_len or get_model(model).max_position_embeddings})

    def translate(self, hardware: HardwareConfig, model: str) -> ComposedConfig:
        no_evict = self.capacity_scheduler_policy == "GUARANTEED_NO_EVICT"
        # A pause keeps what was generated as prompt: soft reset arithmetic, back at the head.
        return ComposedConfig(
            max_num_seqs=self.max_batch_size,
            max_num_batched_tokens=self.max_num_tokens,
            max_model_len=self.max_seq_len,
            preemption_mode=self.preemption_mode,
            order=("decode", "partial"),
            chunked=self.enable_chunked_prefill,
            chunk_unit="block",
            admission="reserve_to_completion" if no_evict else "free_blocks",
            on_kv_shortage="preempt",
            victim="latest_arrival",
            requeue="head",
            admit_after_preemption="not_this_step",
            # a paused request's blocks, prompt and generated, are stored for reuse as it is freed
            # (py_executor _pause_requests -> free_resources -> BlockManager::releaseBlocks, which
            # stores the blocks of all its tokens but the last when block reuse is on)
            cache_preempted_blocks="all",
        )
