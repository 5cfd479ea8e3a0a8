"""Parameter sweeps (``servesim sweep``): the cross product of ``--grid`` overrides, one run each.

Every point is the scenario with its overrides applied to the raw YAML and validated like
``--set``; a point whose values do not validate, or whose run fails, becomes a row with
``status = "failed"`` and its one-line ``error``, and the rest of the sweep goes on; when no
point validates (a misspelt key fails them all) the sweep stops before running anything. Rows are in
grid order (the first ``--grid`` varies slowest), so the table is the same whichever backend ran
it and in whatever order the workers finished. Everything in a row except ``wall_s`` (seconds the
run took on its worker, see ``WALL_COLUMNS``) is a pure function of the scenario and its seed.

Given an output folder, each point is recorded in its ``points.jsonl`` as it finishes
(``points_log.py``) and the table is built from those records, so ``resume=True`` reruns only the
points missing there and gives the very table an uninterrupted sweep gives. A point whose worker
died twice has status ``lost`` and is not recorded: ``--resume`` runs it again.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ..host_memory import GRID_POINT_BYTES, Demand, over_host_memory
from ..outputs import begin_folder, write_csv, write_parquet
from ..scenario import Scenario, ScenarioError, apply_override, parse_yaml_value, scenario_from_dict
from .parallel import TaskRunner
from .points_log import Recording, run_recorded

WALL_COLUMNS = ("wall_s",)  # vary from run to run; leave them out when comparing sweeps
HEADER_KEYS = ("kv_num_blocks",)
TABLE_FILES = ("sweep.csv", "sweep.parquet")  # sweep.csv is written last: it marks a finished sweep
POINTS_FILE = "points.jsonl"
SPEC_LABELS = {"scenario": "base scenario", "set": "--set overrides", "grid": "grid"}


@dataclass(frozen=True, slots=True)
class GridAxis:
    key: str  # dotted scenario path
    values: tuple[Any, ...]  # parsed (YAML) values, the table's cells
    texts: tuple[str, ...]  # as typed, applied like --set key=text


def parse_grid(items: Sequence[str]) -> list[GridAxis]:
    """``key.path=v1,v2,...`` items; each value is parsed as YAML like a ``--set`` value."""
    axes: list[GridAxis] = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or not text.strip():
            raise ScenarioError(f"--grid {item!r}: expected key.path=v1,v2,..., e.g. scheduler.type=static,chunked")
        texts = tuple(_split_values(text))
        if any(a.key == key for a in axes):
            raise ScenarioError(f"--grid {key}: given twice; put all its values in one --grid")
        values = tuple(parse_yaml_value(t, f"--grid {key}") for t in texts)
        twice = next((t for j, t in enumerate(texts) if values[j] in values[:j]), None)
        if twice is not None:  # (each point ran twice, its results counted twice)
            raise ScenarioError(f"--grid {key}: the value {twice} is given twice")
        axes.append(GridAxis(key, values, texts))
    if not axes:
        raise ScenarioError("sweep needs at least one --grid key.path=v1,v2,...")
    return axes


def _split_values(text: str) -> list[str]:
    """Split on commas outside brackets, so a value may itself be a YAML list or mapping."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def grid_points(axes: Sequence[GridAxis], flag: str = "--grid") -> list[list[int]]:
    """Every combination as value indices per axis, the first axis varying slowest; ``ScenarioError``
    naming ``flag`` when the points (a validated scenario each) would not fit the host's memory."""
    over = over_host_memory([Demand(flag, "points", math.prod(len(a.values) for a in axes), GRID_POINT_BYTES)])
    if over is not None:
        raise ScenarioError(f"{over[0]}: {over[1]}; give fewer values")
    return [list(c) for c in itertools.product(*(range(len(a.values)) for a in axes))]


def point_scenario(raw: dict[str, Any], base_overrides: Sequence[str], overrides: Sequence[str],
                   source: str, base_dir: Path) -> Scenario:
    """The validated scenario of one point (raises ScenarioError with a one-line message)."""
    d = copy.deepcopy(raw)
    for item in [*base_overrides, *overrides]:
        apply_override(d, item)
    sc = scenario_from_dict(d, source=source)
    sc.workload = sc.workload.resolve_paths(base_dir)
    return sc


def run_point(sc: Scenario) -> dict[str, Any]:
    """Worker entry point: simulate and return the summary plus run facts worth a column."""
    from ..simulate import simulate, summary_iterations

    res = simulate(sc, progress=False, iterations=summary_iterations(sc))
    return {"kv_num_blocks": res.kv.num_blocks, **res.summary}


def _label(overrides: Sequence[str]) -> str:
    return ", ".join(overrides)


def sweep_spec(raw: dict[str, Any], axes: Sequence[GridAxis], base_overrides: Sequence[str]) -> dict[str, Any]:
    """What makes two sweeps the same sweep (``--resume`` refuses a folder recorded with another)."""
    return {"scenario": raw, "set": list(base_overrides), "grid": [{"key": a.key, "values": list(a.texts)}
                                                                    for a in axes]}


def run_sweep(raw: dict[str, Any], axes: Sequence[GridAxis], base_overrides: Sequence[str] = (),
              backend: str = "local", workers: int | None = None, ray_address: str | None = None,
              source: str = "scenario", base_dir: str | Path = ".", progress: bool = True,
              out_dir: str | Path | None = None, resume: bool = False) -> pd.DataFrame:
    """One row per grid point: point index, grid values, status, error, summary metrics, wall_s.

    ``out_dir``: record each finished point in its ``points.jsonl``; ``resume``: keep the points
    already recorded there (the folder must hold this same sweep) and run only the others.
    """
    points = grid_points(axes)
    keys = [a.key for a in axes]
    scenarios: list[Scenario | None] = []
    errors: list[str | None] = []
    for pt in points:
        overrides = [f"{a.key}={a.texts[j]}" for a, j in zip(axes, pt, strict=True)]
        try:
            scenarios.append(point_scenario(raw, base_overrides, overrides, f"{source} [{_label(overrides)}]",
                                            Path(base_dir)))
            errors.append(None)
        except ScenarioError as e:
            scenarios.append(None)
            errors.append(str(e).splitlines()[0])
    valid = [i for i, s in enumerate(scenarios) if s is not None]
    if not valid:
        # a misspelt grid key (or a base scenario that does not validate) fails every point: say so
        # once, before any worker starts, instead of a table of identical failures
        raise ScenarioError(f"sweep: none of the {len(points)} grid points is a valid scenario; the first: "
                            f"{errors[0]}")
    recording = None if out_dir is None else Recording(
        Path(out_dir), POINTS_FILE, sweep_spec(raw, axes, base_overrides), SPEC_LABELS, "sweep", resume, TABLE_FILES)
    done = run_recorded(run_point, {i: scenarios[i] for i in valid},
                        lambda: TaskRunner(backend, workers=workers, ray_address=ray_address, progress=progress,
                                           desc="sweep"), recording, "points")
    rows = []
    for i, pt in enumerate(points):
        row: dict[str, Any] = {"point": i, **{a.key: a.values[j] for a, j in zip(axes, pt, strict=True)}}
        rec = done.get(i)
        if rec is not None:
            row["status"], row["error"] = rec["status"], rec["error"]
            row.update(rec["value"] or {})
            row["wall_s"] = rec["wall_s"]
        else:  # did not validate: never ran
            row.update(status="failed", error=errors[i] or "", wall_s=0.0)
        rows.append(row)
    df = pd.DataFrame(rows)
    metric_cols = [c for c in df.columns if c not in ("point", "status", "error", *WALL_COLUMNS, *keys)]
    df = df[["point", *keys, "status", "error", *metric_cols, *WALL_COLUMNS]]
    for a in axes:  # parquet wants one type per column; a grid mixing types is kept as text
        if len({type(v) for v in a.values}) > 1:
            df[a.key] = df[a.key].map(str)
    df.attrs["resumed_points"] = done.resumed  # points taken from points.jsonl instead of run now
    return df


def comparable(df: pd.DataFrame) -> pd.DataFrame:
    """The part of a sweep table that must be identical between backends (no wall-clock columns)."""
    return df.drop(columns=[c for c in WALL_COLUMNS if c in df.columns])


def write_sweep(df: pd.DataFrame, axes: Sequence[GridAxis], out_dir: str | Path, plots: bool = True) -> Path:
    """sweep.parquet, sweep.png (one bar per point for the headline metrics), and sweep.csv last."""
    out = begin_folder(out_dir, *TABLE_FILES)
    write_parquet(df, out / "sweep.parquet")
    if plots:
        from ..plots import plot_sweep

        plot_sweep(out / "sweep.png", df, [a.key for a in axes])
    write_csv(df, out / "sweep.csv")
    return out


def format_sweep(df: pd.DataFrame, axes: Sequence[GridAxis]) -> str:
    """A compact table: grid values and the headline metrics, failed points with their error.

    Throughput and latencies count only the requests a point admitted, so a point that rejected
    some is marked ``!`` in the ``rejected`` column and named below the table: it must not pass
    for the best point.
    """
    keys = [a.key for a in axes]
    metrics = [("request_throughput", "req/s", ".2f"), ("rejected", "rejected", "d"),
               ("request_goodput", "goodput", ".2f"), ("p99_ttft_ms", "TTFT p99", ".0f"),
               ("p99_tpot_ms", "TPOT p99", ".1f"), ("p99_itl_ms", "ITL p99", ".1f"),
               ("p99_e2el_ms", "E2E p99", ".0f")]  # fmt: skip
    head = ["#", *[k.rsplit(".", 1)[-1] for k in keys], *[h for _, h, _ in metrics]]
    rows, rejecting = [], []
    for _, r in df.iterrows():
        cells = [str(r["point"]), *[str(r[k]) for k in keys]]
        if r["status"] != "ok":
            cells.append(f"{r['status'].upper()}: {r['error']}")
        else:
            for col, _, spec in metrics:
                v = r.get(col, math.nan)
                if v is None or (isinstance(v, float) and math.isnan(v)):
                    cells.append("-")
                elif col == "rejected":
                    cells.append(f"{int(v)}!" if v else "0")
                else:
                    cells.append(format(v, spec))
            if r.get("rejected"):
                rejecting.append(f"{r['point']} ({int(r['rejected'])} of {int(r['rejected'] + r['completed'])})")
        rows.append(cells)
    full = [head, *[c for c in rows if len(c) == len(head)]]  # failed rows do not set widths
    widths = [max(len(c[i]) for c in full) for i in range(len(head))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(head, widths, strict=True)), "  ".join("-" * w for w in widths)]
    for cells in rows:
        lines.append("  ".join(v.rjust(w) if len(cells) == len(head) else v
                               for v, w in zip(cells, widths, strict=False)))
    if rejecting:
        lines.append(f"! rejected requests at point{'s' if len(rejecting) > 1 else ''} {', '.join(rejecting)}: "
                     f"their throughput and latencies count only the requests they admitted")
    return "\n".join(lines)
