"""Model and hardware presets, and the vLLM-style KV-cache sizing that follows from them.

Model shapes are the published Hugging Face ``config.json`` values (sources next to each entry).
Hardware figures are datasheet peaks: dense (no 2:4 sparsity) BF16 tensor-core FLOP/s, HBM
bandwidth, and the memory ``nvidia-smi`` reports, next to the smaller total CUDA reports
(``torch.cuda.mem_get_info``), which is what vLLM's ``gpu_memory_utilization`` multiplies. Next to
the peaks, each GPU carries the fractions of them that real kernels reach (weight streaming,
streaming passes, GEMM and attention FLOP/s) and its kernel floor, measured from public kernel
timings and cited next to ``HARDWARE``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from .errors import PresetError
from .hardware_file import hardware_fields, is_hardware_file
from .hf_config import is_config_path, model_fields
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
    # Qwen3: an RMSNorm over each head's q and k (2 x head_dim weights per layer). Counted in the
    # parameters; the live model (kernels/model.py) does not apply it, a negligible cost.
    qk_norm: bool = False

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
        if self.qk_norm:
            per_layer += 2 * self.head_dim
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
    # huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json: 3.213 B params, tied lm head.
    "llama-3.2-3b": _llama("llama-3.2-3b", 28, 3072, 24, 8, 8192, head_dim=128, tie_word_embeddings=True,
                           max_position_embeddings=131072),
    # huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json: 8.030 B params.
    "llama-3.1-8b": _llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, max_position_embeddings=131072),
    # huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json: as 3.1-8B (8.030 B params),
    # only its context differs (8192 positions, no rope scaling).
    "llama-3-8b": _llama("llama-3-8b", 32, 4096, 32, 8, 14336, max_position_embeddings=8192),
    # huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json: 6.738 B params, MHA (32 KV heads).
    "llama-2-7b": _llama("llama-2-7b", 32, 4096, 32, 32, 11008, vocab_size=32000, rope_theta=10000.0,
                         max_position_embeddings=4096),
    # huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json: 70.55 B params.
    "llama-3.1-70b": _llama("llama-3.1-70b", 80, 8192, 64, 8, 28672, max_position_embeddings=131072),
    # huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json: as 3.1-70B (70.55 B params),
    # only its context differs (8192 positions, no rope scaling). Vidur's A100 tables time it.
    "llama-3-70b": _llama("llama-3-70b", 80, 8192, 64, 8, 28672, max_position_embeddings=8192),
    # huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json: 68.98 B params, GQA (8 KV heads),
    # 4096 positions. Vidur's H100 tables time it.
    "llama-2-70b": _llama("llama-2-70b", 80, 8192, 64, 8, 28672, vocab_size=32000, rope_theta=10000.0,
                          max_position_embeddings=4096),
    # huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json (v0.3: vocab 32768, theta 1e6,
    # no sliding window; v0.1 differs only in vocab 32000, theta 1e4, window 4096): 7.248 B params.
    "mistral-7b": _llama("mistral-7b", 32, 4096, 32, 8, 14336, vocab_size=32768, rope_theta=1e6,
                         max_position_embeddings=32768),
    # huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json: 7.616 B params, bias on q/k/v only.
    "qwen2.5-7b": _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, vocab_size=152064, rope_theta=1e6,
                         rms_norm_eps=1e-6, qkv_bias=True, max_position_embeddings=131072),
    # huggingface.co/Qwen/Qwen3-32B/blob/main/config.json: 32.76 B params; head_dim 128 with 64
    # heads (q width 8192 > hidden 5120), q/k RMSNorm, no qkv bias, untied lm head.
    "qwen3-32b": _llama("qwen3-32b", 64, 5120, 64, 8, 25600, head_dim=128, vocab_size=151936,
                        rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True, max_position_embeddings=40960),
    # huggingface.co/Qwen/Qwen3-8B/blob/main/config.json: 8.191 B params; q/k RMSNorm, untied lm head.
    "qwen3-8b": _llama("qwen3-8b", 36, 4096, 32, 8, 12288, head_dim=128, vocab_size=151936, rope_theta=1e6,
                       rms_norm_eps=1e-6, qk_norm=True, max_position_embeddings=40960),
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
    memory_bytes: float = 80 * GiB  # what nvidia-smi reports as total
    # What CUDA reports as total (torch.cuda.mem_get_info()[1]), the figure vLLM's
    # gpu_memory_utilization multiplies; the driver keeps 300-900 MiB of the nvidia-smi total for
    # itself (calibration/data/gpu_cuda_totals.csv). None: memory_bytes (the CPU, no driver).
    cuda_memory_bytes: float | None = None
    pcie_bandwidth: float = 50e9  # host<->device, effective, one direction (KV swap)
    interconnect_bandwidth: float = 450e9  # GPU<->GPU for TP all-reduce, one direction per GPU
    # The TP all-reduce over that link (sim/allreduce.py): one call takes latency + hop latency x
    # (GPUs - 1) + 2 (n - 1) / n x bytes / (bandwidth x efficiency). Fitted per GPU where NCCL was
    # measured (sources next to HARDWARE); these defaults are for links nobody measured.
    interconnect: str = "nvlink4"  # what the link is: nvlink3 / nvlink4 / pcie4 / pcie5
    allreduce_efficiency: float = 0.7
    allreduce_latency_s: float = 20e-6
    allreduce_hop_latency_s: float = 0.0
    gpus_per_node: int = 8  # the largest TP group on one link (TP across nodes is not modelled)
    # On-demand $ per GPU-hour (approximate list prices, see HARDWARE); None: no price known.
    price_per_gpu_hour: float | None = None
    # Device memory outside PyTorch's allocator that vLLM's profile run adds (its "non-torch
    # forward increase": cuBLAS workspaces, NCCL and all-reduce buffers), per device; and what
    # tensor parallelism adds to it. vLLM 0.19 logged 0.24-0.46 GiB at TP 1 (median 0.25) and
    # 2.06-2.13 GiB at TP 2 and 4 on H100 NVSwitch nodes (calibration/data/vllm_memory_logs.csv).
    # The CUDA context is not in it: vLLM's baseline snapshot is taken after the context exists.
    non_torch_bytes: float = 0.25 * GiB
    tp_non_torch_bytes: float = 0.0
    # Rows of a GEMM tile: a step's token count is padded up to a multiple of it (1 = no padding).
    gemm_tile_tokens: int = 64
    # What real kernels reach of the peaks above (fractions), for the roofline cost model. Measured
    # per GPU from public kernel timings (sources next to HARDWARE); these defaults are for hardware
    # nobody has profiled: round figures inside the range the profiled GPUs span.
    weight_bandwidth_fraction: float = 0.85  # GEMMs streaming their weights, beyond the kernel floor
    stream_bandwidth_fraction: float = 0.85  # streaming kernels: decode attention's KV read, norms, activation
    gemm_flops_fraction: float = 0.75  # large bf16 GEMMs (thousands of rows)
    attention_flops_fraction: float = 0.6  # prefill flash attention, on the causal FLOPs
    kernel_floor_s: float = 4e-6  # the shortest a kernel takes: launch, ramp-up and tail (seconds)
    # Streaming multiprocessors and L2 cache (datasheets); None: not a GPU, or not known.
    sm_count: int | None = None
    l2_bytes: float | None = None
    # The FlashAttention major version vLLM V1 runs on this GPU (sources next to HARDWARE): 2 on
    # Ampere, Ada and RTX Blackwell (sm80/86/89/120), 3 on Hopper (sm90); None: not known or no
    # FlashAttention (CPU). With 2 and an sm_count the roofline prices a step that has a prefill row
    # as FA2's varlen kernel runs it (sim/varlen_attention.py); otherwise as a decode KV read plus a
    # prefill. It is a fact about vLLM on that chip, not a measurement: unprofiled presets set it too.
    flash_attention: int | None = None
    # FA2's decode-only steps (GQA-packed split-KV thread blocks, sim/varlen_attention.py): seconds a
    # block spends per KV tile when latency-bound (short contexts, few rows) and what the merge
    # kernel of a split adds, per layer. Fitted per GPU on LLMServingSim's measured decode attention
    # (benchmarks/mixed_attention.py --decode-waves); None: not measured, and a decode step's
    # attention stays a KV read plus launch floors.
    fa2_decode_tile_s: float | None = None
    fa2_decode_merge_s: float = 0.0
    # What CUDA calls the device (torch.cuda.get_device_name(), nvidia-smi's name), which vLLM's
    # batch defaults read (sim/engine_presets/vllm_v1.py); None: take ``name``.
    device_name: str | None = None

    @property
    def cuda_total_bytes(self) -> float:
        """Device memory as CUDA reports its total (bytes): what ``gpu_memory_utilization`` scales."""
        return self.memory_bytes if self.cuda_memory_bytes is None else self.cuda_memory_bytes


# Sources: NVIDIA A100 datasheet (nvidia.com/.../a100-80gb-datasheet-update-nvidia-us-1521051-r2-web.pdf),
# H100 datasheet (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet),
# H200 product brief (nvidia.com/en-us/data-center/h200), L40S datasheet
# (resources.nvidia.com/en-us-l40s/l40s-datasheet-28413). Datasheet "with sparsity" figures are halved.
# memory_bytes is nvidia-smi's total (81920 MiB A100 80GB, 81559 MiB H100 SXM, 143771 MiB H200 SXM,
# 46068 MiB L40S), the figure vLLM's gpu_memory_utilization scales. PCIe effective is ~80% of
# one direction of x16 (Gen4 32 GB/s, Gen5 64 GB/s). NVLink: half the bidirectional total
# (A100 600 GB/s, H100/H200 900 GB/s); L40S has no NVLink, so TP all-reduces cross PCIe.
# RTX PRO 6000 Blackwell Server Edition (nvidia.com/en-us/data-center/rtx-pro-6000-blackwell-server-edition):
# 96 GB GDDR7 (97887 MiB in nvidia-smi), 1792 GB/s, 4 PFLOPS FP4 with sparsity -> 2 dense FP4,
# 0.5 dense BF16 (FP32 accumulate at full rate on this professional card); PCIe Gen5, no NVLink.
# RTX 4090 (Ada Lovelace whitepaper, appendix table): 24 GB GDDR6X (24564 MiB), 1008 GB/s,
# 165.2 TFLOP/s dense BF16 with FP32 accumulate (GeForce runs FP32 accumulate at half rate);
# PCIe Gen4, no NVLink (and no peer-to-peer), so TP all-reduces cross PCIe through the host.
#
# cuda_memory_bytes, the total CUDA reports (calibration/data/gpu_cuda_totals.csv): H100 SXM 79.19
# GiB (vLLM 0.19's own snapshot), RTX PRO 6000 94.97 GiB, RTX 4090 23.64 GiB (torch messages on
# those cards); L40S 44.43 GiB, read on an RTX 6000 Ada, the same AD102 board with the same 46068
# MiB. A100 80GB and H200 are not measured: nvidia-smi's total less 512 MiB, about the median gap
# of the six measured cards (317-637 MiB, median 490). tp_non_torch_bytes 1.85 GiB on the NVSwitch Hopper nodes:
# vLLM 0.19 logged 2.06-2.13 GiB non-torch at TP 2 and 4 on H100s against 0.25 at TP 1; no
# PCIe card is measured at TP > 1 (vLLM issue #29070: 0.09 GiB at TP 4 on NVLink-paired A30s).
#
# Achievable fractions, from the public kernel timings in ../shared/data/gpu (SOURCES.md there:
# LLMServingSim, MIT (c) 2024 CASYS Lab at KAIST; Vidur, MIT (c) Microsoft Corporation;
# inference-sim, Apache-2.0). `python benchmarks/roofline_vs_measured.py --constants` recomputes
# every figure below from those files. "GEMM fit": least squares of time = floor + weight bytes /
# (bandwidth x fraction) over the model's GEMMs at 1, 2, 4 and 8 rows (the weight-bound end);
# "GEMM FLOP/s": the model's layer GEMMs' FLOPs over their summed time at the largest rows given.
# - h100-sxm: weight 0.89 (GEMM fit: llmservingsim/v0-H100-Llama-3.1-8B/layers.csv o/down/lm_head
#   0.87, floor 3.4 us; vidur/compute/h100/.../Llama-2-7b-hf/mlp.csv 0.92, floor 5.5 us); stream
#   0.87 (inference-sim/h100/mha_decode_h100_32-{8,32}-128-tp1.csv, batch >= 64 at kv 1024-4096:
#   0.76-0.94); GEMM FLOP/s 0.76 (v0 layers.csv at 2048 rows 0.765; Vidur at 1024 / 4096: 0.74 / 0.75);
#   attention 0.73 (mha_prefill_h100_*.csv at 8192 tokens, mfu 0.729-0.731); floor 4 us (GEMM
#   fits 3.4-5.5 us, Vidur's norm and rotary at 1 token 4 us).
# - a100-80g: weight 0.82 (GEMM fit: vidur/compute/a100/.../Meta-Llama-3-8B/mlp.csv 0.82, floor
#   4.7 us); stream 0.88 (same file, residual add at 4096-32768 tokens, 3 passes: 0.83-0.88; no
#   attention table for the A100); GEMM FLOP/s 0.70 (same file, 1024-4096 rows: 0.66-0.73);
#   attention 0.6 (not measured here: FlashAttention-2 reports 50-73 % of peak on the A100
#   forward pass, arXiv:2307.08691); floor 4.5 us (GEMM fit 4.7 us; norm at 1 token 5 us).
# - rtx-pro-6000: weight 0.84 (GEMM fit: llmservingsim/profiles/RTXPRO6000/*/tp1 dense.csv qkv/o/
#   gate_up/down + per_sequence.csv lm_head: Llama-3.1-8B 0.85, floor 4.0 us, Qwen3-32B 0.82,
#   floor 2.0 us); stream 0.84 (attention.csv decode, n_decode >= 64 at kv 4096: 0.80-0.84);
#   GEMM FLOP/s 0.78 (dense.csv at 2048 rows: 0.785 / 0.777); attention 0.43 (attention.csv, a
#   2048-token chunk with no cached context: 0.40 / 0.46); floor 3 us (GEMM fits 2.0-4.0 us; norm,
#   rotary, activation, embedding at 1 token 2.3-4.2 us).
# - rtx-4090: weight 0.95 (GEMM fit, RTX4090 Llama-3.1-8B tp1: 0.95, floor 4.3 us); stream 0.93
#   (attention.csv decode n_decode >= 64 at kv 4096: 0.90-0.94); GEMM FLOP/s 1.0 (dense.csv at
#   2048 rows: 1.00 of the datasheet's 165.2, boost clocks); attention 0.62 (2048-token chunk, no
#   cached context); floor 3 us (GEMM fit 4.3 us; small ops at 1 token 1.9-2.8 us).
# - h200: not profiled; the H100's fractions (same Hopper SM, faster HBM3e).
#
# TP all-reduce (sim/allreduce.py), fitted by `python benchmarks/allreduce_vs_nccl.py` to Vidur's
# NCCL all-reduce timings on one DGX node, 2/4/8 GPUs, 2 KB-64 MB (vidur/network/{a100,h100}_dgx/
# all_reduce.csv; microsoft/vidur @ 7d47513363ec, MIT, (c) Microsoft Corporation), on three
# quarters of the message sizes; error on the held-out quarter (median / p90 APE):
# - h100-sxm (NVLink 4, 450 GB/s): latency 17.2 us + 1.80 us per further GPU, efficiency 0.727;
#   held-out 1-16 MB 0.047 / 0.138, >= 16 MB 0.075 / 0.102, < 1 MB 0.40 (NCCL's
#   small messages swing between 7 and 60 us from call to call there).
# - a100-80g (NVLink 3, 300 GB/s): latency 31.1 us + 0.84 us per further GPU, efficiency 0.514;
#   held-out 1-16 MB 0.112 / 0.165, >= 16 MB 0.080 / 0.151, < 1 MB 0.34.
# - h200: NVLink 4 like the H100: the H100's figures.
# - rtx-pro-6000 (PCIe Gen5, no NVLink): nobody measured its all-reduce here; LLMServingSim's own
#   link for this card (20 us, 16 GB/s; casys-kaist/LLMServingSim @ 5daddb21a545
#   bench/examples/RTXPRO6000/Qwen3-32B/llmservingsim_config.json, MIT), the figure the shipped
#   rtx-pro-6000 tp2 profiles price (calibration/gpu_import.py), so efficiency 0.32 of the 50 GB/s:
#   the roofline and the profiles of one card price one link. (The defaults, 0.7 of 50 GB/s, were
#   2.2x faster than that figure; on the RTX PRO 6000 Qwen3-32B tp2 run the roofline's TPOT read
#   -19.9 % with them, -6.0 % with this.)
# - l40s, rtx-4090 (PCIe Gen4): not measured; the defaults above (20 us per call, 0.7 of 25 GB/s =
#   17.5 GB/s, the order of that PCIe figure). rtx-4090: no peer-to-peer, so through the host.
#
# Prices: approximate on-demand $ per GPU-hour of public GPU clouds' list pages as of mid-2025
# (Lambda Cloud 8-GPU instances: H100 SXM 2.99, A100 SXM 80GB 1.79; RunPod secure cloud: H200
# 3.59, L40S 0.86, RTX PRO 6000 1.79, RTX 4090 0.69), quoted from memory without network access
# here and not re-checked: they move often and differ by provider, region and commitment.
# Override them (servesim search --gpu-cost h100-sxm=2.5 or --gpu-cost prices.yaml).
# cpu-2core: 0.10, about two vCPUs of a cloud VM.
#
# SMs (datasheets / whitepapers above): A100 108, H100 SXM and H200 132, L40S 142, RTX PRO 6000
# Blackwell Server Edition 188 (24,064 CUDA cores at 128 per SM), RTX 4090 128. L2, set where the
# FA2 term reads it: A100 40 MB, L40S 96 MB, RTX 4090 72 MB, RTX PRO 6000 128 MB.
# flash_attention: vLLM V1 picks the FLASH_ATTN backend first on every CUDA GPU but sm100 (B200,
# FlashInfer first; vllm/platforms/cuda.py _get_backend_priorities), and within it FA3 on sm90 and
# FA2 elsewhere but sm100 (vllm/v1/attention/backends/fa_utils.py get_flash_attn_version: "if
# device_capability.major == 9 ... fa_version = 3", "major == 10 ... 4", else 2). So: A100 (sm80),
# L40S and RTX 4090 (sm89), RTX PRO 6000 (sm120) run FA2; H100 and H200 (sm90) run FA3, whose
# varlen kernel packs GQA heads and splits KV with a scheduler of its own; no mixed-step
# measurement of FA3 exists in ../shared/data/gpu, so they keep the decode-plus-prefill pricing.
# fa2_decode_tile_s / fa2_decode_merge_s: each GPU's own fit (median + p90 APE, 0.25 us / 0.5 us
# grid) on the decode-only rows of LLMServingSim's attention.csv (casys-kaist/LLMServingSim @
# 5daddb21a545, MIT; one layer's vLLM 0.19 attention call): RTX PRO 6000 6.25 / 5.0 us (its four
# tables), RTX 4090 7.0 / 2.5 us; either GPU's fit scores the other within ~3 points of its own
# (benchmarks/mixed_attention.py --decode-waves). A100 and L40S run the same kernel but nobody
# measured their decode latency here: they keep the KV-read pricing.
H100_LINK = dict(interconnect="nvlink4", allreduce_efficiency=0.727, allreduce_latency_s=17.2e-6,
                 allreduce_hop_latency_s=1.80e-6)
H100_FRACTIONS = dict(weight_bandwidth_fraction=0.89, stream_bandwidth_fraction=0.87, gemm_flops_fraction=0.76,
                      attention_flops_fraction=0.73, kernel_floor_s=4e-6)
HARDWARE: dict[str, HardwareConfig] = {
    "a100-80g": HardwareConfig("a100-80g", device_name="NVIDIA A100-SXM4-80GB",
                               peak_flops=312e12, hbm_bandwidth=2.039e12,
                               memory_bytes=81920 * MiB, cuda_memory_bytes=(81920 - 512) * MiB,
                               pcie_bandwidth=25e9, interconnect_bandwidth=300e9,
                               interconnect="nvlink3", allreduce_efficiency=0.514, allreduce_latency_s=31.1e-6,
                               allreduce_hop_latency_s=0.84e-6, price_per_gpu_hour=1.79,
                               weight_bandwidth_fraction=0.82, stream_bandwidth_fraction=0.88,
                               gemm_flops_fraction=0.70, attention_flops_fraction=0.6, kernel_floor_s=4.5e-6,
                               sm_count=108, l2_bytes=40 * MiB, flash_attention=2),
    "h100-sxm": HardwareConfig("h100-sxm", device_name="NVIDIA H100 80GB HBM3",
                               peak_flops=989e12, hbm_bandwidth=3.35e12,
                               memory_bytes=81559 * MiB, cuda_memory_bytes=79.19 * GiB,
                               tp_non_torch_bytes=1.85 * GiB, pcie_bandwidth=50e9, interconnect_bandwidth=450e9,
                               price_per_gpu_hour=2.99, sm_count=132, flash_attention=3, **H100_LINK,
                               **H100_FRACTIONS),
    "h200": HardwareConfig("h200", device_name="NVIDIA H200",
                           peak_flops=989e12, hbm_bandwidth=4.8e12,
                           memory_bytes=143771 * MiB, cuda_memory_bytes=(143771 - 512) * MiB,
                           tp_non_torch_bytes=1.85 * GiB, pcie_bandwidth=50e9, interconnect_bandwidth=450e9,
                           price_per_gpu_hour=3.59, sm_count=132, flash_attention=3, **H100_LINK,
                           **H100_FRACTIONS),
    "l40s": HardwareConfig("l40s", device_name="NVIDIA L40S",
                           peak_flops=362e12, hbm_bandwidth=864e9,
                           memory_bytes=46068 * MiB, cuda_memory_bytes=44.43 * GiB,
                           pcie_bandwidth=25e9, interconnect_bandwidth=25e9,
                           interconnect="pcie4", price_per_gpu_hour=0.86, sm_count=142,
                           l2_bytes=96 * MiB, flash_attention=2),
    "rtx-pro-6000": HardwareConfig("rtx-pro-6000", device_name="NVIDIA RTX PRO 6000 Blackwell Server Edition",
                                   peak_flops=503.8e12, hbm_bandwidth=1.792e12,
                                   memory_bytes=97887 * MiB, cuda_memory_bytes=94.97 * GiB,
                                   pcie_bandwidth=50e9, interconnect_bandwidth=50e9,
                                   interconnect="pcie5", price_per_gpu_hour=1.79, allreduce_efficiency=0.32,
                                   weight_bandwidth_fraction=0.84, stream_bandwidth_fraction=0.84,
                                   gemm_flops_fraction=0.78, attention_flops_fraction=0.43, kernel_floor_s=3e-6,
                                   sm_count=188, l2_bytes=128 * MiB, flash_attention=2,
                                   fa2_decode_tile_s=6.25e-6, fa2_decode_merge_s=5.0e-6),
    "rtx-4090": HardwareConfig("rtx-4090", device_name="NVIDIA GeForce RTX 4090",
                               peak_flops=165.2e12, hbm_bandwidth=1.008e12,
                               memory_bytes=24564 * MiB, cuda_memory_bytes=23.64 * GiB,
                               pcie_bandwidth=25e9, interconnect_bandwidth=25e9,
                               interconnect="pcie4", price_per_gpu_hour=0.69,
                               weight_bandwidth_fraction=0.95, stream_bandwidth_fraction=0.93,
                               gemm_flops_fraction=1.0, attention_flops_fraction=0.62, kernel_floor_s=3e-6,
                               sm_count=128, l2_bytes=72 * MiB, flash_attention=2,
                               fa2_decode_tile_s=7.0e-6, fa2_decode_merge_s=2.5e-6),
    # This machine (2 AMD EPYC cores, AVX2 FMA): fp32 PyTorch matmuls reach a few tens of GFLOP/s
    # and a stream copy ~10 GB/s. Rough on purpose: calibration/profiles/cpu-tiny.json replaces it.
    # memory_bytes is the slice of host RAM live mode may use for weights + KV, not the whole RAM.
    # The fractions are the old GPU-wide guesses (0.8 of bandwidth, 0.6 of FLOP/s); no launch floor.
    "cpu-2core": HardwareConfig("cpu-2core", peak_flops=50e9, hbm_bandwidth=10e9, memory_bytes=4 * GiB,
                                pcie_bandwidth=5e9, interconnect_bandwidth=5e9, interconnect="shared-memory",
                                price_per_gpu_hour=0.10,
                                non_torch_bytes=256 * MiB, gemm_tile_tokens=1,
                                weight_bandwidth_fraction=0.8, stream_bandwidth_fraction=0.8,
                                gemm_flops_fraction=0.6, attention_flops_fraction=0.6, kernel_floor_s=0.0),
}


def _lookup(table: dict, name: str, what: str, other: str = ""):
    """``table[name]``; else a ``PresetError`` listing the names (and ``other``: what else ``name`` may be)."""
    try:
        return table[name]
    except (KeyError, TypeError):
        raise PresetError(f"unknown {what} {name!r}{did_you_mean(name, table)}; choose one of: "
                          f"{', '.join(sorted(table))}{other}") from None


def get_model(name: str) -> ModelConfig:
    """The model preset called ``name``, or the model of the Hugging Face ``config.json`` a path
    names (``sim/hf_config.py``); ``PresetError`` lists the names if it is neither."""
    if isinstance(name, str) and name not in MODELS and is_config_path(name):
        return ModelConfig(**model_fields(name))
    return _lookup(MODELS, name, "model", ", or give the path of a Hugging Face config.json")


def _field_kinds(cls: type) -> dict[str, tuple[str, bool]]:
    """(``float`` / ``int`` / ``str``, None allowed) of each field of a config dataclass."""
    out = {}
    for f in dataclasses.fields(cls):
        text = str(f.type)
        out[f.name] = (next(t for t in ("float", "int", "str") if t in text), "None" in text)
    return out


HARDWARE_FIELDS = _field_kinds(HardwareConfig)


def get_hardware(name: str) -> HardwareConfig:
    """The hardware preset called ``name``, or the GPU a hardware file at that path describes
    (``sim/hardware_file.py``); ``PresetError`` lists the names if it is neither."""
    if isinstance(name, str) and name not in HARDWARE and is_hardware_file(name):
        return HardwareConfig(**hardware_fields(name, HARDWARE_FIELDS, HARDWARE))
    return _lookup(HARDWARE, name, "hardware", ", or give the path of a hardware file (.yaml)")


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


# vLLM V1 sizes its KV cache after a profile run (vllm/v1/worker/gpu_worker.py
# determine_available_memory, vllm/utils/mem_utils.py memory_profiling, as stored at vllm-project/vllm
# commits 35d5cda and a6d5c39; the 0.19 logs reproduce the sum to 0.01 GiB):
#   KV bytes = CUDA total x gpu_memory_utilization - weights - torch peak increase - non-torch increase
# The profile run (gpu_model_runner.py profile_run, commit 4e17906) is one _dummy_run of max_num_batched_tokens
# tokens spread over min(max_num_seqs, tokens) requests, then _dummy_sampler_run on the last token
# of each: logits of every vocabulary entry, sampled with temperature, top-k and top-p, while the
# step's hidden states are still held. The torch peak increase is the larger of the two phases.
# CUDA graphs are captured after the cache is allocated and are not charged to it up to 0.20
# (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS: on by default from 0.21 until vLLM PR #45197 turned
# it off again; not modelled); the block count is
# floor(KV bytes / (layers x per-layer page)) with no further rounding (kv_cache_utils.py).
# Fitted on the vLLM 0.19 logs of calibration/data/vllm_memory_logs.csv (benchmarks/kv_sizing_vs_logs.py):
SAMPLER_BYTES_PER_LOGIT = 14.8  # bf16 logits, their fp32 copy, probabilities and exponential noise
FORWARD_HIDDEN_BUFFERS = 4.25  # hidden-sized buffers live next to the SwiGLU's 3 x intermediate


def default_activation_reserve_bytes(model: ModelConfig, tensor_parallel: int = 1,
                                     max_num_batched_tokens: int = 8192, max_num_seqs: int = 256, *,
                                     sampler_bytes_per_logit: float = SAMPLER_BYTES_PER_LOGIT,
                                     hidden_buffers: float = FORWARD_HIDDEN_BUFFERS) -> float:
    """Peak activation memory of vLLM V1's profile run, per device (bytes): the larger of its two phases.

    - Forward pass of ``max_num_batched_tokens`` tokens: the SwiGLU gate/up output and its product
      (3 x intermediate / TP values per token) next to ``hidden_buffers`` hidden-sized ones
      (a fitted count: the residual, the normed input and the like), at the model's dtype.
    - Dummy sampler over ``min(max_num_seqs, tokens)`` rows of the full vocabulary (every TP rank
      gathers all logits and samples): ``sampler_bytes_per_logit`` per row and vocabulary entry,
      plus the step's hidden states, still alive.

    vLLM 0.19 on an H100 logged 1.89 GiB for Llama-3.1-8B at 1024 seqs / 8192 tokens (sampler) and
    0.77 GiB for CodeLlama-7B, whose 32k vocabulary leaves the forward pass the larger; releases
    whose sampler sorted the logits in PyTorch held ~38 bytes per entry (vLLM 0.11.0: 4.76 GiB).
    """
    tokens = max_num_batched_tokens
    forward = tokens * (3 * model.intermediate_size / tensor_parallel + hidden_buffers * model.hidden_size)
    rows = min(max_num_seqs, tokens)
    sampler = rows * model.vocab_size * sampler_bytes_per_logit + tokens * model.hidden_size * model.dtype_bytes
    return max(forward * model.dtype_bytes, sampler)


def non_torch_reserve_bytes(hardware: HardwareConfig, tensor_parallel: int) -> float:
    """What vLLM's profile run counts outside PyTorch's allocator on each device (bytes)."""
    return hardware.non_torch_bytes + (hardware.tp_non_torch_bytes if tensor_parallel > 1 else 0.0)


def kv_block_bytes(model: ModelConfig, tensor_parallel: int, block_size: int) -> int:
    """Bytes one KV block (``block_size`` tokens, all layers, K and V) takes on one TP rank."""
    per_token = 2 * model.num_layers * kv_heads_per_rank(model, tensor_parallel) * model.head_dim
    return per_token * model.dtype_bytes * block_size


def num_kv_blocks(model: ModelConfig, hardware: HardwareConfig, tensor_parallel: int,
                  gpu_memory_utilization: float, block_size: int,
                  activation_reserve_bytes: float | None = None, *, max_num_seqs: int = 256,
                  max_num_batched_tokens: int = 8192) -> int:
    """KV blocks per device the way vLLM V1 sizes its cache (every TP rank holds the same number).

    usable = CUDA total x utilization - weights / tp - non-torch reserve - activation reserve (bytes),
    floored to whole blocks: ``hardware.cuda_total_bytes``, ``non_torch_reserve_bytes`` and, unless
    given, ``default_activation_reserve_bytes`` of a ``max_num_batched_tokens`` step over
    ``max_num_seqs`` requests (see the comment above it for the vLLM code paths). Raises
    ``PresetError`` when the weights and reserves leave no room for even one block.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise PresetError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if block_size < 1:
        raise PresetError(f"block_size must be >= 1, got {block_size}")
    if activation_reserve_bytes is None:
        activation_reserve_bytes = default_activation_reserve_bytes(model, tensor_parallel, max_num_batched_tokens,
                                                                    max_num_seqs)
    budget = hardware.cuda_total_bytes * gpu_memory_utilization
    weights = model.weight_bytes / tensor_parallel
    reserves = non_torch_reserve_bytes(hardware, tensor_parallel) + activation_reserve_bytes
    usable = budget - weights - reserves
    per_block = kv_block_bytes(model, tensor_parallel, block_size)
    if usable < per_block:
        raise PresetError(
            f"{model.name} does not fit on {hardware.name} with tensor_parallel={tensor_parallel}: "
            f"weights {weights / GiB:.1f} GiB + reserves {reserves / GiB:.1f} GiB per device vs "
            f"{budget / GiB:.1f} GiB at gpu_memory_utilization={gpu_memory_utilization}; "
            "raise tensor_parallel or pick bigger hardware")
    return math.floor(usable / per_block)


# a GPU name as runs spell it, lower-cased with only letters and digits kept -> hardware preset
_GPUS = {
    "rtxpro6000": "rtx-pro-6000",
    "rtx4090": "rtx-4090",
    "h100": "h100-sxm",
    "h200": "h200",
    "a100": "a100-80g",
    "l40s": "l40s",
}
# Variants of a family whose memory, bandwidth or compute differ from the preset's: no preset, so the run must
# name one (--set hardware=) rather than be simulated on the wrong card (an A100 40GB priced with
# 80 GB of memory, an H100 PCIe at the SXM part's 3.35 TB/s, a GH200 as an H200).
_OTHER_VARIANTS = {
    "a100-80g": ("40g", "pcie"),  # the 80GB PCIe card: 1.94 TB/s at 300 W, no NVSwitch (the preset is the SXM4 part)
    "h100-sxm": ("pcie", "nvl", "h100l"),
    "h200": ("gh200", "nvl"),
    "rtx-pro-6000": ("maxq",),  # the 300 W Max-Q Workstation Edition (the 600 W one is this preset's card)
    "rtx-4090": ("4090d", "laptop", "mobile"),  # the 4090 D has 114 SMs, the laptop part 16 GB
}


def hardware_preset(name: str) -> str | None:
    """The servesim hardware preset a GPU name names (``RTXPRO6000``, ``NVIDIA H100 80GB HBM3``), or None."""
    key = re.sub(r"[^a-z0-9]", "", str(name).lower())
    if key in HARDWARE:
        return key
    hits = [preset for token, preset in _GPUS.items() if token in key]
    if len(hits) != 1 or any(marker in key for marker in _OTHER_VARIANTS.get(hits[0], ())):
        return None
    return hits[0]
