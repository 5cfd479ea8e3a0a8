"""The scenario each pool of a disaggregated cluster runs: the scenario with the pool's overrides.

A pool's ``hardware``, ``tensor_parallel`` and ``scheduler`` replace the scenario's; its
``kv_cache`` fields are laid over the scenario's ``kv_cache``. The result is validated like any
scenario, so a bad pool field is one line naming ``cluster.disagg.<pool>``.
"""

from __future__ import annotations

from typing import Any

from .scenario import Scenario, scenario_from_dict


def pool_scenario(sc: Scenario, role: str) -> Scenario:
    """The scenario of pool ``role`` ("prefill" or "decode"), one replica per instance."""
    disagg = sc.cluster.disagg
    if disagg is None:
        raise ValueError("not a disaggregated scenario")
    pool = getattr(disagg, role)
    raw: dict[str, Any] = sc.model_dump(mode="json", exclude_none=True)
    raw["cluster"] = {"num_replicas": pool.count}
    raw["name"] = f"{sc.name}-{role}"
    for key in ("hardware", "tensor_parallel", "scheduler"):
        value = getattr(pool, key)
        if value is not None:
            raw[key] = value
    if pool.kv_cache is not None:
        raw["kv_cache"] = {**raw.get("kv_cache", {}), **pool.kv_cache}
    return scenario_from_dict(raw, source=f"cluster.disagg.{role}")
