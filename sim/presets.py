"""Model and hardware presets, and the vLLM-style KV-cache sizing that follows from them.

Model shapes are the published Hugging Face ``config.json`` values (sources next to each entry).
Hardware figures are datasheet peaks: dense (no 2:4 sparsity) BF16 tensor-core FLOP/s, HBM
bandwidth, and the memory the driver reports (``nvidia-smi`` total), because that is what
vLLM's ``gpu_memory_utilization`` multiplies. The cost model applies efficiency factors to the
peaks; nothing here is "achievable" throughput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import PresetError
from .hints import did_you_mean

GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, RoPE, GQA attention, SwiGLU MLP."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    # the context length the model was trained for (config.json ``max_position_embeddings``); engine
    # presets derive their default max_model_len / context_length from it, as vLLM and SGLang do
    max_position_embeddings: int
    dtype_bytes: int = 2
    qkv_bias: bool = False

    @property
    def layer_matmul_params(self) -> int:
        """Weights of the q/k/v/o and gate/up/down projections of one layer (parameters)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o + k, v
        return attn + 3 * h * self.intermediate_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters: embedding, layers (matmuls, qkv bias, two norms), final norm, lm head."""
        per_layer = self.layer_matmul_params + 2 * self.hidden_size
        if self.qkv_bias:
            per_layer += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + self.num_layers * per_layer + self.hidden_size + lm_head

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights at ``dtype_bytes`` per parameter."""
        return self.num_params * self.dtype_bytes

    @property
    def streamed_weight_bytes(self) -> int:
        """Weight bytes a forward pass reads: all but the embedding table, which is only gathered.

        With tied embeddings the table is read whole as the lm head, so it counts.
        """
        if self.tie_word_embeddings:
            return self.weight_bytes
        return (self.num_params - self.embedding_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies over all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def linear_flops_per_token(self) -> int:
        """FLOPs of the matmuls for one token through every layer plus the lm head (2 per MAC)."""
        return 2 * (self.num_layers * self.layer_matmul_params + self.embedding_params)

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs per (query, key) pair over all layers: QK^T and PV, 2 FLOPs per MAC each."""
        return 4 * self.num_layers * self.num_heads * self.head_dim


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, inter: int, **kw) -> ModelConfig:
    base = dict(head_dim=hidden // heads, vocab_size=128256, tie_word_embeddings=False,
                rope_theta=500000.0, rms_norm_eps=1e-5)
    base.update(kw)
    return ModelConfig(name, layers, hidden, heads, kv, intermediate_size=inter, **base)


MODELS: dict[str, ModelConfig] = {
    # huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json: 1.236 B params, tied lm head.
    "llama-3.2-1b": _llama("llama-3.2-1b", 16, 2048, 32, 8, 8192, head_dim=64, tie_word_embeddings=True,
                           max_position_embeddings=131072),
    # huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json: 8.030 B params.
    "llama-3.1-8b": _llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, max_position_embeddings=131072),
    # huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json: 70.55 B params.
    "llama-3.1-70b": _llama("llama-3.1-70b", 80, 8192, 64, 8, 28672, max_position_embeddings=131072),
    # huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json (v0.3: vocab 32768, theta 1e6,
    # no sliding window; v0.1 differs only in vocab 32000, theta 1e4, window 4096): 7.248 B params.
    "mistral-7b": _llama("mistral-7b", 32, 4096, 32, 8, 14336, vocab_size=32768, rope_theta=1e6,
                         max_position_embeddings=32768),
    # huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json: 7.616 B params, bias on q/k/v only.
    "qwen2.5-7b": _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, vocab_size=152064, rope_theta=1e6,
                         rms_norm_eps=1e-6, qkv_bias=True, max_position_embeddings=131072),
    # Live mode on the 2-core CPU: small enough for ~100 tokens/s in fp32 PyTorch.
    "tiny": ModelConfig("tiny", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=32,
                        intermediate_size=768, vocab_size=4096, tie_word_embeddings=False,
                        rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096, dtype_bytes=4),
}


@dataclass(frozen=True, slots=True)
class HardwareConfig:
    """One accelerator. Peaks per device; bandwidths in bytes/s, one direction."""

    name: str
    peak_flops: float = 989e12  # dense BF16 FLOP/s
    hbm_bandwidth: float = 3.35e12  # bytes/s
    memory_bytes: float = 80 * GiB  # what the driver reports as total
    pcie_bandwidth: float = 50e9  # host<->device, effective, one direction (KV swap)
    interconnect_bandwidth: float = 450e9  # GPU<->GPU for TP all-reduce, one direction per GPU
    # CUDA context, cuBLAS/NCCL workspaces, CUDA graphs: memory vLLM never gives to the KV cache.
    runtime_reserve_bytes: float = 1 * GiB
    # Rows of a GEMM tile: a step's token count is padded up to a multiple of it (1 = no padding).
    gemm_tile_tokens: int = 64


# Sources: NVIDIA A100 datasheet (nvidia.com/.../a100-80gb-datasheet-update-nvidia-us-1521051-r2-web.pdf),
# H100 datasheet (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet),
# H200 product brief (nvidia.com/en-us/data-center/h200), L40S datasheet
# (resources.nvidia.com/en-us-l40s/l40s-datasheet-28413). Datasheet "with sparsity" figures are halved.
# memory_bytes is nvidia-smi's total (81920 MiB A100 80GB, 81559 MiB H100 SXM, 143771 MiB H200 SXM,
# 46068 MiB L40S), the figure vLLM's gpu_memory_utilization scales. PCIe effective is ~80% of
# one direction of x16 (Gen4 32 GB/s, Gen5 64 GB/s). NVLink: half the bidirectional total
# (A100 600 GB/s, H100/H200 900 GB/s); L40S has no NVLink, so TP all-reduces cross PCIe.
HARDWARE: dict[str, HardwareConfig] = {
    "a100-80g": HardwareConfig("a100-80g", peak_flops=312e12, hbm_bandwidth=2.039e12,
                               memory_bytes=81920 * MiB, pcie_bandwidth=25e9, interconnect_bandwidth=300e9),
    "h100-sxm": HardwareConfig("h100-sxm", peak_flops=989e12, hbm_bandwidth=3.35e12,
                               memory_bytes=81559 * MiB, pcie_bandwidth=50e9, interconnect_bandwidth=450e9),
    "h200": HardwareConfig("h200", peak_flops=989e12, hbm_bandwidth=4.8e12,
                           memory_bytes=143771 * MiB, pcie_bandwidth=50e9, interconnect_bandwidth=450e9),
    "l40s": HardwareConfig("l40s", peak_flops=362e12, hbm_bandwidth=864e9,
                           memory_bytes=46068 * MiB, pcie_bandwidth=25e9, interconnect_bandwidth=25e9),
    # This machine (2 AMD EPYC cores, AVX2 FMA): fp32 PyTorch matmuls reach a few tens of GFLOP/s
    # and a stream copy ~10 GB/s. Rough on purpose: calibration/profiles/cpu-tiny.json replaces it.
    # memory_bytes is the slice of host RAM live mode may use for weights + KV, not the whole RAM.
    "cpu-2core": HardwareConfig("cpu-2core", peak_flops=50e9, hbm_bandwidth=10e9, memory_bytes=4 * GiB,
                                pcie_bandwidth=5e9, interconnect_bandwidth=5e9,
                                runtime_reserve_bytes=256 * MiB, gemm_tile_tokens=1),
}


def _lookup(table: dict, name: str, what: str):
    try:
        return table[name]
    except (KeyError, TypeError):
        raise PresetError(f"unknown {what} {name!r}{did_you_mean(name, table)}; choose one of: "
                          f"{', '.join(sorted(table))}") from None


def get_model(name: str) -> ModelConfig:
    """The model preset called ``name``; ``PresetError`` lists the names if there is none."""
    return _lookup(MODELS, name, "model")


def get_hardware(name: str) -> HardwareConfig:
    """The hardware preset called ``name``; ``PresetError`` lists the names if there is none."""
    return _lookup(HARDWARE, name, "hardware")


def kv_heads_per_rank(model: ModelConfig, tensor_parallel: int) -> int:
    """KV heads each TP rank holds: split evenly, or replicated when there are fewer heads than ranks.

    Follows vLLM: ``max(1, num_kv_heads // tp)``; head counts that do not divide are rejected.
    """
    tp, kv = tensor_parallel, model.num_kv_heads
    if tp < 1:
        raise PresetError(f"tensor_parallel must be >= 1, got {tp}")
    if model.num_heads % tp or (kv % tp if kv >= tp else tp % kv):
        raise PresetError(f"{model.name}: {model.num_heads} heads / {kv} KV heads cannot be split over "
                          f"tensor_parallel={tp}; use a divisor of {model.num_heads}")
    return max(1, kv // tp)


def default_activation_reserve_bytes(model: ModelConfig, tensor_parallel: int = 1,
                                     max_num_batched_tokens: int = 8192) -> float:
    """Peak activation memory of vLLM's profiling forward pass, per device (bytes).

    The largest live tensors of a ``max_num_batched_tokens`` step are the SwiGLU gate/up output
    (2 x intermediate per token) next to a few hidden-sized buffers (residual, normed input,
    qkv, attention output): ~(2 I + 4 h) values per token, split across TP ranks. Llama-3.1-8B
    at 8192 tokens gives ~0.7 GiB, in line with the 1-2 GiB vLLM logs as "activation peak".
    """
    per_token = 2 * model.intermediate_size + 4 * model.hidden_size
    return max_num_batched_tokens * per_token * model.dtype_bytes / tensor_parallel


def kv_block_bytes(model: ModelConfig, tensor_parallel: int, block_size: int) -> int:
    """Bytes one KV block (``block_size`` tokens, all layers, K and V) takes on one TP rank."""
    per_token = 2 * model.num_layers * kv_heads_per_rank(model, tensor_parallel) * model.head_dim
    return per_token * model.dtype_bytes * block_size


def num_kv_blocks(model: ModelConfig, hardware: HardwareConfig, tensor_parallel: int,
                  gpu_memory_utilization: float, block_size: int,
                  activation_reserve_bytes: float | None = None) -> int:
    """KV blocks per device, vLLM style (every TP rank holds the same number of blocks).

    usable = memory * utilization - weights / tp - runtime reserve - activation reserve (bytes);
    the runtime reserve is ``hardware.runtime_reserve_bytes`` (1 GiB on GPUs) and the activation
    reserve defaults to ``default_activation_reserve_bytes``. Raises ``PresetError`` when the
    weights and reserves leave no room for even one block.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise PresetError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if block_size < 1:
        raise PresetError(f"block_size must be >= 1, got {block_size}")
    if activation_reserve_bytes is None:
        activation_reserve_bytes = default_activation_reserve_bytes(model, tensor_parallel)
    budget = hardware.memory_bytes * gpu_memory_utilization
    weights = model.weight_bytes / tensor_parallel
    usable = budget - weights - hardware.runtime_reserve_bytes - activation_reserve_bytes
    per_block = kv_block_bytes(model, tensor_parallel, block_size)
    if usable < per_block:
        raise PresetError(
            f"{model.name} does not fit on {hardware.name} with tensor_parallel={tensor_parallel}: "
            f"weights {weights / GiB:.1f} GiB + reserves "
            f"{(hardware.runtime_reserve_bytes + activation_reserve_bytes) / GiB:.1f} GiB per device vs "
            f"{budget / GiB:.1f} GiB at gpu_memory_utilization={gpu_memory_utilization}; "
            "raise tensor_parallel or pick bigger hardware")
    return math.floor(usable / per_block)
