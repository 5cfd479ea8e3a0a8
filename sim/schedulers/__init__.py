"""Schedulers: pure policy over a KV block manager. ``make_scheduler`` is the one constructor
both simulation and live mode use; engine presets (``engine_presets.py``) build theirs from the
same classes and building blocks."""

from __future__ import annotations

from ..kv_cache import BlockManager
from .base import Scheduler, SchedulerConfig, StepOutput
from .chunked import ChunkedScheduler
from .composed import ComposedScheduler, Composition
from .continuous import ContinuousScheduler
from .dynamic_batcher import DynamicBatcher
from .engine_presets import PRESETS, EnginePreset
from .retracting import RetractingScheduler
from .static import StaticScheduler

SCHEDULERS: dict[str, type[Scheduler]] = {
    "static": StaticScheduler,
    "continuous": ContinuousScheduler,
    "chunked": ChunkedScheduler,
}


def make_scheduler(config: SchedulerConfig | EnginePreset, block_manager: BlockManager) -> Scheduler:
    """Build the scheduler named by ``config.type`` (or the engine preset ``config``) over ``block_manager``."""
    if isinstance(config, EnginePreset):
        return config.build(block_manager)
    return SCHEDULERS[config.type](config, block_manager)


__all__ = [
    "PRESETS",
    "SCHEDULERS",
    "ChunkedScheduler",
    "ComposedScheduler",
    "Composition",
    "ContinuousScheduler",
    "DynamicBatcher",
    "EnginePreset",
    "RetractingScheduler",
    "Scheduler",
    "SchedulerConfig",
    "StaticScheduler",
    "StepOutput",
    "make_scheduler",
]
