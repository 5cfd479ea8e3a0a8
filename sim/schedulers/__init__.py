"""Schedulers: pure policy over a KV block manager. ``make_scheduler`` is the one constructor
both simulation and live mode use."""

from __future__ import annotations

from ..kv_cache import BlockManager
from .base import Scheduler, SchedulerConfig, StepOutput
from .chunked import ChunkedScheduler
from .continuous import ContinuousScheduler
from .static import StaticScheduler

SCHEDULERS: dict[str, type[Scheduler]] = {
    "static": StaticScheduler,
    "continuous": ContinuousScheduler,
    "chunked": ChunkedScheduler,
}


def make_scheduler(config: SchedulerConfig, block_manager: BlockManager) -> Scheduler:
    """Build the scheduler named by ``config.type`` over ``block_manager``."""
    return SCHEDULERS[config.type](config, block_manager)


__all__ = [
    "SCHEDULERS",
    "ChunkedScheduler",
    "ContinuousScheduler",
    "Scheduler",
    "SchedulerConfig",
    "StaticScheduler",
    "StepOutput",
    "make_scheduler",
]
