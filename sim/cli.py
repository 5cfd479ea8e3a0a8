"""The ``servesim`` command line.

Every error a user can cause (a bad scenario field, a missing trace, an impossible KV cache)
prints one line on stderr and exits with status 2; a traceback means a bug in servesim.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from .errors import USER_ERRORS, UserError, one_line_error
from .outputs import Interrupted

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


def _load(args: argparse.Namespace):
    from .scenario import load_scenario

    return load_scenario(args.scenario, args.set)


def cmd_run(args: argparse.Namespace) -> int:
    from .metrics import format_summary_table
    from .simulate import AUTO_BINNED_REQUESTS, AUTO_BINNED_STEPS, default_out_dir, simulate, write_results
    from .workload import workload_stats

    sc = _load(args)
    out_dir = Path(args.out or default_out_dir(sc))
    try:
        result = simulate(sc, progress=None if not args.quiet else False, iterations=args.iterations)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted during the simulation; nothing written to {out_dir}/") from None
    try:
        out = write_results(result, out_dir, plots=not args.no_plots)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted while writing {out_dir}/; it holds no summary.json, so it is not a "
                          f"result: run again") from None
    stats = workload_stats(result.requests)
    print(
        f"servesim run: {sc.name} | {sc.model} on {sc.hardware} (tp={sc.tensor_parallel}) x{sc.cluster.num_replicas} | "
        f"{sc.scheduler_name} scheduler | {result.kv.num_blocks} KV blocks of {result.kv.block_size} tokens | "
        f"{int(stats.get('count', len(result.requests)))} requests, seed {sc.seed}"
    )
    print(format_summary_table(result.summary))
    engine = "the compiled engine" if result.engine == "compiled" else "the Python engine"
    print(f"simulated in {result.wall_s:.2f} s wall on {engine}; results in {out}/")
    if result.not_compiled:
        print(f"note: the compiled engine (several times faster on large runs) does not run {result.not_compiled}; "
              "see Commands in the README for what it runs", file=sys.stderr)
    if args.iterations == "auto" and result.iterations == "binned":
        why = (f"{len(result.requests):,} requests, --iterations auto bins from {AUTO_BINNED_REQUESTS:,}"
               if len(result.requests) >= AUTO_BINNED_REQUESTS else
               f"{result.summary['num_iterations']:,} steps, --iterations auto bins from step {AUTO_BINNED_STEPS:,}")
        print(f"note: iterations.parquet holds time bins ({why}); --iterations full keeps every step",
              file=sys.stderr)
    _warn_rejected(result.requests_df)
    # the engine the preset models would refuse this server at start-up (vLLM: max_model_len over the
    # KV cache): the simulation still ran, as a what-if; say so on one line
    if why := sc.start_refusal(result.kv.num_blocks, result.kv.block_size):
        print(f"warning: {why}", file=sys.stderr)
    return 0


def _warn_rejected(requests_df) -> None:  # noqa: ANN001 - the run's requests frame
    """Rejected requests are part of the result, not an error; say so on one line."""
    reasons = requests_df["reject_reason"].dropna()
    reasons = reasons[reasons != ""]
    if len(reasons):
        print(f"warning: {len(reasons)} requests rejected: {reasons.iloc[0]}", file=sys.stderr)


def cmd_live(args: argparse.Namespace) -> int:
    from .metrics import format_summary_table
    from .simulate import default_out_dir, write_results

    sc = _load(args)
    try:
        from servesim.kernels.live import run_live
    except ImportError as e:  # torch is an optional extra
        raise UserError(f"live mode needs the kernels extra (pip install -e '.[kernels]'): {e}") from None
    result = run_live(sc, progress=None if not args.quiet else False)
    out = write_results(result, args.out or default_out_dir(sc, "live"), plots=not args.no_plots)
    print(
        f"servesim live: {sc.name} | {sc.model} ({sc.live.dtype}, {sc.live.backend} on {sc.live.device}) | "
        f"{sc.scheduler_name} scheduler | {result.kv.num_blocks} KV blocks of {result.kv.block_size} tokens "
        f"({result.kv.source}) | {len(result.requests)} requests, seed {sc.seed}"
    )
    print(format_summary_table(result.summary))
    overhead = result.iterations_df["sched_overhead_s"]
    print(f"ran in {result.wall_s:.2f} s wall; scheduler + bookkeeping {overhead.mean() * 1e3:.3f} ms per step "
          f"(mean); results in {out}/")
    _warn_rejected(result.requests_df)
    return 0


def cmd_engines(args: argparse.Namespace) -> int:
    from .verbs.engines import compare_engines, format_table

    table, out = compare_engines(args.scenario, args.set, args.presets, args.out,
                                 progress=False if args.quiet else None, plots=not args.no_plots)
    print(f"servesim engines: {args.scenario} | the same {int(table['completed'].iloc[0] + table['rejected'].iloc[0])} "
          f"requests through {len(table)} engine presets (latencies in ms)")
    print(format_table(table))
    print(f"comparison in {out}/engines.csv, latency CDFs in {out}/latency_cdf.png, one run folder per preset")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from servesim.calibration.replay import format_dynamics
    from servesim.calibration.validate import (
        format_host_share,
        format_step_check,
        format_table,
        parse_max_error,
        validate,
    )

    if args.against:
        return cmd_validate_against(args)
    if args.scenario is None:
        raise UserError("validate needs a SCENARIO to run live, or --against RUN to compare with a measured run")
    if args.format:
        raise UserError("--format goes with --against RUN")
    sc = _load(args)
    parse_max_error(args.max_error)  # a bad threshold is a usage error before anything runs
    out = Path(args.out) if args.out else Path("results") / f"{sc.name}-validate"
    print(f"servesim validate: {sc.name} | {sc.model} | {sc.scheduler_name} scheduler | seed {sc.seed} | "
          f"sim cost model: {'profile ' + args.profile if args.profile else sc.cost_model.type}", flush=True)
    result = validate(sc, out, profile=args.profile, max_error=args.max_error, source=args.scenario,
                      overrides=args.set, progress=False if args.quiet else None, plots=not args.no_plots,
                      log=lambda msg: print(msg, flush=True), repeats=args.repeats, replay_steps=args.replay_steps)
    print(f"relative error (sim - live) / live, {result.provenance['num_requests']} requests, "
          f"{result.provenance['kv_num_blocks']} KV blocks on both sides:")
    print(format_table(result.table))
    print(format_step_check(result.step_check))
    print(format_host_share(result.host_share))
    if result.dynamics is not None:
        print(format_dynamics(result.dynamics))
    plots = "" if args.no_plots else ", cdf_{ttft,tpot,itl,e2e}.png"
    replay = ", replay/" if result.dynamics is not None and result.dynamics.run is not None else ""
    print(f"results in {out}/ (validation.json, validation.csv, validation.md{plots}, live/, sim/{replay})")
    for line in result.failed:
        print(f"servesim validate: FAIL {line}", file=sys.stderr)
    return 1 if result.failed else 0


def cmd_validate_against(args: argparse.Namespace) -> int:
    from servesim.calibration.validate import format_table
    from servesim.calibration.validate_against import validate_against

    if args.repeats != 1:
        raise UserError("--repeats repeats a live run; a measured run (--against) is what it is")
    if args.replay_steps:  # (it was ignored)
        raise UserError("--replay-steps replays a live run's own steps; a measured run (--against) has none")
    run = Path(args.against)  # a run folder keeps its whole name (dots too), a JSON file loses its suffix
    out = Path(args.out) if args.out else Path("results") / f"{run.name if run.is_dir() else run.stem}-against"
    print(f"servesim validate --against {args.against}"
          f"{f' (scenario {args.scenario})' if args.scenario else ''} | sim cost model: "
          f"{'profile ' + args.profile if args.profile else 'the scenario, or the shipped profile for the GPU and model, or the roofline'}",
          flush=True)
    result = validate_against(args.against, out, fmt=args.format, profile=args.profile, scenario_file=args.scenario,
                              overrides=args.set, max_error=args.max_error, plots=not args.no_plots,
                              progress=False if args.quiet else None, log=lambda msg: print(msg, flush=True))
    p = result.provenance
    for note in p["notes"]:
        print(f"note: {note}")
    print(f"relative error (sim - measured) / measured, {p['num_requests']} requests; ITL {p['itl']}:")
    print(format_table(result.table))
    timing = ""
    if result.step_timing is not None:
        print("steps timed from the run's engine timestamps, measured / the cost model's price of the same rows:")
        print("\n".join(result.step_timing.markdown() or ["- no step of the run could be read that way"]))
        timing = ", step_timing.csv"
    plots = "" if args.no_plots else ", cdf_*.png, scatter_requests.png"
    print(f"results in {out}/ (validation.json, validation.csv, validation.md, per_request.csv{timing}{plots}, sim/)")
    for line in result.failed:
        print(f"servesim validate: FAIL {line}", file=sys.stderr)
    return 1 if result.failed else 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    try:
        from servesim.calibration.commands import (
            CalibrateOptions,
            calibrate,
            format_report,
            unusable_fit_warning,
        )
    except ImportError as e:  # torch is an optional extra
        raise UserError(f"calibrate needs the kernels extra (pip install -e '.[kernels]'): {e}") from None
    opts = CalibrateOptions(
        model=args.model, backend=args.backend, device=args.device, dtype=args.dtype, out=args.profile_out,
        quick=args.quick, rounds=args.rounds, threads=args.threads, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_tokens=args.max_tokens, max_context=args.max_context,
        holdout=args.holdout, seed=args.seed, progress=False if args.quiet else None,
        time_budget_s=args.time_budget, cuda_graphs=args.cuda_graphs, piecewise_graphs=args.piecewise_graphs)
    print(f"servesim calibrate: {opts.model} ({opts.dtype}, {opts.backend} on {opts.device}), "
          f"{'quick' if opts.quick else 'default'} grid")
    profile = calibrate(opts)
    print(format_report(profile))
    warning = unusable_fit_warning(profile)
    if warning:
        print(f"servesim calibrate: {warning}", file=sys.stderr)
    return 0


def _add_calibrate(sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
    cal = sub.add_parser("calibrate", help="time real steps on a device and fit a cost-model profile",
                         description="Sweep prefill, decode and mixed batch shapes through the live executor, "
                                     "fit a profile, report its error on held-out shapes.")
    cal.add_argument("--model", default="tiny", help="model preset (tiny)")
    cal.add_argument("--backend", default="torch", choices=["torch", "triton"], help="attention kernels (torch)")
    cal.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="(cpu)")
    cal.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="(float32)")
    # dest profile_out: a file, not a run folder (main's --out folder check does not apply)
    cal.add_argument("--out", dest="profile_out", metavar="PATH",
                     help="profile JSON path; the raw CSV and the fit plot go beside it "
                                   "(default calibration/profiles/DEVICE-MODEL.json)")
    cal.add_argument("--quick", action="store_true", help="a small grid and 3 rounds: a smoke test (2-3 minutes on 2 idle cores)")
    cal.add_argument("--rounds", type=int, default=None, help="timed runs per shape (3 quick, 25 default)")
    cal.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                     help="stop the timing rounds early (after at least one) rather than run past SECONDS; "
                          "the profile records the rounds run (default: all rounds)")
    cal.add_argument("--cuda-graphs", action="store_true",
                     help="decode-only shapes replay CUDA graphs, as a live run with live.cuda_graphs: true "
                          "(on a CPU the same padded path runs eagerly)")
    cal.add_argument("--piecewise-graphs", action="store_true",
                     help="prefill and mixed shapes run piecewise CUDA graphs, as a live run with "
                          "live.piecewise_graphs: true (not yet run on a GPU)")
    cal.add_argument("--threads", type=int, default=2, help="torch CPU threads; match the scenario's live.threads (2)")
    cal.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (16)")
    cal.add_argument("--max-num-seqs", type=int, default=32, help="largest batch in the grid (32)")
    cal.add_argument("--max-tokens", type=int, default=512, help="most new tokens in one step (512)")
    cal.add_argument("--max-context", type=int, default=512, help="longest cached context per row (512)")
    cal.add_argument("--holdout", type=float, default=0.2, help="fraction of shapes held out of the fit (0.2)")
    cal.add_argument("--seed", type=int, default=0, help="seed of the grid, the shuffles and the split (0)")
    cal.add_argument("--quiet", action="store_true", help="no progress bar")
    cal.set_defaults(fn=cmd_calibrate)
    actions = cal.add_subparsers(dest="calibrate_action", metavar="ACTION")
    imp = actions.add_parser(
        "import", help="build a GPU profile from published kernel measurements (no GPU needed)",
        description="Read public per-kernel GPU measurements (LLMServingSim, Vidur, inference-sim), assemble a "
                    "servesim-gpu-profile/1, print and store its held-out error per regime.")
    imp.add_argument("paths", nargs="+", metavar="PATH", help="the source: an LLMServingSim profile folder "
                     "(holding meta.yaml) or the files of --format")
    imp.add_argument("--format", dest="import_format", required=True, choices=["llmservingsim", "vidur", "inference-sim"],
                     help="format of PATH")
    imp.add_argument("--with", dest="import_with", action="append", default=[], metavar="FORMAT:PATH",
                     help="another source combined in, e.g. inference-sim:mha_decode_h100_32-8-128-tp1.csv (repeatable)")
    imp.add_argument("--model", dest="import_model", required=True, metavar="M", help="model preset the source measured")
    imp.add_argument("--hardware", dest="import_hardware", required=True, metavar="H", help="hardware preset of the source's GPU")
    imp.add_argument("--tp", dest="import_tp", type=int, default=1, metavar="N", help="tensor-parallel degree (1)")
    imp.add_argument("--out", dest="import_out", metavar="P", help="profile JSON (default calibration/profiles/HW-MODEL-tpN.json)")
    imp.add_argument("--step-overhead-us", type=float, default=0.0, help="host time per step, us (0)")
    imp.add_argument("--per-seq-overhead-us", type=float, default=0.0, help="host time per row, us (0)")
    imp.add_argument("--prompt-step-overhead-us", type=float, default=0.0,
                     help="device time a step with prompt rows costs beyond its kernel tables, us (0)")
    imp.add_argument("--skew", dest="import_skew", choices=["auto", "use", "ignore"], default="auto",
                     help="LLMServingSim skew.csv (decode rows of unequal context): auto uses it unless the source's "
                          "meta.yaml switches its skew profile off (auto)")
    imp.add_argument("--link-bandwidth", type=float, default=None, metavar="BYTES_PER_S",
                     help="GPU-GPU link for TP all-reduce when no measured table is given (16e9)")
    imp.add_argument("--link-latency-us", type=float, default=None, help="per all-reduce latency, us (20)")
    imp.set_defaults(fn=cmd_calibrate_import, command="calibrate import")
    ref = actions.add_parser(
        "refit", help="fit a calibrated profile again from the raw CSV beside it (no device needed)",
        description="Refit a servesim calibrate profile from its raw timings (NAME.csv beside it) with this "
                    "servesim's fit: same held-out split, GEMM tables and engine-loop overhead; prints the "
                    "held-out error, keeps the first fit's in the provenance.")
    ref.add_argument("refit_profile", metavar="PROFILE", help="the profile JSON (its raw CSV beside it)")
    ref.add_argument("--out", dest="refit_out", metavar="P", help="write here instead of over PROFILE")
    ref.set_defaults(fn=cmd_calibrate_refit, command="calibrate refit")


def cmd_calibrate_refit(args: argparse.Namespace) -> int:
    from servesim.calibration.commands import format_report, refit

    print(f"servesim calibrate refit: {args.refit_profile}")
    profile = refit(args.refit_profile, args.refit_out)
    print(format_report(profile))
    first = profile["provenance"]["refit"]["first_held_out_error"].get("all")
    if first:
        print(f"first fit, all regimes: held-out median {100 * first['median_ape']:.2f} %, "
              f"p90 {100 * first['p90_ape']:.2f} %")
    return 0


def cmd_calibrate_import(args: argparse.Namespace) -> int:
    from servesim.calibration.gpu_import import ImportOptions, format_report, run_import

    opts = ImportOptions(args.import_format, args.paths, args.import_model, args.import_hardware, args.import_tp,
                         args.import_out, args.step_overhead_us, args.per_seq_overhead_us, args.link_bandwidth,
                         args.link_latency_us, args.import_with,
                         prompt_step_overhead_us=args.prompt_step_overhead_us, skew=args.import_skew)
    print(f"servesim calibrate import: {opts.fmt} {' '.join(opts.paths)} -> {opts.model} on {opts.hardware} tp{opts.tp}")
    profile = run_import(opts)
    print(format_report(profile))
    print(f"wrote {profile['path']} ({profile['format']})")
    return 0


def _out_help(sp: argparse.ArgumentParser, text: str) -> None:
    """Reword the shared --out option's help for one command."""
    for action in sp._actions:
        if "--out" in action.option_strings:
            action.help = text


class _Parser(argparse.ArgumentParser):
    """argparse with its own errors (a flag's bad value, a missing argument) on one line, like servesim's."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="servesim", description="Simulate and measure LLM serving schedulers.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def scenario_cmd(name: str, help_: str, fn: Callable[[argparse.Namespace], int],
                     optional: str | None = None) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("scenario", nargs="?" if optional else None, help=optional or "scenario YAML file")
        sp.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override a scenario field, e.g. --set scheduler.max_num_seqs=128 (repeatable)")
        sp.add_argument("--out", help="run folder (default: the scenario's output_dir or results/NAME)")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")
        sp.set_defaults(fn=fn)
        return sp

    run = scenario_cmd("run", "simulate a scenario and write its run folder", cmd_run)
    run.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    run.add_argument("--iterations", choices=["auto", "full", "binned", "off"], default="auto",
                     help="iterations.parquet: one row per engine step (full), time bins of them (binned: "
                          "millions of steps in a few MB), or none (off); auto (the default): full under "
                          "100,000 requests (binned from a run's 1,048,576th step), binned from there; "
                          "summary.json is the same")
    live = scenario_cmd("live", "run a scenario on the real model (random weights) in real time", cmd_live)
    live.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    engines = scenario_cmd("engines", "run the scenario's traffic through several engine presets and compare them",
                           cmd_engines)
    engines.add_argument("--presets", metavar="A,B,...",
                         help="engine presets to compare, NAME or NAME:VARIANT, e.g. vllm-v1,tensorrt-llm:MAX_UTILIZATION "
                              "(default: every preset and variant)")
    engines.add_argument("--no-plots", action="store_true", help="skip the latency-CDF overlay")
    _out_help(engines, "output folder (default: results/NAME-engines)")
    _add_planning_commands(sub, scenario_cmd)
    val = scenario_cmd("validate", "run the scenario live (or read a measured run: --against), simulate the "
                       "identical workload, report relative errors", cmd_validate,
                       optional="scenario YAML file (with --against: optional, for what the run does not say)")
    val.add_argument("--against", metavar="RUN", default=None,
                     help="no live run: compare with a measured vLLM run (an LLMServingSim run folder or a vllm bench "
                          "serve --save-detailed JSON), simulated under the vllm-v1 preset")
    val.add_argument("--format", choices=["llmservingsim", "vllm-bench"], default=None,
                     help="format of RUN (default: a folder is llmservingsim, a .json file vllm-bench)")
    val.add_argument("--profile", metavar="P", default=None,
                     help="fitted cost-model profile for the simulated side (default: the scenario's cost_model)")
    val.add_argument("--max-error", action="append", default=[], metavar="KEY=PCT,...",
                     help="exit 1 when |error| exceeds PCT %%: a key (p90_ttft_ms=8) or a family for its p50 and "
                          "p90 (ttft, tpot, itl, e2e), comma-separated or repeated")
    val.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    val.add_argument("--repeats", type=int, default=1, metavar="N",
                     help="run the live side N times on the same requests: the live column is each metric's "
                          "median and a 'live spread %%' column its range (1)")
    val.add_argument("--replay-steps", action="store_true",
                     help="dynamics check: replay the live run's measured step durations into a simulation of the "
                          "same requests; exit 1 unless every TTFT and E2E matches, naming the first step that differs")
    _out_help(val, "output folder (default: results/NAME-validate, with --against results/RUN-against)")
    _add_calibrate(sub)
    return p


# ---- plan, sweep, compare (what-if questions over many runs) -------------------------------------
def _plan_settings(args: argparse.Namespace, sc, verb: str, **kw):  # noqa: ANN001, ANN202 - Scenario, PlanSettings
    """How plan and search judge one rate: the SLO terms (--slo, else the scenario's slo:) and the run settings."""
    from .verbs.plan import PlanSettings
    from .verbs.slo import parse_slo, terms_from_scenario_slo

    if args.slo:
        terms = parse_slo(args.slo)
    elif sc.slo:
        terms = terms_from_scenario_slo(sc.slo)
    else:
        raise UserError(f"{verb} needs an SLO: --slo p99_ttft_ms=500,p99_tpot_ms=50 or an slo: section in the scenario")
    return PlanSettings(terms, attainment=args.attainment, seeds=args.seeds, tolerance=args.tolerance,
                        window_s=args.duration, min_requests=args.min_requests, **kw).for_scenario(sc)


def cmd_plan(args: argparse.Namespace) -> int:
    from .verbs.plan import format_plan, plan, write_plan

    sc = _load(args)
    st = _plan_settings(args, sc, "plan", start_rate=args.start_rate)
    if args.max_gpus is not None and (sc.cluster.disagg is None or args.target_rate is None):  # (it was ignored)
        raise UserError("--max-gpus bounds the pool split of a disaggregated scenario (cluster.disagg) sized for a "
                        f"--target-rate; {'this scenario has no cluster.disagg' if sc.cluster.disagg is None else 'give --target-rate'}")
    if sc.cluster.disagg is not None and args.target_rate is not None:
        return _plan_disagg(sc, st, args)
    result = plan(sc, st, target_rate=args.target_rate, workers=args.workers, progress=not args.quiet)
    out = write_plan(result, args.out or Path("results") / f"{sc.name}-plan", plots=not args.no_plots)
    print(f"servesim plan: {sc.name} | {sc.model} on {sc.hardware} | {sc.scheduler_name} scheduler")
    print(format_plan(result))
    print(f"results in {out}/ (plan.csv, plan.json{'' if args.no_plots else ', latency_vs_rate.png'})")
    return 0


def _plan_disagg(sc, st, args: argparse.Namespace) -> int:  # noqa: ANN001
    from .verbs.plan_disagg import format_disagg_plan, plan_disagg, write_disagg_plan

    result = plan_disagg(sc, st, args.target_rate, max_gpus=16 if args.max_gpus is None else args.max_gpus,
                         workers=args.workers, progress=not args.quiet)
    out = write_disagg_plan(result, args.out or Path("results") / f"{sc.name}-plan")
    print(f"servesim plan: {sc.name} | {sc.model} | disaggregated prefill:decode for {args.target_rate:g} req/s")
    print(format_disagg_plan(result))
    print(f"results in {out}/ (plan_disagg.csv, plan_disagg.json)")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from .scenario import read_scenario_file
    from .verbs.sweep import format_sweep, parse_grid, run_sweep, write_sweep

    sc = _load(args)  # the base scenario must be valid on its own
    raw = read_scenario_file(args.scenario)
    axes = parse_grid(args.grid)
    out_dir = Path(args.out or Path("results") / f"{sc.name}-sweep")
    df = run_sweep(raw, axes, args.set, backend="ray" if args.ray is not None else "local", workers=args.workers,
                   ray_address=args.ray or None, source=args.scenario, base_dir=Path(args.scenario).parent,
                   progress=not args.quiet, out_dir=out_dir, resume=args.resume)
    try:
        out = write_sweep(df, axes, out_dir, plots=not args.no_plots)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted while writing the table; the finished points are recorded in "
                          f"{out_dir}/points.jsonl, and the same command with --resume writes it from them") from None
    resumed = df.attrs.get("resumed_points", 0)
    print(f"servesim sweep: {sc.name} | {len(df)} points over {', '.join(a.key for a in axes)} | "
          f"{'on ray' if args.ray is not None else 'on local processes'}"
          f"{f' | resumed: {resumed} points from points.jsonl' if args.resume else ''}")
    print(format_sweep(df, axes))
    failed = df[df["status"] != "ok"]
    for _, r in failed.iterrows():
        again = "; --resume runs it again" if r["status"] == "lost" else ""
        print(f"servesim sweep: point {r['point']} {r['status']}: {r['error']}{again}", file=sys.stderr)
    print(f"results in {out}/ (sweep.parquet, sweep.csv, points.jsonl{'' if args.no_plots else ', sweep.png'})")
    return 1 if len(failed) else 0


def cmd_search(args: argparse.Namespace) -> int:
    from .scenario import read_scenario_file
    from .verbs.prices import parse_gpu_costs, prices_for
    from .verbs.search import SearchSettings, search
    from .verbs.search_report import format_search, write_search
    from .verbs.search_space import parse_space, space_hardware

    if args.top < 1:  # (a Python slice: -1 printed all but the last, 0 nothing)
        raise UserError(f"--top must be >= 1, got {args.top}")
    sc = _load(args)
    axes = parse_space(args.space)
    prices = prices_for(space_hardware(sc, axes), parse_gpu_costs(args.gpu_cost))
    st = _plan_settings(args, sc, "search")
    ss = SearchSettings(args.target_rate, st, prices, wave=args.wave, max_replicas=args.max_replicas,
                        saturation_requests=args.saturation_requests, budget_s=args.budget_s)
    result = search(read_scenario_file(args.scenario), sc, axes, ss, args.set, source=args.scenario,
                    base_dir=Path(args.scenario).parent, backend="ray" if args.ray is not None else "local",
                    workers=args.workers, ray_address=args.ray or None, progress=not args.quiet)
    out = write_search(result, args.out or Path("results") / f"{sc.name}-search", plots=not args.no_plots)
    print(f"servesim search: {sc.name} | {sc.model} | {len(result.points)} points over "
          f"{', '.join(a.key for a in axes)} | {'on ray' if args.ray is not None else 'on local processes'}")
    print(format_search(result, top=args.top))
    print(f"results in {out}/ (search.parquet, search.csv, search.json"
          f"{'' if args.no_plots else ', pareto.png'}{', winner.yaml' if result.best else ''})")
    return 0 if result.best is not None else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from .scenario import load_scenario
    from .verbs.compare import compare, format_compare, write_compare

    metrics = None
    if args.metrics is not None:  # (an empty --metrics reported the default metrics)
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
        if not metrics:
            raise UserError(f"--metrics {args.metrics!r} names no metric; give comma-separated summary keys, "
                            "e.g. p99_ttft_ms,request_throughput, or leave --metrics out for the defaults")
    base = load_scenario(args.scenario, args.set)
    cand = load_scenario(args.candidate, [*args.set, *args.candidate_set])
    out_dir = Path(args.out or Path("results") / f"compare-{base.name}-vs-{cand.name}")
    result = compare(base, cand, seeds=args.seeds, fail_on=args.fail_on, metrics=metrics, workers=args.workers,
                     progress=not args.quiet, set_both=args.set, set_candidate=args.candidate_set, out_dir=out_dir,
                     resume=args.resume)
    out = write_compare(result, out_dir)
    if args.resume:
        print(f"resumed: {result.resumed} runs from runs.jsonl")
    print(format_compare(result))
    print(f"results in {out}/ (compare.csv, compare_seeds.csv, compare.json, runs.jsonl)")
    if len(result.failed_runs):
        return 1
    return 1 if result.flagged else 0


def _add_planning_commands(sub, scenario_cmd) -> None:  # noqa: ANN001 - argparse's private subparsers type
    def workers(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--workers", type=int, default=None,
                        help="parallel local worker processes (default: one per CPU core; 1 = in this process)")

    pl = scenario_cmd("plan", "highest arrival rate one replica sustains within an SLO; replicas for a target rate",
                      cmd_plan)
    def rate_test(sp: argparse.ArgumentParser, seeds: int, tolerance: float, tolerance_help: str) -> None:
        """The flags saying how one rate is judged (plan and search)."""
        sp.add_argument("--slo", action="append", default=[], metavar="TERMS",
                        help="[pNN_|median_|mean_]METRIC_ms=TARGET,... with METRIC ttft, tpot, itl, e2el, "
                             "queueing_delay, e.g. p99_ttft_ms=500,p99_tpot_ms=50 (default: the scenario's slo)")
        sp.add_argument("--attainment", type=float, default=0.9,
                        help="fraction of requests that must meet all per-request terms (bare METRIC_ms) (0.9)")
        sp.add_argument("--seeds", type=int, default=seeds, help=f"seeds per rate, pooled ({seeds})")
        sp.add_argument("--tolerance", type=float, default=tolerance, help=f"{tolerance_help} ({tolerance})")
        sp.add_argument("--duration", type=float, default=None, metavar="S",
                        help="arrival window per seed in seconds (default: derived from the tolerance, see README)")
        sp.add_argument("--min-requests", type=int, default=200, help="at least this many requests per seed (200)")

    rate_test(pl, 3, 0.05, "stop when the bracket's high/low rate ratio is within 1 + TOLERANCE")
    pl.add_argument("--max-gpus", type=int, default=None, metavar="N",
                    help="disaggregated scenarios with --target-rate: largest prefill + decode GPU count tried (16)")
    pl.add_argument("--target-rate", type=float, default=None, metavar="R",
                    help="also find the replicas (with the scenario's router) that sustain R requests/s")
    pl.add_argument("--start-rate", type=float, default=None, metavar="R",
                    help="first rate tried (default: workload.arrival.rate)")
    pl.add_argument("--no-plots", action="store_true", help="skip latency_vs_rate.png")
    workers(pl)

    sw = scenario_cmd("sweep", "run the cross product of --grid overrides into one results table", cmd_sweep)
    sw.add_argument("--grid", action="append", default=[], metavar="KEY.PATH=V1,V2,...",
                    help="a scenario field and its values, e.g. scheduler.type=static,continuous,chunked (repeatable)")
    sw.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                    help="run the points as Ray tasks: no ADDRESS starts or joins Ray like ray.init(); "
                         "'auto' or ray://HOST:PORT joins a cluster")
    sw.add_argument("--no-plots", action="store_true", help="skip sweep.png")
    sw.add_argument("--resume", action="store_true",
                    help="finish an interrupted sweep in the same --out: run only the points its points.jsonl lacks "
                         "(the grid, --set and base scenario must be the ones it recorded)")
    workers(sw)

    se = scenario_cmd("search", "cheapest deployment (GPU, TP, knobs, replicas) that serves a target rate within "
                      "an SLO", cmd_search)
    se.add_argument("--target-rate", type=float, required=True, metavar="R", help="requests/s to serve")
    se.add_argument("--space", action="append", default=[], metavar="KEY.PATH=V1,V2,...",
                    help="a scenario field and its values, e.g. hardware=h100-sxm,l40s or tensor_parallel=1,2,4,8 "
                         "(repeatable; the cross product is searched)")
    se.add_argument("--gpu-cost", action="append", default=[], metavar="HW=PRICE,...|FILE",
                    help="$ per GPU-hour overrides, e.g. h100-sxm=2.5,l40s=0.9, or a YAML file of hardware: price "
                         "(default: the presets' approximate on-demand prices, see README)")
    rate_test(se, 2, 0.1, "overload the arrival window must expose, as plan's (sets the default window)")
    se.add_argument("--wave", type=int, default=8,
                    help="points searched together (8); fixes the order of decisions, so any backend gives one table")
    se.add_argument("--max-replicas", type=int, default=128, help="give a point up beyond this many replicas (128)")
    se.add_argument("--saturation-requests", type=int, default=200,
                    help="requests in each point's saturation run, which bounds its capacity (200)")
    se.add_argument("--budget-s", type=float, default=None, metavar="S",
                    help="stop after S seconds with the best deployment found so far (marked as such)")
    se.add_argument("--top", type=int, default=10, help="deployments to print (10)")
    se.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                    help="run the simulations as Ray tasks (no ADDRESS: start or join Ray like ray.init())")
    se.add_argument("--no-plots", action="store_true", help="skip pareto.png")
    workers(se)

    cp = sub.add_parser("compare", help="is a candidate config worse than the baseline? paired runs, bootstrap CIs",
                        description="Run BASELINE and CANDIDATE on the same workloads over N seeds and report "
                                    "each metric's change with a 95% bootstrap CI; exit 1 on a flagged regression.")
    cp.add_argument("scenario", metavar="BASELINE", help="baseline scenario YAML")
    cp.add_argument("candidate", metavar="CANDIDATE", help="candidate scenario YAML (its workload is replaced by the baseline's)")
    cp.add_argument("--seeds", type=int, default=10, help="paired runs per side (10)")
    cp.add_argument("--fail-on", action="append", default=[], metavar="METRIC=+X%",
                    help="exit 1 when METRIC rises (+) / falls (-) significantly by more than X%% (repeatable)")
    cp.add_argument("--metrics", default=None, help="comma-separated summary keys to report (default: latencies, "
                                                     "throughput, and goodput when the baseline has an slo)")
    cp.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override both scenarios")
    cp.add_argument("--candidate-set", action="append", default=[], metavar="KEY.PATH=VALUE",
                    help="override the candidate only, e.g. --candidate-set scheduler.max_num_batched_tokens=256")
    cp.add_argument("--out", help="folder for compare.csv / compare.json (default results/compare-BASE-vs-CAND)")
    cp.add_argument("--quiet", action="store_true", help="no progress bar")
    cp.add_argument("--resume", action="store_true",
                    help="finish an interrupted comparison in the same --out: run only the runs its runs.jsonl lacks")
    cp.set_defaults(fn=cmd_compare)
    workers(cp)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    previous_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        out = getattr(args, "out", None)
        if out is not None and isinstance(out, str):
            _check_out(out)
        if getattr(args, "workers", None) is not None:
            from .verbs.parallel import check_workers

            check_workers(args.workers)
        return int(args.fn(args) or 0)
    except USER_ERRORS as e:
        print(f"servesim {args.command}: error: {one_line_error(e)}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # writing the results: a path this machine refuses (too long, read-only, full)
        what = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
        print(f"servesim {args.command}: error: cannot write the results ({what})", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not turn this line into a traceback
        what = str(e) if isinstance(e, Interrupted) and str(e) else "interrupted before its results were written"
        print(f"servesim {args.command}: {what}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous_term)


def _check_out(out: str) -> None:
    """Refuse, before any work, an --out folder that cannot be made: empty, a file, a name longer
    than a file name may be, or under a path that is no writable folder."""
    if not out.strip():
        raise UserError("--out is empty; name a folder (it is created if missing)")
    p = Path(out)
    long = [part for part in p.parts if len(part.encode()) > 255]
    if long:
        raise UserError(f"--out: the name {long[0][:40]!r}... is {len(long[0].encode())} bytes; a folder name may "
                        "hold 255")
    if p.exists() and not p.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder; name a folder (it is created if missing)")
    parent = p.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: {parent} is not a folder this user can write in")
    if not p.exists():  # a file system that refuses folders whatever the permissions say (/proc, read-only)
        try:
            os.rmdir(tempfile.mkdtemp(dir=parent))
        except OSError as e:
            raise UserError(f"--out {out}: cannot make a folder in {parent} ({e.strerror})") from None


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM (a job scheduler, ``kill``) ends a run the way Ctrl-C does."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())

