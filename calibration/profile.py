"""Time real engine steps: the live executor's step over each grid shape, and the engine loop.

``measure_shapes`` runs each ``Shape`` through ``LiveExecutor.run`` — the exact call live mode
makes each iteration: input preparation, the model forward on the paged cache, the sampled
tokens appended — on a model with random weights. Every timed run directly follows an untimed
run of the same shape (caches and allocator warm, as in a live run where consecutive steps look
alike), and the shapes are timed in rounds, each round in a fresh random order, so that a slow
minute of a noisy machine spreads over all shapes instead of biasing a few. On CUDA the executor
synchronises before it stops the clock.

``measure_engine_overhead`` times the host work *around* the executor — ``scheduler.update``,
the metrics, ``scheduler.schedule`` and the event loop — by driving a burst of requests through
the real ``Replica`` loop with the live executor, and fits ``step_s + per_seq_s * rows`` to the
gaps between consecutive executor calls.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from scipy.optimize import nnls
from servesim.sim.batch import Batch
from servesim.sim.engine import SimEnvironment
from servesim.sim.kv_cache import BlockManager
from servesim.sim.presets import ModelConfig
from servesim.sim.request import Request
from servesim.sim.scenario import scenario_from_dict
from servesim.sim.simulate import plan_kv, run_replicas
from servesim.sim.workload import generate_requests
from tqdm import tqdm

from .grid import Shape


@dataclass
class Bench:
    """A model on a paged cache with its block manager: what a calibration sweep runs on."""

    executor: object  # servesim.kernels.live.LiveExecutor
    kv: BlockManager
    config: ModelConfig


def make_bench(config: ModelConfig, shapes: Iterable[Shape], *, backend: str, device: str, dtype: str,
               block_size: int, seed: int = 0, cuda_graphs: bool = False, piecewise_graphs: bool = False) -> Bench:
    """A ``LiveExecutor`` over a cache just big enough for the largest shape; ``cuda_graphs``: its
    decode-only shapes replay CUDA graphs as in a live run with ``live.cuda_graphs``."""
    from servesim.kernels.live import DTYPES, MAX_GRAPH_BATCH, MAX_PIECEWISE_TOKENS, LiveExecutor
    from servesim.kernels.model import LlamaModel
    from servesim.kernels.runner import KVCache, ModelRunner

    shapes = list(shapes)
    need = max(sum(-(-(q + c) // block_size) for q, c in zip(s.q, s.ctx, strict=True)) for s in shapes)
    model = LlamaModel(config, dtype=DTYPES[dtype], device=device, seed=seed, backend=backend)
    cache = KVCache(config, need + 1, block_size, dtype=DTYPES[dtype], device=device)
    kv = BlockManager(need + 1, block_size)
    runner = ModelRunner(model, cache, block_size)
    longest = max(q + c for s in shapes for q, c in zip(s.q, s.ctx, strict=True))
    if cuda_graphs:
        runner.use_decode_graphs(min(max(len(s.q) for s in shapes), MAX_GRAPH_BATCH), longest)
    if piecewise_graphs:
        runner.use_piecewise_graphs(min(max(s.num_tokens for s in shapes), MAX_PIECEWISE_TOKENS), longest)
    return Bench(LiveExecutor(runner, kv), kv, config)


def _step(bench: Bench, shape: Shape, rng: np.random.Generator) -> tuple[Batch, list[Request]]:
    vocab = bench.config.vocab_size
    reqs = []
    for i, (q, c) in enumerate(zip(shape.q, shape.ctx, strict=True)):
        n = q + c
        r = Request(i, 0.0, n, 1, prompt_token_ids=rng.integers(0, vocab, n).tolist())
        if not bench.kv.allocate(r, n):
            raise RuntimeError(f"calibration cache too small for shape {shape.key}")
        reqs.append(r)
    return Batch.of(reqs, list(shape.q), list(shape.ctx)), reqs


@contextmanager
def stepped(bench: Bench, shape: Shape, rng: np.random.Generator) -> Iterator[tuple[Batch, list[Request]]]:
    """The batch of ``shape`` and its requests, their KV blocks held for the ``with`` block and freed after."""
    batch, reqs = _step(bench, shape, rng)
    try:
        yield batch, reqs
    finally:
        for r in reqs:
            bench.kv.free(r)


def time_shape(bench: Bench, shape: Shape, rng: np.random.Generator) -> float:
    """Seconds of one executor step of ``shape``, right after an untimed run of it."""
    with stepped(bench, shape, rng) as (batch, reqs):
        bench.executor.run(batch)
        for r in reqs:
            r.output_token_ids.clear()
        batch = Batch.of(reqs, list(shape.q), list(shape.ctx))
        return bench.executor.run(batch)


def measure_shapes(bench: Bench, shapes: list[Shape], rounds: int, seed: int = 0, rnd0: int = 0,
                   repeat: dict[str, int] | None = None, bar: tqdm | None = None) -> list[dict]:
    """One row per timed step: round, shape key, regime and seconds.

    ``repeat`` times a regime's shapes that many times per round (cheap decode steps are the
    noisiest, relative to their length, and the cheapest to repeat).
    """
    rng = np.random.default_rng(seed + rnd0)
    repeat = repeat or {}
    rows: list[dict] = []
    for rnd in range(rnd0, rnd0 + rounds):
        order = [i for i in range(len(shapes)) for _ in range(repeat.get(shapes[i].regime, 1))]
        for i in rng.permutation(order).tolist():
            s = shapes[i]
            rows.append({"round": rnd, "shape": s.key, "regime": s.regime, "seconds": time_shape(bench, s, rng)})
            if bar is not None:
                bar.update()
    return rows


def gemm_points(max_tokens: int) -> list[int]:
    """M values the GEMM tables are measured at: every M to 32, then ~12 % steps, and max_tokens."""
    points, m = list(range(1, min(32, max_tokens) + 1)), 32.0
    while m < max_tokens:
        m *= 1.125
        points.append(min(int(round(m)), max_tokens))
    return sorted(set(points))


def gemm_tables(rows: list[dict]) -> dict[str, list]:
    """The profile's ``gemm_tables`` from ``measure_gemm_round`` rows: the median per M."""
    df = pd.DataFrame(rows).groupby("m").median()
    return {"tokens": [int(m) for m in df.index], "linear_s": df["linear_s"].tolist(),
            "lm_head_s": df["lm_head_s"].tolist()}


def measure_gemm_round(bench: Bench, points: list[int], seed: int = 0, calls: int = 3) -> list[dict]:
    """One shuffled round of GEMM timings: all decoder layers' GEMMs (qkv, o, gate_up, down) and
    the LM head, each at M = every point; a value is the mean of ``calls`` calls after one untimed.

    The weights are the bench model's own; inputs are random activations of M rows.
    """
    import torch.nn.functional as F  # noqa: N812

    model = bench.executor.runner.model
    cfg = bench.config
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def inputs(m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def r(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device=model.device, dtype=model.dtype)
        return r(m, cfg.hidden_size), r(m, cfg.num_heads * cfg.head_dim), r(m, cfg.intermediate_size)

    def layers(x: torch.Tensor, o: torch.Tensor, act: torch.Tensor) -> None:
        for w in model.layers:
            F.linear(x, w.qkv, w.qkv_bias)
            F.linear(o, w.o)
            F.linear(x, w.gate_up)
            F.linear(act, w.down)

    def head(x: torch.Tensor, o: torch.Tensor, act: torch.Tensor) -> None:
        F.linear(x, model.lm_head)

    def timed(fn, args) -> float:  # noqa: ANN001
        fn(*args)
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        sync()
        return (time.perf_counter() - t0) / calls

    rows = []
    with torch.inference_mode():
        for i in rng.permutation(len(points)).tolist():
            m = points[i]
            args = inputs(m)
            rows.append({"m": m, "linear_s": timed(layers, args), "lm_head_s": timed(head, args)})
    return rows


@dataclass
class EngineOverhead:
    step_s: float
    per_seq_s: float
    samples: int
    median_gap_s: float


def measure_engine_overhead(model: str, scheduler: dict, *, backend: str, device: str, dtype: str,
                            block_size: int, num_requests: int, max_tokens: int, seed: int = 0,
                            progress: bool | None = None, cuda_graphs: bool = False,
                            piecewise_graphs: bool = False) -> EngineOverhead:
    """Host time per iteration outside the executor, from the real replica loop on a burst."""
    from servesim.kernels.live import DTYPES, build_live_replica
    from servesim.kernels.runner import KVCache

    sc = scenario_from_dict({
        "name": "calibrate-engine-loop", "seed": seed, "model": model, "hardware": "cpu-2core",
        "scheduler": scheduler, "kv_cache": {"block_size": block_size, "num_blocks": 4096},
        "live": {"backend": backend, "device": device, "dtype": dtype, "cuda_graphs": cuda_graphs,
                 "piecewise_graphs": piecewise_graphs},
        "workload": {"num_requests": num_requests, "arrival": {"process": "poisson", "rate": 1e6},
                     "prompt_len": {"dist": "uniform", "min": 16, "max": max(16, max_tokens // 2)},
                     "output_len": {"dist": "uniform", "min": 8, "max": 64},
                     "token_ids": True, "vocab_size": 1024},
    })
    from servesim.sim.presets import get_model

    kvp = plan_kv(sc, KVCache.block_bytes(get_model(model), block_size, DTYPES[dtype]))
    scheduler_obj, executor = build_live_replica(sc, kvp, seed=seed)
    calls: list[tuple[float, float, int]] = []
    run = executor.run

    def timed_run(batch: Batch) -> float:
        t0 = time.perf_counter()
        dt = run(batch)
        calls.append((t0, time.perf_counter(), batch.size))
        return dt

    executor.run = timed_run  # type: ignore[method-assign]
    requests = generate_requests(sc.workload, sc.seed)
    run_replicas(SimEnvironment(), sc, requests, lambda _r: (scheduler_obj, executor), progress)
    starts = np.array([c[0] for c in calls[1:]])
    ends = np.array([c[1] for c in calls[:-1]])
    rows = np.array([c[2] for c in calls[1:]], dtype=np.float64)
    gaps = starts - ends
    keep = gaps < np.percentile(gaps, 99)  # a stray context switch is not engine work
    a = np.stack([np.ones(keep.sum()), rows[keep]], axis=1)
    scale = np.abs(a).max(axis=0)
    coef, _ = nnls(a / scale, gaps[keep])
    coef /= scale
    return EngineOverhead(float(coef[0]), float(coef[1]), int(keep.sum()), float(np.median(gaps)))


def device_info(device: str) -> dict:
    """Device and host description for a profile's provenance."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):  # noqa: SIM115 - read a few lines
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"device": device, "cpu_model": cpu, "torch_threads": torch.get_num_threads(),
            "torch_version": torch.__version__}
    try:
        import triton

        info["triton_version"] = triton.__version__
    except ImportError:
        info["triton_version"] = None
    if device == "cuda":
        info["device_name"] = torch.cuda.get_device_name()
        info["cuda_version"] = torch.version.cuda
    else:
        info["device_name"] = cpu
    return info
