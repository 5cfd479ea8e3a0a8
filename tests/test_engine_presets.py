"""Engine presets: each one's distinguishing behaviour, checked on the batches it builds.

Most tests drive a preset's scheduler step by step (schedulers are pure policy); the rest run a
small scenario through the simulator and read its iterations table. Each test contrasts the preset
with a setting or preset that behaves differently, so it fails if the behaviour is lost.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from servesim.sim.engine_presets import PRESETS
from servesim.sim.kv_cache import BlockManager
from servesim.sim.presets import get_hardware
from servesim.sim.request import Request, RequestState
from servesim.sim.scenario import ScenarioError, load_scenario, scenario_from_dict, scenario_to_yaml
from servesim.sim.schedulers import ComposedScheduler, DynamicBatcher, RetractingScheduler, make_scheduler
from servesim.sim.schedulers.blocks import (
    blocks_to_completion,
    chunk_tokens,
    fewest_outputs_longest_prompt,
    latest_arrival,
)
from servesim.sim.schedulers.running import RunningTable
from servesim.sim.simulate import plan_kv, simulate

ENGINES_DIR = Path(__file__).resolve().parent.parent / "scenarios" / "engines"


def build(knobs: dict, num_blocks: int, block_size: int, *, prefix: bool = False, hardware: str = "h100-sxm"):
    """The scheduler a preset builds over a cache of ``num_blocks`` blocks of ``block_size`` tokens."""
    hw = get_hardware(hardware)
    cfg = PRESETS[knobs["preset"]].model_validate(knobs).resolved(hw, "llama-3.1-8b")
    kv = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix, watermark=cfg.KV_DEFAULTS["watermark"])
    return make_scheduler(cfg.translate(hw, "llama-3.1-8b"), kv)


def run_steps(sched, requests: list[Request], step_s: float = 1.0, max_steps: int = 50_000):
    """Drive schedule/update with arrivals at their times; per step: (start, batch, ids running before)."""
    pending = sorted(requests, key=lambda r: r.arrival_time)
    now, steps = 0.0, []
    while pending or sched.has_unfinished:
        while pending and pending[0].arrival_time <= now:
            sched.add(pending.pop(0))
        before = {r.request_id for r in sched.run.reqs}
        batch = sched.schedule(now)
        if batch.is_empty:
            assert pending, "scheduler stalled with work left"
            now = pending[0].arrival_time
            continue
        steps.append((now, batch, before))
        now += step_s
        sched.update(batch, now)
        assert len(steps) < max_steps
    sched.check_drained()
    return steps


def admitted_in(step) -> set[int]:
    _, batch, before = step
    return {r.request_id for r in batch.requests} - before


def small_scenario(scheduler: dict, **over) -> dict:
    d = {
        "name": "preset-test",
        "model": "llama-3.1-8b",
        "hardware": "h100-sxm",
        "scheduler": scheduler,
        "kv_cache": {"num_blocks": 300, "block_size": 16},
        "workload": {
            "num_requests": 150,
            "arrival": {"process": "poisson", "rate": 4.0},
            "prompt_len": {"dist": "lognormal", "mean": 512, "std": 400, "min": 16, "max": 2048},
            "output_len": {"dist": "lognormal", "mean": 256, "std": 200, "min": 4, "max": 1024},
        },
    }
    d.update(over)
    return d


# ---- configuration: knobs, defaults, errors -------------------------------------------------------
@pytest.mark.parametrize(("hardware", "tokens", "seqs"), [
    ("h100-sxm", 8192, 1024), ("h200", 8192, 1024), ("a100-80g", 2048, 256), ("l40s", 2048, 256),
])
def test_vllm_v1_batch_defaults_follow_the_hardware_class(hardware: str, tokens: int, seqs: int):
    sc = scenario_from_dict(small_scenario({"preset": "vllm-v1"}, hardware=hardware))
    assert (sc.scheduler.max_num_batched_tokens, sc.scheduler.max_num_seqs) == (tokens, seqs)
    assert sc.kv_cache.enable_prefix_caching and sc.kv_cache.block_size == 16


def test_vllm_v1_batch_defaults_read_the_cuda_device_name_not_the_file_name(tmp_path: Path):
    # vLLM reads torch's device name: an A100 described by a file called otherwise is still an A100
    a100 = tmp_path / "my-gpu.yaml"
    a100.write_text("base: a100-80g\nmemory_bytes: 80 GiB\n")
    sc = scenario_from_dict(small_scenario({"preset": "vllm-v1"}, hardware=str(a100)))
    assert (sc.scheduler.max_num_batched_tokens, sc.scheduler.max_num_seqs) == (2048, 256)
    renamed = tmp_path / "big.yaml"  # its own device name overrides the base's
    renamed.write_text("base: a100-80g\ndevice_name: NVIDIA B200\n")
    sc = scenario_from_dict(small_scenario({"preset": "vllm-v1"}, hardware=str(renamed)))
    assert (sc.scheduler.max_num_batched_tokens, sc.scheduler.max_num_seqs) == (8192, 1024)


def test_a_preset_fills_only_what_the_user_left_unset():
    d = small_scenario({"preset": "hf-transformers", "max_batch_tokens": 512})
    d["kv_cache"] = {"block_size": 64, "num_blocks": 100}
    sc = scenario_from_dict(d)
    assert sc.scheduler.max_batch_tokens == 512
    assert sc.scheduler.safety_margin == 0.15  # fifo's default
    assert sc.kv_cache.block_size == 64  # the user's, not the preset's 256
    assert sc.kv_cache.enable_prefix_caching  # the preset's
    d["kv_cache"] = {"num_blocks": 100}
    assert scenario_from_dict(d).kv_cache.block_size == 256


def test_resolved_preset_round_trips_through_the_written_scenario(tmp_path: Path):
    sc = scenario_from_dict(small_scenario({"preset": "tensorrt-llm", "max_batch_size": 64}))
    path = tmp_path / "resolved.yaml"
    path.write_text(scenario_to_yaml(sc))
    again = load_scenario(path)
    assert again.scheduler == sc.scheduler
    assert again.kv_cache == sc.kv_cache


@pytest.mark.parametrize(("knobs", "words"), [
    ({"preset": "tensorrt-llm", "max_num_seqs": 8}, ["max_num_seqs", "max_batch_size"]),
    ({"preset": "sglang", "page_size": 4}, ["page_size", "kv_cache.block_size"]),
    ({"preset": "vllm-v1", "preemption_mode": "swap"}, ["preemption_mode", "recompute only"]),
    ({"preset": "hf-transformers", "max_num_batched_tokens": 64}, ["max_batch_tokens"]),
    ({"preset": "vlm-v1"}, ["vlm-v1", "did you mean 'vllm-v1'?"]),
    ({"preset": "vllm-v1", "max_num_seq": 8}, ["max_num_seq", "did you mean 'max_num_seqs'?"]),
    ({"type": "chunkd"}, ["scheduler.type: unknown scheduler type 'chunkd'", "did you mean 'chunked'?"]),
    ({"type": "chunked", "watermark": 0.1}, ["kv_cache.watermark"]),
])
def test_a_knob_the_engine_lacks_is_a_one_line_error_naming_it(knobs: dict, words: list[str]):
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict(small_scenario(knobs))
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_builtin_scheduler_errors_read_as_before():
    with pytest.raises(ScenarioError) as err:
        scenario_from_dict(small_scenario({"type": "chunked", "max_num_seq": 4}))
    msg = str(err.value)
    assert "scheduler.max_num_seq: unknown field" in msg and "did you mean 'max_num_seqs'" in msg
    assert "max_batch_size" not in msg  # the allowed list is the chunked policy's, not the presets'


def test_chunk_tokens_cuts_at_the_unit_only_when_short_of_the_end():
    assert chunk_tokens(100, 1000) == 100
    assert chunk_tokens(100, 70) == 70
    assert chunk_tokens(100, 70, unit=32) == 64
    assert chunk_tokens(100, 20, unit=32) == 0
    assert chunk_tokens(100, 1000, cap=48) == 48
    assert chunk_tokens(40, 70, unit=32) == 40  # the prompt's end need not be aligned


# ---- vLLM V1 ---------------------------------------------------------------------------------------
def test_vllm_v1_admits_nothing_in_a_step_that_preempted():
    sched = build({"preset": "vllm-v1", "max_num_batched_tokens": 256}, num_blocks=40, block_size=16)
    reqs = [Request(i, 0.5 * i, 100 + 7 * i, 150) for i in range(12)]
    steps = run_steps(sched, reqs)
    preempting = [s for s in steps if s[1].preempted]
    assert preempting, "the cache never ran short; the test proves nothing"
    assert all(not admitted_in(s) for s in preempting)
    # admissions do happen in steps that did not preempt, while requests were waiting
    assert sum(len(admitted_in(s)) for s in steps if not s[1].preempted) >= len(reqs)


# ---- vLLM V0 ---------------------------------------------------------------------------------------
def test_vllm_v0_never_mixes_prefill_and_decode_in_a_step_where_v1_does():
    v0 = simulate(scenario_from_dict(small_scenario({"preset": "vllm-v0"})), progress=False).iterations_df
    v1 = simulate(scenario_from_dict(small_scenario({"preset": "vllm-v1"})), progress=False).iterations_df
    mixed = lambda it: ((it["num_prefill_tokens"] > 0) & (it["num_decode_tokens"] > 0)).sum()  # noqa: E731
    assert mixed(v0) == 0
    assert (v0["num_prefill_tokens"] > 0).sum() > 0 and (v0["num_decode_tokens"] > 0).sum() > 0
    assert mixed(v1) > 0


def test_vllm_v0_budget_is_the_context_length_without_chunking():
    sc = scenario_from_dict(small_scenario({"preset": "vllm-v0"}))
    assert sc.scheduler.max_num_batched_tokens == 131072  # llama-3.1's context
    sc = scenario_from_dict(small_scenario({"preset": "vllm-v0", "max_model_len": 1024}))
    assert sc.scheduler.max_num_batched_tokens == 2048  # max(max_model_len, 2048)
    assert sc.kv_cache.watermark == 0.01


@pytest.mark.parametrize(("preset", "knob"), [("vllm-v1", "max_model_len"), ("tensorrt-llm", "max_seq_len")])
def test_a_request_longer_than_the_models_context_is_rejected_unless_the_limit_is_raised(preset: str, knob: str):
    """vLLM and TensorRT-LLM take the limit from the model's config when it is not given: Llama-3-8B's
    8,192 tokens; prompt + output beyond it is refused (vLLM's API server answers 400)."""
    d = small_scenario({"preset": preset}, model="llama-3-8b", kv_cache={"num_blocks": 2000, "block_size": 16})
    d["workload"] = {"num_requests": 4, "arrival": {"process": "poisson", "rate": 1.0},
                     "prompt_len": {"dist": "fixed", "value": 8000}, "output_len": {"dist": "fixed", "value": 300}}
    sc = scenario_from_dict(d)
    assert getattr(sc.scheduler, knob) == 8192
    res = simulate(sc, progress=False)
    assert res.summary["completed"] == 0 and res.summary["rejected"] == 4
    d["scheduler"] = {"preset": preset, knob: 16384}
    assert simulate(scenario_from_dict(d), progress=False).summary["completed"] == 4


@pytest.mark.parametrize("preset", ["vllm-v1", "vllm-v0"])
def test_vllm_would_refuse_to_start_when_max_model_len_outgrows_the_cache(preset: str):
    """vLLM checks at start-up that one request of max_model_len fits the KV cache, else stops and asks
    for a smaller max_model_len; the preset says so (the simulation itself still runs, as a what-if)."""
    sc = scenario_from_dict(small_scenario({"preset": preset}))  # 300 blocks of 16 = 4,800 tokens
    why = sc.scheduler.start_refusal(300, 16)
    assert why and "131072" in why and "4800" in why and "scheduler.max_model_len" in why and "\n" not in why
    sc = scenario_from_dict(small_scenario({"preset": preset, "max_model_len": 4800}))
    assert sc.scheduler.start_refusal(300, 16) is None  # exactly one request's worth fits
    assert sc.scheduler.start_refusal(299, 16) is not None
    assert scenario_from_dict(small_scenario({"preset": "sglang"})).scheduler.start_refusal(300, 16) is None


def test_servesim_run_warns_once_when_vllm_would_not_start(tmp_path: Path, capsys):
    from servesim.sim.cli import main

    d = small_scenario({"preset": "vllm-v1"})
    d["workload"]["num_requests"] = 20
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(d))
    assert main(["run", str(path), "--no-plots", "--quiet", "--out", str(tmp_path / "a")]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "would not start" in line]
    assert len(err) == 1 and err[0].startswith("warning: vLLM would not start this server")
    d["scheduler"]["max_model_len"] = 4096
    path.write_text(yaml.safe_dump(d))
    assert main(["run", str(path), "--no-plots", "--quiet", "--out", str(tmp_path / "b")]) == 0
    assert "would not start" not in capsys.readouterr().err


# ---- Transformers ----------------------------------------------------------------------------------
def _hf_with_five_big_prompts(margin: float) -> tuple[ComposedScheduler, Request]:
    sched = build({"preset": "hf-transformers", "safety_margin": margin}, num_blocks=100, block_size=16)
    for i in range(5):
        sched.add(Request(i, 0.0, 18 * 16, 50))  # 18 blocks each: 90 of 100 once prefilled
    first = sched.schedule(0.0)
    assert first.size == 5
    sched.update(first, 1.0)
    late = Request(9, 1.0, 64, 10)  # 4 blocks: fits in the 10 left
    sched.add(late)
    return sched, late


def test_hf_fifo_stops_admitting_prefills_below_the_safety_margin():
    sched, late = _hf_with_five_big_prompts(0.15)  # 10 free < 15 = 15% of 100
    batch = sched.schedule(1.0)
    assert late not in batch.requests
    assert batch.size == 5 and batch.num_prefill_tokens == 0  # decodes only
    sched, late = _hf_with_five_big_prompts(0.0)
    assert late in sched.schedule(1.0).requests


def test_hf_soft_reset_takes_the_oldest_then_the_newest_and_requeues_at_the_tail():
    # three prompts of 2 blocks fill a 6-block cache; each needs a third block after its first token
    sched = build({"preset": "hf-transformers", "safety_margin": 0.0}, num_blocks=6, block_size=4)
    a, b, c = (Request(i, 0.0, 8, 9) for i in range(3))
    steps = run_steps(sched, [a, b, c])
    resets = [r for _, batch, _ in steps for r in batch.preempted]
    assert resets[:2] == [a, c], "oldest while admissions are open, then the newest once blocked"
    assert a.num_preemptions >= 1 and c.num_preemptions >= 1 and b.num_preemptions == 0
    # the generated token was folded into the prompt the reset request is re-prefilled with
    first_reset = next(batch for _, batch, _ in steps if batch.preempted)
    assert a.num_prompt_tokens > a.prompt_len
    assert first_reset.size >= 1  # the rest ran in the same step
    assert all(r.state == RequestState.FINISHED for r in (a, b, c))


def test_hf_soft_reset_request_goes_to_the_back_of_the_queue():
    sched = build({"preset": "hf-transformers", "safety_margin": 0.0}, num_blocks=6, block_size=4)
    a, b, c = (Request(i, 0.0, 8, 9) for i in range(3))
    for r in (a, b, c):
        sched.add(r)
    batch = sched.schedule(0.0)
    sched.update(batch, 1.0)
    d = Request(3, 1.0, 4, 2)
    sched.add(d)
    batch = sched.schedule(1.0)
    assert batch.preempted == [a]
    assert list(sched.waiting) == [d, a]


def test_hf_prefill_first_runs_partial_prefills_before_decodes():
    def starved_decode_steps(kind: str) -> int:
        sched = build({"preset": "hf-transformers", "scheduler_type": kind, "max_batch_tokens": 32},
                      num_blocks=200, block_size=16)
        a, b = Request(0, 0.0, 8, 60), Request(1, 3.0, 300, 5)
        steps = run_steps(sched, [a, b])
        return sum(1 for t, batch, _ in steps if a not in batch.requests and a.first_token_time <= t < a.finish_time)

    assert starved_decode_steps("fifo") == 0
    assert starved_decode_steps("prefill_first") > 0  # b's chunks took the whole budget


# ---- TensorRT-LLM ----------------------------------------------------------------------------------
def test_trt_guaranteed_no_evict_never_preempts_where_max_utilization_does():
    gne = simulate(scenario_from_dict(small_scenario({"preset": "tensorrt-llm"})), progress=False)
    maxu = simulate(scenario_from_dict(small_scenario(
        {"preset": "tensorrt-llm", "capacity_scheduler_policy": "MAX_UTILIZATION"})), progress=False)
    assert maxu.summary["num_preemptions"] > 0
    assert gne.summary["num_preemptions"] == 0
    assert gne.summary["completed"] == maxu.summary["completed"] == 150


def test_trt_guaranteed_no_evict_keeps_every_running_request_able_to_finish():
    sched = build({"preset": "tensorrt-llm"}, num_blocks=60, block_size=16)
    reqs = [Request(i, 0.3 * i, 80 + 13 * i, 120) for i in range(15)]
    pending = sorted(reqs, key=lambda r: r.arrival_time)
    now, peak = 0.0, 0
    while pending or sched.has_unfinished:
        while pending and pending[0].arrival_time <= now:
            sched.add(pending.pop(0))
        batch = sched.schedule(now)
        # what the running requests hold plus what they still need never exceeds the cache
        held = int(sched.run.nblocks[: sched.run.n].sum())
        assert held + blocks_to_completion(sched.run, 16) <= sched.kv.num_blocks
        peak = max(peak, sched.run.n)
        assert not batch.preempted
        now = now + 1.0 if not batch.is_empty else pending[0].arrival_time
        if not batch.is_empty:
            sched.update(batch, now)
    assert peak >= 2  # several ran at once: the reserve did not serialise everything


def test_trt_max_utilization_admits_nothing_in_a_step_that_paused():
    sched = build({"preset": "tensorrt-llm", "capacity_scheduler_policy": "MAX_UTILIZATION"},
                  num_blocks=40, block_size=16)
    steps = run_steps(sched, [Request(i, 0.5 * i, 100 + 7 * i, 150) for i in range(12)])
    paused = [s for s in steps if s[1].preempted]
    assert paused
    assert all(not admitted_in(s) for s in paused)
    # a paused request keeps what it generated as prompt and comes back from the head of the queue
    victim = paused[0][1].preempted[0]
    assert victim.num_prompt_tokens > victim.prompt_len


def test_trt_without_chunked_prefill_runs_contexts_whole():
    sched = build({"preset": "tensorrt-llm", "max_num_tokens": 256}, num_blocks=500, block_size=32)
    long = Request(0, 0.0, 300, 4)
    assert not sched.add(long) and "chunked prefill" in long.reject_reason
    a, b = Request(1, 0.0, 200, 4), Request(2, 0.0, 200, 4)
    for r in (a, b):
        sched.add(r)
    first = sched.schedule(0.0)
    assert first.requests == [a] and int(first.num_new_tokens[0]) == 200  # b waits: whole or not at all
    chunked = build({"preset": "tensorrt-llm", "max_num_tokens": 256, "enable_chunked_prefill": True},
                    num_blocks=500, block_size=32)
    for r in (Request(1, 0.0, 200, 4), Request(2, 0.0, 200, 4)):
        chunked.add(r)
    both = chunked.schedule(0.0)
    assert both.num_new_tokens.tolist() == [200, 32]  # b's chunk cut at a 32-token block boundary


# ---- Triton dynamic batcher -------------------------------------------------------------------------
def _triton_run(arrivals: list[float], **knobs):
    d = small_scenario({"preset": "triton-dynamic", "max_batch_size": 4, **knobs},
                       cost_model={"type": "constant", "step_ms": 10.0})
    d["kv_cache"] = {"num_blocks": 1000}
    reqs = [Request(i, t, 32, 3) for i, t in enumerate(arrivals)]
    return simulate(scenario_from_dict(d), requests=reqs, progress=False).requests_df


def test_triton_waits_up_to_the_queue_delay_to_fill_a_batch():
    df = _triton_run([0.0, 0.01, 0.02], max_queue_delay_microseconds=50_000)
    # three requests are fewer than max_batch_size: the batch goes when the oldest has waited 50 ms
    assert df["first_scheduled_time"].tolist() == pytest.approx([0.05] * 3)
    now = _triton_run([0.0, 0.01, 0.02])  # no delay (Triton's default): the first goes alone at once
    assert now["first_scheduled_time"].iloc[0] == pytest.approx(0.0)
    assert now["first_scheduled_time"].iloc[1] > 0.01


def test_triton_launches_at_once_when_the_preferred_size_is_reached():
    df = _triton_run([0.0, 0.01, 0.02], max_queue_delay_microseconds=50_000, preferred_batch_size=[2])
    assert df["first_scheduled_time"].iloc[:2].tolist() == pytest.approx([0.01, 0.01])
    full = _triton_run([0.0, 0.001, 0.002, 0.003, 0.004], max_queue_delay_microseconds=50_000)
    assert full["first_scheduled_time"].iloc[:4].tolist() == pytest.approx([0.003] * 4)  # max_batch_size


def test_triton_batch_runs_to_its_longest_member_with_nobody_joining():
    sched = build({"preset": "triton-dynamic", "max_batch_size": 4}, num_blocks=100, block_size=16)
    assert isinstance(sched, DynamicBatcher)
    a, b, c = Request(0, 0.0, 16, 2), Request(1, 0.0, 16, 8), Request(2, 1.5, 16, 2)
    run_steps(sched, [a, b, c])
    assert c.first_scheduled_time >= b.finish_time


# ---- SGLang -----------------------------------------------------------------------------------------
def _shared(prefix: list[int], n: int, tail_seed: int, total: int = 64) -> list[int]:
    rng = np.random.default_rng(tail_seed)
    return prefix[:n] + rng.integers(1000, 2000, total - n).tolist()


def _sglang_admission_order(policy: str, queue_extra: int = 0) -> list[int]:
    """Warm the cache with one prompt, then queue prompts sharing 0 (first in line), 16 and 48
    (last in line) of its tokens, with ``queue_extra`` unrelated prompts between them."""
    sched = build({"preset": "sglang", "schedule_policy": policy, "chunked_prefill_size": 64},
                  num_blocks=20_000, block_size=4, prefix=True)
    assert isinstance(sched, RetractingScheduler)
    base = list(range(64))
    run_steps(sched, [Request(0, 0.0, 64, 1, prompt_token_ids=base)])
    queue = [Request(1, 10.0, 64, 2, prompt_token_ids=_shared(base, 0, 1))]
    queue += [Request(10 + i, 10.0, 64, 2, prompt_token_ids=_shared([], 0, 10 + i)) for i in range(queue_extra)]
    queue += [Request(2, 10.0, 64, 2, prompt_token_ids=_shared(base, 16, 2)),
              Request(3, 10.0, 64, 2, prompt_token_ids=_shared(base, 48, 3))]
    steps = run_steps(sched, queue)
    order = [r.request_id for s in steps for r in s[1].requests if r.request_id in admitted_in(s)]
    return [i for i in order if i in (1, 2, 3)]


def test_sglang_lpm_serves_the_longest_prefix_match_first():
    assert _sglang_admission_order("lpm") == [3, 2, 1]
    assert _sglang_admission_order("fcfs") == [1, 2, 3]


def test_sglang_lpm_falls_back_to_fcfs_when_the_queue_is_long():
    # 1 + 126 + 2 = 129 waiting (> 128): the first pick is the head of the line, not the best match
    assert _sglang_admission_order("lpm", queue_extra=126)[0] == 1
    assert _sglang_admission_order("lpm", queue_extra=100) == [3, 2, 1]


def test_sglang_never_mixes_prefill_and_decode_and_retracts_fewest_outputs_first():
    # conservativeness 0: the admission estimate reserves nothing for running requests, so the
    # pool overfills and decode steps must retract
    sched = build({"preset": "sglang", "chunked_prefill_size": 256, "schedule_conservativeness": 0.0},
                  num_blocks=1200, block_size=1)
    pending = [Request(i, 0.2 * i, 150 + 11 * i, 200) for i in range(12)]
    now, retractions = 0.0, 0
    while pending or sched.has_unfinished:
        while pending and pending[0].arrival_time <= now:
            sched.add(pending.pop(0))
        batch = sched.schedule(now)
        if batch.is_empty:
            now = pending[0].arrival_time
            continue
        assert batch.num_prefill_tokens == 0 or batch.num_decode_tokens == 0, "a mixed step"
        if batch.preempted:
            # every victim had no more outputs than any request left decoding
            kept = sched.run.out[sched.scheduled.rows]
            assert batch.num_prefill_tokens == 0 and len(kept)
            assert max(v.num_output_tokens for v in batch.preempted) <= kept.min()
            retractions += len(batch.preempted)
        now += 1.0
        sched.update(batch, now)
    sched.check_drained()
    assert retractions > 0, "no retraction; the test proves nothing"
    assert sched.num_retractions == retractions


def drive_sglang(sched, pending: list[Request]) -> int:
    """Run a scheduler over requests to the end (1 s steps); returns the retractions."""
    now, retractions, idle = 0.0, 0, 0
    while pending or sched.has_unfinished:
        while pending and pending[0].arrival_time <= now:
            sched.add(pending.pop(0))
        batch = sched.schedule(now)
        if batch.is_empty:
            idle += 1
            assert pending and idle < 10_000, "no progress with requests waiting on an idle replica"
            now = pending[0].arrival_time
            continue
        retractions += len(batch.preempted)
        now += 1.0
        sched.update(batch, now)
    return retractions


def test_sglang_refuses_a_request_whose_output_it_would_cut_to_fit_the_pool():
    # 100-token pool: max_req_len 99, so a 45-token prompt may ask for at most 53 outputs
    sched = build({"preset": "sglang"}, num_blocks=100, block_size=1)
    fits, cut = Request(0, 0.0, 45, 53), Request(1, 0.0, 45, 54)
    assert sched.add(fits)
    assert not sched.add(cut)
    assert "caps max_new_tokens at max_req_len - prompt - 1 = 53" in cut.reject_reason
    drive_sglang(sched, [])
    assert fits.state == RequestState.FINISHED


@pytest.mark.parametrize("seed", range(6))
def test_sglang_on_a_tight_pool_serves_every_request_it_accepts(seed):
    # prefix caching off: a retracted request re-prefills its prompt and outputs; admission must
    # count the outputs still to come (not its whole output again), or it can never return
    rng = np.random.default_rng(seed)
    sched = build({"preset": "sglang", "schedule_conservativeness": 0.0}, num_blocks=120, block_size=1)
    pending = [Request(i, 0.3 * i, int(rng.integers(5, 15)), int(rng.integers(40, 70))) for i in range(30)]
    reqs = list(pending)
    retractions = drive_sglang(sched, pending)
    sched.check_drained()
    assert retractions > 0, "no retraction; the test proves nothing"
    assert all(r.state in (RequestState.FINISHED, RequestState.REJECTED) for r in reqs)
    assert sum(r.state == RequestState.FINISHED for r in reqs) >= 20

def test_sglang_victim_is_fewest_outputs_then_longest_prompt_not_the_newest():
    run = RunningTable(4)
    for i, (prompt, out) in enumerate([(100, 3), (50, 1), (300, 1), (80, 9)]):
        r = Request(i, float(i), prompt, 20)
        r.num_output_tokens = out
        run.append(r, 1)
    assert fewest_outputs_longest_prompt(run, np.ones(4, dtype=bool)) == 2  # 1 output, 300-token prompt
    assert latest_arrival(run, np.ones(4, dtype=bool)) == 3  # what vLLM / TensorRT-LLM would pick


def test_sglang_admission_reserves_for_the_running_requests_future_tokens():
    sched = build({"preset": "sglang", "chunked_prefill_size": 4096}, num_blocks=1000, block_size=1)
    running = Request(0, 0.0, 100, 800)
    sched.add(running)
    sched.update(sched.schedule(0.0), 1.0)
    newcomer = Request(1, 1.0, 100, 300)
    sched.add(newcomer)
    # 900 free tokens, minus 799 * 0.7 reserved for the running request, leave ~341 < 100 + 300
    assert newcomer not in sched.schedule(1.0).requests
    assert sched.batch_is_full


# ---- the shipped engine scenarios -------------------------------------------------------------------
def test_every_preset_has_a_scenario_that_uses_it():
    used = {load_scenario(p).scheduler_name for p in ENGINES_DIR.glob("*.yaml")}
    assert set(PRESETS) <= used


@pytest.mark.parametrize("path", sorted(ENGINES_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_a_preset_schedules_exactly_as_the_policy_config_it_resolves_to(path: Path, tmp_path: Path):
    sc = load_scenario(path, ["workload.num_requests=120"])
    written = yaml.safe_load(scenario_to_yaml(sc))
    assert written["scheduler"]["preset"] == sc.scheduler_name
    # the same scenario with the resolved policy written out as a plain scheduler section, on the
    # preset's cache (derived KV blocks are sized per preset: Scenario.derived_kv_blocks)
    written["scheduler"] = written.pop("resolved_scheduler")
    written["kv_cache"]["num_blocks"] = plan_kv(sc).num_blocks
    plain = scenario_from_dict(written)
    assert plain.policy == sc.policy
    a, b = simulate(sc, progress=False), simulate(plain, progress=False)
    pd.testing.assert_frame_equal(a.requests_df, b.requests_df)
    pd.testing.assert_frame_equal(a.iterations_df, b.iterations_df)


def test_vllm_v1_without_chunked_prefill_budgets_one_whole_request_and_refuses_less():
    """vLLM's SchedulerConfig: with enable_chunked_prefill false the token budget defaults to at
    least max_model_len, and a smaller one is a server vLLM does not start."""
    sc = scenario_from_dict(small_scenario({"preset": "vllm-v1", "enable_chunked_prefill": False, "max_model_len": 4096}))
    assert sc.scheduler.max_num_batched_tokens == 8192 and sc.policy.chunked_prefill is False  # H100 default
    sc = scenario_from_dict(small_scenario({"preset": "vllm-v1", "enable_chunked_prefill": False,
                                            "max_model_len": 16384}))
    assert sc.scheduler.max_num_batched_tokens == 16384
    sc = scenario_from_dict(small_scenario({"preset": "vllm-v1", "enable_chunked_prefill": False,
                                            "max_model_len": 4096, "max_num_batched_tokens": 1024}))
    assert "max_num_batched_tokens 1024 must be at least max_model_len 4096" in sc.scheduler.start_refusal(10_000, 16)
    res = simulate(sc, progress=False)  # still simulated, as a what-if: what cannot fit a step whole is refused
    assert res.summary["rejected"] > 0 and res.summary["completed"] + res.summary["rejected"] == 150
