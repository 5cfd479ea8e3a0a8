"""``servesim validate``: run a scenario live, simulate the identical workload, report the errors.

The workload is drawn once (with prompt token ids, which live mode needs; they come from their
own seeded stream, so arrivals and lengths are those of the scenario) and the same ``Request``
objects go through both sides: first ``run_live`` on the real model, then ``simulate`` after a
``reset_progress``. The simulated side gets the live run's KV cache exactly: ``kv_cache.num_blocks``
is set to the live run's device block count and ``swap_space_gb`` to the size that leaves the
same number of host (swap) blocks. Its cost model is ``--profile`` (``type: profile``) when given,
else the scenario's own ``cost_model``. Arrivals, lengths and block counts are checked equal on
both sides; a difference is a servesim bug and raises.

Each reported metric gets a relative error ``(sim - live) / live`` in percent. Outputs, in the
run folder: ``validation.json`` (provenance, thresholds, rows), ``validation.csv``,
``validation.md``, the overlaid live-vs-sim CDFs ``cdf_ttft.png``, ``cdf_tpot.png``,
``cdf_itl.png``, ``cdf_e2e.png``, and the two run folders ``live/`` and ``sim/``.

``replay_steps`` adds the dynamics check of ``calibration/replay.py``: the live run's own step
durations replayed into a third run of the same requests (folder ``replay/``), which must
reproduce every request's TTFT and E2E; where it does not, the first divergence is a failure.
"""

from __future__ import annotations

import datetime as dt
import difflib
import math
import os
import re
import statistics
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from servesim.calibration.replay import (
    DynamicsCheck,
    StepTrace,
    check_dynamics,
    divergence_line,
    format_dynamics,
)
from servesim.sim.cost_model import CostModelConfig, build_cost_model, resolve_profile_path
from servesim.sim.metrics import to_json
from servesim.sim.presets import get_model, kv_block_bytes
from servesim.sim.request import Request, RequestState
from servesim.sim.scenario import Scenario, ScenarioError
from servesim.sim.sessions import later_turns
from servesim.sim.simulate import GIB, KVPlan, RunResult, plan_kv, simulate, write_results
from servesim.sim.workload import generate_requests

# metric family (as written on the command line) -> its name in summary keys
FAMILIES = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2el"}
STATS = ("mean", "median", "p90", "p99")  # median is p50
FAMILY_STATS = ("median", "p90")  # what a bare family threshold (tpot=3) checks
THROUGHPUTS = {"request_throughput": "req/s", "output_throughput": "tok/s"}
METRICS: tuple[str, ...] = (
    *(f"{s}_{f}_ms" for f in FAMILIES.values() for s in STATS),
    *THROUGHPUTS,
)
TABLE_COLUMNS = ("metric", "unit", "live", "sim", "error_pct", "max_error_pct", "status")
CDF_METRICS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2e": "e2e"}  # file suffix -> column
_ITEM = re.compile(r"^(?P<key>[a-z0-9_]+)=(?P<pct>[0-9.eE+]+|nan|inf)%?$")

MAX_REPEATS = 100  # live runs one validate may repeat (each takes minutes)


# ---- thresholds ---------------------------------------------------------------------------------
def canonical_metric(key: str) -> str:
    """A metric key as the summary spells it: ``p50_`` -> ``median_``, ``_e2e_ms`` -> ``_e2el_ms``."""
    if key.startswith("p50_"):
        key = "median_" + key[len("p50_"):]
    if key.endswith("_e2e_ms"):
        key = key[: -len("_e2e_ms")] + "_e2el_ms"
    return key


def parse_max_error(items: Sequence[str]) -> dict[str, float]:
    """``--max-error`` values (each comma-separated ``KEY=PCT``) -> {summary key: max |error| in %}.

    KEY is a full metric key (``p90_ttft_ms``, ``p50_tpot_ms``, ``request_throughput``) or a family
    (``ttft``, ``tpot``, ``itl``, ``e2e``), which sets the threshold of its p50 and p90. A full key
    wins over a family whatever the order. Raises ``ScenarioError`` (one line) on bad syntax, an
    unknown key, or a key or family given twice (the last would have won without a word).
    """
    families: dict[str, float] = {}
    keys: dict[str, float] = {}
    for text in items:
        for raw in text.split(","):
            item = raw.strip().replace(" ", "")
            if not item:
                continue
            m = _ITEM.match(item)
            if m is None:
                raise ScenarioError(f"--max-error {item!r}: expected KEY=PCT, e.g. p90_ttft_ms=8 or tpot=3 "
                                    "(a family: its p50 and p90)")
            key = m.group("key")
            try:
                pct = float(m.group("pct"))
            except ValueError:
                raise ScenarioError(f"--max-error {item!r}: expected KEY=PCT, e.g. p90_ttft_ms=8 or tpot=3 "
                                    "(a family: its p50 and p90)") from None
            if not math.isfinite(pct):
                raise ScenarioError(f"--max-error {item!r}: the threshold must be a finite number of percent")
            if key in FAMILIES:
                if f"{FAMILY_STATS[0]}_{FAMILIES[key]}_ms" in families:
                    raise ScenarioError(f"--max-error {item!r}: {key} has a threshold already; give each metric one")
                for stat in FAMILY_STATS:
                    families[f"{stat}_{FAMILIES[key]}_ms"] = pct
                continue
            metric = canonical_metric(key)
            if metric not in METRICS:
                close = difflib.get_close_matches(metric, [*METRICS, *FAMILIES], n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ScenarioError(f"--max-error {item!r}: unknown metric '{key}'{hint}; use a family "
                                    f"({', '.join(FAMILIES)}) or a key such as p90_ttft_ms, mean_itl_ms, "
                                    "request_throughput")
            if metric in keys:
                raise ScenarioError(f"--max-error {item!r}: {metric} has a threshold already; give each metric one")
            keys[metric] = pct
    merged = {**families, **keys}
    return {k: merged[k] for k in METRICS if k in merged}


# ---- the error table ----------------------------------------------------------------------------
def relative_error_pct(live: float, sim: float) -> float:
    """``(sim - live) / live`` in percent; nan when either is undefined or live is zero."""
    if live is None or sim is None:
        return math.nan
    live, sim = float(live), float(sim)
    if not (math.isfinite(live) and math.isfinite(sim)) or live == 0.0:
        return math.nan
    return (sim - live) / live * 100.0


def error_table(live: Mapping[str, Any], sim: Mapping[str, Any],
                thresholds: Mapping[str, float] | None = None) -> pd.DataFrame:
    """One row per metric in METRICS: live and sim values, error in %, its threshold and verdict.

    ``status`` is "FAIL" when a threshold is set and |error| exceeds it or the error is undefined
    (nan), "ok" when it is within, and "" when the metric has no threshold.
    """
    thresholds = thresholds or {}
    rows = []
    for metric in METRICS:
        lv, sv = live.get(metric, math.nan), sim.get(metric, math.nan)
        err = relative_error_pct(lv, sv)
        limit = thresholds.get(metric)
        status = "" if limit is None else ("FAIL" if math.isnan(err) or abs(err) > limit else "ok")
        rows.append({
            "metric": metric, "unit": THROUGHPUTS.get(metric, "ms"),
            "live": math.nan if lv is None else float(lv), "sim": math.nan if sv is None else float(sv),
            "error_pct": err, "max_error_pct": math.nan if limit is None else float(limit), "status": status,
        })  # fmt: skip
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def median_summary(summaries: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each metric's median over several runs' summaries (the one summary when there is one)."""
    out: dict[str, float] = {}
    for m in METRICS:
        values = [float(x) for x in (s.get(m) for s in summaries) if x is not None and not math.isnan(float(x))]
        out[m] = statistics.median(values) if values else math.nan
    return out


def spread_pct(values: Sequence[float]) -> float:
    """100 * (max - min) / median of the finite values; nan with fewer than two or a zero median."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    if len(v) < 2 or statistics.median(v) == 0:
        return math.nan
    return 100 * (max(v) - min(v)) / statistics.median(v)


def failures(table: pd.DataFrame) -> list[str]:
    """One line per failing metric: ``p90_tpot_ms: error +12.3% exceeds 3%``."""
    out = []
    for r in table[table["status"] == "FAIL"].itertuples():
        err = "undefined" if math.isnan(r.error_pct) else f"{r.error_pct:+.2f}%"
        out.append(f"{r.metric}: error {err} exceeds {r.max_error_pct:g}% (live {_num(r.live)}, sim {_num(r.sim)})")
    return out


def _num(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.2f}"


def _pct(x: float, signed: bool = True) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:+.2f}" if signed else f"{x:g}"


def _cells(table: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    head = ["metric", "unit", "live", "sim", "error %", "max %", "result"]
    body = [[r.metric, r.unit, _num(r.live), _num(r.sim), _pct(r.error_pct), _pct(r.max_error_pct, False), r.status]
            for r in table.itertuples()]
    if "live_spread_pct" in table.columns:  # repeated live runs: their range, the measurement's noise floor
        head.append("live spread %")
        for row, spread in zip(body, table["live_spread_pct"], strict=True):
            row.append(_pct(spread, False))
    for col, title in table.attrs.get("extra_columns", {}).items():  # e.g. another simulator's error, same run
        head.append(title)
        for row, value in zip(body, table[col], strict=True):
            row.append(_pct(value))
    return [table.attrs.get("labels", {}).get(h, h) for h in head], body


def format_table(table: pd.DataFrame) -> str:
    """The error table as aligned text (metric and unit left-aligned, numbers right-aligned)."""
    head, body = _cells(table)
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    return "\n".join(line(r).rstrip() for r in [head, *body])


def format_markdown(table: pd.DataFrame) -> str:
    head, body = _cells(table)
    align = ["---", "---", *["---:"] * 4, "---", *["---:"] * (len(head) - 7)]  # + live spread
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(c or " " for c in row) + " |" for row in body]
    return "\n".join(lines)


# ---- the two runs -------------------------------------------------------------------------------
def validation_requests(sc: Scenario) -> list[Request]:
    """The scenario's workload with prompt token ids (live mode needs them; lengths are unchanged;
    multi-turn sessions get theirs from the live run, turn by turn)."""
    wl = sc.workload
    if not wl.token_ids and wl.sessions is None:
        wl = wl.model_copy(update={"token_ids": True, "vocab_size": get_model(sc.model).vocab_size})
    return generate_requests(wl, sc.seed)


def sim_scenario(sc: Scenario, profile: str | Path | None, kv: KVPlan | None = None) -> Scenario:
    """The simulated side: ``--profile`` as its cost model, and the KV cache of the live run ``kv``."""
    cost = CostModelConfig(type="profile", path=str(profile)) if profile else sc.cost_model
    kvc = sc.kv_cache
    if kv is not None:
        sim_bb = kv_block_bytes(get_model(sc.model), sc.tensor_parallel, kv.block_size)
        # plan_kv floors swap_space_gb * GIB / block_bytes; half a block of slack makes the floor exact
        swap_gb = (kv.num_host_blocks + 0.5) * sim_bb / GIB if kv.num_host_blocks else 0.0
        kvc = kvc.model_copy(update={"num_blocks": kv.num_blocks, "block_size": kv.block_size,
                                     "swap_space_gb": swap_gb})
    return sc.model_copy(update={"cost_model": cost, "kv_cache": kvc})


def _signature(requests: Sequence[Request]) -> list[tuple]:
    later = later_turns(requests)
    return [(r.request_id, None if r.request_id in later else r.arrival_time, r.prompt_len, r.output_len,
             r.prefix_id, r.prefix_len, r.priority,
             () if r.session_id >= 0 else tuple(r.prompt_token_ids or ())) for r in requests]


def _check_clean(requests: Sequence[Request]) -> None:
    for r in requests:
        if (r.state != RequestState.WAITING or r.num_computed_tokens or r.num_output_tokens or r.output_token_ids
                or r.num_prompt_tokens != r.prompt_len or not math.isnan(r.first_token_time)):
            raise RuntimeError(f"validate: request {r.request_id} carries progress into the simulation (a servesim bug)")


def check_same_workload(live: RunResult, sim: RunResult, later: set[int] | frozenset[int] = frozenset()) -> None:
    """Both sides saw the same arrivals, lengths and KV blocks; anything else is a servesim bug.
    ``later``: session turns whose arrival follows the run (their lengths must still agree)."""
    cols = ["request_id", "arrival_time", "prompt_len", "output_len"]
    a, b = live.requests_df[cols].reset_index(drop=True), sim.requests_df[cols].reset_index(drop=True)
    if later:
        for df in (a, b):
            df.loc[df["request_id"].isin(later), "arrival_time"] = 0.0
    if not a.equals(b):
        raise RuntimeError("validate: live and simulated runs saw different arrivals or lengths (a servesim bug)")
    if (live.kv.num_blocks, live.kv.num_host_blocks, live.kv.block_size) != (
            sim.kv.num_blocks, sim.kv.num_host_blocks, sim.kv.block_size):
        raise RuntimeError(f"validate: KV caches differ: live {live.kv}, sim {sim.kv} (a servesim bug)")


def step_check(live: RunResult, cost_model: Any) -> dict[str, dict[str, float]]:
    """The cost model against every live step's own shape: per regime, steps, measured and predicted
    seconds in total, and their ratio - 1 (the cost model's bias on exactly the steps live ran).

    This separates the two ways a simulation can miss: a wrong step cost shows here; a right step
    cost with different dynamics (other batches formed, a queue that tipped) does not. When the
    live run recorded its executor's own seconds, two more entries split "all" into ``forward``
    (the executor: input preparation and the model) and ``engine_loop`` (the rest of the step:
    scheduling, metrics, the event loop), against the cost model's ``loop_overhead``.
    """
    from servesim.sim.cost_model import classify_step

    shapes = live.step_shapes
    durations = live.iterations_df["duration"].to_numpy()
    if shapes is None or len(shapes) != len(durations):
        return {}
    forward = live.step_forward_s
    loop_model = getattr(cost_model, "loop_overhead", None)
    split = forward is not None and len(forward) == len(durations) and loop_model is not None
    acc: dict[str, list[float]] = {}

    def add(key: str, measured: float, predicted: float) -> None:
        a = acc.setdefault(key, [0, 0.0, 0.0])
        a[0] += 1
        a[1] += measured
        a[2] += predicted

    for i, ((q, ctx), d) in enumerate(zip(shapes, durations, strict=True)):
        regime = classify_step(q)
        if regime == "empty":
            continue
        p = float(cost_model.iteration_time(q, ctx))
        add(regime, float(d), p)
        add("all", float(d), p)
        if split:
            loop_p = float(loop_model(len(q)))
            add("forward", float(forward[i]), p - loop_p)
            add("engine_loop", float(d) - float(forward[i]), loop_p)
    return {k: {"steps": int(n), "measured_s": m, "predicted_s": p,
                "bias_pct": 100 * (p / m - 1) if m > 0 else math.nan}
            for k, (n, m, p) in acc.items()}


def host_share(live: RunResult) -> dict[str, float] | None:
    """The host's part of the live executor's time: input preparation and kernel launches, up to
    the moment the forward was launched (``iterations.parquet``'s ``host_s`` against ``forward_s``).

    On a GPU a share near 1 is a host-bound engine (the device waits for launches); on a CPU the
    forward runs as it is launched, so the share is ~1 by construction. None without the columns.
    """
    it = live.iterations_df
    if "host_s" not in it or "forward_s" not in it or not len(it):
        return None
    ratio = (it["host_s"] / it["forward_s"].where(it["forward_s"] > 0)).dropna()
    share = {"total": float(it["host_s"].sum() / it["forward_s"].sum()), "median_step": float(ratio.median()),
             "steps": int(len(ratio))}
    if "graphed" in it:  # live.cuda_graphs: how many steps replayed a graph
        share["graphed_steps"], share["all_steps"] = int(it["graphed"].sum()), len(it)
    return share


def format_host_share(share: Mapping[str, float] | None) -> str:
    if not share:
        return "live executor, host part: not recorded"
    return (f"live executor, host part (inputs + launches, before any wait for the device): "
            f"{100 * share['total']:.0f} % of its time, median step {100 * share['median_step']:.0f} % "
            f"(near 100 % on a GPU: host-bound)"
            + (f"; {share['graphed_steps']} of {share['all_steps']} steps ran a CUDA-graph path (replayed on a GPU, "
               "eager on a CPU)"
               if "graphed_steps" in share else ""))


def format_step_check(check: Mapping[str, Mapping[str, float]]) -> str:
    if not check:
        return "step check: not available (more than one replica)"
    def runs(v: Mapping[str, Any]) -> str:
        by_run = v.get("bias_pct_by_run")
        return f" (live runs: {', '.join(f'{b:+.1f}' for b in by_run)} %)" if by_run else ""

    parts = [f"{k} {v['bias_pct']:+.1f} % over {v['steps']} steps{runs(v)}" for k, v in check.items()]
    return "step check, cost model vs the live steps' own shapes (predicted / measured - 1): " + "; ".join(parts)


def servesim_commit() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the servesim checkout this module runs from; (None, None) if not a checkout.

    A working tree copied elsewhere (to a remote GPU machine, with no ``.git`` or a stale one) names
    its commit in ``SERVESIM_COMMIT``: when set it is taken as is, with dirty unknown (None).
    """
    here = Path(__file__).resolve()
    named = os.environ.get("SERVESIM_COMMIT")
    if named:
        return named, None

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(here.parent), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        top = Path(git("rev-parse", "--show-toplevel")).resolve()
        if top / "calibration" / "validate.py" != here:  # an installed copy inside some other repository
            return None, None
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, None


@dataclass
class ValidationResult:
    table: pd.DataFrame
    provenance: dict[str, Any]
    thresholds: dict[str, float]
    live: RunResult
    sim: RunResult
    out: Path
    failed: list[str] = field(default_factory=list)
    step_check: dict[str, dict[str, float]] = field(default_factory=dict)
    dynamics: DynamicsCheck | None = None  # --replay-steps
    host_share: dict[str, float] | None = None  # of the first live run (see host_share)

    @property
    def passed(self) -> bool:
        return not self.failed


def graphs_mismatch(cost_model: object, live_graphs: bool, live_piecewise: bool = False) -> str | None:
    """A line saying the measured profile was calibrated with CUDA graphs (decode: ``cuda_graphs``;
    prefill and mixed: ``piecewise_graphs``) set otherwise than the live run (its steps then differ
    by up to 5x on a GPU); None when they agree or the cost model is no ``servesim calibrate`` profile."""
    provenance = getattr(cost_model, "provenance", None)
    if not provenance or "backend" not in provenance:  # roofline, imported GPU profile
        return None
    for key, flag, live, steps in (("cuda_graphs", "--cuda-graphs", live_graphs, "decode"),
                                   ("piecewise_graphs", "--piecewise-graphs", live_piecewise, "prefill and mixed")):
        measured = bool(provenance.get(key, False))
        if measured != live:
            return (f"the profile was calibrated with {key} {'on' if measured else 'off'} (calibrate "
                    f"{flag if measured else 'without ' + flag}) but live.{key} is {str(live).lower()}: "
                    f"its {steps} steps price another engine")
    return None


def validate(
    sc: Scenario,
    out_dir: str | Path,
    profile: str | Path | None = None,
    max_error: Sequence[str] = (),
    source: str | None = None,
    overrides: Sequence[str] = (),
    progress: bool | None = None,
    plots: bool = True,
    log: Callable[[str], None] | None = print,
    repeats: int = 1,
    replay_steps: bool = False,
) -> ValidationResult:
    """Run ``sc`` live, simulate the identical workload, write the run folder; see the module docstring.

    ``repeats`` > 1 runs the live side that many times on the same requests: the table's live
    column is then each metric's median over the runs and ``live_spread_pct`` its range
    (max - min) / median, the noise floor any simulation error should be read against.
    ``replay_steps`` replays the live run's steps into the simulation (the dynamics check).
    """
    if not 1 <= repeats <= MAX_REPEATS:  # (10**9 was accepted and ran until killed)
        raise ScenarioError(f"--repeats must be between 1 and {MAX_REPEATS}, got {repeats}")
    if replay_steps and repeats > 1:
        raise ScenarioError(f"--replay-steps replays one live run, its own steps; drop --repeats {repeats}")
    if replay_steps and sc.cluster.num_replicas > 1:
        raise ScenarioError(f"--replay-steps replays one replica's steps; cluster.num_replicas is "
                            f"{sc.cluster.num_replicas} (use --set cluster.num_replicas=1)")
    thresholds = parse_max_error(max_error)  # bad syntax fails before the minute-long live run
    template = sim_scenario(sc, profile)
    # built now so a missing or bad profile fails before the live run; the step check reuses it
    cost_model = build_cost_model(template.cost_model, get_model(sc.model), template.cost_hardware(),
                                  sc.tensor_parallel, template.kv_cache.block_size)
    try:
        from servesim.kernels.live import run_live
    except ImportError as e:  # torch is an optional extra
        raise ScenarioError(f"validate needs the kernels extra (pip install -e '.[kernels]'): {e}") from None
    say = log or (lambda _msg: None)
    out = Path(out_dir)
    phases = 3 if replay_steps else 2
    # on a CPU the padded decode path costs what the plain one does: only a GPU run can mismatch
    mismatch = (graphs_mismatch(cost_model, sc.live.cuda_graphs, sc.live.piecewise_graphs)
                if sc.live.device == "cuda" else None)
    if mismatch:
        say(f"servesim validate: note: {mismatch}")

    requests = validation_requests(sc)
    before = _signature(requests)
    span = max((r.arrival_time for r in requests), default=0.0)
    lives: list[RunResult] = []
    for k in range(repeats):
        which = f" (run {k + 1} of {repeats})" if repeats > 1 else ""
        say(f"[1/{phases}] live{which}: {len(requests)} requests on {sc.model} ({sc.live.backend} on "
            f"{sc.live.device}, arrivals over {span:.1f} s) ...")
        lives.append(run_live(sc, requests, progress=progress))  # run_live resets the requests' progress
        write_results(lives[-1], out / ("live" if k == 0 else f"live-{k + 1}"), plots=plots)
        say(f"      live done in {lives[-1].wall_s:.1f} s wall; {lives[-1].kv.num_blocks} KV blocks "
            f"(+{lives[-1].kv.num_host_blocks} host)")
    live = lives[0]

    sc_sim = sim_scenario(sc, profile, live.kv)
    planned = plan_kv(sc_sim)
    if (planned.num_blocks, planned.num_host_blocks) != (live.kv.num_blocks, live.kv.num_host_blocks):
        raise RuntimeError(f"validate: the simulated KV plan {planned} does not match live {live.kv} (a servesim bug)")
    for r in requests:
        r.reset_progress()
    _check_clean(requests)
    if _signature(requests) != before:
        raise RuntimeError("validate: the live run changed the workload's requests (a servesim bug)")
    say(f"[2/{phases}] sim: the same {len(requests)} requests, cost model {sc_sim.cost_model.type}"
        f"{f' ({profile})' if profile else ''} ...")
    sim = simulate(sc_sim, requests=requests, progress=progress)
    check_same_workload(live, sim, later_turns(requests))
    write_results(sim, out / "sim", plots=plots)
    dynamics = None
    if replay_steps:
        say(f"[3/3] replay: the same {len(requests)} requests, each of the live run's {len(live.iterations_df)} "
            "steps taking its measured duration ...")
        dynamics = check_dynamics(sc_sim, requests, StepTrace.of_run(live), live.requests_df)
        if dynamics.run is not None:
            write_results(dynamics.run, out / "replay", plots=False)

    live_summary = median_summary([lv.summary for lv in lives])
    table = error_table(live_summary, sim.summary, thresholds)
    if repeats > 1:
        table["live_spread_pct"] = [spread_pct([lv.summary.get(m, math.nan) for lv in lives]) for m in METRICS]
    checks = [step_check(lv, cost_model) for lv in lives]
    steps = checks[0]
    if repeats > 1 and all(checks):
        steps = {k: {**v, "bias_pct_by_run": [c[k]["bias_pct"] for c in checks if k in c]} for k, v in steps.items()}
    commit, dirty = servesim_commit()
    provenance = {
        "scenario": sc.name,
        "scenario_file": source,
        "overrides": list(overrides),
        "seed": sc.seed,
        "num_requests": len(requests),
        "model": sc.model,
        "scheduler": sc.scheduler_name,
        "live_backend": sc.live.backend,
        "live_device": sc.live.device,
        "live_dtype": sc.live.dtype,
        "sim_cost_model": sc_sim.cost_model.type,
        "profile": str(resolve_profile_path(profile)) if profile else None,
        "kv_num_blocks": live.kv.num_blocks,
        "kv_num_host_blocks": live.kv.num_host_blocks,
        "kv_block_size": live.kv.block_size,
        "live_wall_s": live.wall_s,
        "live_repeats": repeats,
        "sim_wall_s": sim.wall_s,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "servesim_commit": commit,
        "servesim_dirty": dirty,
    }
    failed = failures(table)
    if dynamics is not None and not dynamics.passed:
        failed.append(divergence_line(dynamics))
    result = ValidationResult(table, provenance, thresholds, live, sim, out, failed, steps, dynamics,
                              host_share=host_share(live))
    write_validation(result, plots=plots)
    return result


def write_validation(result: ValidationResult, plots: bool = True) -> Path:
    """validation.json / .csv / .md and the CDF overlays into ``result.out``."""
    out = result.out
    out.mkdir(parents=True, exist_ok=True)
    t = result.table
    t.to_csv(out / "validation.csv", index=False)
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
            for r in t.to_dict(orient="records")]
    (out / "validation.json").write_text(to_json({
        "provenance": result.provenance,
        "max_error_pct": result.thresholds,
        "passed": result.passed,
        "failed": result.failed,
        "metrics": rows,
        "step_check": result.step_check,
        "host_share": result.host_share,
        **({"dynamics": result.dynamics.to_dict()} if result.dynamics is not None else {}),
    }))
    p = result.provenance
    md = [f"# Validation: {p['scenario']} (seed {p['seed']})", "",
          f"{p['num_requests']} requests live ({p['live_backend']} on {p['live_device']}, {p['live_wall_s']:.1f} s wall) "
          f"and simulated (cost model {p['sim_cost_model']}{', ' + p['profile'] if p['profile'] else ''}), "
          f"{p['kv_num_blocks']} KV blocks of {p['kv_block_size']} tokens on both sides. "
          "Error = (sim - live) / live.", "", format_markdown(t), "", format_step_check(result.step_check), "",
          format_host_share(result.host_share), ""]
    if result.dynamics is not None:
        md += ["```", format_dynamics(result.dynamics), "```", ""]
    if result.thresholds or result.dynamics is not None:
        md += ["**passed**" if result.passed else "**failed**: " + "; ".join(result.failed), ""]
    md += [f"servesim {p['servesim_commit'] or 'commit unknown'}{' (dirty)' if p['servesim_dirty'] else ''}, "
           f"{p['date']}", ""]
    (out / "validation.md").write_text("\n".join(md))
    if plots:
        from servesim.sim.plots import plot_cdf_overlay  # matplotlib import is slow; only when plotting

        frames = {"live": result.live.requests_df, "sim": result.sim.requests_df}
        hists = {"live": result.live.itl_hist, "sim": result.sim.itl_hist}
        for suffix, col in CDF_METRICS.items():
            plot_cdf_overlay(out / f"cdf_{suffix}.png", frames, metrics=(col,), itl_hists=hists)
    return out
