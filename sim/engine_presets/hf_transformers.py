"""Hugging Face Transformers continuous batching: fifo / prefill_first over a composed policy (``ComposedConfig``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from ..presets import HardwareConfig
from ..schedulers import ComposedConfig
from .base import EnginePreset


class TransformersPreset(EnginePreset):
    """Hugging Face Transformers' continuous batching (``generation/continuous_batching``: ``scheduler.py``,
    ``continuous_api.py``, ``offloading_manager.py``; ``ContinuousBatchingConfig`` defaults).

    Modelled on transformers v5 (docs v5.17; scheduler.py at 9f84789/57434398 as stored). ``fifo``:
    decoding requests first, then partly prefilled ones, then waiting ones, each taking up to what
    is left of ``max_batch_tokens`` (prompts are chunked by the budget); once free blocks are under
    ``safety_margin`` of the cache (judged at the start of the step) only decodes run, or a single
    prefill if nothing else can. ``prefill_first``: partly prefilled requests before decodes, no
    margin. A request that cannot get a block sits the step out; a waiting one that does not fit is
    passed over for a later one. If no request at all can run, one is soft reset (its generated
    tokens folded into its prompt, blocks freed, back to the end of the queue): the oldest while
    admissions are open, the newest once they are blocked, and admissions stay blocked until a
    request finishes. 256-token blocks with prefix sharing. At most ``max_requests_per_batch``
    requests per step; the number holding KV is bounded only by the cache.
    Not modelled: whether a soft-reset request finds its freed blocks again (here it does not; see
    ``translate``), CPU offloading (``cpu_offload_space``, off by default), the v5 "stalled requests"
    offload path, the per-pass cache-read budget, CUDA-graph padding. transformers v4.56-4.57 used
    ``safety_margin`` 0.2 for fifo (set it to reproduce those releases).
    """

    ENGINE: ClassVar[str] = "Transformers"
    MODELLED: ClassVar[str] = "Transformers continuous batching (v5.x ContinuousBatchingManager)"
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {"block_size": 256, "enable_prefix_caching": True, "watermark": 0.0}
    RENAMED: ClassVar[dict[str, str]] = {
        "max_num_batched_tokens": "max_batch_tokens",
        "max_num_seqs": "max_requests_per_batch",
        "scheduler": "scheduler_type",
        "policy": "scheduler_type",
    }
    NOT_MODELLED: ClassVar[dict[str, str]] = {
        "cpu_offload_space": "CPU offloading is not modelled; requests are soft reset instead",
    }
    VARIANT_KNOB: ClassVar[str | None] = "scheduler_type"

    preset: Literal["hf-transformers"] = "hf-transformers"
    scheduler_type: Literal["fifo", "prefill_first"] = "fifo"
    max_batch_tokens: int = Field(8192, ge=1, description="token budget of one forward pass")
    max_requests_per_batch: int = Field(1024, ge=1, description="requests in one forward pass")
    safety_margin: float | None = Field(None, ge=0.0, le=1.0, description="default 0.15 (fifo), 0.0 (prefill_first)")

    def resolved(self, hardware: HardwareConfig, model: str) -> TransformersPreset:
        margin = self.safety_margin
        if margin is None:
            margin = 0.15 if self.scheduler_type == "fifo" else 0.0
        return self.model_copy(update={"safety_margin": margin})

    def translate(self, hardware: HardwareConfig, model: str) -> ComposedConfig:
        margin = self.safety_margin if self.safety_margin is not None else 0.15
        fifo = self.scheduler_type == "fifo"
        return ComposedConfig(
            # max_num_seqs None: every request holding KV holds a block, which bounds how many are active
            max_num_batched_tokens=self.max_batch_tokens,
            preemption_mode="soft_reset",
            order=("decode", "partial") if fifo else ("partial", "decode"),
            chunked=True,
            admission="safety_margin" if margin > 0 else "free_blocks",
            safety_margin=margin,
            skip_unfit_waiting=True,
            on_kv_shortage="stall",
            victim="oldest_then_newest",
            requeue="tail",
            admit_after_preemption="not_until_a_finish",
            max_rows_per_step=self.max_requests_per_batch,
            # Left as it was (no own blocks found again), in doubt: offloading_manager.py says a soft reset
            # re-prefills from scratch, yet its blocks, hashed over prompt + generated tokens as they
            # complete (mark_shareable_blocks_as_complete), stay initialized when freed with sharing on
            # (cache_manager.py free_blocks), where the reset request's prefix match may find them.
            cache_preempted_blocks="none",
        )
