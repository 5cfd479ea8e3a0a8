"""Triton Inference Server's dynamic batcher in front of a stateless model: static batches, formed by size or delay.

When the model instance is free, queued requests (in arrival order) form one batch:

- as soon as ``max_num_seqs`` (Triton's ``max_batch_size``) are queued, a full batch goes;
- else, if one of ``preferred_batch_sizes`` can be formed, a batch of the largest such size goes;
- else the batcher holds the queue until its oldest request has waited ``max_queue_delay_s``
  (``max_queue_delay_microseconds``), then sends whatever is there. With no delay it sends at once.

The batch then runs as a static batch (``StaticScheduler``): every member's prompt plus whole
output is reserved up front, nobody joins, and a finished member's seat stays idle until the
longest member is done. While holding, ``next_wakeup`` tells the engine when the delay expires,
so the replica waits for either the next arrival or that deadline, with no polling.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from ..batch import Batch
from ..kv_cache import BlockManager
from .static import StaticConfig, StaticScheduler

# The engine's clock reaches a deadline as now + (deadline - now), which can land a rounding error
# short of it; a nanosecond of slack keeps the batcher from waiting again for nothing.
_TIME_TOLERANCE_S = 1e-9


class DynamicBatcherConfig(StaticConfig):
    """Static batches sent by size or after a queue delay; ``max_num_seqs`` is the largest batch."""

    type: Literal["dynamic_batcher"] = "dynamic_batcher"  # type: ignore[assignment]
    max_queue_delay_s: float = Field(0.0, ge=0.0, description="longest the oldest request is held (s)")
    preferred_batch_sizes: list[int] = Field(default_factory=list, description="batch sizes sent at once")

    @model_validator(mode="after")
    def _preferred_within_max(self) -> DynamicBatcherConfig:
        bad = [p for p in self.preferred_batch_sizes if not 1 <= p <= self.max_num_seqs]
        if bad:
            raise PydanticCustomError(  # ctx["field"]: the error's path ends at the knob (sim/config_model.py)
                "value_error", "{bad} must lie in 1..max_num_seqs ({most})",
                {"field": "preferred_batch_sizes", "bad": str(bad), "most": self.max_num_seqs})
        return self


class DynamicBatcher(StaticScheduler):
    config_type = DynamicBatcherConfig

    def __init__(self, config: DynamicBatcherConfig, block_manager: BlockManager) -> None:
        super().__init__(config, block_manager)
        self.max_queue_delay_s = config.max_queue_delay_s
        self.preferred_batch_sizes = tuple(sorted(set(config.preferred_batch_sizes)))

    def batch_size_to_send(self, now: float) -> int:
        """How many queued requests the batcher sends now (0 = keep holding the queue)."""
        queued = len(self.waiting)
        if queued == 0:
            return 0
        if queued >= self.max_num_seqs:
            return self.max_num_seqs
        fitting = [p for p in self.preferred_batch_sizes if p <= queued]
        if fitting:
            return fitting[-1]
        if now + _TIME_TOLERANCE_S >= self._deadline():
            return queued
        return 0

    def schedule(self, now: float) -> Batch:
        if self.run.n == 0:
            self._form_batch(now, self.batch_size_to_send(now))
        return self._step_batch()  # an empty batch while holding the queue

    def next_wakeup(self, now: float) -> float | None:
        if self.run.n or not self.waiting:
            return None
        return self._deadline()

    def _deadline(self) -> float:
        return self.waiting[0].arrival_time + self.max_queue_delay_s
