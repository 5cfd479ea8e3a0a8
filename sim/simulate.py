"""Scenario -> replicas -> a simulated run, and the run folder it writes.

``build_scheduler`` is the single place a scheduler and its KV block manager are constructed;
live mode calls it too, so the two modes cannot drift apart in policy.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import numpy as np
import pandas as pd
import simpy
from tqdm import tqdm

from . import compiled_engine, row_kernels
from .cluster import Cluster, replica_summary
from .cost_model import build_cost_model
from .disagg import DisaggCluster, PrefillRecorder
from .engine import Replica, SimEnvironment, SimExecutor
from .kv_cache import BlockManager, CountingBlockManager
from .metrics import IterationsMode, LogHistogram, MetricsRecorder, summarize, write_run
from .outputs import begin_folder, write_text
from .pools import pool_scenario
from .presets import get_model, kv_block_bytes
from .request import Request
from .scenario import Scenario, ScenarioError, scenario_to_yaml
from .schedulers import Scheduler, make_scheduler
from .workload import RequestArrays, generate_workload

GIB = 1 << 30


@dataclass(slots=True)
class KVPlan:
    """How big each replica's KV cache is."""

    num_blocks: int
    block_size: int
    block_bytes: int  # one block, all layers, K and V, on one TP rank
    num_host_blocks: int
    source: str  # "num_blocks", "gpu_memory_utilization" or "kv_cache_memory_mb"


def plan_kv(sc: Scenario, block_bytes: int | None = None) -> KVPlan:
    """Blocks per replica: the explicit ``kv_cache.num_blocks``, else derived from memory."""
    model = get_model(sc.model)
    kvc = sc.kv_cache
    bb = block_bytes if block_bytes is not None else kv_block_bytes(model, sc.tensor_parallel, kvc.block_size)
    if kvc.num_blocks is not None:
        n, source = kvc.num_blocks, "num_blocks"
    elif sc.live.kv_cache_memory_mb is not None:
        n, source = int(sc.live.kv_cache_memory_mb * 2**20 // bb), "kv_cache_memory_mb"
    else:
        try:
            n = sc.derived_kv_blocks()
        except ValueError as e:
            raise ScenarioError(f"kv_cache: {e}") from None
        source = "gpu_memory_utilization"
    if n < 1:
        raise ScenarioError(f"kv_cache: the memory budget leaves {n} KV blocks; give kv_cache.num_blocks or more memory")
    host = int(kvc.swap_space_gb * GIB // bb)
    return KVPlan(n, kvc.block_size, bb, host, source)


def build_scheduler(sc: Scenario, kv: KVPlan, block_ids: bool = True) -> Scheduler:
    """The scheduler and block manager of one replica, for simulation and live mode alike.

    ``block_ids`` False (simulation): without prefix caching no block id is ever read, and the
    block manager keeps counts only (``CountingBlockManager``: the same answers, fewer operations)."""
    if not block_ids and not sc.kv_cache.enable_prefix_caching:
        block_manager: BlockManager = CountingBlockManager(kv.num_blocks, kv.block_size,
                                                           num_host_blocks=kv.num_host_blocks,
                                                           watermark=sc.kv_cache.watermark)
    else:
        block_manager = BlockManager(
            kv.num_blocks,
            kv.block_size,
            enable_prefix_caching=sc.kv_cache.enable_prefix_caching,
            num_host_blocks=kv.num_host_blocks,
            watermark=sc.kv_cache.watermark,
        )
    return make_scheduler(sc.policy, block_manager)


@dataclass
class RunResult:
    scenario: Scenario
    mode: str  # "sim" or "live"
    requests: Sequence[Request]  # the objects given to simulate, else the workload's columns (RequestArrays)
    requests_df: pd.DataFrame
    iterations_df: pd.DataFrame
    summary: dict[str, Any]
    itl_hist: LogHistogram
    kv: KVPlan
    wall_s: float
    # live mode, one replica: the (q_lens, ctx_lens) rows of every executed step, in order
    step_shapes: list[tuple[np.ndarray, np.ndarray]] | None = None
    # ... and the executor's own seconds of each (the forward); the rest of a step is the engine loop
    step_forward_s: np.ndarray | None = None
    # ... and the request id of each row (validate's dynamics check replays these steps)
    step_request_ids: list[np.ndarray] | None = None
    iterations: str = "full"  # what iterations_df holds: every step (full), time bins (binned) or none (off)
    engine: str = "python"  # what ran the steps: the Python engine (engine.py) or the compiled one (compiled_engine.py)
    # why the Python engine ran a run whose compiled step loops were on (compiled_engine.reason_not_compiled)
    not_compiled: str | None = None

    def header(self) -> dict[str, Any]:
        """Run metadata that goes first in summary.json (nothing here may vary between equal runs)."""
        sc = self.scenario
        return {
            "mode": self.mode,
            "scenario": sc.name,
            "seed": sc.seed,
            "model": sc.model,
            "hardware": sc.hardware,
            "tensor_parallel": sc.tensor_parallel,
            "scheduler": sc.scheduler_name,
            "preemption_mode": sc.policy.preemption_mode,
            "cost_model": sc.cost_model.type,
            "num_replicas": sc.cluster.num_replicas,
            "router": sc.cluster.router,
            "kv_num_blocks": self.kv.num_blocks,
            "kv_block_size": self.kv.block_size,
            "kv_blocks_from": self.kv.source,
        }


def run_replicas(
    env: simpy.Environment,
    sc: Scenario,
    requests: Sequence[Request],
    make_replica_parts,  # callable(replica_index) -> (Scheduler, Executor)
    progress: bool | None,
    fast_forward: bool = True,
    iterations: IterationsMode = "full",
    on_turn=None,  # callable(answered turn, next turn) -> None: see Cluster.on_turn  # noqa: ANN001
    bin_after: int | None = None,
) -> tuple[MetricsRecorder, list[Replica]]:
    """Drive ``requests`` through ``sc.cluster`` replicas on ``env`` and return the metrics.

    ``fast_forward`` False makes every step go through schedule/update (the plain loop the
    fast-forward is tested against); a realtime (live) environment never fast-forwards.
    ``bin_after``: full rows until that many steps, time bins from there (``MetricsRecorder``)."""
    recorder = MetricsRecorder(num_replicas=sc.cluster.num_replicas, iterations=iterations, bin_after=bin_after)
    replicas = []
    for r in range(sc.cluster.num_replicas):
        scheduler, executor = make_replica_parts(r)
        replicas.append(Replica(env, r, scheduler, executor, recorder,
                                async_scheduling=sc.policy.async_scheduling, fast_forward=fast_forward))
    cluster = Cluster(env, replicas, config=sc.cluster, seed=sc.seed)
    cluster.on_turn = on_turn
    drive(cluster, sc.name, requests, recorder, progress)
    return recorder, replicas


# A finished run is cyclic garbage (SimPy's environment, processes and events refer to each
# other, and hold the run's tables). Frozen at the start of the next run and merged back into the
# oldest generation after it, that garbage never met CPython's rule for a full pass, so a process
# that ran many simulations (plan, sweep and search workers, compare) grew by every run: 3.2 GiB
# RSS after 300 random scenarios. A full pass now runs before a run when one is due: the runs
# since the last pass took FULL_PASS_EVERY times as long as that pass did (so passes cost at most
# ~2 % of the runs' time), or the heap has doubled since (counted in pymalloc's blocks:
# sys.getallocatedblocks is cheap where gc.get_freeze_count walks the heap, 10 % of a short run;
# CPython's own quarter ran 57 passes, 7 % of the time, in a minute of engine tests).
FULL_PASS_EVERY = 50.0
# the last pass: its seconds (-1: none yet), run seconds since, the allocator's blocks it kept
_full_pass = {"cost_s": -1.0, "runs_s": 0.0, "heap": 0}


def full_pass_due(blocks: int, blocks_kept: int, runs_s: float, pass_s: float) -> bool:
    """Whether to collect the earlier runs' garbage before a run: none collected yet (``pass_s``
    < 0), the heap's allocated ``blocks`` twice what the last pass kept, or the runs since it took
    ``FULL_PASS_EVERY`` times the ``pass_s`` it cost."""
    return pass_s < 0 or blocks > 2 * blocks_kept or runs_s >= FULL_PASS_EVERY * pass_s


@contextmanager
def _young_gc_only() -> Iterator[None]:
    """Collect less often during a run: the heap built so far (imports, workload, setup) is frozen
    out of the cyclic collector's full passes, and young collections wait for more allocations. A
    run's steps allocate few containers and make almost no cycles, so this only saves the
    collector's passes (~3 % of a long run); settings are restored afterwards. Earlier runs'
    garbage is collected first when a full pass is due (above)."""
    threshold = gc.get_threshold()
    last = _full_pass
    if full_pass_due(sys.getallocatedblocks(), last["heap"], last["runs_s"], last["cost_s"]):
        t = time.perf_counter()
        gc.collect()
        last["cost_s"], last["runs_s"], last["heap"] = time.perf_counter() - t, 0.0, sys.getallocatedblocks()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        last["runs_s"] += time.perf_counter() - t0
        gc.set_threshold(*threshold)
        gc.unfreeze()


@contextmanager
def _running(name: str, num_requests: int, progress: bool | None) -> Iterator[Callable[[int], object]]:
    """A run's progress bar (its ``update``: requests done) and young-only collection around it.
    The bar shows only on runs longer than ~2 s (tqdm's delay), and never when disabled."""
    bar = tqdm(total=num_requests, unit="req", delay=2.0, mininterval=0.5, disable=progress is False,
               desc=name, leave=False)
    try:
        with _young_gc_only():
            yield bar.update
    finally:
        bar.close()


def drive(cluster: Cluster, name: str, requests: Sequence[Request], recorder: MetricsRecorder,
          progress: bool | None) -> None:
    """Run the cluster to the end with a progress bar, then add its replicas' prefix-cache counters."""
    with _running(name, len(requests), progress) as done:
        cluster.on_progress = done
        cluster.run(requests)
    for rep in cluster.replicas:
        kv = rep.scheduler.kv
        recorder.on_prefix_cache(kv.prefix_queries * kv.block_size, kv.prefix_hits * kv.block_size)


AUTO_BINNED_REQUESTS = 100_000  # iterations "auto": time bins from this many requests on
AUTO_BINNED_STEPS = 1 << 20  # and, in a run of fewer, from this many steps on (~120 MB of rows)


def auto_iterations(sc: Scenario, num_requests: int) -> IterationsMode:
    """``--iterations auto``: every step (``full``) for runs under ``AUTO_BINNED_REQUESTS`` requests
    and for a disaggregated cluster (whose pools' summary reads every step), else time bins: a
    million requests make millions of steps, ~120 bytes each as full rows. A ``full`` run that is
    not disaggregated still goes over to bins at its ``AUTO_BINNED_STEPS``-th step (``simulate``)."""
    return "full" if num_requests < AUTO_BINNED_REQUESTS or sc.cluster.disagg is not None else "binned"


def summary_iterations(sc: Scenario) -> IterationsMode:
    """The iterations mode for a caller that reads only a run's summary, requests and ITLs (plan,
    sweep, compare, search): no rows (``off``; the summary is the same in every mode), except for
    a disaggregated cluster, whose pools' summary reads every step (``full``)."""
    return "full" if sc.cluster.disagg is not None else "off"


def simulate(sc: Scenario, requests: Sequence[Request] | None = None, progress: bool | None = None,
             fast_forward: bool = True, iterations: IterationsMode | Literal["auto"] = "full",
             compiled: bool | None = None) -> RunResult:
    """Simulate the scenario (its workload, or the given requests) and summarise the run.

    ``fast_forward`` False: no stretch of decode steps is taken at once (same results, slower).
    ``compiled``: run on the compiled engine (``compiled_engine.py``: the same results, one
    compiled loop) when the compiled step loops are on and the scenario is in its class (None,
    the default), never (False: the Python engine), or always (True: a ScenarioError saying why
    when it cannot).
    ``iterations``: the iterations table holds every step (``full``), time bins of them
    (``binned``) or nothing (``off``), or ``auto`` (``auto_iterations``, and bins from the
    ``AUTO_BINNED_STEPS``-th step of a longer run: the result's ``iterations`` says which); the
    summary is the same in every mode."""
    t0 = time.perf_counter()
    model = get_model(sc.model)
    kv = plan_kv(sc)
    cost = build_cost_model(sc.cost_model, model, sc.cost_hardware(), sc.tensor_parallel, sc.kv_cache.block_size)
    if requests is None:
        # columns; each Request is made when it arrives and dropped once it is recorded
        requests = generate_workload(sc.workload, sc.seed).requests
    elif not isinstance(requests, RequestArrays):  # (columns make a fresh Request at each read)
        for req in requests:
            req.reset_progress()
    row_kernels.use(row_kernels.want(len(requests)))  # compiled step loops for a large run
    bin_after = None
    if iterations == "auto":
        iterations = auto_iterations(sc, len(requests))
        bin_after = AUTO_BINNED_STEPS  # (a disaggregated cluster ignores it: it needs every step)
    env = SimEnvironment()
    if sc.cluster.disagg is not None:
        if compiled:
            raise ScenarioError("the compiled engine cannot run this scenario: a disaggregated cluster")
        result = simulate_disagg(sc, requests, env, progress, t0, iterations)
        if compiled is None and row_kernels.ON:
            result.not_compiled = "a disaggregated cluster"
        return result

    def parts(_r: int):
        return build_scheduler(sc, kv, block_ids=False), SimExecutor(cost, kv.block_bytes,
                                                    overlap_host=sc.policy.async_scheduling)

    built: dict[int, tuple[Scheduler, SimExecutor]] = {}  # replica 0's parts, if built to ask the compiled engine
    why: str | None = None
    if compiled is not False:
        scheduler, executor = built[0] = parts(0)
        why = compiled_engine.reason_not_compiled(sc, requests, scheduler, executor)
        if why is None:
            recorder = MetricsRecorder(num_replicas=sc.cluster.num_replicas, iterations=iterations,
                                       bin_after=bin_after)
            with _running(sc.name, len(requests), progress) as done:
                counters: list[SimpleNamespace] = []
                compiled_engine.run_compiled(requests, scheduler, executor, recorder, done, sc.cluster.num_replicas,
                                             sc.cluster.router, sc.cluster.router_refresh_s, sc.seed, counters)
            # (what the summary reads of each replica: its id and its block manager's prefix counters)
            replicas = [SimpleNamespace(replica_id=r, scheduler=SimpleNamespace(kv=kv_r))
                        for r, kv_r in enumerate(counters)]
            result = finish_run(sc, "sim", requests, recorder, kv, time.perf_counter() - t0, replicas)
            result.engine = "compiled"
            return result
        if compiled:
            raise ScenarioError(f"the compiled engine cannot run this scenario: {why}")
    recorder, replicas = run_replicas(env, sc, requests, lambda r: built.pop(r, None) or parts(r), progress,
                                      fast_forward, iterations, bin_after=bin_after)
    result = finish_run(sc, "sim", requests, recorder, kv, time.perf_counter() - t0, replicas)
    if compiled is None and row_kernels.ON:
        result.not_compiled = why
    return result


def simulate_disagg(sc: Scenario, requests: Sequence[Request], env: simpy.Environment, progress: bool | None,
                    t0: float, iterations: IterationsMode = "full") -> RunResult:
    """Simulate a disaggregated cluster (``cluster.disagg``): prefill pool, KV link, decode pool.

    The cluster checks each request's state at the end, so the requests are objects held for the
    whole run (not made as they arrive); the pools' summary reads every step, so ``iterations``
    must be ``full``."""
    if iterations != "full":
        raise ScenarioError(f"cluster.disagg: --iterations {iterations} is not supported for a disaggregated "
                            "cluster (its pools' summary reads every step); use --iterations full")
    requests = list(requests)
    cfg = sc.cluster.disagg
    model = get_model(sc.model)
    pools = {role: pool_scenario(sc, role) for role in ("prefill", "decode")}
    n_pre = pools["prefill"].cluster.num_replicas
    recorder = MetricsRecorder(num_replicas=n_pre + pools["decode"].cluster.num_replicas)
    reps: dict[str, list[Replica]] = {}
    kvs: dict[str, KVPlan] = {}
    for role, psc in pools.items():
        kvs[role] = kv = plan_kv(psc)
        cost = build_cost_model(psc.cost_model, model, psc.cost_hardware(), psc.tensor_parallel,
                                psc.kv_cache.block_size)
        rec = PrefillRecorder(recorder) if role == "prefill" else recorder
        first = 0 if role == "prefill" else n_pre
        reps[role] = [Replica(env, first + i, build_scheduler(psc, kv, block_ids=False),
                              SimExecutor(cost, kv.block_bytes, overlap_host=psc.policy.async_scheduling), rec,
                              async_scheduling=psc.policy.async_scheduling)
                      for i in range(psc.cluster.num_replicas)]
    dec_kv = reps["decode"][0].scheduler.kv
    if requests:
        smallest = min(r.prompt_len + r.output_len - 1 for r in requests)
        if dec_kv.blocks_for(smallest) > dec_kv.num_blocks - dec_kv.watermark_blocks:
            raise ScenarioError(f"cluster.disagg.decode.kv_cache: a decode instance's {dec_kv.num_blocks} KV blocks "
                                f"cannot hold even the smallest request ({smallest} tokens of KV); give the decode "
                                "pool more KV memory (kv_cache.num_blocks or gpu_memory_utilization)")
    cluster = DisaggCluster(env, reps["prefill"], reps["decode"], cfg, kv_block_bytes(model, 1, 1),
                            min(pools["prefill"].tensor_parallel, pools["decode"].tensor_parallel),
                            refresh_s=sc.cluster.router_refresh_s, seed=sc.seed)
    drive(cluster, sc.name, requests, recorder, progress)
    result = finish_run(sc, "sim", requests, recorder, kvs["decode"], time.perf_counter() - t0, cluster.replicas)
    makespan = float(result.requests_df["finish_time"].max()) if len(result.requests_df) else 0.0
    result.summary["pools"] = cluster.pool_summary(result.iterations_df, makespan if makespan == makespan else 0.0)
    return result


def finish_run(sc: Scenario, mode: str, requests: Sequence[Request], recorder: MetricsRecorder, kv: KVPlan,
               wall_s: float, replicas: list[Replica] | None = None) -> RunResult:
    ids = recorder.request_columns()["request_id"]
    requests_df = recorder.requests_frame(np.argsort(ids, kind="stable"), release=True)
    iterations_df = recorder.iterations_frame()
    hist = recorder.itl_histogram
    summary = summarize(requests_df, iterations_df, hist, slo=sc.slo or None,
                        prefix_cache=(recorder.prefix_cache_queries, recorder.prefix_cache_hits),
                        iteration_stats=recorder.iteration_summary())
    if replicas is not None and len(replicas) > 1:
        # per replica: requests served, prefix-cache hit rate, busy share (issue 17)
        busy = recorder.busy_by_replica()
        makespan = float(requests_df["finish_time"].max()) if len(requests_df) else 0.0
        summary["replicas"] = replica_summary(replicas, requests_df["replica"].to_numpy(),
                                              makespan if makespan == makespan else 0.0,
                                              [float(busy[r.replica_id]) for r in replicas])
    return RunResult(sc, mode, requests, requests_df, iterations_df, summary, hist, kv, wall_s,
                     iterations=recorder.iterations_mode)


def write_results(result: RunResult, out_dir: str | Path, plots: bool = True) -> Path:
    """Write the run folder: parquet tables, the resolved scenario, plots, and summary.json last.

    An interrupted write leaves no summary.json (``write_run`` removes the old one first and
    writes it last), so a folder holding one is a complete run.
    """
    out = begin_folder(out_dir, "summary.json")
    write_text(out / "scenario.yaml", scenario_to_yaml(result.scenario))
    if plots:
        from .plots import plot_run  # matplotlib import is slow; only when plotting

        plot_run(out, result.requests_df, result.iterations_df, result.itl_hist)
    write_run(out, result.requests_df, result.iterations_df, result.summary, result.itl_hist, extra=result.header())
    return out


def default_out_dir(sc: Scenario, mode: str = "sim") -> Path:
    if sc.output_dir:
        return Path(sc.output_dir)
    suffix = "" if mode == "sim" else f"-{mode}"
    return Path("results") / f"{sc.name}{suffix}"
