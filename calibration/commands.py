"""``servesim calibrate``: time real steps on a device, fit a profile, report held-out error.

Writes, next to each other: ``NAME.json`` (the ``servesim-profile/2`` file ``cost_model: {type:
profile, path: ...}`` loads), ``NAME.csv`` (every timed step: round, shape, regime, seconds),
``NAME-gemm.csv`` (every GEMM timing: M, decoder-layer seconds, LM-head seconds) and ``NAME.png``
(predicted vs measured, held-out shapes filled).
"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from servesim.sim.cost_model import FEATURE_NAMES, REGIMES, GemmTables, save_profile, to_profile_dict
from servesim.sim.presets import get_model
from servesim.sim.scenario import MAX_THREADS
from tqdm import tqdm

from . import fit as fitting
from .grid import GridSpec, build_grid
from .validate import servesim_commit

QUICK_ROUNDS, DEFAULT_ROUNDS = 3, 25
# A held-out median error above this and the profile is not worth loading. One shape timed back to
# back on a quiet 2-core machine spreads +-15-25 % (10th-90th percentile, README "Calibration"),
# and a good fit's held-out median is ~3 %: beyond 25 % the fit describes a machine busy with
# something else, not the engine's steps.
UNUSABLE_MEDIAN_APE = 0.25
DECODE_REPEAT = 2  # decode shapes are timed twice per round: the noisiest relative to their length
SETTLE_S = 3.0


@dataclass
class CalibrateOptions:
    model: str = "tiny"
    backend: str = "torch"
    device: str = "cpu"
    dtype: str = "float32"
    out: str | None = None
    quick: bool = False
    rounds: int | None = None
    threads: int | None = 2
    block_size: int = 16
    max_num_seqs: int = 32
    max_tokens: int = 512
    max_context: int = 512
    holdout: float = 0.2
    seed: int = 0
    engine_scheduler: str = "chunked"
    engine_requests: int | None = None
    progress: bool | None = None
    # Seconds the timing rounds may take; after the first round no round starts that would end past
    # it (a GPU lease is counted in minutes). None: all ``rounds``.
    time_budget_s: float | None = None
    # Decode-only shapes replay CUDA graphs (live.cuda_graphs); on a CPU the same padded path, eager.
    cuda_graphs: bool = False
    # Prefill and mixed shapes through piecewise graphs (live.piecewise_graphs).
    piecewise_graphs: bool = False


def default_profile_path(opts: CalibrateOptions) -> Path:
    tag = "cpu" if opts.device == "cpu" else "gpu"
    if opts.device == "cuda":
        import torch

        tag = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    suffix = "" if opts.backend == "torch" and opts.device == "cpu" else f"-{opts.backend}"
    return Path("calibration/profiles") / f"{tag}-{get_model(opts.model).name}{suffix}.json"


def _check(opts: CalibrateOptions) -> None:
    from servesim.sim.scenario import ScenarioError

    get_model(opts.model)  # PresetError names the known models
    if opts.backend not in ("torch", "triton"):
        raise ScenarioError(f"--backend must be torch or triton, got {opts.backend!r}")
    if opts.device not in ("cpu", "cuda"):
        raise ScenarioError(f"--device must be cpu or cuda, got {opts.device!r}")
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        raise ScenarioError("--device cuda: torch sees no GPU; use --device cpu")
    if opts.backend == "triton" and opts.device == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ScenarioError("--backend triton on a CPU needs TRITON_INTERPRET=1 set before starting")
    for name in ("max_num_seqs", "max_tokens", "max_context", "block_size"):
        if getattr(opts, name) < 1:
            raise ScenarioError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(opts, name)}")
    if opts.max_tokens < 16 or opts.max_context < 16:
        raise ScenarioError("--max-tokens and --max-context must be >= 16 (the grid starts at 16 tokens)")
    if not 0.0 <= opts.holdout < 0.9:
        raise ScenarioError(f"--holdout must be in [0, 0.9), got {opts.holdout}")
    if opts.rounds is not None and opts.rounds < 1:
        raise ScenarioError(f"--rounds must be >= 1, got {opts.rounds}")
    if opts.out and Path(opts.out).is_dir():
        raise ScenarioError(f"--out {opts.out}: is a folder; name the profile's JSON file (the raw CSVs and the plot "
                            "are written beside it)")
    if opts.time_budget_s is not None and not opts.time_budget_s > 0:
        raise ScenarioError(f"--time-budget must be > 0 seconds, got {opts.time_budget_s}")
    if opts.threads is not None and not 1 <= opts.threads <= MAX_THREADS:
        raise ScenarioError(f"--threads must be between 1 and {MAX_THREADS}, got {opts.threads}")
    if not 0 <= opts.seed < 2**32:
        raise ScenarioError(f"--seed must be between 0 and 2**32 - 1, got {opts.seed}")
    _check_fits(opts, torch)


def _check_fits(opts: CalibrateOptions, torch: Any) -> None:
    """Refuse, before anything is allocated, a model whose random weights cannot fit where they are
    built (as live mode's ``check_live_fits`` does for a scenario): the weights in ``--dtype``, on
    a CPU in this machine's memory, on CUDA in the device's."""
    from servesim.sim.host_memory import format_bytes, host_memory_bytes
    from servesim.sim.scenario import ScenarioError

    model = get_model(opts.model)
    elem = torch.tensor([], dtype=getattr(torch, opts.dtype)).element_size()
    need = model.num_params * elem
    if opts.device == "cpu":
        limit, where = host_memory_bytes(), "this machine has"
    else:
        limit, where = torch.cuda.mem_get_info()[1], "the GPU has"
    if limit is not None and need > limit:
        raise ScenarioError(f"--model {opts.model}: calibrate builds it with random weights, {format_bytes(need)} of "
                            f"{opts.dtype}, and {where} {format_bytes(limit)}; use a smaller model (--model tiny) "
                            "or --dtype bfloat16")


def calibrate(opts: CalibrateOptions) -> dict[str, Any]:
    """Run the sweep, fit, write the three files; returns the profile dict (plus ``paths``)."""
    _check(opts)
    import torch
    from servesim.kernels.host import keep_heap

    from .profile import (
        device_info,
        gemm_points,
        gemm_tables,
        make_bench,
        measure_engine_overhead,
        measure_gemm_round,
        measure_shapes,
        time_shape,
    )

    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.device == "cpu":
        keep_heap()
    rounds = planned_rounds = opts.rounds or (QUICK_ROUNDS if opts.quick else DEFAULT_ROUNDS)
    spec = GridSpec(opts.max_num_seqs, opts.max_tokens, opts.max_context, opts.quick, opts.seed)
    shapes = build_grid(spec)
    t0 = time.perf_counter()
    bench = make_bench(get_model(opts.model), shapes, backend=opts.backend, device=opts.device, dtype=opts.dtype,
                       block_size=opts.block_size, seed=opts.seed, cuda_graphs=opts.cuda_graphs,
                       piecewise_graphs=opts.piecewise_graphs)
    # Settle: the first seconds of a fresh process run slower (heap growth, one-off allocations,
    # clock ramp-up), so untimed steps over the grid come first.
    settle_rng = np.random.default_rng(opts.seed)
    t_settle = time.perf_counter() + SETTLE_S
    for s in itertools.cycle(shapes[::3]):
        time_shape(bench, s, settle_rng)
        if time.perf_counter() > t_settle:
            break
    # Rounds interleave the GEMM tables with the shapes, so both see the same minutes of the machine.
    points = gemm_points(opts.max_tokens)
    per_round = sum(DECODE_REPEAT if s.regime == "decode" else 1 for s in shapes)
    path = Path(opts.out) if opts.out else default_profile_path(opts)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows, gemm_rows = [], []
    t_rounds = time.perf_counter()
    with tqdm(total=rounds * per_round, unit="step", desc="calibrate: timing shapes", mininterval=0.5,
              disable=opts.progress is False) as bar:
        for rnd in range(rounds):
            gemm_rows += measure_gemm_round(bench, points, seed=opts.seed + rnd)
            rows += measure_shapes(bench, shapes, 1, seed=opts.seed, rnd0=rnd, repeat={"decode": DECODE_REPEAT},
                                   bar=bar)
            # The raw timings so far, rewritten after every round: a sweep cut short (a lease
            # ending, a crash) still leaves every finished round on disk.
            _write_raw(path, rows, gemm_rows)
            elapsed = time.perf_counter() - t_rounds
            if (opts.time_budget_s is not None and rnd + 1 < rounds
                    and elapsed * (rnd + 2) / (rnd + 1) > opts.time_budget_s):
                print(f"calibrate: --time-budget {opts.time_budget_s:g} s: stopping after {rnd + 1} of {rounds} "
                      f"rounds ({elapsed:.0f} s; another round would end past the budget)")
                rounds = rnd + 1
                break
    gemm = gemm_tables(gemm_rows)
    sweep_s = time.perf_counter() - t0
    del bench
    scheduler = {"type": opts.engine_scheduler, "max_num_seqs": opts.max_num_seqs,
                 "max_num_batched_tokens": min(opts.max_tokens, 256)}
    engine = measure_engine_overhead(opts.model, scheduler, backend=opts.backend, device=opts.device,
                                     dtype=opts.dtype, block_size=opts.block_size,
                                     num_requests=opts.engine_requests or (48 if opts.quick else 160),
                                     max_tokens=opts.max_tokens, seed=opts.seed, progress=opts.progress,
                                     cuda_graphs=opts.cuda_graphs, piecewise_graphs=opts.piecewise_graphs)
    raw = pd.DataFrame(rows)
    result = fitting.fit(raw, holdout=opts.holdout, seed=opts.seed,
                         gemm=GemmTables(gemm["tokens"], gemm["linear_s"], gemm["lm_head_s"]))

    info = device_info(opts.device)
    commit, dirty = servesim_commit()
    provenance = {
        **info, "backend": opts.backend, "model": opts.model, "dtype": opts.dtype, "block_size": opts.block_size,
        "cuda_graphs": opts.cuda_graphs, "piecewise_graphs": opts.piecewise_graphs,
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "servesim_commit": commit,
        "servesim_dirty": dirty,
        "grid": {**spec.as_dict(), "rounds": rounds, "rounds_planned": planned_rounds,
                 "time_budget_s": opts.time_budget_s, "shapes": len(shapes), "timed_steps": len(raw),
                 "per_regime": {r: int((result.predictions["regime"] == r).sum()) for r in REGIMES}},
        "statistic": "trimmed mean (10 %) of each shape's timed steps, each right after an untimed run of it",
        "decode_repeat": DECODE_REPEAT, "gemm_points": len(points),
        "holdout_fraction": opts.holdout, "holdout_seed": opts.seed, "sweep_seconds": round(sweep_s, 1),
        "round_deviation": {r: round(v, 4) for r, v in fitting.round_deviation(raw).items()},
        "engine_loop": {"scheduler": scheduler, "samples": engine.samples,
                        "median_gap_s": engine.median_gap_s},
        "raw_csv": path.with_suffix(".csv").name, "gemm_csv": path.stem + "-gemm.csv",
    }
    profile = _profile_of(result, {"step_s": engine.step_s, "per_seq_s": engine.per_seq_s}, provenance, gemm)
    save_profile(path, profile)  # the raw CSVs beside it were written after the last round
    fitting.plot_fit(result, path.with_suffix(".png"),
                     title=f"{opts.model} {opts.backend}/{opts.device} ({info['device_name'][:40]})")
    return {**profile, "paths": [str(path), str(path.with_suffix(".csv")), str(path.with_name(path.stem + "-gemm.csv")),
                                 str(path.with_suffix(".png"))],
            "train_error": result.train}


def _profile_of(result: fitting.Fit, overhead: dict[str, Any], provenance: dict[str, Any],
                gemm: dict[str, Any] | None) -> dict[str, Any]:
    """The profile dict of a fit: its coefficients, tile, host floors and held-out error (rounded)."""
    held = {r: {k: round(v, 5) if isinstance(v, float) else v for k, v in e.items()}
            for r, e in result.held_out.items()}
    return to_profile_dict({r: c.tolist() for r, c in result.coefs.items()}, tile_tokens=result.tile,
                           overhead=overhead, provenance=provenance, held_out_error=held, gemm_tables=gemm,
                           floors=result.floors)


def _read_raw(raw_path: Path) -> pd.DataFrame:
    """The raw per-run timings a profile was fitted to, each bad row a one-line ``ScenarioError``
    naming it (a traceback from deep in the fit, or a profile fitted to negative seconds, before)."""
    from servesim.sim.scenario import ScenarioError

    where = str(raw_path)
    try:
        raw = pd.read_csv(raw_path)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as e:
        raise ScenarioError(f"{where}: not a CSV of timings ({str(e).splitlines()[0]})") from None
    missing = {"round", "shape", "regime", "seconds"} - set(raw.columns)
    if missing:
        raise ScenarioError(f"{where} lacks column(s) {sorted(missing)}")
    seconds = pd.to_numeric(raw["seconds"], errors="coerce")
    for i, (shape, regime, sec) in enumerate(zip(raw["shape"], raw["regime"], seconds, strict=True)):
        row = f"{where}: row {i + 2}"  # (the header is line 1)
        if regime not in REGIMES:
            raise ScenarioError(f"{row}: regime {regime!r} is not one of {list(REGIMES)}")
        if not (np.isfinite(sec) and sec > 0):
            raise ScenarioError(f"{row}: seconds must be a number > 0, got {raw['seconds'].iloc[i]}")
        try:
            q, ctx = fitting.parse_shape(str(shape))
        except ValueError:
            q = ctx = np.zeros(0, dtype=np.int64)
        if len(q) == 0 or len(q) != len(ctx) or (q < 1).any() or (ctx < 0).any():
            raise ScenarioError(f"{row}: shape {shape!r} is not 'q=N N ...;ctx=N N ...' with one ctx per q")
    shapes = raw["shape"].nunique()
    need = fitting.MIN_ROWS_PER_FEATURE * len(FEATURE_NAMES)
    if shapes < need:
        raise ScenarioError(f"{where}: {shapes} shape(s); a fit needs at least {need} (two per feature)")
    return raw


def refit(path: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Fit a ``servesim calibrate`` profile again from the raw CSV beside it (no device needed):
    same held-out split (the provenance's fraction and seed), same GEMM tables and engine-loop
    overhead, today's fit (tile, host floors). Writes ``out`` (default: over ``path``) and its plot;
    the provenance keeps the first fit's held-out error under ``refit``."""
    from servesim.sim.cost_model import FittedCostModel, ProfileError
    from servesim.sim.scenario import ScenarioError

    path = Path(path)
    if out and Path(out).is_dir():
        raise ScenarioError(f"--out {out}: is a folder; name the profile's JSON file")
    try:
        model = FittedCostModel.from_profile(path)
    except ProfileError as e:
        raise ScenarioError(str(e)) from None
    prov = model.provenance
    if "raw_csv" not in prov:
        raise ScenarioError(f"{path} names no raw_csv in its provenance; only a profile written by "
                            "servesim calibrate (with its NAME.csv beside it) can be refit")
    raw_path = path.parent / prov["raw_csv"]  # beside the profile, or relative to it after refit --out
    if not raw_path.is_file():
        raise ScenarioError(f"{raw_path} (the profile's raw_csv) is missing; it must sit beside the "
                            "profile")
    raw = _read_raw(raw_path)
    result = fitting.fit(raw, holdout=prov.get("holdout_fraction", 0.2), seed=prov.get("holdout_seed", 0),
                         gemm=model.gemm)
    commit, dirty = servesim_commit()
    previous = prov.get("refit", {}).get("first_held_out_error", model.held_out_error)
    provenance = {**prov, "refit": {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                                    "servesim_commit": commit, "servesim_dirty": dirty,
                                    "first_held_out_error": previous}}
    out_path = Path(out) if out else path
    if out_path.resolve() != path.resolve():  # the raw files stay where they are: name them from out_path
        for key in ("raw_csv", "gemm_csv"):
            if key in prov:
                provenance[key] = os.path.relpath((path.parent / prov[key]).resolve(), out_path.resolve().parent)
    profile = _profile_of(result, model.overhead, provenance, model.gemm.to_dict() if model.gemm else None)
    save_profile(out_path, profile)
    fitting.plot_fit(result, out_path.with_suffix(".png"),
                     title=f"{prov.get('model', '?')} {prov.get('backend', '?')}/{prov.get('device', '?')} "
                           f"({str(prov.get('device_name', ''))[:40]}), refit")
    return {**profile, "paths": [str(out_path), str(out_path.with_suffix(".png"))], "train_error": result.train}


def _write_raw(path: Path, rows: list[dict], gemm_rows: list[dict]) -> None:
    """NAME.csv (every timed step) and NAME-gemm.csv (every GEMM timing) beside the profile."""
    pd.DataFrame(rows).to_csv(path.with_suffix(".csv"), index=False)
    pd.DataFrame(gemm_rows).to_csv(path.with_name(path.stem + "-gemm.csv"), index=False)


def unusable_fit_warning(profile: dict[str, Any]) -> str | None:
    """One line when a regime's held-out median error is above ``UNUSABLE_MEDIAN_APE``, or when no
    shape was held out (a tiny grid: the error is unmeasured), else None."""
    if not profile["held_out_error"]:
        n = profile["train_error"].get("all", {}).get("n", 0)
        return (f"warning: only {n} shapes were timed and none was held out: this fit's error is unmeasured; "
                "widen the grid (--max-tokens, --max-context, --max-num-seqs) or drop --quick")
    bad = [f"{r} {100 * e['median_ape']:.0f} %" for r in (*REGIMES, "all")
           if (e := profile["held_out_error"].get(r)) and e["median_ape"] > UNUSABLE_MEDIAN_APE]
    if not bad:
        return None
    return (f"warning: held-out median error above {100 * UNUSABLE_MEDIAN_APE:.0f} % ({', '.join(bad)}): this fit is "
            f"unusable; the machine was too noisy (other load?). Rerun on a quiet machine, or with more --rounds")


def format_report(profile: dict[str, Any]) -> str:
    """Held-out (and training) error per regime, the engine-loop overhead, the files."""
    prov = profile["provenance"]
    lines = [f"{'regime':<8} {'shapes':>6} {'held-out median APE':>20} {'p90 APE':>8} {'max APE':>8} "
             f"{'train median APE':>17}"]
    for r in (*REGIMES, "all"):
        e, t = profile["held_out_error"].get(r), profile["train_error"].get(r, {})
        if e:
            n = e["n"] + t.get("n", 0)
            lines.append(f"{r:<8} {n:>6} {100 * e['median_ape']:>19.2f}% {100 * e['p90_ape']:>7.2f}% "
                         f"{100 * e['max_ape']:>7.2f}% {100 * t.get('median_ape', float('nan')):>16.2f}%")
    floors = {r: body["floor_s"] for r, body in profile.get("regimes", {}).items() if body.get("floor_s")}
    if floors:
        lines.append("host floor, max(floor, fitted terms): " + ", ".join(
            f"{r} {1e3 * f:.1f} ms" for r, f in floors.items()))
    dev = prov.get("round_deviation") or {}
    if dev:
        lines.append("timing noise, one round of a shape against its mean over rounds (median): " + ", ".join(
            f"{r} {100 * dev[r]:.1f} %" for r in (*REGIMES, "all") if r in dev))
    ov = profile["overhead"]
    lines.append(f"engine loop (schedule + update + metrics, outside the executor): {ov['step_s'] * 1e3:.3f} ms "
                 f"per step + {ov['per_seq_s'] * 1e6:.2f} us per sequence")
    lines.append(f"tile_tokens {profile['tile_tokens']}; {prov['grid']['shapes']} shapes x {prov['grid']['rounds']} "
                 f"rounds in {prov['sweep_seconds']} s on {prov['device_name']}")
    lines.append("wrote " + ", ".join(profile["paths"]))
    return "\n".join(lines)
