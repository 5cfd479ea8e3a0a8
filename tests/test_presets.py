import dataclasses

import pytest
from servesim.sim.presets import (
    HARDWARE,
    MODELS,
    GiB,
    PresetError,
    default_activation_reserve_bytes,
    get_hardware,
    get_model,
    hardware_preset,
    kv_block_bytes,
    kv_heads_per_rank,
    non_torch_reserve_bytes,
    num_kv_blocks,
)


@pytest.mark.parametrize("name, published", [
    # Parameter counts from the models' safetensors metadata on Hugging Face.
    ("llama-3.2-1b", 1_235_814_400),
    ("llama-3.2-3b", 3_212_749_824),
    # Qwen3-8B's model card: 8.2 B parameters, 6.95 B without the two embedding tables (both agree
    # with this count from its config's shapes).
    ("qwen3-8b", 8_190_735_360),
    ("llama-3.1-8b", 8_030_261_248),
    ("llama-3.1-70b", 70_553_706_496),
    ("llama-3-70b", 70_553_706_496),
    ("llama-2-70b", 68_976_648_192),
    ("mistral-7b", 7_248_023_552),
    ("qwen2.5-7b", 7_615_616_512),
    ("llama-3-8b", 8_030_261_248),
    ("llama-2-7b", 6_738_415_616),
    # Qwen3-32B's model card: 32.8 B parameters, 31.2 B without the two embedding tables.
    ("qwen3-32b", 32_762_123_264),
])
def test_param_count_matches_published_checkpoint(name, published):
    assert get_model(name).num_params == published


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer():
    # 2 (K, V) * 32 layers * 8 KV heads * 128 head_dim * 2 bytes
    assert get_model("llama-3.1-8b").kv_bytes_per_token == 131_072
    # tiny runs fp32 on the CPU: 2 * 4 * 2 * 32 * 4
    assert get_model("tiny").kv_bytes_per_token == 2048


def test_tied_embeddings_count_the_table_once():
    m = get_model("llama-3.2-1b")
    untied = dataclasses.replace(m, tie_word_embeddings=False)
    assert untied.num_params - m.num_params == m.vocab_size * m.hidden_size
    assert untied.streamed_weight_bytes == untied.weight_bytes - m.vocab_size * m.hidden_size * 2
    # Tied: the lm head reads the whole table, so every weight byte streams each step.
    assert m.streamed_weight_bytes == m.weight_bytes


def test_linear_flops_per_token_is_twice_the_matmul_weights_including_lm_head():
    m = get_model("llama-3.1-8b")
    norms = m.num_layers * 2 * m.hidden_size + m.hidden_size
    matmul_params = m.num_params - m.embedding_params - norms  # lm head stays in
    assert m.linear_flops_per_token == 2 * matmul_params


def test_unknown_names_raise_preset_error_listing_the_choices():
    with pytest.raises(PresetError) as err:
        get_model("llama-9")
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    assert "llama-3.1-8b" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(PresetError, match="h100-sxm"):
        get_hardware("tpu")


def test_every_hardware_preset_has_positive_figures():
    for hw in HARDWARE.values():
        assert min(hw.peak_flops, hw.hbm_bandwidth, hw.memory_bytes, hw.pcie_bandwidth) > 0
    assert {"rtx-pro-6000", "rtx-4090"} <= set(HARDWARE)
    assert set(MODELS) >= {"llama-3-8b", "llama-2-7b", "qwen3-32b", "llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b", "mistral-7b", "qwen2.5-7b", "tiny"}


def test_llama_8b_on_h100_gets_the_block_count_vllm_019_logged():
    # llm-d-planner's vLLM 0.19.0 log (calibration/data/vllm_memory_logs.csv row 1): utilization
    # 0.95, 1024 seqs, 8192 tokens -> "GPU KV cache size: 476,016 tokens" = 29,751 blocks of 16.
    blocks = num_kv_blocks(get_model("llama-3.1-8b"), get_hardware("h100-sxm"), 1, 0.95, 16,
                           max_num_seqs=1024, max_num_batched_tokens=8192)
    assert abs(blocks - 29_751) / 29_751 < 0.002


def test_utilization_scales_the_total_cuda_reports_not_nvidia_smis():
    hw = get_hardware("h100-sxm")
    assert hw.cuda_total_bytes == 79.19 * GiB < hw.memory_bytes  # 81559 MiB in nvidia-smi
    for gpu in HARDWARE.values():
        assert 0 <= gpu.memory_bytes - gpu.cuda_total_bytes <= 1 * GiB
    assert get_hardware("cpu-2core").cuda_total_bytes == get_hardware("cpu-2core").memory_bytes


def test_sampler_reserve_is_seats_times_vocabulary_and_ignores_tensor_parallel():
    m = get_model("llama-3.1-8b")
    small, big = (default_activation_reserve_bytes(m, 1, 8192, seqs) for seqs in (512, 1024))
    assert big - small == pytest.approx(512 * m.vocab_size * 14.8)
    # every TP rank gathers the full logits and samples, so the sampler phase does not shrink
    assert default_activation_reserve_bytes(m, 4, 8192, 1024) == big
    # vLLM 0.19 on an H100 (llm-d-planner): Llama-3.1-8B 1.89 GiB, Qwen2.5-7B 2.21 GiB
    assert big / GiB == pytest.approx(1.89, abs=0.05)
    assert default_activation_reserve_bytes(get_model("qwen2.5-7b"), 1, 8192, 1024) / GiB == pytest.approx(2.21, abs=0.05)


def test_profile_run_has_at_most_one_request_per_token():
    m = get_model("llama-3.1-8b")
    assert default_activation_reserve_bytes(m, 1, 128, 1024) == default_activation_reserve_bytes(m, 1, 128, 128)


def test_forward_reserve_wins_for_a_small_vocabulary_and_splits_over_tensor_parallel():
    # CodeLlama-7B's 32k vocabulary: vLLM 0.19 logged 0.77 GiB, the forward pass's peak
    codellama = dataclasses.replace(get_model("llama-2-7b"), vocab_size=32016)
    one = default_activation_reserve_bytes(codellama, 1, 8192, 1024)
    assert one / GiB == pytest.approx(0.77, abs=0.03)
    assert one == 8192 * (3 * 11008 + 4.25 * 4096) * 2
    assert default_activation_reserve_bytes(codellama, 2, 8192, 1024) < one


def test_non_torch_reserve_grows_with_tensor_parallel_only_on_nvswitch_hoppers():
    h100, pro = get_hardware("h100-sxm"), get_hardware("rtx-pro-6000")
    assert non_torch_reserve_bytes(h100, 1) == non_torch_reserve_bytes(pro, 1) == 0.25 * GiB
    # vLLM 0.19 logged 2.06-2.13 GiB at TP 2 and 4 on H100s
    assert non_torch_reserve_bytes(h100, 2) == non_torch_reserve_bytes(h100, 4) == 2.1 * GiB
    assert non_torch_reserve_bytes(pro, 2) == 0.25 * GiB


def test_scenario_blocks_follow_the_schedulers_seats_and_budget():
    from servesim.sim.scenario import scenario_from_dict

    def blocks(**knobs):
        return scenario_from_dict({"model": "llama-3.1-8b", "hardware": "rtx-4090",
                                   "scheduler": {"preset": "vllm-v1", **knobs},
                                   "workload": {"num_requests": 1, "arrival": {"process": "poisson", "rate": 1},
                                                "prompt_len": 1, "output_len": 1}}).derived_kv_blocks()

    # fewer seats: a smaller dummy-sampler batch, so more KV blocks
    assert blocks(max_num_seqs=64) > blocks(max_num_seqs=256)
    m, hw = get_model("llama-3.1-8b"), get_hardware("rtx-4090")
    assert blocks(max_num_seqs=64, max_num_batched_tokens=4096) == num_kv_blocks(
        m, hw, 1, 0.9, 16, max_num_seqs=64, max_num_batched_tokens=4096)


def test_other_engine_presets_get_the_memory_a_default_vllm_server_leaves():
    from servesim.sim.scenario import scenario_from_dict

    def tokens(preset, **knobs):
        sc = scenario_from_dict({"model": "llama-3.1-8b", "hardware": "h100-sxm",
                                 "scheduler": {"preset": preset, **knobs},
                                 "workload": {"num_requests": 1, "arrival": {"process": "poisson", "rate": 1},
                                              "prompt_len": 1, "output_len": 1}})
        return sc.derived_kv_blocks() * sc.kv_cache.block_size

    # vLLM V1 on an H100 defaults to 1024 seats; TensorRT-LLM's 2048-row batch does not change its memory
    vllm = tokens("vllm-v1")
    for preset in ("tensorrt-llm", "sglang", "vllm-v0"):
        assert abs(tokens(preset) - vllm) < 32  # whole blocks of each preset's own size
    assert tokens("tensorrt-llm", max_batch_size=64) == tokens("tensorrt-llm")


def test_more_memory_gives_more_blocks():
    m = get_model("llama-3.1-8b")
    b = {hw: num_kv_blocks(m, get_hardware(hw), 1, 0.9, 16) for hw in ("h200", "h100-sxm", "a100-80g", "l40s")}
    assert b["h200"] > b["h100-sxm"] > b["l40s"]
    assert b["h200"] > b["a100-80g"] > b["l40s"]
    # A100 80GB and H100 SXM both carry 80 GB: within 2% of each other.
    assert abs(b["h100-sxm"] - b["a100-80g"]) / b["h100-sxm"] < 0.02


def test_block_count_follows_the_memory_formula():
    m, hw = get_model("tiny"), get_hardware("cpu-2core")
    usable = hw.cuda_total_bytes * 0.5 - m.weight_bytes - hw.non_torch_bytes - 1 * GiB
    expected = int(usable // (m.kv_bytes_per_token * 16))
    assert num_kv_blocks(m, hw, 1, 0.5, 16, activation_reserve_bytes=1 * GiB) == expected


def test_70b_does_not_fit_on_one_l40s():
    with pytest.raises(PresetError, match="does not fit"):
        num_kv_blocks(get_model("llama-3.1-70b"), get_hardware("l40s"), 1, 0.9, 16)
    assert num_kv_blocks(get_model("llama-3.1-70b"), get_hardware("l40s"), 8, 0.9, 16) > 0


def test_tensor_parallel_splits_weights_and_kv_heads():
    m, hw = get_model("llama-3.1-8b"), get_hardware("h100-sxm")
    assert kv_block_bytes(m, 2, 16) * 2 == kv_block_bytes(m, 1, 16)
    # Half the weights per rank and half the KV per block: more than twice the blocks.
    assert num_kv_blocks(m, hw, 2, 0.9, 16) > 2 * num_kv_blocks(m, hw, 1, 0.9, 16)


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    m = get_model("llama-3.1-8b")  # 8 KV heads
    assert kv_heads_per_rank(m, 16) == 1
    assert kv_block_bytes(m, 16, 16) == kv_block_bytes(m, 8, 16)


def test_head_counts_that_do_not_split_are_rejected():
    with pytest.raises(PresetError, match="tensor_parallel=3"):
        kv_heads_per_rank(get_model("llama-3.1-8b"), 3)
    with pytest.raises(PresetError, match="gpu_memory_utilization"):
        num_kv_blocks(get_model("tiny"), get_hardware("cpu-2core"), 1, 1.5, 16)


def test_did_you_mean_prefers_the_choice_a_name_begins_then_the_closest_then_nothing():
    from servesim.sim.hints import did_you_mean

    assert did_you_mean("h100", ["a100-80g", "h100-sxm", "h200"]) == " (did you mean 'h100-sxm'?)"
    assert did_you_mean("max_num_seq", ["max_num_seqs", "policy"]) == " (did you mean 'max_num_seqs'?)"
    assert did_you_mean("zzz", ["max_num_seqs", "policy"]) == ""


def test_shipped_sizing_constants_are_the_fit_of_the_logged_vllm_rows():
    import importlib.util
    from pathlib import Path

    import pandas as pd
    from servesim.sim.presets import FORWARD_HIDDEN_BUFFERS, SAMPLER_BYTES_PER_LOGIT

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kv_sizing_vs_logs.py"
    spec = importlib.util.spec_from_file_location("kv_sizing_vs_logs", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = pd.read_csv(bench.DATA)
    fitted = bench.fit(rows[rows["vllm_version"] == bench.FIT_RELEASE])
    h100 = get_hardware("h100-sxm")
    assert fitted["sampler"] == pytest.approx(SAMPLER_BYTES_PER_LOGIT, abs=0.05)
    assert fitted["hidden"] == pytest.approx(FORWARD_HIDDEN_BUFFERS, abs=0.05)
    assert fitted["non_torch"] == pytest.approx(h100.non_torch_bytes, abs=0.01 * GiB)
    assert fitted["tp_extra"] == pytest.approx(h100.tp_non_torch_bytes, abs=0.01 * GiB)


def test_each_gpu_presets_cuda_device_name_names_that_preset():
    # the name CUDA reports (what vLLM reads, and what calibrate's provenance records) maps back
    for name, hw in HARDWARE.items():
        if not name.startswith("cpu"):
            assert hw.device_name and hardware_preset(hw.device_name) == name, name
