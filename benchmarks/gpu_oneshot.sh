#!/usr/bin/env bash
# One prepared GPU session (H200 or another CUDA GPU), run from the repository root:
#   1. Triton kernels against the PyTorch reference at llama-3.1-8b shapes, and decode-attention
#      bandwidth (benchmarks/gpu_kernels.py);
#   2. the calibration sweep of llama-3.1-8b (bf16, Triton kernels) into a profile + raw CSVs + plot;
#   3. the roofline's prediction for the same shapes beside the measurements (what calibration buys),
#      and on a GPU each step's host part against its CUDA-graph GPU time (benchmarks/gpu_host_bound.py);
#   4. live vs simulation on the GPU: `servesim validate` of scenarios/gpu/h200-llama-3.1-8b-live.yaml
#      with the profile just fitted, and the dynamics check (--replay-steps).
# GRAPHS=1: decode steps replay CUDA graphs (calibrate --cuda-graphs, live.cuda_graphs: true), and a
# stage before the calibration checks graphed decode steps against eager ones and times both
# (benchmarks/gpu_graphs.py); PIECEWISE=1 adds piecewise graphs for prefill and mixed steps
# (calibrate --piecewise-graphs, live.piecewise_graphs: true, gpu_graphs.py --piecewise; not yet run
# on a GPU); LIVE_ALSO_EAGER=1 adds the live validate without graphs, against the scenario's own
# profile. SKIP="kernels host-bound" leaves those stages out.
# Everything goes under $OUT (default results/gpu-run), with the log, nvidia-smi's view and its
# once-a-second clocks / power / load for the whole session (dmon.txt). Each stage
# runs in its own time box and a failed or cut stage does not stop the next: a GPU lease is counted
# in minutes, and what was measured must come back. The calibration writes its raw CSVs after every
# round and stops its rounds at CAL_BUDGET seconds (calibrate --time-budget).
#
# SNAPSHOT=FILE.tgz also packs $OUT into FILE.tgz after every stage and every 30 s (a remote machine
# that returns only a few files; an archive from the last snapshot survives a kill). On the device
# tool, whose returned folder is also called $OUT, name it first: `R=$OUT; OUT=/tmp/gpu-run
# SNAPSHOT=$R/gpu-run.tgz bash ...` (in `OUT=/tmp/x SNAPSHOT=$OUT/y` the second $OUT is already /tmp/x,
# and the archive stays on the machine: lease D's did).
#
# On the device tool's machine python3 has torch, triton, numpy, pandas, scipy, matplotlib, pyyaml,
# tqdm and pyarrow but not simpy or pydantic: carry them as wheels in .whl/ (see the device tool's
# README), e.g. on the CPU machine
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl simpy pydantic pydantic-core annotated-types \
#     typing-inspection typing-extensions
# and this script installs them into /tmp/site when the import fails.
# Budget: the default stage limits sum to ~14 min; on an H200 the stages took 19 + 239 + 2 + 58 s
# (README "H200"; the host-bound stage, added after, ~45 s). Inside a 10-minute call, as there:
#   KERNELS_TIMEOUT=90 CAL_TIMEOUT=320 CAL_BUDGET=200 HOST_BOUND_TIMEOUT=90 LIVE_TIMEOUT=90
# With GRAPHS=1 LIVE_ALSO_EAGER=1 SKIP=host-bound (H200 lease D, 392 s in all) the stages took
# 24 + 24 (graphs) + 219 (CAL_BUDGET=180: 2 rounds) + 3 + 49 + 58 (eager live) s.
# Export SERVESIM_COMMIT before the command, e.g. SERVESIM_COMMIT=$(git rev-parse --short HEAD) here
# written into the command: never a placeholder (lease D's files had to be corrected by hand).
#
# A working tree copied elsewhere (no .git, or a stale one) names its commit in SERVESIM_COMMIT.
# Every setting has an environment override; a CPU smoke run of the plumbing (no GPU needed):
#   OUT=/tmp/gpu_smoke DEVICE=cpu BACKEND=torch MODEL=tiny DTYPE=float32 HARDWARE=cpu-2core \
#     GRID="--quick --max-num-seqs 4 --max-tokens 32 --max-context 32" ROUNDS=1 KERNELS="--cpu-smoke" \
#     LIVE_SET="--set model=tiny --set hardware=cpu-2core --set live.device=cpu --set live.backend=torch \
#     --set live.dtype=float32 --set live.kv_cache_memory_mb=16 --set workload.num_requests=20 \
#     --set workload.vocab_size=4096" \
#     TRITON_INTERPRET=1 bash benchmarks/gpu_oneshot.sh
set -uo pipefail
OUT=${OUT:-results/gpu-run}
DEVICE=${DEVICE:-cuda}
BACKEND=${BACKEND:-triton}
MODEL=${MODEL:-llama-3.1-8b}
DTYPE=${DTYPE:-bfloat16}
HARDWARE=${HARDWARE:-h200}
GRID=${GRID:---max-num-seqs 256 --max-tokens 8192 --max-context 2048}
KERNELS=${KERNELS:-}
ROUNDS=${ROUNDS:-5}
CAL_BUDGET=${CAL_BUDGET:-240}      # seconds of timing rounds (after the first round)
KERNELS_TIMEOUT=${KERNELS_TIMEOUT:-120}
CAL_TIMEOUT=${CAL_TIMEOUT:-360}    # the whole calibrate: model build, rounds, engine loop, fit
LIVE=${LIVE:-scenarios/gpu/h200-llama-3.1-8b-live.yaml}
LIVE_SET=${LIVE_SET:-}
LIVE_TIMEOUT=${LIVE_TIMEOUT:-120}
HOST_BOUND_TIMEOUT=${HOST_BOUND_TIMEOUT:-120}
GRAPHS=${GRAPHS:-0}
GRAPHS_TIMEOUT=${GRAPHS_TIMEOUT:-120}
SKIP=${SKIP:-}
CAL_FLAGS=""
PIECEWISE=${PIECEWISE:-0}
if [ "$GRAPHS" = 1 ]; then
  CAL_FLAGS="--cuda-graphs"
  LIVE_SET="$LIVE_SET --set live.cuda_graphs=true"
fi
GRAPHS_FLAGS=()
if [ "$PIECEWISE" = 1 ]; then
  CAL_FLAGS="$CAL_FLAGS --piecewise-graphs"
  LIVE_SET="$LIVE_SET --set live.piecewise_graphs=true"
  GRAPHS_FLAGS=(--piecewise)
fi
PROFILE="$OUT/${HARDWARE}-${MODEL}-${BACKEND}.json"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import simpy, pydantic" 2>/dev/null && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# servesim's package dirs (sim/, kernels/, calibration/) as the servesim namespace without pip install -e
if ! python3 -c "import servesim.sim" 2>/dev/null; then
  mkdir -p .gpu-src/servesim
  for d in sim kernels calibration; do ln -sfn "$PWD/$d" ".gpu-src/servesim/$d"; done
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/.gpu-src"
fi
snapshot() {
  [ -n "${SNAPSHOT:-}" ] || return 0
  tar czf "$SNAPSHOT.part" -C "$(dirname "$OUT")" "$(basename "$OUT")" 2>/dev/null && mv -f "$SNAPSHOT.part" "$SNAPSHOT"
}
stage() {  # stage NAME SECONDS CMD...: run CMD under a time limit, say how it ended, snapshot
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  case " $SKIP " in *" $name "*) echo "=== $name: skipped (SKIP) ==="; return 0;; esac
  echo "=== $name (limit ${limit} s) ==="
  timeout --signal=TERM --kill-after=15 "$limit" "$@"
  rc=$?
  echo "=== $name: rc $rc after $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo ', cut at its time limit') ==="
  snapshot
  return 0
}
if [ -n "${SNAPSHOT:-}" ]; then (while sleep 30; do snapshot; done) & SNAP_PID=$!; fi
# The GPU's clocks, power and load once a second for the whole session (dmon.txt, with wall-clock
# times): on the H200 the same live workload ran 1.4-2x slower on some leases than on others, and a
# slower SM clock while live mode waits for arrivals is the suspect (README "H200").
if command -v nvidia-smi >/dev/null; then
  nvidia-smi dmon -s pucm -o DT -d 1 > "$OUT/dmon.txt" 2>&1 & DMON_PID=$!
fi
{
  echo "servesim ${SERVESIM_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo '?')} on $(hostname), $(date -u +%FT%TZ)"
  nvidia-smi || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
  # shellcheck disable=SC2086  # KERNELS, GRID and LIVE_SET are lists of flags
  stage kernels "$KERNELS_TIMEOUT" python3 benchmarks/gpu_kernels.py $KERNELS --out "$OUT"
  if [ "$GRAPHS" = 1 ]; then
    if [ "$DEVICE" = cuda ]; then graphs_flags=(--model "$MODEL"); else graphs_flags=(--cpu-smoke --reps 2); fi
    stage graphs "$GRAPHS_TIMEOUT" python3 benchmarks/gpu_graphs.py "${graphs_flags[@]}" ${GRAPHS_FLAGS[@]+"${GRAPHS_FLAGS[@]}"} --out "$OUT"
  fi
  # shellcheck disable=SC2086
  stage calibrate "$CAL_TIMEOUT" python3 -m servesim.sim.cli calibrate --model "$MODEL" --backend "$BACKEND" \
    --device "$DEVICE" --dtype "$DTYPE" $GRID --rounds "$ROUNDS" --time-budget "$CAL_BUDGET" $CAL_FLAGS --quiet \
    --out "$PROFILE"
  if [ -f "$PROFILE" ]; then
    stage roofline 120 sh -c "python3 benchmarks/roofline_vs_profile.py --profile '$PROFILE' --model '$MODEL' \
      --hardware '$HARDWARE' > '$OUT/roofline_vs_profile.txt'; cat '$OUT/roofline_vs_profile.txt'"
    # the step's host part against its CUDA-graph GPU time (is the live engine host-bound here?)
    [ "$DEVICE" = cuda ] && stage host-bound "$HOST_BOUND_TIMEOUT" python3 benchmarks/gpu_host_bound.py --model "$MODEL" \
      --threads 2 --out "$OUT"
    # shellcheck disable=SC2086
    [ -n "$LIVE" ] && stage live-validate "$LIVE_TIMEOUT" python3 -m servesim.sim.cli validate "$LIVE" $LIVE_SET \
      --set "cost_model.path=$(realpath "$PROFILE")" --profile "$PROFILE" --replay-steps --quiet \
      --out "$OUT/live-validate"
    # shellcheck disable=SC2086
    [ -n "$LIVE" ] && [ "$GRAPHS" = 1 ] && [ "${LIVE_ALSO_EAGER:-0}" = 1 ] && stage live-validate-eager "$LIVE_TIMEOUT" \
      python3 -m servesim.sim.cli validate "$LIVE" $(echo "$LIVE_SET" | sed 's/--set live\.[a-z_]*graphs=true//g') \
      --replay-steps --quiet \
      --out "$OUT/live-validate-eager"
  else
    echo "no profile at $PROFILE: roofline and live-validate stages skipped"
  fi
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv || true
} 2>&1 | tee "$OUT/log.txt"
[ -n "${SNAP_PID:-}" ] && kill "$SNAP_PID" 2>/dev/null
[ -n "${DMON_PID:-}" ] && kill "$DMON_PID" 2>/dev/null
snapshot
[ -f "$PROFILE" ]
