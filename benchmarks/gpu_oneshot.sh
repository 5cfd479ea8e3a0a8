#!/usr/bin/env bash
# One prepared GPU session (H200 or another CUDA GPU), run from the repository root:
#   1. Triton kernels against the PyTorch reference at llama-3.1-8b shapes (benchmarks/gpu_kernels.py);
#   2. the calibration sweep of llama-3.1-8b (bf16, Triton kernels) into a profile + raw CSV + plot;
#   3. the roofline's prediction for the same shapes beside the measurements (what calibration buys).
# Everything it writes goes under $OUT (default results/gpu), with the log and nvidia-smi's view.
#
# On the device tool's machine python3 has torch and triton but not simpy or pydantic: carry them as
# wheels (see the device tool's README), e.g. on the CPU machine
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl simpy pydantic pydantic-core annotated-types typing-inspection
# and start the command with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/.gpu-src
# Budget (estimated, not yet measured): ~2 min kernels, ~6 min calibration (542 shapes, ROUNDS=5) on an H200.
#
# Every setting has an environment override; a CPU smoke run of the plumbing (no GPU needed):
#   OUT=/tmp/gpu_smoke DEVICE=cpu BACKEND=torch MODEL=tiny DTYPE=float32 HARDWARE=cpu-2core \
#     GRID="--quick --max-num-seqs 4 --max-tokens 32 --max-context 32" ROUNDS=1 KERNELS="--cpu-smoke" \
#     TRITON_INTERPRET=1 bash benchmarks/gpu_oneshot.sh
set -euo pipefail
OUT=${OUT:-results/gpu}
DEVICE=${DEVICE:-cuda}
BACKEND=${BACKEND:-triton}
MODEL=${MODEL:-llama-3.1-8b}
DTYPE=${DTYPE:-bfloat16}
HARDWARE=${HARDWARE:-h200}
GRID=${GRID:---max-num-seqs 256 --max-tokens 8192 --max-context 2048}
KERNELS=${KERNELS:-}
PROFILE="$OUT/${HARDWARE}-${MODEL}-${BACKEND}.json"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# servesim's package dirs (sim/, kernels/, calibration/) as the servesim namespace without pip install -e
if ! python3 -c "import servesim.sim" 2>/dev/null; then
  mkdir -p .gpu-src/servesim
  for d in sim kernels calibration; do ln -sfn "$PWD/$d" ".gpu-src/servesim/$d"; done
  export PYTHONPATH="${PYTHONPATH:-}:$PWD/.gpu-src"
fi
{
  nvidia-smi || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  python3 benchmarks/gpu_kernels.py $KERNELS --out "$OUT"
  # shellcheck disable=SC2086  # GRID is a list of flags
  python3 -m servesim.sim.cli calibrate --model "$MODEL" --backend "$BACKEND" --device "$DEVICE" --dtype "$DTYPE" \
    $GRID --rounds "${ROUNDS:-5}" --quiet --out "$PROFILE"
  python3 benchmarks/roofline_vs_profile.py --profile "$PROFILE" --model "$MODEL" --hardware "$HARDWARE" \
    | tee "$OUT/roofline_vs_profile.txt"
} 2>&1 | tee "$OUT/log.txt"
