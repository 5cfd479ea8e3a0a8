"""The points of a ``servesim search`` space: parsing ``--space``, one validated scenario per
combination, and what needs no simulation to rule out (see ``search.py``)."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PresetError, UserError
from ..hardware_file import is_hardware_file
from ..hints import did_you_mean
from ..presets import HARDWARE, get_hardware
from ..scenario import Scenario, ScenarioError, apply_override, scenario_from_dict
from .plan import RatePoint
from .sweep import GridAxis, grid_points, parse_grid

STATUSES = ("best", "best-so-far", "feasible", "pruned", "infeasible", "unfinished")


@dataclass
class Point:
    """One configuration of the space and what the search learned about it."""

    index: int
    values: dict[str, Any]
    scenario: Scenario | None
    status: str = "unfinished"
    reason: str = ""
    replica_cost: float = math.nan  # $/hour of one replica: tensor_parallel x $/GPU-hour
    upper_bound_rps: float = math.nan  # capacity bound of one replica from the saturation run
    replicas: int | None = None  # smallest n with one replica passing at target / n
    failed_replicas: int = 0  # largest n known to fail (0: none)
    tested: dict[int, RatePoint] = field(default_factory=dict)
    sims: int = 0  # simulations this point ran (cache hits not counted)

    @property
    def lower_bound_replicas(self) -> int:
        return max(1, self.failed_replicas + 1)

    @property
    def cost(self) -> float:
        return self.replicas * self.replica_cost if self.replicas else math.nan


# what the search sets on every point itself, so an axis over it would only repeat points
SEARCH_CHOOSES = {
    "cluster.num_replicas": "search chooses the replica count itself (bound it with --max-replicas)",
    "cluster.disagg": "a disaggregated deployment is not searched; size it with servesim plan --target-rate",
    "workload.arrival.rate": "search tests each point at target-rate / replicas itself (give --target-rate)",
    "workload.num_requests": "search sets each test's requests from --duration / --min-requests",
    "workload.duration_s": "search sets each test's arrival window from --tolerance or --duration",
}


def parse_space(items: Sequence[str]) -> list[GridAxis]:
    """``--space key.path=v1,v2`` items (``sweep --grid`` syntax); hardware names are checked here."""
    if not items:
        raise ScenarioError("search needs at least one --space key.path=v1,v2,..., e.g. --space hardware=h100-sxm,l40s")
    try:
        axes = parse_grid(items)
    except ScenarioError as e:
        raise ScenarioError(str(e).replace("--grid", "--space")) from None
    for a in axes:
        chosen = SEARCH_CHOOSES.get(a.key) or next(
            (why for key, why in SEARCH_CHOOSES.items() if a.key.startswith(key + ".")), None)
        if chosen:
            raise ScenarioError(f"--space {a.key}: {chosen}")
        if a.key == "hardware":
            for v in a.values:
                if isinstance(v, str) and v not in HARDWARE and is_hardware_file(v):
                    try:
                        get_hardware(v)  # a hardware file (relative to the working directory, like --set)
                    except PresetError as e:
                        raise ScenarioError(f"--space hardware: {e}") from None
                elif v not in HARDWARE:
                    raise ScenarioError(f"--space hardware: unknown hardware {v!r}{did_you_mean(str(v), HARDWARE)}; "
                                        f"choose from: {', '.join(HARDWARE)}, or the path of a hardware file (.yaml)")
    return axes


def space_hardware(base: Scenario, axes: Sequence[GridAxis]) -> list[str]:
    """Every hardware the space uses (the base scenario's when no axis varies it), as a scenario
    holds it: a preset name, or a hardware file's absolute path."""
    for a in axes:
        if a.key == "hardware":
            return [v if v in HARDWARE else str(Path(v).expanduser().absolute()) for v in map(str, a.values)]
    return [base.hardware]


def build_points(raw: dict[str, Any], axes: Sequence[GridAxis], base_overrides: Sequence[str],
                 source: str, base_dir: Path) -> list[Point]:
    """One ``Point`` per combination; one that does not validate is infeasible with the reason."""
    points = []
    for i, combo in enumerate(grid_points(axes, "--space")):
        values = {a.key: a.values[j] for a, j in zip(axes, combo, strict=True)}
        d = copy.deepcopy(raw)
        try:
            for item in [*base_overrides, *(f"{a.key}={a.texts[j]}" for a, j in zip(axes, combo, strict=True))]:
                apply_override(d, item)
            sc = scenario_from_dict(d, source=source)
            sc.workload = sc.workload.resolve_paths(base_dir)
            points.append(Point(i, values, sc))
        except UserError as e:
            points.append(Point(i, values, None, "infeasible", str(e).splitlines()[0]))
    return points


def check_feasible(p: Point, prices: dict[str, float]) -> None:
    """Mark ``p`` infeasible when one replica cannot hold the model; price it otherwise."""
    from ..simulate import plan_kv

    sc = p.scenario
    if sc is None:
        return
    if sc.cluster.disagg is not None:
        p.status, p.reason = "infeasible", ("a disaggregated deployment (cluster.disagg) is not one replica's "
                                            "configuration: size it with servesim plan --target-rate")
        return
    hw = get_hardware(sc.hardware)
    if sc.tensor_parallel > hw.gpus_per_node:
        p.status, p.reason = "infeasible", (f"tensor_parallel={sc.tensor_parallel} spans more than one "
                                            f"{hw.name} node ({hw.gpus_per_node} GPUs): not modelled")
        return
    try:
        plan_kv(sc)
    except UserError as e:
        p.status, p.reason = "infeasible", str(e).splitlines()[0]
        return
    p.replica_cost = sc.tensor_parallel * prices[sc.hardware]


