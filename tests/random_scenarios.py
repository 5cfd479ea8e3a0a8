"""Random valid scenarios and the invariants every run must keep, whatever the configuration.

``scenario(seed)`` draws one scenario: a model and GPU (roofline or a shipped GPU profile, TP 1-4),
a policy or engine preset with its knobs (budgets, seats, preemption mode, async scheduling,
chunking, thresholds, priority), a KV cache from 40 blocks up, prefix caching, workloads from one
request to a few hundred (Poisson, bursty gamma, constant; fixed, uniform, lognormal and Zipf
lengths; shared prefixes; multi-turn sessions), several replicas behind every router, or a
disaggregated prefill/decode cluster. ``problems(raw)`` simulates it and lists what is wrong:

- every request is reported once, finished with all its tokens or rejected with a reason (the
  engine's own conservation check raises otherwise: a stall that strands requests is a failure);
- times are ordered (arrival <= first token <= finish) and finite;
- the same seed gives the same ``summary.json``;
- the plain loop (no fast-forward, Python engine) gives the same summary (several replicas: mean and
  std ITL may differ in the last bits, as the README's Architecture section says);
- ``iterations`` ``binned`` and ``off`` give the same summary and requests table as ``full``;
- the model as a Hugging Face config.json (under another name) and the GPU as a hardware file of
  ``base: PRESET`` give the same requests table and summary as the presets.

``knobs_scenario(seed)`` turns rarer knobs (watermark, memory share, a disaggregated pool's own
scheduler and KV, scraping routers). ``session_scenario(seed)`` puts multi-turn sessions on the scenario's engine and cluster (a
disaggregated one too). ``trace_scenario(seed, folder)`` runs the same engines on a random trace file (csv, Azure,
BurstGPT, Mooncake) with unsorted rows, tied times and zero lengths.

``round_trip(seed)`` simulates a random ``vllm-v1`` run, writes it as an LLMServingSim run folder
(engine clock offset from the client's) and checks that ``validate --against`` reproduces every
request's TTFT and E2E.

Found with it (``tests/test_disagg.py`` keeps each): a disaggregated cluster under async
scheduling stalled its KV pulls; a decode instance's preempted request waited for blocks that the
transferred requests queued behind it held; SGLang pools stopped admitting or pulled more than
they could start; an Azure trace whose datetimes Python's isoformat wrote (some without
fractions) was refused; sessions on a disaggregated cluster crashed when a one-token turn was
answered in the prefill pool; with async scheduling a transferred request reached the decode
queue behind a preempted one. ``tests/test_random_scenarios.py`` runs a fixed set of seeds (more with ``-m
slow``); ``python tests/random_scenarios.py --start 0 --count 300`` searches further and prints
each failing scenario as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from servesim.sim.errors import ScenarioError
from servesim.sim.presets import get_model
from servesim.sim.scenario import scenario_from_dict
from servesim.sim.simulate import simulate

GPU_MODELS = [("h100-sxm", "llama-3.1-8b"), ("a100-80g", "llama-3-8b"), ("l40s", "mistral-7b"),
              ("rtx-4090", "llama-3.2-1b"), ("h200", "qwen2.5-7b"), ("rtx-pro-6000", "qwen3-32b")]
PROFILES = [("rtx-pro-6000", "llama-3.1-8b", 1), ("rtx-pro-6000", "llama-3.1-8b", 2), ("rtx-pro-6000", "qwen3-32b", 2),
            ("rtx-4090", "llama-3.1-8b", 1), ("h100-sxm", "llama-3.1-8b", 1), ("a100-80g", "llama-3-8b", 1),
            ("h100-sxm", "llama-2-7b", 1)]
PRESETS = ["vllm-v1", "vllm-v0", "hf-transformers", "tensorrt-llm", "triton-dynamic", "sglang"]
ROUTERS = ["round_robin", "least_outstanding", "kv_aware", "least_kv_usage", "power_of_two_choices", "prefix_aware"]


def _scheduler(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["static", "continuous", "chunked", "preset"])
    if kind == "preset":
        sch: dict[str, Any] = {"preset": rng.choice(PRESETS)}
        if sch["preset"] == "sglang" and rng.random() < 0.5:
            sch["chunked_prefill_size"] = rng.choice([-1, 512, 4096])
        if sch["preset"] == "hf-transformers" and rng.random() < 0.5:
            sch["scheduler_type"] = rng.choice(["fifo", "prefill_first"])
        if sch["preset"] == "vllm-v1":
            sch.update(max_num_seqs=rng.choice([4, 16, 64, 256]), max_num_batched_tokens=rng.choice([512, 2048, 8192]),
                       async_scheduling=rng.random() < 0.5)
        return sch
    sch = {"type": kind, "max_num_seqs": rng.choice([1, 2, 8, 32, 128]),
           "max_num_batched_tokens": rng.choice([256, 1024, 4096, 16384])}
    if kind != "static":
        sch["preemption_mode"] = rng.choice(["recompute", "soft_reset", "swap"])
        sch["async_scheduling"] = rng.random() < 0.3
    if kind == "chunked":
        sch["long_prefill_token_threshold"] = rng.choice([0, 0, 64, 512])
        sch["chunked_prefill"] = rng.random() < 0.8
    if rng.random() < 0.3:
        sch["max_model_len"] = rng.choice([512, 2048, 8192])
    if rng.random() < 0.2:
        sch["policy"] = "priority"
    return sch


def scenario(seed: int) -> dict[str, Any]:
    """The raw scenario of ``seed`` (valid by construction, though it may be refused with a reason)."""
    rng = random.Random(seed)
    hw, model = rng.choice(GPU_MODELS)
    raw: dict[str, Any] = {"name": "random", "seed": rng.randrange(1000), "model": model, "hardware": hw,
                           "tensor_parallel": 1, "cost_model": {"type": "roofline"}, "scheduler": _scheduler(rng)}
    kv: dict[str, Any] = {"block_size": rng.choice([16, 32])}
    if rng.random() < 0.5:
        kv["num_blocks"] = rng.choice([40, 100, 400, 3000])
    kv["enable_prefix_caching"] = rng.random() < 0.4
    if rng.random() < 0.2:
        kv["swap_space_gb"] = rng.choice([0.01, 0.5, 4])
    raw["kv_cache"] = kv
    num_requests = rng.choice([1, 5, 60, 300])
    arrival = rng.choice([{"process": "poisson", "rate": rng.choice([0.5, 5.0, 50.0])},
                          {"process": "gamma", "rate": 10.0, "cv": 3.0}, {"process": "constant", "rate": 20.0}])
    wl: dict[str, Any] = {
        "num_requests": num_requests, "arrival": arrival,
        "prompt_len": rng.choice([{"dist": "lognormal", "mean": 600, "std": 500, "min": 1, "max": 4000},
                                  {"dist": "fixed", "value": rng.choice([1, 17, 1000])},
                                  {"dist": "uniform", "min": 1, "max": 3000}]),
        "output_len": rng.choice([{"dist": "lognormal", "mean": 150, "std": 150, "min": 1, "max": 1500},
                                  {"dist": "fixed", "value": rng.choice([1, 2, 300])},
                                  {"dist": "zipf", "a": 1.5, "min": 1, "max": 800}])}
    if kv["enable_prefix_caching"] and rng.random() < 0.6:
        wl["prefix"] = {"num_prefixes": rng.choice([1, 3]), "prefix_len": rng.choice([16, 300]), "fraction": 0.7}
    raw["workload"] = wl
    if rng.random() < 0.3:
        raw["cluster"] = {"num_replicas": rng.choice([2, 3]), "router": rng.choice(ROUTERS)}
    r = rng.random()
    if r < 0.15:
        raw["hardware"], raw["model"], raw["tensor_parallel"] = p = rng.choice(PROFILES)
        raw["cost_model"] = {"type": "profile", "path": f"{p[0]}-{p[1]}-tp{p[2]}.json"}
    elif r < 0.25:
        raw.update(hardware="h100-sxm", model="llama-3.1-70b", tensor_parallel=rng.choice([2, 4]))
    r = rng.random()
    if r < 0.12 and "prefix" not in wl:
        wl["sessions"] = {"turns": rng.choice([2, {"dist": "uniform", "min": 1, "max": 5}]),
                          "think_time_s": rng.choice([0.0, 0.5, 3.0]),
                          "think_time_dist": rng.choice(["exponential", "fixed"]),
                          "system_prompt_len": rng.choice([0, 100])}
        wl["num_requests"] = min(wl["num_requests"], 60)
    elif r < 0.22:
        raw["cluster"] = {"disagg": {"prefill": {"count": rng.choice([1, 2])}, "decode": {"count": rng.choice([1, 2])},
                                     "link": {"preset": rng.choice(["nvlink", "infiniband", "pcie", "ethernet"])}}}
    if rng.random() < 0.3:
        raw["slo"] = {"ttft_ms": 500, "tpot_ms": 50}
    return raw


def _summary_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, sort_keys=True, default=str)


def _differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in a.keys() | b.keys() if json.dumps(a.get(k), default=str) != json.dumps(b.get(k), default=str)]


def problems(raw: dict[str, Any]) -> list[str] | None:
    """What is wrong with the run of ``raw`` (empty: nothing); None when the scenario is refused with
    a ScenarioError (a clear error is a valid answer to a configuration that cannot run)."""
    def run(**kwargs: Any):
        return simulate(scenario_from_dict(json.loads(json.dumps(raw))), progress=False, **kwargs)

    try:
        first = run()
    except ScenarioError:
        return None
    out: list[str] = []
    df = first.requests_df
    n = raw["workload"].get("num_requests")  # (a trace: every row it keeps)
    if n is not None and "sessions" not in raw["workload"] and len(df) != n:
        out.append(f"{len(df)} request rows for {n} requests")
    finished = df[df["state"] == "finished"]
    unfinished = df[df["state"] != "finished"]
    if unfinished["reject_reason"].isna().any():
        out.append(f"{int(unfinished['reject_reason'].isna().sum())} requests neither finished nor rejected with a reason")
    if (finished["num_output_tokens"] != finished["output_len"]).any():
        out.append("a finished request lacks output tokens")
    if ((finished["first_token_time"] < finished["arrival_time"] - 1e-12)
            | (finished["finish_time"] < finished["first_token_time"] - 1e-12)).any():
        out.append("a request's times are out of order")
    if not np.isfinite(finished[["ttft", "e2e"]].to_numpy(dtype=float)).all():
        out.append("a finished request's TTFT or E2E is not finite")
    base = _summary_json(first.summary)
    if _summary_json(run().summary) != base:
        out.append("the same seed gave another summary")
    plain = run(fast_forward=False, compiled=False)
    several = raw.get("cluster", {}).get("num_replicas", 1) > 1 or "disagg" in raw.get("cluster", {})
    diff = [k for k in _differing(first.summary, plain.summary) if not (several and k in ("mean_itl_ms", "std_itl_ms"))]
    if diff:
        out.append(f"the plain loop's summary differs from the {first.engine} engine's in {sorted(diff)[:6]}")
    if "disagg" not in raw.get("cluster", {}):  # (a disaggregated cluster needs every step)
        for mode in ("binned", "off"):
            other = run(iterations=mode)
            if _summary_json(other.summary) != base:
                out.append(f"iterations={mode}: summary differs in {sorted(_differing(first.summary, other.summary))[:6]}")
            if not other.requests_df.equals(df):
                out.append(f"iterations={mode}: the requests table differs")
    if _copyable(raw):  # the model and GPU as files (config.json, base: preset)
        with _as_files(raw) as files:
            twin = simulate(scenario_from_dict(files), progress=False)
        if _summary_json({**twin.summary, **SAME}) != _summary_json({**first.summary, **SAME}) or \
                not twin.requests_df.equals(df):
            out.append(f"the model and GPU as files simulate otherwise, in "
                       f"{sorted(_differing(first.summary, twin.summary))[:6]}")
    return out


SAME = {"model": None, "hardware": None}  # summary keys that name the model and GPU as given


def _copyable(raw: dict[str, Any]) -> bool:
    """Whether a config.json can copy the model: not one of 4-byte weights (``tiny``, fp32)."""
    return get_model(raw.get("model", "llama-3.1-8b")).dtype_bytes == 2


@contextmanager
def _as_files(raw: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``raw`` with its model written as a Hugging Face config.json (named otherwise, the preset's
    shapes) and its GPU as a hardware file of ``base: PRESET``, in a folder that lives as long as
    the ``with``."""
    m = get_model(raw.get("model", "llama-3.1-8b"))
    hw = raw.get("hardware", "h100-sxm")
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        kind = "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "llama"
        config = {"_name_or_path": f"copies/{m.name}-copy", "model_type": kind, "hidden_size": m.hidden_size,
                  "intermediate_size": m.intermediate_size, "num_hidden_layers": m.num_layers,
                  "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
                  "vocab_size": m.vocab_size, "tie_word_embeddings": m.tie_word_embeddings, "rope_theta": m.rope_theta,
                  "rms_norm_eps": m.rms_norm_eps, "max_position_embeddings": m.max_position_embeddings}
        (folder / "config.json").write_text(json.dumps(config))
        (folder / f"{hw}.yaml").write_text(f"base: {hw}\n")  # the preset's name: vLLM's defaults read it
        yield {**json.loads(json.dumps(raw)), "model": str(folder / "config.json"), "hardware": str(folder / f"{hw}.yaml")}


# ---- multi-turn sessions on every engine and cluster ------------------------------------------------
def session_scenario(seed: int) -> dict[str, Any]:
    """``scenario(seed)`` with multi-turn sessions in place of its traffic's shape, on whatever engine
    and cluster it drew, disaggregated ones included (``scenario`` keeps the two apart)."""
    rng = random.Random(seed + 777)
    raw = scenario(seed)
    wl = raw["workload"]
    wl.pop("prefix", None)
    wl["sessions"] = {"turns": rng.choice([1, 3, {"dist": "uniform", "min": 1, "max": 6}]),
                      "think_time_s": rng.choice([0.0, 0.2, 2.0]), "think_time_dist": rng.choice(["exponential", "fixed"]),
                      "system_prompt_len": rng.choice([0, 50, 600])}
    wl["num_requests"] = min(wl["num_requests"], 40)
    if rng.random() < 0.5:
        raw["kv_cache"]["enable_prefix_caching"] = True
    return raw


# ---- rarer knobs --------------------------------------------------------------------------------------
def knobs_scenario(seed: int) -> dict[str, Any]:
    """``scenario(seed)`` with rarer knobs turned: what a preempted request finds of its KV, vLLM v0's
    step order, the watermark, the memory share, a disaggregated pool's own scheduler, KV and
    routers, the scraping routers and their refresh."""
    rng = random.Random(seed + 99)
    raw = scenario(seed)
    sch, kv, cl = raw["scheduler"], raw["kv_cache"], raw.get("cluster", {})
    if sch.get("type") in ("continuous", "chunked") and rng.random() < 0.5:
        sch["cache_preempted_blocks"] = rng.choice(["all", "prompt", "none"])
    if sch.get("type") == "continuous" and rng.random() < 0.5:
        sch["schedule_order"] = rng.choice(["prefill_first", "decode_first"])
    if rng.random() < 0.3:
        kv["watermark"] = rng.choice([0.0, 0.05, 0.2])
    if rng.random() < 0.2 and "num_blocks" not in kv:
        kv["gpu_memory_utilization"] = rng.choice([0.3, 0.5, 0.95])
    if "disagg" in cl and rng.random() < 0.6:
        pool = rng.choice(["prefill", "decode"])
        cl["disagg"][pool]["scheduler"] = rng.choice([
            {"type": "chunked", "max_num_seqs": 4, "max_num_batched_tokens": 512},
            {"preset": "vllm-v1", "async_scheduling": True},
            {"type": "continuous", "max_num_seqs": 2, "max_num_batched_tokens": 4096, "preemption_mode": "swap"}])
        if rng.random() < 0.5:
            cl["disagg"][pool]["kv_cache"] = {"num_blocks": rng.choice([60, 300])}
        cl["disagg"]["prefill_router"] = rng.choice(["round_robin", "least_outstanding", "least_kv_usage"])
        cl["disagg"]["decode_router"] = rng.choice(["round_robin", "least_kv_usage", "kv_aware"])
    elif cl.get("num_replicas", 1) > 1 and rng.random() < 0.5:
        cl["router"] = rng.choice(["vllm_dp", "prefix_aware", "kv_aware"])
        cl["router_refresh_s"] = rng.choice([0.0, 0.1, 1.0])
    return raw


# ---- trace workloads -------------------------------------------------------------------------------
def trace_scenario(seed: int, folder: Path) -> dict[str, Any]:
    """``scenario(seed)``'s engine on a random trace written under ``folder``: csv, Azure (datetimes,
    some with fractions, some without, as Python's isoformat writes them), BurstGPT or Mooncake
    (shared block hashes), unsorted rows, tied times, zero lengths, a time scale."""
    import datetime as dt

    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    raw = scenario(seed)
    raw["workload"] = {}
    n = rng.choice([1, 3, 50, 200])
    t = np.cumsum(np_rng.exponential(rng.choice([0.001, 0.1, 1.0]), n))
    if rng.random() < 0.3:
        t = t[np_rng.permutation(n)]
    if rng.random() < 0.3:
        t = np.round(t, 1)
    prompt, output = np_rng.integers(0, 3000, n), np_rng.integers(0, 500, n)
    fmt = rng.choice(["csv", "azure", "burstgpt", "mooncake"])
    path = folder / ("trace.jsonl" if fmt == "mooncake" else "trace.csv")
    trace: dict[str, Any] = {"format": fmt, "path": str(path)}
    if fmt == "csv":
        lines = ["t,prompt,out", *(f"{a!r},{b},{c}" for a, b, c in zip(t.tolist(), prompt, output, strict=True))]
        trace.update(time_column="t", prompt_column="prompt", output_column="out")
    elif fmt == "azure":
        start = dt.datetime(2024, 5, 1)
        lines = ["TIMESTAMP,ContextTokens,GeneratedTokens",
                 *(f"{(start + dt.timedelta(seconds=a)).isoformat(sep=' ')},{b},{c}"
                   for a, b, c in zip(t.tolist(), prompt, output, strict=True))]
    elif fmt == "burstgpt":  # (rows with 0 response tokens are failed requests: dropped and counted)
        lines = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
                 *(f"{a!r},ChatGPT,{b},{c},{b + c},Conversation log" for a, b, c in zip(t.tolist(), prompt, output, strict=True))]
    else:
        lines = []
        for a, b, c in zip(t.tolist(), prompt, output, strict=True):
            length = max(int(b), 1)
            shared = [int(h) for h in np_rng.integers(0, 4, rng.randrange(0, -(-length // 512) + 1))]
            lines.append(json.dumps({"timestamp": 1000 * a, "input_length": length, "output_length": max(int(c), 1),
                                     "hash_ids": shared}))
    path.write_text("\n".join(lines) + "\n")
    if rng.random() < 0.3:
        trace["time_scale"] = rng.choice([0.1, 10.0])
    raw["workload"] = {"trace": trace}
    return raw


# ---- validate --against its own simulation --------------------------------------------------------
RT_GPUS = {"rtx-4090": "RTX4090", "rtx-pro-6000": "RTXPRO6000", "h100-sxm": "H100", "a100-80g": "A100"}
RT_MODELS = {"llama-3.1-8b": "meta-llama/Llama-3.1-8B", "qwen3-32b": "Qwen/Qwen3-32B",
             "llama-3-8b": "meta-llama/Meta-Llama-3-8B"}
RT_SETUPS = [("rtx-4090", "llama-3.1-8b", 1, True), ("rtx-pro-6000", "llama-3.1-8b", 1, True),
             ("rtx-pro-6000", "llama-3.1-8b", 2, True), ("rtx-pro-6000", "qwen3-32b", 2, True),
             ("h100-sxm", "llama-3.1-8b", 1, True), ("a100-80g", "llama-3-8b", 1, True),
             ("h100-sxm", "llama-3.1-8b", 2, False)]


def round_trip(seed: int, folder: Path | None = None) -> list[str] | None:
    """Simulate a random vllm-v1 run, write it as an LLMServingSim run folder and validate against it:
    the problems (empty: every TTFT and E2E reproduced); None when the run rejected a request (a
    measured run holds served requests only)."""
    from servesim.sim.cli import main as cli
    from test_validate_against import write_run

    rng = random.Random(seed)
    hw, model, tp, profile = rng.choice(RT_SETUPS)
    dp = rng.choice([1, 1, 1, 2, 3])
    seats = rng.choice([4, 16, 64, 128])
    budget = rng.choice([max(seats, 256), 512, 2048, 8192])
    asyn, caching, threshold = rng.random() < 0.7, rng.random() < 0.6, rng.choice([0, 0, 256])
    blocks = rng.choice([None, 120, 400, 3000])
    kv: dict[str, Any] = {"block_size": 16, "enable_prefix_caching": caching}
    if blocks:
        kv["num_blocks"] = blocks
    arrival: dict[str, Any] = {"process": rng.choice(["poisson", "gamma"]), "rate": rng.choice([2.0, 20.0, 200.0])}
    if arrival["process"] == "gamma":
        arrival["cv"] = 2.0
    raw = {"name": "rt", "seed": seed, "model": model, "hardware": hw, "tensor_parallel": tp,
           "cost_model": {"type": "profile", "path": f"{hw}-{model}-tp{tp}.json"} if profile else {"type": "roofline"},
           "scheduler": {"preset": "vllm-v1", "max_num_seqs": seats, "max_num_batched_tokens": budget,
                         "async_scheduling": asyn, "long_prefill_token_threshold": threshold},
           "kv_cache": kv,
           "workload": {"num_requests": rng.choice([10, 60, 150]), "arrival": arrival,
                        "prompt_len": {"dist": "uniform", "min": 1, "max": rng.choice([300, 1500])},
                        "output_len": {"dist": "uniform", "min": 1, "max": rng.choice([50, 400])}}}
    if dp > 1:
        raw["cluster"] = {"num_replicas": dp, "router": "vllm_dp", "router_refresh_s": 0.1}
    res = simulate(scenario_from_dict(raw), progress=False)
    df = res.requests_df
    if (df["state"] != "finished").any():
        return None
    # the client clock a small offset from the engine's: near 1.7e9 s a float64 resolves 0.24 us, and
    # the bursts here put requests closer than that, which no measured run could tell apart either
    rows = [{"request_id": f"q{r.request_id}", "input_toks": r.prompt_len, "output_toks": r.output_len,
             "arrival_time": 1000.0 + r.arrival_time, "queued_ts": 5000.0 + r.arrival_time,
             "scheduled_ts": 5000.0 + r.first_scheduled_time, "first_token_ts": 5000.0 + r.first_token_time,
             "last_token_ts": 5000.0 + r.finish_time} for r in df.itertuples()]
    folder = Path(folder or tempfile.mkdtemp())
    run_dir = write_run(folder / "run", rows, model=RT_MODELS[model], gpu=RT_GPUS[hw], tp=tp, meta_extra={
        "engine_kwargs": {"model": RT_MODELS[model], "tensor_parallel_size": tp, "data_parallel_size": dp,
                          "max_num_seqs": seats, "max_num_batched_tokens": budget, "max_model_len": None,
                          "async_scheduling": asyn, "long_prefill_token_threshold": threshold},
        "kv_cache": {"block_size": 16, "enable_prefix_caching": caching, "num_gpu_blocks": int(res.kv.num_blocks)}})
    argv = ["validate", "--against", str(run_dir), "--out", str(folder / "out"), "--no-plots", "--quiet"]
    if not profile:
        argv += ["--set", "cost_model.type=roofline"]
    code = cli(argv)
    if code != 0:
        return [f"validate --against exited {code}"]
    per = pd.read_csv(folder / "out" / "per_request.csv")
    out = []
    for key in ("ttft", "e2e"):
        gap = (per[f"sim_{key}"] - per[f"measured_{key}"]).abs()
        bad = gap > 1e-6 + 1e-6 * per[f"measured_{key}"].abs()
        if bad.any():
            out.append(f"{key}: {int(bad.sum())} of {len(per)} requests differ, by up to {gap.max():.3g} s")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--round-trip", action="store_true", help="check validate --against on its own runs instead")
    ap.add_argument("--traces", action="store_true", help="random trace workloads (csv, azure, burstgpt, mooncake)")
    ap.add_argument("--sessions", action="store_true", help="multi-turn sessions on every engine and cluster")
    ap.add_argument("--knobs", action="store_true", help="rarer knobs (watermark, pools' own schedulers, routers)")
    args = ap.parse_args()
    tally: Counter[str] = Counter()
    for seed in range(args.start, args.start + args.count):
        try:
            if args.round_trip:
                found = round_trip(seed)
            elif args.traces:
                found = problems(trace_scenario(seed, Path(tempfile.mkdtemp())))
            elif args.sessions:
                found = problems(session_scenario(seed))
            elif args.knobs:
                found = problems(knobs_scenario(seed))
            else:
                found = problems(scenario(seed))
        except Exception:  # a crash is a finding: print it with the scenario
            found = [traceback.format_exc().strip().splitlines()[-1]]
        status = "refused" if found is None else ("failed" if found else "ok")
        tally[status] += 1
        if found:
            print(f"seed {seed}: {'; '.join(found)}", flush=True)
            if not args.round_trip:
                shown = (trace_scenario(seed, Path(tempfile.mkdtemp())) if args.traces
                         else session_scenario(seed) if args.sessions
                         else knobs_scenario(seed) if args.knobs else scenario(seed))
                print(f"  {json.dumps(shown)}", flush=True)
    print(dict(tally))
    return 1 if tally["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
