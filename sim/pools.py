"""The scenario each pool of a disaggregated cluster runs: the scenario with the pool's overrides.

A pool's ``hardware``, ``tensor_parallel`` and ``scheduler`` replace the scenario's; its
``kv_cache`` fields are laid over the scenario's ``kv_cache``. The result is validated like any
scenario, so a bad pool field is one line naming ``cluster.disagg.<pool>``.
"""

from __future__ import annotations

from typing import Any

from .scenario import Scenario, ScenarioError, scenario_from_dict


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
    where = f"cluster.disagg.{role}"
    try:
        return scenario_from_dict(raw, source=where)
    except ScenarioError as e:
        raise ScenarioError(_pool_path(str(e), where, pool)) from None


def _pool_path(msg: str, where: str, pool: Any) -> str:
    """``cluster.disagg.prefill: kv_cache.bogus: ...`` -> ``cluster.disagg.prefill.kv_cache.bogus: ...``
    where the field is one the pool sets (``count`` for the pool's replica count)."""
    if not msg.startswith(where + ": "):
        return msg
    path, sep, tail = msg[len(where) + 2:].partition(": ")
    if not sep or " " in path:
        return msg
    head = path.split(".", 1)[0]
    if path == "cluster.num_replicas":
        path = "count"
    elif getattr(pool, head, None) is None:  # the scenario's own field, not the pool's
        return msg
    return f"{where}.{path}: {tail}"
