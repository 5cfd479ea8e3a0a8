"""The ``servesim`` command line.

Every error a user can cause (a bad scenario field, a missing trace, an impossible KV cache)
prints one line on stderr and exits with status 2; a traceback means a bug in servesim.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

EXIT_USAGE = 2


class UserError(Exception):
    """An error the user can fix; printed as one line, exit status 2."""


def _user_errors() -> tuple[type[BaseException], ...]:
    from .cost_model import ProfileError
    from .presets import PresetError
    from .scenario import ScenarioError
    from .workload import WorkloadError

    return (UserError, ScenarioError, WorkloadError, ProfileError, PresetError, FileNotFoundError)


def _load(args: argparse.Namespace):
    from .scenario import load_scenario

    return load_scenario(args.scenario, args.set)


def cmd_run(args: argparse.Namespace) -> int:
    from .metrics import format_summary_table
    from .simulate import default_out_dir, simulate, write_results
    from .workload import workload_stats

    sc = _load(args)
    result = simulate(sc, progress=None if not args.quiet else False)
    out = write_results(result, args.out or default_out_dir(sc), plots=not args.no_plots)
    stats = workload_stats(result.requests)
    print(
        f"servesim run: {sc.name} | {sc.model} on {sc.hardware} (tp={sc.tensor_parallel}) x{sc.cluster.num_replicas} | "
        f"{sc.scheduler.type} scheduler | {result.kv.num_blocks} KV blocks of {result.kv.block_size} tokens | "
        f"{int(stats.get('count', len(result.requests)))} requests, seed {sc.seed}"
    )
    print(format_summary_table(result.summary))
    print(f"simulated in {result.wall_s:.2f} s wall; results in {out}/")
    _warn_rejected(result.requests)
    return 0


def _warn_rejected(requests) -> None:  # noqa: ANN001 - list[Request]
    """Rejected requests are part of the result, not an error; say so on one line."""
    rejected = [r for r in requests if r.reject_reason]
    if rejected:
        print(f"warning: {len(rejected)} requests rejected: {rejected[0].reject_reason}", file=sys.stderr)


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
        f"{sc.scheduler.type} scheduler | {result.kv.num_blocks} KV blocks of {result.kv.block_size} tokens "
        f"({result.kv.source}) | {len(result.requests)} requests, seed {sc.seed}"
    )
    print(format_summary_table(result.summary))
    overhead = result.iterations_df["sched_overhead_s"]
    print(f"ran in {result.wall_s:.2f} s wall; scheduler + bookkeeping {overhead.mean() * 1e3:.3f} ms per step "
          f"(mean); results in {out}/")
    _warn_rejected(result.requests)
    return 0


def cmd_engines(args: argparse.Namespace) -> int:
    from .engine_compare import compare_engines, format_table

    table, out = compare_engines(args.scenario, args.set, args.presets, args.out,
                                 progress=False if args.quiet else None, plots=not args.no_plots)
    print(f"servesim engines: {args.scenario} | the same {int(table['completed'].iloc[0] + table['rejected'].iloc[0])} "
          f"requests through {len(table)} engine presets (latencies in ms)")
    print(format_table(table))
    print(f"comparison in {out}/engines.csv, latency CDFs in {out}/latency_cdf.png, one run folder per preset")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="servesim", description="Simulate and measure LLM serving schedulers.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def scenario_cmd(name: str, help_: str, fn: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("scenario", help="scenario YAML file")
        sp.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override a scenario field, e.g. --set scheduler.max_num_seqs=128 (repeatable)")
        sp.add_argument("--out", help="run folder (default: the scenario's output_dir or results/NAME)")
        sp.add_argument("--quiet", action="store_true", help="no progress bar")
        sp.set_defaults(fn=fn)
        return sp

    run = scenario_cmd("run", "simulate a scenario and write its run folder", cmd_run)
    run.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    live = scenario_cmd("live", "run a scenario on the real model (random weights) in real time", cmd_live)
    live.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    engines = scenario_cmd("engines", "run the scenario's traffic through several engine presets and compare them",
                           cmd_engines)
    engines.add_argument("--presets", metavar="A,B,...",
                         help="engine presets to compare, NAME or NAME:VARIANT, e.g. vllm-v1,tensorrt-llm:MAX_UTILIZATION "
                              "(default: every preset and variant)")
    engines.add_argument("--no-plots", action="store_true", help="skip the latency-CDF overlay")
    for action in engines._actions:
        if "--out" in action.option_strings:
            action.help = "output folder (default: results/NAME-engines)"
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except _user_errors() as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, FileNotFoundError) and e.filename:
            msg = f"file not found: {e.filename}"
        print(f"servesim {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("servesim: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

