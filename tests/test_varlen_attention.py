"""FA2's varlen attention as the roofline prices it (sim/varlen_attention.py)."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from servesim.sim.batch import step_sums
from servesim.sim.cost_model import RooflineCostModel
from servesim.sim.presets import get_hardware, get_model
from servesim.sim.varlen_attention import (
    EMPTY_CTA_S,
    FA2VarlenAttention,
    fa2_num_splits,
    makespan,
    prefill_iterations,
    reference_tile_s,
)

I64 = np.int64


def varlen(hardware: str = "rtx-4090", model: str = "llama-3.1-8b") -> FA2VarlenAttention:
    return RooflineCostModel(get_model(model), get_hardware(hardware))._varlen


def test_a_prefill_row_walks_its_query_tiles_causally():
    # 128 new tokens over 1000 cached: tiles of 64 rows see 1064 and 1128 keys, 9 blocks of 128 each
    # (8.3125 and 8.8125 plus half a block of rounding), the longest 9
    its, tiles, longest = prefill_iterations(128, 1000, 128)
    assert (tiles, longest) == (2, 9)
    assert its == pytest.approx((1064 + 1128) / 128 + 2 / 2)


def test_equal_blocks_take_whole_waves_and_one_wave_takes_the_longest():
    assert makespan(10 * 300, 300, 10, 10 * 300, 300, 10, sms=128) == pytest.approx(30)  # ceil(300 / 128) waves
    assert makespan(100, 20, 9, 90, 10, 9, sms=128) == 9
    # a wave of long blocks beside many short ones is not two waves
    assert makespan(128 * 10 + 32, 160, 10, 128 * 10, 128, 10, sms=128) == pytest.approx(10 + 32 / 128)


def test_decode_rows_beside_a_chunk_run_in_waves_of_one_block_per_query_head_by_hand():
    v = varlen()  # RTX 4090: 128 SMs; Llama-3.1-8B: 32 query heads, 8 KV heads, 128-key blocks
    t = v.tile_s
    # a 16-token chunk and 8 decodes at 16,383 cached tokens (16,384 keys each): 8 x 32 = 256 blocks of
    # 128 iterations are two waves on 128 SMs; the chunk's 32 one-tile blocks (0.625 iterations each)
    # fill in; the KV read (each KV head's once, the group's four heads in one wave) is shorter
    kernel = v.layer_s(n=9, n_dec=8, tokens=24, decode_kv=8 * 16384, prefill_kv=16)
    assert kernel == pytest.approx((2 * 128 + 32 * 0.625 / 128) * t)
    assert (16 + 8 * 16384) * v.kv_token_s < kernel
    # the same decodes beside a 2048-token chunk: 31 more blocks per decode row and head return at once
    assert v.layer_s(9, 8, 2056, 8 * 16384, 2048) > kernel + 8 * 32 * 31 * EMPTY_CTA_S / 128


def test_decode_kv_is_read_again_per_wave_once_a_kv_heads_share_outgrows_l2():
    v = varlen()  # RTX 4090: 72 MiB of L2; one KV head's K and V take 512 bytes a token
    fits, spills = 128 * 1024, 128 * 2048  # 128 decode rows: 67 and 134 MB of one KV head
    assert v.kv_read_s(128, 1, fits, 16) == pytest.approx((16 + fits) * v.kv_token_s)
    # 129 blocks per query head: a group's 4 query heads span 4 waves of 128 SMs, each reading again
    assert v.kv_read_s(128, 1, spills, 16) == pytest.approx((16 + 4 * spills) * v.kv_token_s)


def test_the_longest_decode_row_ends_the_schedule():
    v = varlen()
    # 7 short decodes and one at 16k: its 32 blocks of 128 iterations outlast everything else (the
    # closed form adds a wave of mean-length blocks: 256 decode blocks on 128 SMs)
    longest = v.layer_s(9, 8, 24, 7 * 513 + 16384, 16, longest_decode_kv=16384)
    assert 128 * v.tile_s < longest < 1.2 * 128 * v.tile_s
    assert v.layer_s(9, 8, 24, 7 * 513 + 16384, 16) < 0.5 * 128 * v.tile_s  # every row at the mean


def test_the_reference_prefill_keeps_the_attention_fraction():
    # a 2048-token prefill of 32 heads of 128 is what attention_flops_fraction was measured on
    hw = get_hardware("rtx-pro-6000")
    flops = 4 * 128 * 32 * 2048 * 2049 / 2
    v = FA2VarlenAttention(get_model("llama-3.1-8b"), hw, kv_heads=8, heads=32, stream_rate=1e30)
    assert v.layer_s(1, 0, 2048, 0, 2048) == pytest.approx(flops / (hw.peak_flops * hw.attention_flops_fraction))
    assert v.tile_s == reference_tile_s(hw)


def test_decode_only_steps_and_fa3_gpus_keep_the_kv_read_pricing():
    model = get_model("llama-3.1-8b")
    decode = step_sums(np.ones(64, dtype=I64), np.full(64, 4000, dtype=I64))
    mixed = step_sums(np.array([512] + [1] * 64, dtype=I64), np.array([0] + [4000] * 64, dtype=I64))
    for name in ("rtx-4090", "rtx-pro-6000", "a100-80g", "l40s"):
        hw = get_hardware(name)
        new, old = RooflineCostModel(model, hw), RooflineCostModel(model, replace(hw, flash_attention=None))
        assert new.step_time(decode) == old.step_time(decode)
        assert new.step_time(mixed) > old.step_time(mixed), name
    for name in ("h100-sxm", "h200"):
        assert get_hardware(name).flash_attention == 3 and RooflineCostModel(model, get_hardware(name))._varlen is None


def test_iteration_time_reads_the_longest_decode_row_of_a_mixed_step():
    cm = RooflineCostModel(get_model("llama-3.1-8b"), get_hardware("rtx-4090"))
    q = np.array([16] + [1] * 8, dtype=I64)
    ctx = np.array([0] + [512] * 7 + [16383], dtype=I64)
    sums = step_sums(q, ctx)
    assert cm.mixed_needs_rows
    assert cm.iteration_time(q, ctx) == cm.step_time(sums, 0.0, 16384) > cm.step_time(sums)


GPU_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu"
RTX4090 = GPU_DATA / "llmservingsim" / "profiles" / "RTX4090" / "meta-llama" / "Llama-3.1-8B" / "tp1" / "attention.csv"


@pytest.mark.skipif(not RTX4090.is_file(), reason="needs the shared GPU data (../shared/data/gpu)")
def test_a_measured_rtx4090_mixed_step_is_within_the_held_out_error():
    # a full 2048-token budget: a chunk over 2048 cached tokens beside 64 decodes at 2048 (LLMServingSim,
    # vLLM 0.19 on an RTX 4090, one layer). EMPTY_CTA_S was fitted on the RTX PRO 6000 tables only; the
    # RTX 4090's mixed shapes held out: median 7.8 %, p90 18.6 % (benchmarks/mixed_attention.py --fit)
    with RTX4090.open() as f:
        row = next(r for r in csv.DictReader(f) if (r["prefill_chunk"], r["kv_prefill"], r["n_decode"],
                                                     r["kv_decode"]) == ("2048", "2048", "64", "2048"))
    measured = float(row["time_us"]) * 1e-6
    q = np.array([2048] + [1] * 64, dtype=I64)
    ctx = np.array([2048] + [2048] * 64, dtype=I64)
    hw, model = get_hardware("rtx-4090"), get_model("llama-3.1-8b")
    per_layer = {}
    for name, h in (("fa2", hw), ("before", replace(hw, flash_attention=None))):
        per_layer[name] = RooflineCostModel(model, h).breakdown(step_sums(q, ctx))["attention"] / model.num_layers
    assert abs(per_layer["fa2"] / measured - 1) <= 0.186
    assert per_layer["before"] < 0.8 * measured  # a decode read plus a prefill: 25 % cheap here


@pytest.mark.parametrize("scheduler, varlen", [
    ({"preset": "vllm-v1"}, True), ({"type": "chunked"}, True), ({"preset": "sglang"}, True),
    # TensorRT-LLM runs its own context FMHA and generation XQA kernels, not one FA2 varlen call
    ({"preset": "tensorrt-llm", "enable_chunked_prefill": True}, False),
])
def test_the_fa2_term_follows_the_engines_attention_kernels(scheduler, varlen):
    from servesim.sim.cost_model import build_cost_model
    from servesim.sim.scenario import scenario_from_dict
    sc = scenario_from_dict({"name": "fa", "model": "llama-3.1-8b", "hardware": "a100-80g", "scheduler": scheduler,
                             "workload": {"num_requests": 1, "arrival": {"process": "poisson", "rate": 1},
                                          "prompt_len": {"dist": "fixed", "value": 8},
                                          "output_len": {"dist": "fixed", "value": 8}}})
    cost = build_cost_model(sc.cost_model, get_model(sc.model), sc.cost_hardware(), sc.tensor_parallel)
    assert (cost.describe()["varlen_attention"] is not None) is varlen
    # a mixed step: 64 decodes at 2k context beside a 512-token chunk
    q = np.array([1] * 64 + [512])
    ctx = np.array([2048] * 64 + [0])
    plain = RooflineCostModel(get_model("llama-3.1-8b"), replace(get_hardware("a100-80g"), flash_attention=None))
    same = cost.iteration_time(q, ctx) == pytest.approx(plain.iteration_time(q, ctx), rel=1e-12)
    assert same is (not varlen)


# ---- decode-only steps: FA2's split-KV blocks in waves ----------------------------------------
def test_decode_keys_are_split_as_fa2_chooses():
    assert fa2_num_splits(400, 376, 9) == 1  # the blocks nearly fill the slots: no split
    # 128 blocks on 376 slots, 9 KV tiles: 2 splits fill 68 % of a wave, 5 splits 85 % of two; 3
    # is worse and 4, 6-8 walk as many tiles as a count below them: the fewest within 85 % is 5
    assert fa2_num_splits(128, 376, 9) == 5
    assert fa2_num_splits(8, 376, 1) == 1  # one tile cannot be split


def _decode_attention(hardware: str, n: int, ctx: int, **hw_changes) -> float:
    hw = replace(get_hardware(hardware), **hw_changes)
    cm = RooflineCostModel(get_model("llama-3.1-8b"), hw, 1)
    q = np.ones(n, dtype=np.int64)
    return cm.breakdown(step_sums(q, np.full(n, ctx, dtype=np.int64)))["attention"]


def test_short_decode_rows_cost_their_waves_and_long_ones_their_kv_read():
    read = {"fa2_decode_tile_s": None}
    # 256 rows of 16 tokens on the RTX PRO 6000: 2048 blocks (8 KV heads), no split, 11 waves of one
    # tile, far more than the KV read (measured: 62 us a layer; the KV read alone prices 19)
    cm = RooflineCostModel(get_model("llama-3.1-8b"), get_hardware("rtx-pro-6000"), 1)
    short = _decode_attention("rtx-pro-6000", 256, 15)
    assert short == pytest.approx(cm._attn_fixed + 256 * cm._kv_s + cm.model.num_layers * 11 * 6.25e-6, rel=1e-12)
    assert short > 2.5 * _decode_attention("rtx-pro-6000", 256, 15, **read)
    # 256 rows of 16 k tokens: bandwidth-bound, exactly the KV-read pricing
    assert _decode_attention("rtx-pro-6000", 256, 16383) == _decode_attention("rtx-pro-6000", 256, 16383, **read)
    assert cm.describe()["varlen_attention"]["decode_tile_s"] == 6.25e-6
    # GPUs without a measured decode latency keep the KV read (A100 runs FA2 too)
    assert get_hardware("a100-80g").fa2_decode_tile_s is None
    a100 = RooflineCostModel(get_model("llama-3.1-8b"), get_hardware("a100-80g"), 1).describe()["varlen_attention"]
    assert a100["decode_tile_s"] is None and a100["decode_merge_s"] is None
    assert _decode_attention("a100-80g", 256, 15) == _decode_attention("a100-80g", 256, 15, flash_attention=None)


def test_decode_waves_step_with_the_rows_as_measured():
    """The RTX PRO 6000's measured 16-token column steps with the waves (13.2, 17.9, 22.8, 35.8,
    62.3 us a layer for 16-256 rows: 1, 2, 3, 6, 11 waves); the term's waves are those."""
    v = varlen("rtx-pro-6000")
    waves = [v.decode_waves_s(n, 17 * n)[0] / v.decode_tile_s for n in (16, 32, 64, 128, 256)]
    assert waves == pytest.approx([1, 2, 3, 6, 11])
