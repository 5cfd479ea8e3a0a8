import dataclasses

import pytest
from servesim.sim.presets import (
    HARDWARE,
    MODELS,
    GiB,
    PresetError,
    get_hardware,
    get_model,
    kv_block_bytes,
    kv_heads_per_rank,
    num_kv_blocks,
)


@pytest.mark.parametrize("name, published", [
    # Parameter counts from the models' safetensors metadata on Hugging Face.
    ("llama-3.2-1b", 1_235_814_400),
    ("llama-3.1-8b", 8_030_261_248),
    ("llama-3.1-70b", 70_553_706_496),
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


def test_llama_8b_on_h100_gets_vllm_like_block_count():
    blocks = num_kv_blocks(get_model("llama-3.1-8b"), get_hardware("h100-sxm"), 1, 0.9, 16)
    # vLLM logs ~28k GPU blocks for this setup (2 MiB per 16-token block).
    assert 26_000 <= blocks <= 30_500


def test_more_memory_gives_more_blocks():
    m = get_model("llama-3.1-8b")
    b = {hw: num_kv_blocks(m, get_hardware(hw), 1, 0.9, 16) for hw in ("h200", "h100-sxm", "a100-80g", "l40s")}
    assert b["h200"] > b["h100-sxm"] > b["l40s"]
    assert b["h200"] > b["a100-80g"] > b["l40s"]
    # A100 80GB and H100 SXM both carry 80 GB: within 2% of each other.
    assert abs(b["h100-sxm"] - b["a100-80g"]) / b["h100-sxm"] < 0.02


def test_block_count_follows_the_memory_formula():
    m, hw = get_model("tiny"), get_hardware("cpu-2core")
    usable = hw.memory_bytes * 0.5 - m.weight_bytes - hw.runtime_reserve_bytes - 1 * GiB
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
