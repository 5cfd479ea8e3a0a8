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
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import simpy
import torch
from scipy.optimize import nnls
from servesim.sim.batch import Batch
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
               block_size: int, seed: int = 0) -> Bench:
    """A ``LiveExecutor`` over a cache just big enough for the largest shape."""
    from servesim.kernels.live import DTYPES, LiveExecutor
    from servesim.kernels.model import LlamaModel
    from servesim.kernels.runner import KVCache, ModelRunner

    need = max(sum(-(-(q + c) // block_size) for q, c in zip(s.q, s.ctx, strict=True)) for s in shapes)
    model = LlamaModel(config, dtype=DTYPES[dtype], device=device, seed=seed, backend=backend)
    cache = KVCache(config, need + 1, block_size, dtype=DTYPES[dtype], device=device)
    kv = BlockManager(need + 1, block_size)
    return Bench(LiveExecutor(ModelRunner(model, cache, block_size), kv), kv, config)


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


def time_shape(bench: Bench, shape: Shape, rng: np.random.Generator) -> float:
    """Seconds of one executor step of ``shape``, right after an untimed run of it."""
    batch, reqs = _step(bench, shape, rng)
    try:
        bench.executor.run(batch)
        for r in reqs:
            r.output_token_ids.clear()
        batch = Batch.of(reqs, list(shape.q), list(shape.ctx))
        return bench.executor.run(batch)
    finally:
        for r in reqs:
            bench.kv.free(r)


def measure_shapes(bench: Bench, shapes: list[Shape], rounds: int, seed: int = 0,
                   progress: bool | None = None) -> list[dict]:
    """One row per timed step: round, shape key, regime and seconds."""
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    with tqdm(total=rounds * len(shapes), unit="step", desc="calibrate: timing shapes", disable=progress is False,
              mininterval=0.5) as bar:
        for rnd in range(rounds):
            for i in rng.permutation(len(shapes)).tolist():
                s = shapes[i]
                rows.append({"round": rnd, "shape": s.key, "regime": s.regime, "seconds": time_shape(bench, s, rng)})
                bar.update()
    return rows


@dataclass
class EngineOverhead:
    step_s: float
    per_seq_s: float
    samples: int
    median_gap_s: float


def measure_engine_overhead(model: str, scheduler: dict, *, backend: str, device: str, dtype: str,
                            block_size: int, num_requests: int, max_tokens: int, seed: int = 0,
                            progress: bool | None = None) -> EngineOverhead:
    """Host time per iteration outside the executor, from the real replica loop on a burst."""
    from servesim.kernels.live import DTYPES, build_live_replica
    from servesim.kernels.runner import KVCache

    sc = scenario_from_dict({
        "name": "calibrate-engine-loop", "seed": seed, "model": model, "hardware": "cpu-2core",
        "scheduler": scheduler, "kv_cache": {"block_size": block_size, "num_blocks": 4096},
        "live": {"backend": backend, "device": device, "dtype": dtype},
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
    run_replicas(simpy.Environment(), sc, requests, lambda _r: (scheduler_obj, executor), progress)
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
