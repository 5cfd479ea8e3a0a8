"""What ``servesim search`` prints and writes: the table, the answer, the Pareto plot, winner.yaml.

Columns of ``search.parquet`` / ``search.csv`` (one row per point, in space order):
``point``, the ``--space`` keys, ``status`` (best / best-so-far / feasible / pruned / infeasible /
unfinished), ``reason``, ``hardware``, ``tensor_parallel``, ``price_per_gpu_hour``,
``replica_cost_per_hour`` (tensor_parallel x price), ``upper_bound_rps`` (the saturation bound of
one replica), ``replicas`` (smallest count that passed; for a pruned or unfinished point only the
smallest passing count tested), ``failed_replicas`` (largest count that failed), the capacity of
one replica bracketed as ``capacity_lo_rps`` = target / replicas (passes) and ``capacity_hi_rps``
= target / failed_replicas (fails), ``cost_per_hour`` (replicas x replica cost), ``rps_per_dollar``
(target / cost per hour: requests per second bought per $/hour), the pooled latencies at the
chosen count, ``sims`` (simulations the point ran) and ``tested_replicas``. Nothing in a row
depends on the backend or on timing; ``search.json`` holds the settings, counts and wall time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from ..metrics import to_json
from ..outputs import begin_folder, write_csv, write_parquet, write_text
from ..scenario import scenario_to_yaml
from .plan import SESSION_RATES_NOTE, at_rate
from .search import SearchResult
from .search_space import Point
from .slo import describe

LATENCY_KEYS = ("p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms", "slo_attainment")


def point_row(p: Point, keys: Sequence[str], target: float, prices: dict[str, float]) -> dict[str, Any]:
    sc = p.scenario
    row: dict[str, Any] = {"point": p.index, **{k: p.values[k] for k in keys}, "status": p.status, "reason": p.reason,
                           "hardware": sc.hardware if sc else None, "tensor_parallel": sc.tensor_parallel if sc else None,
                           "price_per_gpu_hour": prices.get(sc.hardware, math.nan) if sc else math.nan,
                           "replica_cost_per_hour": p.replica_cost, "upper_bound_rps": p.upper_bound_rps,
                           "replicas": p.replicas, "failed_replicas": p.failed_replicas if p.tested else None}
    row["capacity_lo_rps"] = target / p.replicas if p.replicas else math.nan
    row["capacity_hi_rps"] = target / p.failed_replicas if p.tested and p.failed_replicas else math.nan
    row["cost_per_hour"] = p.cost
    row["rps_per_dollar"] = target / p.cost if p.replicas else math.nan
    chosen = p.tested.get(p.replicas) if p.replicas else None
    for k in LATENCY_KEYS:
        row[k] = chosen.summary.get(k, math.nan) if chosen and chosen.summary else math.nan
    row["sims"] = p.sims
    row["tested_replicas"] = ",".join(str(n) for n in sorted(p.tested))
    return row


def search_frame(result: SearchResult) -> pd.DataFrame:
    keys = [a.key for a in result.axes]
    df = pd.DataFrame([point_row(p, keys, result.settings.target_rate, result.settings.prices) for p in result.points])
    for c in ("replicas", "failed_replicas"):
        df[c] = df[c].astype("Int64")
    for a in result.axes:  # parquet wants one type per column
        if len({type(v) for v in a.values}) > 1:
            df[a.key] = df[a.key].map(str)
    return df


def counts(result: SearchResult) -> dict[str, int]:
    out = {s: 0 for s in ("best", "best-so-far", "feasible", "pruned", "infeasible", "unfinished")}
    for p in result.points:
        out[p.status] += 1
    return out


def _label(p: Point) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in p.values.items())


def closest_miss(result: SearchResult) -> str:
    """The point that came nearest to passing, for the no-answer message."""
    tried = [p for p in result.points if p.tested]
    if tried:
        def score(p: Point) -> float:
            rp = p.tested[max(p.tested)]
            return min((r.value for r in rp.results if r.term.stat != "mean"), default=0.0) if rp.results else -1.0

        p = max(tried, key=lambda q: (score(q), -q.index))
        rp = p.tested[max(p.tested)]
        worst = [f"{r.term.key} met by {r.value:.1%}" for r in rp.results if not r.passed]
        return (f"closest miss: point {p.index} ({_label(p)}) at {rp.rate:.3g} req/s per replica "
                f"({max(p.tested)} replicas): {'; '.join(worst) or p.reason}")
    sized = [p for p in result.points if p.scenario is not None]
    if not sized:
        return f"closest miss: none (first point: {result.points[0].reason})"
    from ..presets import get_hardware

    p = max(sized, key=lambda q: (q.scenario.tensor_parallel * get_hardware(q.scenario.hardware).memory_bytes, -q.index))
    return f"closest miss: point {p.index} ({_label(p)}): {p.reason}"


def format_search(result: SearchResult, top: int = 10) -> str:
    st, ss = result.settings.plan, result.settings
    df = search_frame(result)
    lines = [f"target {ss.target_rate:g} req/s | SLO: {describe(st.terms, st.attainment)} | {st.seeds} seed(s), "
             f"arrival window >= {st.base_window_s:.0f} s"]
    ok = df[df["replicas"].notna() & df["status"].isin(["best", "best-so-far", "feasible"])]
    ok = ok.sort_values(["cost_per_hour", "point"]).head(top)
    keys = [a.key for a in result.axes]
    cols = [("point", "#", "d"), *[(k, k.rsplit(".", 1)[-1], "") for k in keys], ("replicas", "repl", "d"),
            ("cost_per_hour", "$/hour", ".2f"), ("capacity_lo_rps", "cap/repl", ".3g"),
            ("p99_ttft_ms", "TTFT p99", ".0f"), ("p99_tpot_ms", "TPOT p99", ".1f"), ("status", "", "")]
    if len(ok):
        table = [[h for _, h, _ in cols]]
        for _, r in ok.iterrows():
            table.append(["-" if pd.isna(r[c]) else format(r[c], f) if f else str(r[c]) for c, _, f in cols])
        widths = [max(len(x[i]) for x in table) for i in range(len(cols))]
        for i, r in enumerate(table):
            lines.append("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
    n = counts(result)
    lines.append(f"{len(result.points)} points: {n['best'] + n['best-so-far'] + n['feasible']} sized, {n['pruned']} pruned, "
                 f"{n['infeasible']} infeasible, {n['unfinished']} unfinished | {result.sims_run} simulations run, "
                 f"{result.sims_reused} reused | {result.wall_s:.0f} s on {result.backend}")
    b = result.best
    if b is None:
        lines.append("no deployment meets the SLO at the target rate; " + closest_miss(result))
    else:
        tag = "" if result.complete else " (BEST SO FAR: --budget-s stopped the search before every point was decided)"
        lines.append(f"cheapest: {_label(b)} x {b.replicas} replicas = ${b.cost:.2f}/hour "
                     f"({b.replicas * b.scenario.tensor_parallel} GPUs, {ss.target_rate / b.replicas:.3g} req/s "
                     f"per replica){tag}")
    if result.base.workload.sessions is not None:
        lines.append(SESSION_RATES_NOTE)
    return "\n".join(lines)


def winner_scenario(result: SearchResult):  # noqa: ANN201 - Scenario
    """The best point as a runnable scenario: its replicas at the target rate, the search's window."""
    b, ss = result.best, result.settings
    window = ss.plan.window_at(ss.target_rate / b.replicas)
    sc = at_rate(b.scenario, ss.target_rate, window, b.scenario.seed, b.replicas)
    return sc.model_copy(update={"name": f"{b.scenario.name}-search-winner"})


def write_search(result: SearchResult, out_dir: str | Path, plots: bool = True) -> Path:
    """search.parquet, search.csv, winner.yaml (when there is a best), pareto.png, then search.json:
    each file written atomically and search.json last, so a folder holding it is complete."""
    out = begin_folder(out_dir, "search.json")
    df = search_frame(result)
    write_parquet(df, out / "search.parquet")
    write_csv(df, out / "search.csv")
    ss, st = result.settings, result.settings.plan
    b = result.best
    summary = {"scenario": result.base.name, "target_rate": ss.target_rate, "slo": [str(t) for t in st.terms],
               "attainment": st.attainment, "seeds": st.seeds, "window_s": st.base_window_s,
               "space": {a.key: list(a.values) for a in result.axes}, "prices": ss.prices,
               "complete": result.complete, "counts": counts(result), "simulations_run": result.sims_run,
               "simulations_reused": result.sims_reused, "wall_s": result.wall_s, "backend": result.backend,
               "best": None if b is None else {"point": b.index, **b.values, "replicas": b.replicas,
                                               "cost_per_hour": b.cost, "best_so_far": not result.complete}}
    (out / "winner.yaml").unlink(missing_ok=True)
    if b is not None:
        write_text(out / "winner.yaml", scenario_to_yaml(winner_scenario(result)))
    if plots:
        plot_pareto(out / "pareto.png", df, ss.target_rate, b.index if b else None)
    write_text(out / "search.json", to_json(summary))
    return out


def plot_pareto(path: Path, df: pd.DataFrame, target: float, best: int | None) -> Path:
    """Capacity of one replica against its $/hour, one colour per hardware: filled markers at the
    capacity a point was sized at exactly (target / replicas), hollow ones at the upper bound of a
    point pruned before that (its saturation bound, or target / the most replicas that failed); the frontier (nothing both cheaper and more capable) as a line and
    the chosen deployment starred."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 5))
    ax = fig.add_subplot()
    priced = df[df["replica_cost_per_hour"].notna() & df["status"].ne("infeasible")]
    upper = priced["upper_bound_rps"].where(priced["capacity_hi_rps"].isna(),
                                            priced[["upper_bound_rps", "capacity_hi_rps"]].min(axis=1))
    colours = {hw: f"C{i}" for i, hw in enumerate(sorted(priced["hardware"].unique()))}
    exact = priced["status"].isin(["best", "best-so-far", "feasible"])
    for hw, g in priced.groupby("hardware", sort=True):
        sized = g[exact[g.index]]
        tps = ", ".join(str(t) for t in sorted(g["tensor_parallel"].unique()))
        ax.scatter(sized["replica_cost_per_hour"], sized["capacity_lo_rps"], color=colours[hw], s=40,
                   label=f"{hw} (TP {tps})")
        rest = g[~exact[g.index]]
        ax.scatter(rest["replica_cost_per_hour"], upper[rest.index], facecolor="none", edgecolor=colours[hw], s=40)
    sized = priced[exact].sort_values(["replica_cost_per_hour", "capacity_lo_rps"],
                                                           ascending=[True, False])
    xs, ys, top = [], [], -math.inf
    for _, r in sized.iterrows():
        if r["capacity_lo_rps"] > top:
            top = r["capacity_lo_rps"]
            xs.append(r["replica_cost_per_hour"])
            ys.append(top)
    if xs:
        ax.step(xs, ys, where="post", color="grey", lw=1, label="frontier of sized points")
    ax.scatter([], [], facecolor="none", edgecolor="grey", label="pruned: capacity upper bound")
    if best is not None:
        r = df[df["point"] == best].iloc[0]
        ax.scatter([r["replica_cost_per_hour"]], [r["capacity_lo_rps"]], marker="*", s=360, facecolor="none",
                   edgecolor="red", lw=1.5,
                   label=f"cheapest: {int(r['replicas'])} x {r['hardware']} TP {r['tensor_parallel']}, "
                         f"\\${r['cost_per_hour']:.2f}/h")
        # a replica beats the winner only above this line (ignoring the rounding up of replicas)
        xmax = float(priced["replica_cost_per_hour"].max()) * 1.05
        ax.plot([0, xmax], [0, target * xmax / r["cost_per_hour"]], ls="--", lw=0.8, color="red", alpha=0.6,
                label="same total \\$/h as the cheapest")
    ax.set_xlabel("\\$ / hour of one replica (tensor_parallel x \\$ / GPU-hour)")
    ax.set_ylabel(f"SLO capacity of one replica (req/s; target {target:g} / replicas)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"deployment search: one replica's capacity vs its price (target {target:g} req/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path
