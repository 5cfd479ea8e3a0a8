import importlib.util
import json
import re
import sys
import timeit
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from servesim.sim.batch import StepSums, step_sums
from servesim.sim.cost_model import (
    FEATURE_NAMES,
    ROOFLINE_TERMS,
    SAMPLER_KERNELS,
    ConstantCostModel,
    CostModelConfig,
    FittedCostModel,
    GemmTables,
    ProfileError,
    RooflineCostModel,
    build_cost_model,
    classify_step,
    save_profile,
    step_features,
    to_profile_dict,
)
from servesim.sim.presets import HARDWARE, get_hardware, get_model

I64 = np.int64


def arr(*xs):
    return np.array(xs, dtype=I64)


@pytest.fixture
def llama8b_h100():
    return get_model("llama-3.1-8b"), get_hardware("h100-sxm")


def naive_features(q, ctx, tile):
    """Row-by-row reference for step_features."""
    f = dict.fromkeys(FEATURE_NAMES, 0.0)
    for qi, ci in zip(q.tolist(), ctx.tolist(), strict=True):
        f["tokens"] += qi
        f["seqs"] += 1
        if qi == 1:
            f["decode_kv_tokens"] += ci + 1
        else:
            f["prefill_seqs"] += 1
            f["prefill_attn_pairs"] += qi * (ci + (qi + 1) / 2)
    f["tokens_tiled"] = -(-f["tokens"] // tile) * tile
    f["const"] = 1.0 if len(q) else 0.0
    decode_ctx = [ci + 1 for qi, ci in zip(q.tolist(), ctx.tolist(), strict=True) if qi == 1]
    f["linear_measured_s"] = f["lm_head_measured_s"] = 0.0  # no measured tables given
    f["decode_padded_kv"] = len(decode_ctx) * max(decode_ctx, default=0)
    if any(c > 0 for c in ctx.tolist()):  # the step reads the paged cache
        for qi, ci in zip(q.tolist(), ctx.tolist(), strict=True):
            if qi != 1:
                f["paged_prefill_kv"] += ci + qi
                f["paged_prefill_pairs"] += qi * (ci + qi)
                f["paged_prefill_seqs"] += 1
    return np.array([f[k] for k in FEATURE_NAMES])


# ---- features ----


def test_features_of_a_mixed_step_by_hand():
    # one decode (ctx 10), one fresh 5-token prompt, one 3-token chunk after 4 cached tokens
    f = dict(zip(FEATURE_NAMES, step_features(arr(1, 5, 3), arr(10, 0, 4), tile=4), strict=True))
    assert f == {
        "tokens": 9, "tokens_tiled": 12,
        "prefill_attn_pairs": 5 * (0 + 3) + 3 * (4 + 2),  # causal: q * (ctx + (q + 1) / 2)
        "decode_kv_tokens": 11, "seqs": 3, "prefill_seqs": 2, "const": 1,
        "decode_padded_kv": 11,  # one decode row, padded to the longest decode context
        "paged_prefill_kv": 5 + 7, "paged_prefill_pairs": 5 * 5 + 3 * 7, "paged_prefill_seqs": 2,
        "linear_measured_s": 0.0, "lm_head_measured_s": 0.0,
    }
    # a prefill-only step reads no cache: no paged terms
    f = dict(zip(FEATURE_NAMES, step_features(arr(5, 3), arr(0, 0), tile=4), strict=True))
    assert f["paged_prefill_kv"] == f["paged_prefill_pairs"] == f["paged_prefill_seqs"] == f["decode_padded_kv"] == 0


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_features_match_a_row_by_row_reference(kind):
    rng = np.random.default_rng(7)
    for _ in range(50):
        n = int(rng.integers(1, 300))
        q = np.ones(n, dtype=I64) if kind == "decode" else rng.integers(2, 600, n)
        if kind == "mixed":
            q[rng.random(n) < 0.5] = 1
            q[0], q[-1] = 1, 17
        ctx = rng.integers(0, 5000, n)
        if kind == "prefill" and rng.random() < 0.3:
            ctx[:] = 0
        np.testing.assert_allclose(step_features(q, ctx, 64), naive_features(q, ctx, 64))
        assert classify_step(q) == kind


def test_step_sums_with_a_known_decode_head_match_the_reference():
    # Batch.sums passes decode_head (leading rows known to be plain decodes); short and long tails
    rng = np.random.default_rng(3)
    for tail in (0, 1, 5, 64, 65, 200):
        for _ in range(10):
            head = int(rng.integers(0, 100))
            q = np.concatenate([np.ones(head, dtype=I64), rng.integers(1, 400, tail)])
            ctx = rng.integers(0, 5000, head + tail)
            n, n_dec, tokens, pairs, dec_kv, pre_kv = step_sums(q, ctx, head)
            assert (n, n_dec, tokens) == (len(q), int((q == 1).sum()), int(q.sum()))
            f = naive_features(q, ctx, 64)
            assert pairs == f[FEATURE_NAMES.index("prefill_attn_pairs")]
            assert dec_kv == f[FEATURE_NAMES.index("decode_kv_tokens")]
            assert pre_kv == int((ctx + q)[q != 1].sum())
            assert step_sums(q, ctx, head) == step_sums(q, ctx)


def test_a_batch_knows_its_longest_decode_context_as_the_rows_say():
    # Batch.longest_decode_kv reads the known decode head with one reduction, the tail row by row
    from servesim.sim.batch import Batch

    rng = np.random.default_rng(4)
    for tail in (0, 1, 5, 64, 65):
        for _ in range(10):
            head = int(rng.integers(0, 50))
            q = np.concatenate([np.ones(head, dtype=I64), rng.integers(1, 4, tail)])
            ctx = rng.integers(0, 5000, head + tail)
            want = int(ctx[q == 1].max()) + 1 if (q == 1).any() else None
            for known in (head, 0):
                b = Batch(num_new_tokens=q, num_context_tokens=ctx, samples=np.ones(len(q), dtype=bool),
                          decode_rows=known)
                assert b.longest_decode_kv == want


def test_step_time_from_sums_equals_iteration_time(llama8b_h100):
    q, ctx = arr(1, 1, 300, 7), arr(500, 20, 0, 33)
    base_only = {r: body["coef"][:7] + [0.0] * 6 for r, body in example_profile()["regimes"].items()}
    for cm in (RooflineCostModel(*llama8b_h100), FittedCostModel(base_only, swap_bandwidth=1e9),
               ConstantCostModel(0.01, 1e-5)):
        assert not getattr(cm, "needs_rows", False)
        assert cm.step_time(step_sums(q, ctx), 1e6) == cm.iteration_time(q, ctx, 1e6)
        assert cm.step_time(step_sums(arr(), arr()), 1e6) == cm.iteration_time(arr(), arr(), 1e6)


def test_a_profile_with_row_level_terms_is_priced_from_the_rows():
    from servesim.sim.batch import Batch
    from servesim.sim.engine import SimExecutor
    from servesim.sim.request import Request

    cm = FittedCostModel.from_profile_dict(example_profile())
    assert cm.needs_rows
    with pytest.raises(ValueError, match="iteration_time"):
        cm.step_time(step_sums(arr(1, 5), arr(9, 0)))
    reqs = [Request(i, 0.0, 40, 4) for i in range(3)]
    batch = Batch.of(reqs, [1, 1, 17], [30, 12, 0])
    expected = cm.iteration_time(batch.num_new_tokens, batch.num_context_tokens)
    assert SimExecutor(cm, 1024).run(batch) == expected
    base_only = {r: body["coef"][:7] + [0.0] * 6 for r, body in example_profile()["regimes"].items()}
    without = FittedCostModel(base_only, tile_tokens=16, overhead={"step_s": 1e-4, "per_seq_s": 2e-6})
    assert expected > without.iteration_time(batch.num_new_tokens, batch.num_context_tokens)  # row terms priced


def test_loop_overhead_is_the_part_of_a_step_outside_the_features(llama8b_h100):
    zero = {r: [0.0] * 13 for r in ("decode", "prefill", "mixed")}
    cm = FittedCostModel(zero, tile_tokens=16, overhead={"step_s": 1e-4, "per_seq_s": 2e-6})
    q, ctx = arr(1, 1, 1), arr(9, 30, 4)
    assert cm.loop_overhead(3) == pytest.approx(1e-4 + 3 * 2e-6)
    assert cm.iteration_time(q, ctx) == pytest.approx(cm.loop_overhead(3))  # no feature terms: overhead only
    roof = RooflineCostModel(*llama8b_h100, step_overhead_s=1e-3, per_seq_overhead_s=1e-5)
    assert roof.loop_overhead(4) == pytest.approx(1.04e-3)


def test_empty_step_has_zero_features():
    assert not step_features(arr(), arr()).any()
    assert classify_step(arr()) == "empty"


# ---- roofline physics ----


def test_empty_step_costs_nothing_but_its_swap(llama8b_h100):
    cm = RooflineCostModel(*llama8b_h100)
    assert cm.iteration_time(arr(), arr()) == 0.0
    assert cm.iteration_time(arr(), arr(), swap_bytes=1e9) == pytest.approx(1e9 / llama8b_h100[1].pcie_bandwidth)


def test_swap_bytes_add_pcie_transfer_time(llama8b_h100):
    cm = RooflineCostModel(*llama8b_h100)
    q, ctx = np.ones(8, dtype=I64), np.full(8, 300, dtype=I64)
    extra = cm.iteration_time(q, ctx, swap_bytes=2e9) - cm.iteration_time(q, ctx)
    assert extra == pytest.approx(2e9 / llama8b_h100[1].pcie_bandwidth)


def test_decode_time_grows_with_kv_read(llama8b_h100):
    model, hw = llama8b_h100
    cm = RooflineCostModel(model, hw)
    q = np.ones(32, dtype=I64)
    times = [cm.iteration_time(q, np.full(32, c, dtype=I64)) for c in (0, 512, 2048, 8192)]
    assert times == sorted(times) and times[-1] > times[0]
    slope = (times[2] - times[1]) / (32 * (2048 - 512))
    # KV is read at what decode attention measurably reaches, not at the weights' streaming rate
    assert slope == pytest.approx(model.kv_bytes_per_token / (hw.hbm_bandwidth * hw.stream_bandwidth_fraction))
    assert hw.stream_bandwidth_fraction != hw.weight_bandwidth_fraction


def test_small_batch_decode_is_weight_read_bound(llama8b_h100):
    model, hw = llama8b_h100
    t = RooflineCostModel(model, hw).iteration_time(arr(1), arr(100))
    no_floor = RooflineCostModel(model, replace(hw, kernel_floor_s=0.0))
    kernels = no_floor.iteration_time(arr(1), arr(100)) - no_floor.loop_overhead(1)
    assert kernels == pytest.approx(model.streamed_weight_bytes / (hw.hbm_bandwidth * hw.weight_bandwidth_fraction),
                                    rel=0.05)
    # Bandwidth, not FLOPs, sets it: FLOP/s at 0.3 of peak barely moves it (the 64-row GEMM tile's
    # compute comes near the weight read only then), bandwidth at 0.4 of peak nearly doubles it.
    assert t < RooflineCostModel(model, hw, flops_efficiency=0.3).iteration_time(arr(1), arr(100)) < 1.15 * t
    assert RooflineCostModel(model, hw, bandwidth_efficiency=0.4).iteration_time(arr(1), arr(100)) > 1.8 * t


def test_weights_are_read_once_per_step_not_per_sequence(llama8b_h100):
    cm = RooflineCostModel(*llama8b_h100)
    t1 = cm.iteration_time(arr(1), arr(100))
    t16 = cm.iteration_time(np.ones(16, dtype=I64), np.full(16, 100, dtype=I64))
    assert t16 < 1.2 * t1


def test_long_prefill_is_compute_bound(llama8b_h100):
    model, hw = llama8b_h100
    t = RooflineCostModel(model, hw).iteration_time(arr(4096), arr(0))
    assert t == pytest.approx(2 * model.num_params * 4096 / (hw.peak_flops * hw.gemm_flops_fraction), rel=0.2)
    # far from the ridge point the weight read hides under the compute
    assert RooflineCostModel(model, hw, bandwidth_efficiency=0.4).iteration_time(arr(4096), arr(0)) \
        == pytest.approx(t, rel=0.03)


def test_doubling_tensor_parallel_roughly_halves_a_large_prefill():
    model, hw = get_model("llama-3.1-70b"), get_hardware("h100-sxm")
    q, ctx = np.full(4, 2048, dtype=I64), np.zeros(4, dtype=I64)
    t2, t4 = (RooflineCostModel(model, hw, tp).iteration_time(q, ctx) for tp in (2, 4))
    assert 0.5 <= t4 / t2 <= 0.6  # the rest is all-reduce traffic that does not shrink


def test_tensor_parallel_decode_pays_all_reduce_latency(llama8b_h100):
    cm1, cm2 = (RooflineCostModel(*llama8b_h100, tensor_parallel=tp) for tp in (1, 2))
    t1, t2 = cm1.iteration_time(arr(1), arr(100)), cm2.iteration_time(arr(1), arr(100))
    assert t2 > t1 / 2 + 2 * 32 * cm2.tp_comm_latency_s * 0.99


def test_describe_reports_the_constants(llama8b_h100):
    hw = llama8b_h100[1]
    d = RooflineCostModel(*llama8b_h100, step_overhead_s=1e-3).describe()
    assert d["step_overhead_s"] == 1e-3 and d["effective_flops"] == pytest.approx(989e12 * hw.gemm_flops_fraction)
    assert d["kernel_floor_s"] == hw.kernel_floor_s


def test_breakdown_terms_sum_to_the_step_time(llama8b_h100):
    cm = RooflineCostModel(*llama8b_h100, tensor_parallel=2)
    sums = step_sums(arr(1, 1, 300), arr(500, 20, 64))
    parts = cm.breakdown(sums, 1e6)
    assert tuple(parts) == ROOFLINE_TERMS and all(v > 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(cm.step_time(sums, 1e6))
    assert parts["host"] == cm.loop_overhead(3)


def test_every_kernel_of_a_step_pays_the_kernel_floor(llama8b_h100):
    model, hw = llama8b_h100
    q, ctx = arr(1, 1), arr(100, 100)
    without = RooflineCostModel(model, replace(hw, kernel_floor_s=0.0)).iteration_time(q, ctx)
    floor = 5e-6
    with_floor = RooflineCostModel(model, replace(hw, kernel_floor_s=floor)).iteration_time(q, ctx)
    L = model.num_layers
    # per layer: 4 GEMMs, 2 norms + rotary + activation, KV write + attention; per step: embedding,
    # final norm, LM head and the sampler's kernels
    kernels = 4 * L + 4 * L + 2 * L + 2 + 1 + SAMPLER_KERNELS
    assert with_floor - without == pytest.approx(kernels * floor)


def test_lm_head_and_sampler_scale_with_sequences_not_tokens(llama8b_h100):
    cm = RooflineCostModel(*llama8b_h100)
    one_prefill = cm.breakdown(step_sums(arr(512), arr(0)))
    one_decode = cm.breakdown(step_sums(arr(1), arr(511)))
    many_decodes = cm.breakdown(step_sums(np.ones(512, dtype=I64), np.zeros(512, dtype=I64)))
    for term in ("lm_head", "sampler"):
        assert one_prefill[term] == one_decode[term] < many_decodes[term]
    assert one_prefill["small_ops"] > one_decode["small_ops"]  # norms, rotary, activation: per token


def test_a_gemm_at_its_ridge_point_is_slower_than_either_bound(llama8b_h100):
    model, hw = llama8b_h100
    cm = RooflineCostModel(model, replace(hw, kernel_floor_s=0.0))
    weights = model.num_layers * model.layer_matmul_params * model.dtype_bytes / (hw.hbm_bandwidth * hw.weight_bandwidth_fraction)
    per_token = 2 * model.num_layers * model.layer_matmul_params / (hw.peak_flops * hw.gemm_flops_fraction)
    ridge = round(weights / per_token / 64) * 64
    linear = cm.breakdown(step_sums(arr(ridge), arr(0)))["linear"]
    assert linear > 1.25 * max(weights, ridge * per_token)
    far = cm.breakdown(step_sums(arr(16 * ridge), arr(0)))["linear"]
    assert far == pytest.approx(16 * ridge * per_token, rel=0.02)


def test_hardware_presets_carry_fractions_of_their_peaks():
    for name, hw in HARDWARE.items():
        fractions = (hw.weight_bandwidth_fraction, hw.stream_bandwidth_fraction, hw.gemm_flops_fraction,
                     hw.attention_flops_fraction)
        assert all(0.0 < f <= 1.0 for f in fractions), name
        assert 0.0 <= hw.kernel_floor_s < 20e-6, name


# ---- fitted profile ----


GEMM = {"tokens": [1, 2, 3, 4, 8, 64], "linear_s": [1e-4, 3e-4, 4e-4, 2e-4, 3e-4, 1.3e-3],
        "lm_head_s": [2e-5, 5e-5, 6e-5, 4e-5, 6e-5, 3e-4]}


def test_gemm_tables_interpolate_and_extrapolate_linearly():
    g = GemmTables(**GEMM)
    assert g.linear(0) == 0.0 and g.linear(3) == pytest.approx(4e-4) and g.linear(6) == pytest.approx(2.5e-4)
    assert g.linear(128) == pytest.approx(1.3e-3 + (1e-3 / 56) * 64)  # the last segment's slope
    assert g.lm_head(2) == pytest.approx(5e-5)
    with pytest.raises(ProfileError, match="ascending"):
        GemmTables([1, 1], [0.0, 0.0], [0.0, 0.0])


def test_a_noisy_falling_last_segment_never_prices_a_big_step_below_zero():
    # a 1-round CPU sweep whose last GEMM point came out faster than the one before it
    g = GemmTables([16, 24, 32], [2e-3, 1.8e-3, 1.4e-3], [1e-4, 2e-4, 1e-4])
    assert g.linear(2048) == pytest.approx(1.4e-3) and g.lm_head(512) == pytest.approx(1e-4)  # flat, not < 0
    assert g.linear(28) == pytest.approx(1.6e-3)  # inside the table: unchanged


def example_profile(**kw):
    coefs = {"prefill": [1e-6, 2e-7, 3e-11, 0.0, 1e-5, 2e-5, 4e-3, 0.0, 1e-9, 2e-11, 3e-6, 0.9, 1.1],
             "decode": [5e-6, 0.0, 0.0, 2e-9, 3e-6, 0.0, 6e-3, 1e-9, 0.0, 0.0, 0.0, 1.0, 0.0],
             "mixed": [2e-6, 1e-7, 4e-11, 3e-9, 2e-6, 1e-5, 7e-3, 2e-9, 3e-9, 1e-11, 2e-6, 1.2, 0.5]}
    return to_profile_dict(coefs, tile_tokens=16, overhead={"step_s": 1e-4, "per_seq_s": 2e-6}, gemm_tables=GEMM,
                           provenance={"device": "cpu", "model": "tiny"},
                           held_out_error={"mape": 0.05}, **kw)


def random_step(rng, kind):
    n = int(rng.integers(2, 64))
    q = np.ones(n, dtype=I64) if kind == "decode" else rng.integers(2, 512, n)
    if kind == "mixed":
        q[: n // 2 + 1] = 1
        q[-1] = 33
    return q, rng.integers(0, 3000, n)


def test_fitted_model_round_trips_and_reproduces_coef_dot_features(tmp_path):
    profile = example_profile()
    path = save_profile(tmp_path / "p.json", profile)
    cm = FittedCostModel.from_profile(path)
    assert cm.to_profile_dict() == json.loads(path.read_text())
    rng = np.random.default_rng(3)
    for kind in ("decode", "prefill", "mixed"):
        for _ in range(20):
            q, ctx = random_step(rng, kind)
            assert classify_step(q) == kind
            expected = np.dot(profile["regimes"][kind]["coef"], step_features(q, ctx, tile=16, gemm=GemmTables(**GEMM)))
            expected += 1e-4 + 2e-6 * len(q)
            assert cm.iteration_time(q, ctx) == pytest.approx(expected, rel=1e-12)


def test_a_regime_floor_raises_small_steps_to_it_and_leaves_the_engine_loop_and_swaps_outside(tmp_path):
    profile = example_profile(floors={"prefill": 0.05})
    assert profile["regimes"]["prefill"]["floor_s"] == 0.05 and "floor_s" not in profile["regimes"]["decode"]
    cm = FittedCostModel.from_profile(save_profile(tmp_path / "f.json", profile))
    plain = FittedCostModel.from_profile_dict(example_profile())
    assert cm.to_profile_dict() == profile
    small, big = (arr(16), arr(0)), (arr(8000), arr(0))
    loop = 1e-4 + 2e-6  # overhead.step_s + per_seq_s x 1 row: the engine loop, not the executor
    assert plain.iteration_time(*small) < 0.05
    assert cm.iteration_time(*small) == pytest.approx(0.05 + loop)
    assert cm.iteration_time(*small, swap_bytes=1e9) == pytest.approx(0.05 + loop + 1e9 / cm._swap_bw)
    assert cm.iteration_time(*big) == plain.iteration_time(*big) > 0.05 + loop  # above the floor: the terms
    assert cm.iteration_time(arr(1, 1), arr(5, 9)) == plain.iteration_time(arr(1, 1), arr(5, 9))  # decode: no floor
    # a regime without coefficients of its own falls back to "all", floor and all
    fallback = FittedCostModel({"all": [0.0] * 12 + [0.0]}, floors={"all": 0.02})
    assert fallback.iteration_time(arr(1), arr(9)) == fallback.step_time(StepSums(1, 1, 1, 0, 10, 0)) == 0.02


def test_single_all_regime_serves_every_step():
    cm = FittedCostModel({"all": [0, 0, 0, 0, 0, 0, 1e-3, 0, 0, 0, 0, 0, 0]}, swap_bandwidth=1e9)
    assert cm.iteration_time(arr(1, 1), arr(5, 5)) == cm.iteration_time(arr(9), arr(0)) == pytest.approx(1e-3)
    assert cm.iteration_time(arr(), arr()) == 0.0
    assert cm.iteration_time(arr(), arr(), swap_bytes=1e6) == pytest.approx(1e-3)


def test_a_version_1_profile_still_loads_with_zero_extra_terms(tmp_path):
    coefs = {"all": [1e-6, 0.0, 2e-11, 3e-9, 4e-6, 5e-6, 1e-3]}
    legacy = {**to_profile_dict(coefs), "format": "servesim-profile/1", "features": list(FEATURE_NAMES[:7])}
    legacy["regimes"] = {"all": {"coef": coefs["all"]}}
    save_path = tmp_path / "old.json"
    save_path.write_text(json.dumps(legacy))
    cm = FittedCostModel.from_profile(save_path)
    rng = np.random.default_rng(1)
    for kind in ("decode", "prefill", "mixed"):
        q, ctx = random_step(rng, kind)
        assert cm.iteration_time(q, ctx) == pytest.approx(np.dot(coefs["all"], step_features(q, ctx)[:7]))
    legacy["features"] = list(FEATURE_NAMES)  # a v1 file must list the v1 features
    save_path.write_text(json.dumps(legacy))
    with pytest.raises(ProfileError, match="do not match"):
        FittedCostModel.from_profile(save_path)


def test_missing_profile_file_names_the_path(tmp_path):
    with pytest.raises(ProfileError, match="nope.json"):
        FittedCostModel.from_profile(tmp_path / "nope.json")


@pytest.mark.parametrize("breakage, message", [
    (lambda p: p.update(format="other/9"), "not a servesim profile"),
    (lambda p: p.update(features=p["features"][:-1]), "do not match"),
    (lambda p: p["regimes"]["decode"].update(coef=[-1.0] * 13), ">= 0"),
    (lambda p: p["regimes"]["decode"].update(coef=[1.0] * 3), "list of 13"),
    (lambda p: p["regimes"].pop("mixed"), "no 'all' regime"),
    (lambda p: p["regimes"].update(warmup={"coef": [0.0] * 13}), "unknown regime"),
    (lambda p: p["regimes"]["mixed"].update(floor_s=-0.01), "floor_s must be a number of seconds >= 0"),
    (lambda p: p["regimes"]["mixed"].update(floor_s="33 ms"), "floor_s must be a number"),
    (lambda p: p["regimes"]["mixed"].update(floor_s=""), "floor_s must be a number"),
    (lambda p: p["regimes"]["mixed"].update(floor=0.03), r"unknown key\(s\) \['floor'\]"),
])
def test_bad_profiles_say_what_is_wrong(tmp_path, breakage, message):
    profile = example_profile()
    breakage(profile)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(ProfileError, match=message):
        FittedCostModel.from_profile(path)


def test_unparseable_profile_is_a_profile_error(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="cannot read"):
        FittedCostModel.from_profile(path)


# ---- constant ----


def test_constant_model_is_step_plus_per_token():
    cm = ConstantCostModel(0.01, 0.001, swap_bandwidth=1e9)
    assert cm.iteration_time(arr(3, 1), arr(0, 7)) == pytest.approx(0.014)
    assert cm.iteration_time(arr(), arr()) == 0.0
    assert cm.iteration_time(arr(), arr(), swap_bytes=1e9) == pytest.approx(1.0)


# ---- config and building ----


@pytest.mark.parametrize("fields, field_name", [
    ({"type": "profile"}, "path"),
    ({"step_overhead_ms": -1}, "step_overhead_ms"),
    ({"flops_efficiency": 1.5}, "flops_efficiency"),
    ({"type": "constant"}, "step_ms"),
    ({"path": "x.json"}, "path"),  # a path with type roofline would be silently ignored
    ({"typo": 1}, "typo"),
])
def test_bad_cost_model_config_names_the_field(fields, field_name):
    with pytest.raises(ValidationError, match=field_name):
        CostModelConfig(**fields)


def test_build_uses_config_overrides(llama8b_h100):
    cm = build_cost_model(CostModelConfig(step_overhead_ms=2, flops_efficiency=0.5), *llama8b_h100, 2)
    d = cm.describe()
    assert isinstance(cm, RooflineCostModel)
    assert (d["step_overhead_s"], d["flops_efficiency"], d["tensor_parallel"]) == (2e-3, 0.5, 2)
    const = build_cost_model(CostModelConfig(type="constant", step_ms=5, per_token_ms=1), *llama8b_h100)
    assert const.iteration_time(arr(2), arr(0)) == pytest.approx(0.007)


def test_relative_profile_path_resolves_from_current_dir(tmp_path, monkeypatch):
    save_profile(tmp_path / "profiles" / "mine.json", example_profile())
    monkeypatch.chdir(tmp_path)
    cm = build_cost_model(CostModelConfig(type="profile", path="profiles/mine.json"),
                          get_model("tiny"), get_hardware("cpu-2core"), 1)
    assert isinstance(cm, FittedCostModel)


def test_missing_profile_lists_the_paths_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProfileError) as err:
        build_cost_model(CostModelConfig(type="profile", path="profiles/absent.json"),
                         get_model("tiny"), get_hardware("cpu-2core"), 1)
    msg = str(err.value)
    assert str(tmp_path) in msg and "calibration" in msg


def test_profile_fitted_on_another_model_is_an_error(tmp_path, monkeypatch):
    save_profile(tmp_path / "p.json", example_profile())
    with pytest.raises(ProfileError, match="for model 'tiny' but the scenario runs 'llama-3.1-8b'"):
        build_cost_model(CostModelConfig(type="profile", path=str(tmp_path / "p.json")),
                         get_model("llama-3.1-8b"), get_hardware("h100-sxm"), 1)


@pytest.mark.parametrize(("provenance", "hardware", "tp", "block_size", "says"), [
    # a fitted profile states the device it ran on, one device, and its paged kernels' block size
    ({"device": "cuda", "device_name": "NVIDIA H200"}, "h100-sxm", 1, 16, "for hardware 'h200' but the scenario runs 'h100-sxm'"),
    ({"device": "cuda", "device_name": "NVIDIA H200"}, "h200", 2, 16, "for tensor_parallel 1 but the scenario runs 2"),
    ({"device": "cpu", "cpu_model": "AMD EPYC"}, "h100-sxm", 1, 16, "measured on a CPU (AMD EPYC)"),
    ({"device": "cpu", "block_size": 16}, "cpu-2core", 1, 32, "KV blocks of 16 tokens but the scenario's kv_cache.block_size is 32"),
])
def test_fitted_profile_for_another_device_tp_or_block_size_is_an_error(tmp_path, provenance, hardware, tp, block_size,
                                                                        says):
    # these ran before, priced with the wrong device's measurements
    profile = example_profile()
    profile["provenance"] = {"model": "tiny", **provenance}
    save_profile(tmp_path / "p.json", profile)
    cfg = CostModelConfig(type="profile", path=str(tmp_path / "p.json"))
    with pytest.raises(ProfileError, match=re.escape(says)):
        build_cost_model(cfg, get_model("tiny"), get_hardware(hardware), tp, block_size)
    fine = {"cuda": "h200", "cpu": "cpu-2core"}[provenance["device"]]  # its own device, TP 1, its block size
    build_cost_model(cfg, get_model("tiny"), get_hardware(fine), 1, provenance.get("block_size", block_size))


@pytest.mark.parametrize(("edit", "says"), [
    (lambda p: p["overhead"].update(step_s=-1), "overhead.step_s must be a number of seconds >= 0"),  # simpy's traceback
    (lambda p: p["overhead"].update(per_seq_s="fast"), "overhead.per_seq_s must be a number"),  # float()'s traceback
    (lambda p: p["overhead"].update(swap_bandwidth="x"), "overhead.swap_bandwidth must be > 0"),
    (lambda p: p["regimes"]["decode"]["coef"].__setitem__(0, 1e300), "holds 1e+300 seconds"),  # TTFT 3.6e302 ms
    (lambda p: p.update(gemm_tables=None), "no gemm_tables"),  # the measured terms were silently 0
])
def test_a_corrupt_fitted_profile_names_its_field(edit, says):
    profile = example_profile()
    edit(profile)
    with pytest.raises(ProfileError, match=re.escape(says)):
        FittedCostModel.from_profile_dict(profile)


# ---- speed ----


def test_iteration_time_is_cheap_enough_for_100k_steps(llama8b_h100):
    rng = np.random.default_rng(0)
    q = np.ones(512, dtype=I64)
    q[:4] = 256
    ctx = rng.integers(0, 4000, 512)
    for cm in (RooflineCostModel(*llama8b_h100), FittedCostModel.from_profile_dict(example_profile())):
        per_call = min(timeit.repeat(lambda cm=cm: cm.iteration_time(q, ctx), number=2000, repeat=5)) / 2000
        print(f"{type(cm).__name__}: {per_call * 1e6:.1f} us per 512-row mixed step")
        assert per_call < 150e-6  # target ~15 us; the bound only catches a per-row Python loop


GPU_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpu"


@pytest.mark.skipif(not (GPU_DATA / "SOURCES.md").is_file(), reason="needs the shared GPU data (../shared/data/gpu)")
def test_the_default_roofline_tracks_public_gpu_kernel_timings(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "roofline_vs_measured", Path(__file__).resolve().parents[1] / "benchmarks" / "roofline_vs_measured.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclass looks its module up
    spec.loader.exec_module(bench)
    points = bench.compare(GPU_DATA)
    assert {p["column"] for p in points} >= {"H100 llama-3.1-8b", "A100 llama-3-8b", "RTX 4090 llama-3.1-8b"}
    within = [p for p in points if abs(p["ratio"] - 1) <= 0.10]
    # two known misses (README, Benchmarks): Vidur's H100 gate/up GEMM at 256 rows is as slow as at
    # 512, and the RTX 4090's GEMMs overlap memory and compute better than the blend assumes there
    assert len(within) >= len(points) - 2
    assert all(0.8 <= p["ratio"] <= 1.2 for p in points)


@pytest.mark.skipif(not (GPU_DATA / "SOURCES.md").is_file(), reason="needs the shared GPU data (../shared/data/gpu)")
def test_the_roofline_against_vidurs_tensor_parallel_shards(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "roofline_vs_measured", Path(__file__).resolve().parents[1] / "benchmarks" / "roofline_vs_measured.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    points = bench.compare(GPU_DATA, bench.tp_columns(GPU_DATA))
    assert {p["tp"] for p in points} == {1, 2, 4, 8} and len(points) == 264

    def share(tps):
        mine = [p for p in points if p["tp"] in tps]
        return sum(abs(p["ratio"] - 1) <= 0.10 for p in mine) / len(mine)

    # a rank's work is priced on that rank's shard: at TP 1-2 the roofline holds (126 of 132 points)
    assert share({1, 2}) >= 0.93
    # the known gap (README, Benchmarks): narrow shards reach less of the GEMM peak, so TP 4-8 runs
    # fast (99 of 132 within 10 %, worst 0.76); a bound, so a fix that closes the gap still passes
    assert all(0.74 <= p["ratio"] <= 1.2 for p in points)
    assert share({4, 8}) >= 0.70
