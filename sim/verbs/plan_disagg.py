"""``servesim plan --target-rate R`` for a disaggregated scenario: the prefill:decode split that
serves R requests/s within the SLO on the fewest GPUs.

Candidates (P prefill, D decode instances) are tried in order of GPUs (P x prefill TP + D x decode
TP), then by how balanced they are; each is simulated at the target rate with ``plan``'s settings
(seeds, window, attainment, terms) and judged like any ``plan`` point. The first GPU count with a
passing split ends the search; of its passing splits the one with the highest SLO attainment wins.
A split no larger in both pools than one that failed is skipped (more of either instance never
hurts in this model, so it would fail too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from ..metrics import to_json
from ..outputs import begin_folder, write_csv, write_text
from ..scenario import Scenario, ScenarioError
from .parallel import TaskRunner, default_workers
from .plan import PlanSettings, RatePoint, check_target_rate, evaluate_rate


@dataclass
class DisaggPlan:
    scenario: Scenario
    target_rate: float
    best: tuple[int, int] | None  # (prefill instances, decode instances)
    gpus: int | None
    points: list[tuple[int, int, int, RatePoint]] = field(default_factory=list)  # (P, D, GPUs, point)


def with_counts(sc: Scenario, prefill: int, decode: int) -> Scenario:
    """The scenario with ``prefill`` and ``decode`` instances."""
    d = sc.cluster.disagg
    disagg = d.model_copy(update={"prefill": d.prefill.model_copy(update={"count": prefill}),
                                  "decode": d.decode.model_copy(update={"count": decode})})
    return sc.model_copy(update={"cluster": sc.cluster.model_copy(update={"disagg": disagg})})


def gpus_of(sc: Scenario, prefill: int, decode: int) -> int:
    d = sc.cluster.disagg
    return (prefill * (d.prefill.tensor_parallel or sc.tensor_parallel)
            + decode * (d.decode.tensor_parallel or sc.tensor_parallel))


MAX_GPUS = 1024  # --max-gpus: a level of g GPUs holds up to g splits, each a simulation per seed


def _splits(sc: Scenario, max_gpus: int) -> list[tuple[int, int]]:
    """Every (prefill, decode) count pair of at most ``max_gpus`` GPUs (linear in the pairs kept)."""
    d = sc.cluster.disagg
    tp_p, tp_d = d.prefill.tensor_parallel or sc.tensor_parallel, d.decode.tensor_parallel or sc.tensor_parallel
    return [(p, dd) for p in range(1, (max_gpus - tp_d) // tp_p + 1)
            for dd in range(1, (max_gpus - p * tp_p) // tp_d + 1)]


def plan_disagg(sc: Scenario, st: PlanSettings, target_rate: float, max_gpus: int = 16, workers: int | None = None,
                progress: bool = True) -> DisaggPlan:
    """Fewest-GPU (prefill, decode) split of ``sc`` meeting ``st`` at ``target_rate`` requests/s."""
    if sc.cluster.disagg is None:
        raise ScenarioError("plan for a disaggregated deployment needs a cluster.disagg section")
    check_target_rate(target_rate)
    smallest, most = gpus_of(sc, 1, 1), MAX_GPUS
    if not smallest <= max_gpus <= most:
        raise ScenarioError(f"--max-gpus must be between {smallest} (one prefill and one decode instance) and {most}, "
                            f"got {max_gpus}")
    cands = sorted((gpus_of(sc, p, d), abs(p - d), p, d) for p, d in _splits(sc, max_gpus))
    result = DisaggPlan(sc, target_rate, None, None)
    failed: list[tuple[int, int]] = []
    with TaskRunner("local", workers=min(workers or default_workers(), st.seeds), progress=progress,
                    desc="plan disagg") as runner:
        level_best: tuple[float, int, int] | None = None
        level = None
        for g, _, p, d in cands:
            if level is not None and g != level and level_best is not None:
                break
            level = g
            if any(p <= fp and d <= fd for fp, fd in failed):
                continue
            point = evaluate_rate(runner, with_counts(sc, p, d), st, target_rate)
            result.points.append((p, d, g, point))
            if point.passed:
                att = point.summary.get("slo_attainment", 0.0)
                if level_best is None or att > level_best[0]:
                    level_best = (att, p, d)
            else:
                failed.append((p, d))
        if level_best is not None:
            result.best, result.gpus = (level_best[1], level_best[2]), level
    return result


def disagg_rows(result: DisaggPlan) -> pd.DataFrame:
    rows = []
    for p, d, g, point in result.points:
        row = point.row()
        rows.append({"prefill": p, "decode": d, "gpus": g, **row})
    return pd.DataFrame(rows)


def format_disagg_plan(result: DisaggPlan) -> str:
    df = disagg_rows(result)
    lines = [" P   D  GPUs  pass  attain  p99_ttft_ms  p99_tpot_ms"]
    for _, r in df.iterrows():
        lines.append(f"{r['prefill']:>2} {r['decode']:>3} {r['gpus']:>5}  {'yes' if r['passed'] else ' NO':>4}  "
                     f"{r['slo_attainment']:>6.3f}  {r['p99_ttft_ms']:>11.1f}  {r['p99_tpot_ms']:>11.1f}")
    if result.best is None:
        lines.append(f"no prefill:decode split up to the GPU limit serves {result.target_rate:g} req/s within the SLO")
    else:
        p, d = result.best
        lines.append(f"fewest GPUs for {result.target_rate:g} req/s: {p} prefill + {d} decode instances "
                     f"({result.gpus} GPUs, prefill:decode {p}:{d})")
    return "\n".join(lines)


def write_disagg_plan(result: DisaggPlan, out_dir: str | Path) -> Path:
    """plan_disagg.csv (every split tried), then plan_disagg.json (the answer), each atomically."""
    out = begin_folder(out_dir, "plan_disagg.json")
    df = disagg_rows(result)
    write_csv(df, out / "plan_disagg.csv")
    summary: dict[str, Any] = {"target_rate": result.target_rate, "gpus": result.gpus,
                               "prefill": result.best[0] if result.best else None,
                               "decode": result.best[1] if result.best else None,
                               "points": df.drop(columns=["error"], errors="ignore").to_dict("records")}
    write_text(out / "plan_disagg.json", to_json(summary))
    return out
