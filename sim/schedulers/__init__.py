"""Schedulers: pure policy over a KV block manager.

Each policy is one file holding its config (a ``PolicyConfig`` with ``type: Literal[NAME]`` and
the knobs it adds) and its ``Scheduler`` subclass (``config_type`` names the config). ``POLICIES``
is the registry: the scenario's ``scheduler`` section is the union of the registered configs,
tagged by ``type``, and ``make_scheduler`` looks the policy up there. Engine presets
(``sim/engine_presets/``) translate an engine's knobs into one of these configs.
"""

from __future__ import annotations

from typing import Any

from ..kv_cache import BlockManager
from .base import PolicyConfig, Scheduler, StepOutput
from .chunked import ChunkedConfig, ChunkedScheduler
from .composed import ComposedConfig, ComposedScheduler
from .continuous import ContinuousConfig, ContinuousScheduler
from .dynamic_batcher import DynamicBatcher, DynamicBatcherConfig
from .retracting import RetractingConfig, RetractingScheduler
from .static import StaticConfig, StaticScheduler

# scheduler.type -> the policy; a new policy is one file and one line here
POLICIES: dict[str, type[Scheduler]] = {
    "static": StaticScheduler,
    "continuous": ContinuousScheduler,
    "chunked": ChunkedScheduler,
    "composed": ComposedScheduler,
    "retracting": RetractingScheduler,
    "dynamic_batcher": DynamicBatcher,
}
DEFAULT_POLICY = "chunked"  # a scheduler section without ``type``


def policy_config(**knobs: Any) -> PolicyConfig:
    """The config of the policy named by ``knobs["type"]`` (default chunked), validated."""
    return POLICIES[knobs.get("type", DEFAULT_POLICY)].config_type.model_validate(knobs)


def make_scheduler(config: PolicyConfig, block_manager: BlockManager) -> Scheduler:
    """Build the policy named by ``config.type`` over ``block_manager``."""
    return POLICIES[config.type](config, block_manager)


__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "ChunkedConfig",
    "ChunkedScheduler",
    "ComposedConfig",
    "ComposedScheduler",
    "ContinuousConfig",
    "ContinuousScheduler",
    "DynamicBatcher",
    "DynamicBatcherConfig",
    "PolicyConfig",
    "RetractingConfig",
    "RetractingScheduler",
    "Scheduler",
    "StaticConfig",
    "StaticScheduler",
    "StepOutput",
    "make_scheduler",
    "policy_config",
]
