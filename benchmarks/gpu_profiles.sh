#!/usr/bin/env bash
# Rebuild every shipped GPU profile (calibration/profiles/*-tp*.json) from the public measurements
# in ../shared/data/gpu (SOURCES.md there: repositories, commits, licenses). No GPU needed; ~1.5 min.
#
#   benchmarks/gpu_profiles.sh [DATA_DIR]
set -euo pipefail
DATA=${1:-../shared/data/gpu}
L=$DATA/llmservingsim/profiles
imp() { servesim calibrate import "$@"; echo; }

# LLMServingSim profiles: every table from one folder (vLLM 0.19 kernels, enforce_eager)
imp --format llmservingsim "$L/RTXPRO6000/meta-llama/Llama-3.1-8B" --model llama-3.1-8b --hardware rtx-pro-6000 --tp 1
imp --format llmservingsim "$L/RTXPRO6000/meta-llama/Llama-3.1-8B" --model llama-3.1-8b --hardware rtx-pro-6000 --tp 2
imp --format llmservingsim "$L/RTXPRO6000/Qwen/Qwen3-32B" --model qwen3-32b --hardware rtx-pro-6000 --tp 1
imp --format llmservingsim "$L/RTXPRO6000/Qwen/Qwen3-32B" --model qwen3-32b --hardware rtx-pro-6000 --tp 2
imp --format llmservingsim "$L/RTX4090/meta-llama/Llama-3.1-8B" --model llama-3.1-8b --hardware rtx-4090 --tp 1

# Composites: GEMMs from LLMServingSim v0, small ops from Vidur, attention from inference-sim
imp --format llmservingsim "$DATA/llmservingsim/v0-H100-Llama-3.1-8B/layers.csv" \
    --with "vidur:$DATA/vidur/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv" \
    --with "inference-sim:$DATA/inference-sim/h100/mha_decode_h100_32-8-128-tp1.csv" \
    --with "inference-sim:$DATA/inference-sim/h100/mha_prefill_h100_32-8-128.csv" \
    --model llama-3.1-8b --hardware h100-sxm --tp 1
imp --format vidur "$DATA/vidur/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv" \
    --with "inference-sim:$DATA/inference-sim/h100/mha_decode_h100_32-32-128-tp1.csv" \
    --with "inference-sim:$DATA/inference-sim/h100/mha_prefill_h100_32-32-128.csv" \
    --model llama-2-7b --hardware h100-sxm --tp 1
# A100: Vidur publishes no attention table we carry: roofline attention, labelled in the profile
imp --format vidur "$DATA/vidur/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv" \
    --model llama-3-8b --hardware a100-80g --tp 1

# 70B at TP 4 and 8: Vidur's per-rank token ops and its DGX NCCL all-reduce timings; attention and
# LM head are roofline terms, labelled (no 70B attention in the published data)
for tp in 4 8; do
  imp --format vidur "$DATA/vidur/compute/h100/meta-llama/Llama-2-70b-hf/mlp.csv" \
      --with "vidur:$DATA/vidur/network/h100_dgx/all_reduce.csv" --model llama-2-70b --hardware h100-sxm --tp "$tp"
  imp --format vidur "$DATA/vidur/compute/a100/meta-llama/Meta-Llama-3-70B/mlp.csv" \
      --with "vidur:$DATA/vidur/network/a100_dgx/all_reduce.csv" --model llama-3-70b --hardware a100-80g --tp "$tp"
done
