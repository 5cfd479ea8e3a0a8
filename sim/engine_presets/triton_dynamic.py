"""Triton Inference Server's dynamic batcher: static batches by size or queue delay (``DynamicBatcherConfig``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from ..presets import HardwareConfig
from ..schedulers import DynamicBatcherConfig
from .base import EnginePreset


class TritonDynamicPreset(EnginePreset):
    """Triton Inference Server's dynamic batcher serving a stateless generate model
    (``docs/user_guide/batcher.md``: preferred batch sizes, delayed batching).

    Modelled on Triton Inference Server 2.x (r24/r25 docs). When the model instance is free, a
    batch of the queued requests goes at once if ``max_batch_size`` of them (or one of the
    ``preferred_batch_size`` sizes, the largest that can be formed) are waiting; otherwise the
    batcher waits until the oldest has been queued ``max_queue_delay_microseconds`` and sends what
    is there (0, Triton's default, means no wait). The batch runs to its longest member with no one
    joining (a stateless model generates the whole batch in one execution), each member's prompt
    and output reserved up front. Triton has no default ``max_batch_size`` (it is the model's
    config); servesim uses 16.
    Not modelled: padding every member to the longest sequence (a real stateless model wastes that
    KV and compute), non-streaming responses held until the batch ends (servesim times each
    request's tokens as they are produced), several model instances, queue priorities and timeouts.
    """

    ENGINE: ClassVar[str] = "Triton dynamic batcher"
    MODELLED: ClassVar[str] = "Triton Inference Server 2.x dynamic batcher"
    KV_DEFAULTS: ClassVar[dict[str, Any]] = {"block_size": 16, "enable_prefix_caching": False, "watermark": 0.0}
    RENAMED: ClassVar[dict[str, str]] = {
        "max_num_seqs": "max_batch_size",
        "preferred_batch_sizes": "preferred_batch_size",
        "max_queue_delay_us": "max_queue_delay_microseconds",
    }

    preset: Literal["triton-dynamic"] = "triton-dynamic"
    max_batch_size: int = Field(16, ge=1)
    preferred_batch_size: list[int] = Field(default_factory=list)
    max_queue_delay_microseconds: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _preferred_within_max(self) -> TritonDynamicPreset:
        bad = [p for p in self.preferred_batch_size if not 1 <= p <= self.max_batch_size]
        if bad:
            raise PydanticCustomError(  # ctx["field"]: the error's path ends at the knob (sim/config_model.py)
                "value_error", "{bad} must lie in 1..max_batch_size ({most})",
                {"field": "preferred_batch_size", "bad": str(bad), "most": self.max_batch_size})
        return self

    def translate(self, hardware: HardwareConfig, model: str) -> DynamicBatcherConfig:
        return DynamicBatcherConfig(
            max_num_seqs=self.max_batch_size, max_queue_delay_s=self.max_queue_delay_microseconds * 1e-6,
            preferred_batch_sizes=self.preferred_batch_size,
        )
