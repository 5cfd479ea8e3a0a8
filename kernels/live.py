"""Live mode: the simulator's own schedulers drive the real model on real kernels.

``run_live`` builds each replica with ``servesim.sim.simulate.build_scheduler`` — the very
function simulation uses — and swaps only the executor: ``LiveExecutor`` runs the Batch through
``ModelRunner`` on a paged KV cache tensor whose rows are the block manager's block ids, appends
each sampled token to its request, and returns the seconds the step took. The engine loop runs
unchanged on ``simpy.rt.RealtimeEnvironment(strict=False)``: requests arrive at their wall-clock
times and every step advances the clock by what it really took.
"""

from __future__ import annotations

import time

import numpy as np
import simpy.rt
import torch
from servesim.sim.batch import Batch
from servesim.sim.host_memory import format_bytes, host_memory_bytes
from servesim.sim.kv_cache import BlockManager
from servesim.sim.presets import get_model
from servesim.sim.request import Request, RequestState
from servesim.sim.scenario import Scenario, ScenarioError
from servesim.sim.sessions import later_turns
from servesim.sim.simulate import KVPlan, RunResult, build_scheduler, finish_run, plan_kv, run_replicas
from servesim.sim.workload import generate_requests

from .host import keep_heap
from .model import LlamaModel
from .runner import KVCache, ModelRunner

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_GRAPH_BATCH = 512  # vLLM's largest CUDA-graph capture size; bigger decode steps run eagerly
MAX_PIECEWISE_TOKENS = 8192  # piecewise graphs' largest token count; bigger steps run eagerly


class LiveExecutor:
    """Executes a scheduler Batch on the model; returns measured seconds."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager) -> None:
        self.runner = runner
        self.kv = block_manager
        self.cuda = runner.model.device.type == "cuda"
        self.last_forward_s = 0.0
        self.num_steps = 0
        self.shapes: list[tuple[np.ndarray, np.ndarray]] = []  # each step's rows, for validate's step check
        self.request_ids: list[np.ndarray] = []  # ... and whose they are, for its dynamics check (--replay-steps)
        self.seconds: list[float] = []  # each step's executor time (the forward and its input preparation)
        # ... and its host part: from the step's start until the forward was launched (ModelRunner.execute_timed)
        self.host_seconds: list[float] = []
        self.graphed: list[bool] = []  # ... and whether it ran a CUDA-graph path (live.cuda_graphs / piecewise_graphs)

    def run(self, batch: Batch) -> float:
        t0 = time.perf_counter()
        self.shapes.append((batch.num_new_tokens.copy(), batch.num_context_tokens.copy()))
        requests = batch.requests
        self.request_ids.append(np.fromiter((r.request_id for r in requests), dtype=np.int64, count=len(requests)))
        tables = [self.kv.block_table(r) for r in requests]
        tokens, launched = self.runner.execute_timed(batch, tables)
        self.graphed.append(self.runner.graphed)
        if self.cuda:
            torch.cuda.synchronize()
        # EOS is ignored (as in serving benchmarks): every request generates exactly output_len tokens.
        sampling = [r for r, s in zip(requests, batch.samples.tolist(), strict=True) if s]
        for req, tok in zip(sampling, tokens, strict=True):
            req.output_token_ids.append(tok)
        self.last_forward_s = time.perf_counter() - t0
        self.seconds.append(self.last_forward_s)
        self.host_seconds.append(launched - t0)
        self.num_steps += 1
        return self.last_forward_s


def _segment_tokens(seed: int, segment: int, length: int, vocab: int) -> list[int]:
    """The token ids a content segment stands for (the same segment, the same tokens)."""
    return np.random.default_rng([seed, segment]).integers(0, vocab, length).tolist()


class SessionTokens:
    """Token ids for multi-turn sessions: a first turn's prompt is its segments' tokens (system
    prompt, user message); a later turn's prompt is written when the turn before it is answered
    (``Cluster.on_turn``): that turn's prompt and the reply the model generated, then the new
    message. Content that agrees agrees in tokens, so the prefix cache, which keys a session turn by
    its segments, finds in live mode what it finds in simulation."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.seed, self.vocab = seed, vocab

    def first_turns(self, requests: list[Request], later: set[int]) -> None:
        """Token ids of every turn but the ``later`` ones (request ids), which ``__call__`` writes."""
        for r in requests:
            if r.request_id not in later:
                r.prompt_token_ids = [t for seg, n in list(r.segments)[:-1]
                                      for t in _segment_tokens(self.seed, seg, n, self.vocab)]

    def __call__(self, answered: Request, turn: Request) -> None:
        seen = answered.prompt_len + answered.output_len
        done = answered.all_token_ids()
        if answered.state != RequestState.FINISHED or len(done) != seen:  # rejected: the reply as described
            seg, n = list(answered.segments)[-1]
            done = list(answered.prompt_token_ids or []) + _segment_tokens(self.seed, seg, n, self.vocab)
        seg, n = list(turn.segments)[-2]  # the new user message (the last segment is its reply)
        turn.prompt_token_ids = done[:seen] + _segment_tokens(self.seed, seg, n, self.vocab)


def _prepare_requests(sc: Scenario, requests: list[Request] | None, tokens: SessionTokens) -> list[Request]:
    if requests is None:
        wl = sc.workload
        if not wl.token_ids and wl.sessions is None:
            # live mode needs real token ids; they come from their own seeded stream, so arrivals
            # and lengths stay identical to the simulated run of the same scenario
            wl = wl.model_copy(update={"token_ids": True, "vocab_size": get_model(sc.model).vocab_size})
        requests = generate_requests(wl, sc.seed)
    else:
        for r in requests:
            r.reset_progress()
    vocab = get_model(sc.model).vocab_size
    later = later_turns(requests)
    if later:  # multi-turn sessions: first turns now, later ones as their previous turn is answered
        tokens.first_turns(requests, later)
    for r in requests:
        if r.request_id in later:
            r.prompt_token_ids = None
            continue
        if r.prompt_token_ids is None or len(r.prompt_token_ids) != r.prompt_len:
            raise ScenarioError(f"request {r.request_id}: live mode needs prompt_token_ids of length prompt_len")
        if max(r.prompt_token_ids, default=0) >= vocab:
            raise ScenarioError(
                f"request {r.request_id}: token id >= the model's vocab_size {vocab}; set workload.vocab_size"
            )
    return requests


def build_live_replica(sc: Scenario, kv: KVPlan, seed: int = 0):  # noqa: ANN201
    """(scheduler, LiveExecutor) of one replica: the simulator's scheduler over a real cache."""
    live = sc.live
    if live.device == "cuda" and not torch.cuda.is_available():
        raise ScenarioError("live.device: cuda requested but torch sees no GPU; use live.device: cpu")
    if live.backend == "triton" and live.device == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ScenarioError("live.backend: triton on a CPU needs TRITON_INTERPRET=1 set before starting")
    model_cfg = get_model(sc.model)
    dtype = DTYPES[live.dtype]
    scheduler = build_scheduler(sc, kv)
    model = LlamaModel(model_cfg, dtype=dtype, device=live.device, seed=seed, backend=live.backend)
    cache = KVCache(model_cfg, kv.num_blocks, kv.block_size, dtype=dtype, device=live.device,
                    num_host_blocks=kv.num_host_blocks)
    runner = ModelRunner(model, cache, kv.block_size)
    longest = kv.num_blocks * kv.block_size  # no sequence outgrows the cache
    if scheduler.config.max_model_len is not None:
        longest = min(longest, scheduler.config.max_model_len)
    if live.cuda_graphs:
        runner.use_decode_graphs(min(scheduler.max_num_seqs, MAX_GRAPH_BATCH), longest)
    if live.piecewise_graphs:
        runner.use_piecewise_graphs(min(scheduler.max_num_batched_tokens, MAX_PIECEWISE_TOKENS), longest)
    return scheduler, LiveExecutor(runner, scheduler.kv)


def _warm_up(executor: LiveExecutor, steps: int, block_size: int) -> None:
    """Untimed forwards so the first measured step does not pay one-off allocation costs."""
    if steps <= 0:
        return
    kv = executor.kv
    probe = Request(-1, 0.0, 2 * block_size, 1, prompt_token_ids=list(range(2 * block_size)))
    if not kv.allocate(probe, probe.prompt_len):
        return
    batch = Batch.of([probe], [probe.prompt_len], [0])
    for _ in range(steps):
        executor.runner.execute(batch, [kv.block_table(probe)])
    kv.free(probe)


def check_live_fits(sc: Scenario, kv: KVPlan, memory_bytes: int | None = None) -> None:
    """Refuse, before anything is allocated, a live run whose weights and KV tensors cannot fit.

    Every replica builds the model with random weights in ``live.dtype`` and its KV tensors
    (device blocks, plus host blocks for swap); on ``live.device: cpu`` all of it lives in this
    machine's memory, on ``cuda`` the device's. ``memory_bytes`` overrides the limit (tests)."""
    model_cfg = get_model(sc.model)
    dtype = DTYPES[sc.live.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    block = KVCache.block_bytes(model_cfg, kv.block_size, dtype)
    n = sc.cluster.num_replicas
    weights = n * model_cfg.num_params * elem
    device_kv, host_kv = n * kv.num_blocks * block, n * kv.num_host_blocks * block
    if sc.live.device == "cpu":
        limit, where, need = memory_bytes or host_memory_bytes(), "this machine has", weights + device_kv + host_kv
    else:
        total = memory_bytes or (torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else None)
        limit, where, need = total, "the GPU has", weights + device_kv
    if limit is None or need <= limit:
        return
    kv_field = {"num_blocks": "kv_cache.num_blocks", "kv_cache_memory_mb": "live.kv_cache_memory_mb"}.get(
        kv.source, f"kv_cache.{kv.source}")
    field = "model" if weights >= device_kv + (host_kv if sc.live.device == "cpu" else 0) else kv_field
    raise ScenarioError(
        f"{field}: live mode builds {sc.model} with random weights: {n} x {format_bytes(weights / n)} of "
        f"{sc.live.dtype} weights and {format_bytes(device_kv + host_kv)} of KV cache ({kv.num_blocks} blocks"
        f"{f' + {kv.num_host_blocks} swap' if kv.num_host_blocks else ''} per replica) need {format_bytes(need)}, "
        f"{where} {format_bytes(limit)}; use a smaller model (model: tiny, as scenarios/live-cpu-*.yaml do), "
        "a smaller live.kv_cache_memory_mb or live.dtype: bfloat16")


def run_live(sc: Scenario, requests: list[Request] | None = None, progress: bool | None = None) -> RunResult:
    """Replay the scenario's workload on the real model in real time; same RunResult as ``simulate``."""
    if sc.cluster.disagg is not None:
        raise ScenarioError("cluster.disagg: live mode runs colocated replicas only; a disaggregated cluster is "
                            "simulated (servesim run), not run live")
    if sc.workload.trace is not None and sc.workload.trace.format == "mooncake":
        raise ScenarioError("workload.trace.format: live mode does not replay a Mooncake trace (block hashes, no "
                            "token ids); simulate it with servesim run")
    if sc.live.threads:
        torch.set_num_threads(sc.live.threads)
    if sc.live.device == "cpu":
        keep_heap()
    model_cfg = get_model(sc.model)
    kv = plan_kv(sc, KVCache.block_bytes(model_cfg, sc.kv_cache.block_size, DTYPES[sc.live.dtype]))
    check_live_fits(sc, kv)
    tokens = SessionTokens(sc.seed, model_cfg.vocab_size)
    requests = _prepare_requests(sc, requests, tokens)
    parts = [build_live_replica(sc, kv, seed=sc.seed) for _ in range(sc.cluster.num_replicas)]
    for _, executor in parts:
        _warm_up(executor, sc.live.warmup_steps, kv.block_size)
    env = simpy.rt.RealtimeEnvironment(factor=1.0, strict=False)
    t0 = time.perf_counter()
    env.sync()  # time zero is now, after model construction and warm-up
    recorder, _ = run_replicas(env, sc, requests, lambda r: parts[r], progress,
                               on_turn=tokens if sc.workload.sessions is not None else None)
    result = finish_run(sc, "live", requests, recorder, kv, time.perf_counter() - t0)
    if len(parts) == 1:
        executor = parts[0][1]
        result.step_shapes = executor.shapes
        result.step_forward_s = np.asarray(executor.seconds)
        result.step_request_ids = executor.request_ids
        if len(executor.seconds) == len(result.iterations_df):  # one row per step (not binned)
            # The executor's time of each step and its host part, beside the step's duration: on a
            # GPU, host_s close to forward_s is a host-bound step (README "H200").
            result.iterations_df["forward_s"] = executor.seconds
            result.iterations_df["host_s"] = executor.host_seconds
            if sc.live.cuda_graphs or sc.live.piecewise_graphs:
                result.iterations_df["graphed"] = executor.graphed
    return result
