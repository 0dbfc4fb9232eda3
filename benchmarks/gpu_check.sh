#!/usr/bin/env bash
# GPU check, in priority order (figures first, most wanted first: they are what a short device lease is
# for): the profiled cost model held out (benchmarks/profile_blocks.py: a DiT and a GPT block stack at real
# width), plans replayed on measured compute (benchmarks/replay.py, 8 and 32 ranks), the kernel benchmark
# and the varlen choice tests, the single-GPU training benchmark (benchmarks/single_gpu.py), Inductor vs
# aot_eager on a real-width DiT, then the optional steps. The whole run keeps to GPU_CHECK_TOTAL (below):
# none of these steps has been timed on a GPU yet, so what does not fit is skipped and listed.
#
# Usage (from anywhere):  bash benchmarks/gpu_check.sh
# On an offline machine where `pip install -e .` cannot run, bring this checkout's
# dcp_compile.egg-info along (it holds the entry point that makes backend="dcp" known): with the
# checkout on PYTHONPATH, importlib.metadata finds it there.
# Results go to $OUT when set (e.g. a device runner's output folder), else benchmarks/results/:
#   profile_cuda_<gpu>.md/.json, replay_cuda_<gpu>.md/.json,
#   kernels_nvidia_smi.txt, kernels_tests.log (with the 15 slowest tests),
#   kernels_bench.log, kernels_<gpu>.csv, kernels_<gpu>.png, varlen_choice_<gpu>.json, varlen_choice_tests.log
#
# Knobs (environment):
#   GPU_CHECK_TESTS   cuda (default: only the CUDA-parametrized tests, a few minutes of device time)
#                     | all (also the CPU/interpreter cases) | none
#   GPU_CHECK_BENCH   quick (default) | full | none
#   GPU_CHECK_TIMEOUT seconds per step (default 270); GPU_CHECK_TEST_TIMEOUT for the tests alone
#   GPU_CHECK_TOTAL   seconds for the whole script (default 480); GPU_CHECK_MIN_STEP (default 45)
#   GPU_CHECK_PACKED  no (default) | yes (benchmarks/packed_vs_padded.py on CUDA, packed_vs_padded_cuda.md/.csv)
#   GPU_CHECK_PROFILE yes (default: profile_blocks.py) | no;  GPU_CHECK_REPLAY yes (default: replay.py) | no
#   GPU_CHECK_DIT     yes (default: dit_inductor_step.py, Inductor vs aot_eager on a real-width DiT) | no
#   GPU_CHECK_SINGLE  yes (default: single_gpu.py, DCP at SP 1 vs static and bucket schedules on a Wan 2.1 1.3B-wide
#                     DiT and a Llama-1B-wide LM, 4 layers each, bf16, aot_eager; single_gpu_<gpu>.md/.json; runs after
#                     the profile, replay and kernel steps) | no;  GPU_CHECK_SINGLE_BUDGET its --budget-s (default 240),
#                     GPU_CHECK_SINGLE_TIMEOUT its hard limit in seconds (default 330)
#   GPU_CHECK_COMPILED_CHOICE no (default) | yes (a packed row through Inductor picks FlexAttention by the
#                     kernel table and matches eager: tests/test_compiled_kernel_choice.py -k cuda,
#                     compiled_choice_tests.log; one Inductor compile with FlexAttention's kernels, not yet timed)
set -uo pipefail

cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-benchmarks/results}"
TESTS="${GPU_CHECK_TESTS:-none}"
BENCH="${GPU_CHECK_BENCH:-quick}"
STEP_TIMEOUT="${GPU_CHECK_TIMEOUT:-270}"
mkdir -p "$OUT_DIR"

{ nvidia-smi || echo "nvidia-smi unavailable"; } > "$OUT_DIR/kernels_nvidia_smi.txt" 2>&1
python - <<'PY' | tee -a "$OUT_DIR/kernels_nvidia_smi.txt"
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")
PY

# torch.compile finds backend="dcp" through the package's entry point, so the package must be
# installed, not only importable from this folder. The device image is offline: no build isolation
# (it would fetch setuptools), no dependency changes.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python - <<'PY' 2>/dev/null || pip install -e . --no-deps --no-build-isolation -q
import importlib.metadata as metadata, sys
sys.exit(not any(e.name == "dcp" for e in metadata.entry_points(group="torch_dynamo_backends")))
PY

status=0
# The tests must compile real kernels for CUDA tensors: never interpret here.
unset TRITON_INTERPRET DCP_KERNELS

# The whole script keeps to GPU_CHECK_TOTAL seconds (default 480: a 15-minute lease less the machine's
# start and room for a rerun): each step's timeout is cut to what is left, and a step that would get
# less than GPU_CHECK_MIN_STEP seconds (default 45) is skipped and listed in $OUT_DIR/skipped_steps.txt,
# so the steps run in priority order and the rest wait for the next lease (turn the done ones off).
TOTAL="${GPU_CHECK_TOTAL:-480}"
MIN_STEP="${GPU_CHECK_MIN_STEP:-45}"
STARTED=$(date +%s)
: > "$OUT_DIR/skipped_steps.txt"

run_step() {  # name, then the command: logged to $OUT_DIR/<name>.log, its exit code counted
  local name=$1; shift
  local left=$(( TOTAL - ($(date +%s) - STARTED) ))
  local limit=$(( STEP_TIMEOUT < left ? STEP_TIMEOUT : left ))
  if [ "$limit" -lt "$MIN_STEP" ]; then
    echo "== $name skipped: ${left}s left of GPU_CHECK_TOTAL=${TOTAL}s" | tee -a "$OUT_DIR/skipped_steps.txt"
    return
  fi
  echo "== $name (up to ${limit}s; $(( $(date +%s) - STARTED ))s used of ${TOTAL}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name exit code: $rc"
  [ "$rc" -eq 0 ] || status=1
}
if python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  # Inductor compiles each variant (minutes for all of them): the profile keeps two policies, the
  # replay (which compiles every SP size up to 32 its plans use) runs aot_eager; both files say so.
  [ "${GPU_CHECK_PROFILE:-yes}" = "no" ] || run_step profile python benchmarks/profile_blocks.py --device cuda \
      --repeats 5 --recompute none full --inner "${GPU_CHECK_PROFILE_INNER:-inductor}" --out-dir "$OUT_DIR"
  [ "${GPU_CHECK_REPLAY:-yes}" = "no" ] || run_step replay python benchmarks/replay.py --device cuda --steps 2 \
      --inner "${GPU_CHECK_REPLAY_INNER:-aot_eager}" --out-dir "$OUT_DIR"
fi

if [ "$BENCH" != "none" ]; then
  bench_args=(--out-dir "$OUT_DIR")
  [ "$BENCH" = "quick" ] && bench_args+=(--quick)
  run_step kernels_bench python benchmarks/kernel_benchmarks.py "${bench_args[@]}"
fi

# The varlen path's implementations (Triton, FlexAttention document mask, equal-length SDPA, and the
# chooser's pick) forward and backward against the reference on CUDA: about a minute. The kernel
# benchmark above times the chooser's pick against FlexAttention and padded SDPA and writes the
# chooser's table, varlen_choice_<gpu>.json.
if [ "$BENCH" != "none" ] && python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  run_step varlen_choice_tests python -m pytest tests/kernels/test_kernels_attention_choice.py -q -k cuda -p no:cacheprovider
fi

# One device, real models, the real training step: DCP at SP 1 (per-batch recompute, accumulation, packing)
# against static and bucket schedules, tokens/s with intervals, peak memory, the loss check. It keeps to its
# --budget-s (compiles and profiles included); the hard timeout only stops a run that does not.
if [ "${GPU_CHECK_SINGLE:-yes}" != "no" ] && python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  STEP_TIMEOUT="${GPU_CHECK_SINGLE_TIMEOUT:-330}" run_step single_gpu python benchmarks/single_gpu.py \
      --budget-s "${GPU_CHECK_SINGLE_BUDGET:-240}" --out-dir "$OUT_DIR"
fi

# A diffusers DiT at real width (Wan 2.1 1.3B, 4 layers) under dcp: step time with Inductor against
# aot_eager, and no Inductor fallback (dit_inductor_step_<gpu>.md); about 3 minutes, mostly compiles.
if [ "${GPU_CHECK_DIT:-yes}" != "no" ] && python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  run_step dit_inductor_step python benchmarks/dit_inductor_step.py --out-dir "$OUT_DIR"
fi

if [ "${GPU_CHECK_COMPILED_CHOICE:-no}" != "no" ] && python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  run_step compiled_choice_tests python -m pytest tests/test_compiled_kernel_choice.py -q -k cuda -p no:cacheprovider
fi

# End to end on the GPU: packed rows through the compiled model (Triton varlen) against padded SDPA.
if [ "${GPU_CHECK_PACKED:-no}" != "no" ] && python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  run_step packed_vs_padded python benchmarks/packed_vs_padded.py --device cuda --repeats 5
  cp benchmarks/results/packed_vs_padded_cuda.* "$OUT_DIR/" 2>/dev/null || true
fi

if [ "$TESTS" = "cuda" ] && ! python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "no CUDA device visible: running every kernel test (CPU, interpreted) instead of the CUDA ones"
  TESTS=all
fi
case "$TESTS" in
  none) ;;
  all)  selection=() ;;
  *)    selection=(-k "cuda") ;;
esac
if [ "$TESTS" != "none" ]; then
  STEP_TIMEOUT="${GPU_CHECK_TEST_TIMEOUT:-$STEP_TIMEOUT}" run_step kernels_tests python -m pytest tests/kernels -q -rs \
      -p no:cacheprovider "${selection[@]}" --durations=15
fi


exit "$status"
