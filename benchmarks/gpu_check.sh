#!/usr/bin/env bash
# GPU check: the one script a session runs on a lent GPU (an H100 or H200, 15 minutes of device time
# with the machine's start, no internet, run from the working tree). Its steps run in priority order,
# each under its own time budget, and the whole run keeps to GPU_CHECK_TOTAL seconds (default 540: the
# default budgets of the steps that are on sum to 520, the rest is for the setup). Every script it
# calls rewrites its tables after each measured case and is stopped with `timeout --signal=INT
# --kill-after=15`, so a step that runs out of time leaves valid tables marked "partial".
#
# Usage (from anywhere):
#   bash benchmarks/gpu_check.sh               the check, on the GPU found (fails at once without one)
#   bash benchmarks/gpu_check.sh --dry-run     every step on the CPU at tiny sizes (`--tiny`, aot_eager or
#                                              eager inner compilers): every table the GPU run writes, under
#                                              the same names with the CPU's tag (below), labelled "dry run
#                                              on CPU" inside; CUDA-only test selections run their CPU
#                                              counterparts (`-k "not cuda"`). A few minutes on 2 cores.
#   bash benchmarks/gpu_check.sh --print-plan  (or --list) the steps in order with budgets, on/off, tables and commands
#                                              under the present environment (add --dry-run for its commands);
#                                              runs nothing
#
# Steps, most valuable first (name: what, default budget in seconds, knob that turns it off/on):
#   1 replay               benchmarks/replay.py --device cuda: the DCP-vs-baselines comparison on measured
#                          compute (replay_<tag>.md/.json)                  120 s  GPU_CHECK_REPLAY=yes|no
#   2 longest_sequence     benchmarks/longest_sequence.py --device cuda (issue 37): the longest sequence one GPU
#                          trains, measured, beside the cost model's prediction: a Llama-3-8B-shaped LM with one
#                          of its 32 layers, bf16, SP 1, recompute lean, offload, block; a lean try near 800K
#                          tokens takes 1-2 minutes on an H100: this budget holds lean's first try there and
#                          little more (GPU_CHECK_BUDGET_LONGEST_SEQUENCE=240 for every policy); on an H200 lean's
#                          try (~1.5M tokens) is time-capped, a measured lower bound (~420 s for the whole try);
#                          GPU_CHECK_LONGEST_ARGS more arguments
#                          (longest_sequence_<gpu>.md/.json)                200 s  GPU_CHECK_LONGEST=yes|no
#   3 profile              benchmarks/profile_blocks.py: held-out error of the profiled cost model, a DiT and a
#                          GPT block stack at real width, SP 1 2 4 8, recompute none/full, inner
#                          GPU_CHECK_PROFILE_INNER (default aot_eager: Inductor's compiles of 16 variants would
#                          not fit) (profile_cuda_<gpu>.md/.json)            70 s  GPU_CHECK_PROFILE=yes|no
#   4 single_gpu           benchmarks/single_gpu.py: DCP at SP 1 vs static and bucket schedules on a Wan 2.1
#                          1.3B-wide DiT and a Llama-1B-wide LM, 4 layers each, bf16, aot_eager; its --budget-s
#                          is GPU_CHECK_SINGLE_BUDGET (default: the step's limit less 20 s)
#                          (single_gpu_<gpu>.md/.json)                       70 s  GPU_CHECK_SINGLE=yes|no
#   5 kernels_bench        benchmarks/kernel_benchmarks.py [--quick]: the kernels against their torch paths
#                          (kernels_<gpu>.csv/.png, varlen_choice_<gpu>.json) 30 s  GPU_CHECK_BENCH=quick|full|none
#   6 varlen_choice_tests  tests/kernels/test_kernels_attention_choice.py -k cuda: every varlen implementation
#                          against the reference on CUDA (a log only)        30 s  on unless GPU_CHECK_BENCH=none
#   Optional, off by default, run only in the time left:
#   7 dit_inductor_step    benchmarks/dit_inductor_step.py --layers 2 --repeats 3: a diffusers Wan DiT, Inductor
#                          vs aot_eager step time, no Inductor fallback (off by default since longest_sequence
#                          took its time) (dit_inductor_step_<gpu>.md/.json) 80 s  GPU_CHECK_DIT=no|yes
#   8 compiled_choice_tests tests/test_compiled_kernel_choice.py -k cuda     60 s  GPU_CHECK_COMPILED_CHOICE=no|yes
#   9 packed_vs_padded     benchmarks/packed_vs_padded.py --device cuda --repeats 5
#                          (packed_vs_padded_cuda.md/.csv; skipped in the dry run: that script has no tiny
#                          mode and writes to benchmarks/results/)           60 s  GPU_CHECK_PACKED=no|yes
#  10 kernels_tests        tests/kernels, -k cuda (GPU_CHECK_TESTS=cuda) or all of them (all); the 15 slowest
#                          listed                                           120 s  GPU_CHECK_TESTS=none|cuda|all
# <gpu> is the device's name in lower case with dashes (e.g. nvidia-h100-80gb-hbm3), <tag> is "cuda_" and
# the name with spaces as dashes; in the dry run both are "cpu" (the replay's tag there is "cpu_tiny").
#
# Files written to $OUT when set (e.g. a device runner's output folder), else benchmarks/results/ (the dry
# run: $TMPDIR/gpu_check_dry_run, never benchmarks/results/): the tables above; <step>.log for each step
# run (its output); kernels_nvidia_smi.txt (nvidia-smi, torch/CUDA/Triton versions, the device);
# gpu_check_summary.md (per step: budget, limit given, seconds used, result: ok / failed / timed out with
# partial tables / skipped and why / off; the tables it wrote), rewritten after every step.
#
# Knobs (environment), besides the on/off ones above:
#   GPU_CHECK_TOTAL        seconds for the whole script (default 540); each step's limit is its budget cut
#                          to what is left (less the 15 s a stopped step may take to write its tables)
#   GPU_CHECK_MIN_STEP     a step whose limit would be under this many seconds (default 20, or its budget if
#                          smaller) is skipped and listed as skipped in gpu_check_summary.md
#   GPU_CHECK_BUDGET_<STEP> a step's budget in seconds, e.g. GPU_CHECK_BUDGET_REPLAY=200 (upper-case names)
#   GPU_CHECK_TIMEOUT      a cap on every step's budget (unset: none)
#   GPU_CHECK_TEST_TIMEOUT kernels_tests' budget (same as GPU_CHECK_BUDGET_KERNELS_TESTS)
#   GPU_CHECK_SINGLE_TIMEOUT single_gpu's budget (same as GPU_CHECK_BUDGET_SINGLE_GPU)
#   GPU_CHECK_PROFILE_INNER  profile's inner compiler (aot_eager | inductor | eager; default aot_eager)
#   GPU_CHECK_REPLAY_INNER   replay's --inner (unset: replay.py's default);  GPU_CHECK_REPLAY_ARGS more arguments
#   GPU_CHECK_DIT_ARGS     arguments for dit_inductor_step.py instead of "--layers 2 --repeats 3"
#   GPU_CHECK_KERNELS_ARGS extra arguments for kernel_benchmarks.py (e.g. "--wall-clock-repeats 40")
# Each step also gets GPU_CHECK_STEP_BUDGET_S (its limit in seconds) in its environment.
#
# On an offline machine where `pip install -e .` cannot run, bring this checkout's dcp_compile.egg-info
# along (it holds the entry point that makes backend="dcp" known): with the checkout on PYTHONPATH,
# importlib.metadata finds it there. The GPU run tries `pip install -e . --no-deps --no-build-isolation`
# if the entry point is missing; the dry run fails instead, naming the fix.
set -uo pipefail

cd "$(dirname "$0")/.."

MODE=gpu
PRINT_PLAN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) MODE=dry ;;
    --print-plan|--list) PRINT_PLAN=1 ;;
    -h|--help) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (use --dry-run, --print-plan or none; --help for more)" >&2; exit 2 ;;
  esac
done

DRY_LABEL="dry run on CPU"
TOTAL="${GPU_CHECK_TOTAL:-540}"
MIN_STEP="${GPU_CHECK_MIN_STEP:-20}"
GRACE=15  # seconds a step gets after SIGINT to write its tables, before SIGKILL
BENCH="${GPU_CHECK_BENCH:-quick}"
TESTS="${GPU_CHECK_TESTS:-none}"
if [ "$MODE" = dry ]; then OUT_DIR="${OUT:-${TMPDIR:-/tmp}/gpu_check_dry_run}"; else OUT_DIR="${OUT:-benchmarks/results}"; fi

STEPS=(replay longest_sequence profile single_gpu kernels_bench varlen_choice_tests dit_inductor_step
       compiled_choice_tests packed_vs_padded kernels_tests)
declare -A DEFAULT_BUDGET=([replay]=120 [longest_sequence]=200 [profile]=70 [single_gpu]=70 [kernels_bench]=30
                           [varlen_choice_tests]=30 [dit_inductor_step]=80 [compiled_choice_tests]=60
                           [packed_vs_padded]=60 [kernels_tests]=120)
declare -A TABLES=([replay]="replay_*.md replay_*.json"
                   [longest_sequence]="longest_sequence_*.md longest_sequence_*.json"
                   [profile]="profile_*.md profile_*.json"
                   [single_gpu]="single_gpu_*.md single_gpu_*.json"
                   [kernels_bench]="kernels_*.csv kernels_*.png varlen_choice_*.json" [varlen_choice_tests]=""
                   [dit_inductor_step]="dit_inductor_step_*.md dit_inductor_step_*.json" [compiled_choice_tests]=""
                   [packed_vs_padded]="packed_vs_padded_cuda.md packed_vs_padded_cuda.csv" [kernels_tests]="")

budget_of() {  # the step's budget in seconds, knobs applied
  local name=$1 upper budget
  upper=$(echo "$name" | tr '[:lower:]' '[:upper:]')
  local var="GPU_CHECK_BUDGET_$upper"
  budget="${!var:-}"
  if [ -z "$budget" ]; then
    case "$name" in
      kernels_tests) budget="${GPU_CHECK_TEST_TIMEOUT:-${DEFAULT_BUDGET[$name]}}" ;;
      single_gpu) budget="${GPU_CHECK_SINGLE_TIMEOUT:-${DEFAULT_BUDGET[$name]}}" ;;
      *) budget="${DEFAULT_BUDGET[$name]}" ;;
    esac
  fi
  if [ -n "${GPU_CHECK_TIMEOUT:-}" ] && [ "$GPU_CHECK_TIMEOUT" -lt "$budget" ]; then budget=$GPU_CHECK_TIMEOUT; fi
  echo "$budget"
}

enabled_of() {  # "on" or "off (<knob>)"
  case "$1" in
    replay) [ "${GPU_CHECK_REPLAY:-yes}" != no ] && echo on || echo "off (GPU_CHECK_REPLAY=no)" ;;
    longest_sequence) [ "${GPU_CHECK_LONGEST:-yes}" != no ] && echo on || echo "off (GPU_CHECK_LONGEST=no)" ;;
    profile) [ "${GPU_CHECK_PROFILE:-yes}" != no ] && echo on || echo "off (GPU_CHECK_PROFILE=no)" ;;
    single_gpu) [ "${GPU_CHECK_SINGLE:-yes}" != no ] && echo on || echo "off (GPU_CHECK_SINGLE=no)" ;;
    kernels_bench|varlen_choice_tests) [ "$BENCH" != none ] && echo on || echo "off (GPU_CHECK_BENCH=none)" ;;
    dit_inductor_step) [ "${GPU_CHECK_DIT:-no}" != no ] && echo on || echo "off (optional: GPU_CHECK_DIT=yes)" ;;
    compiled_choice_tests) [ "${GPU_CHECK_COMPILED_CHOICE:-no}" != no ] && echo on || echo "off (optional: GPU_CHECK_COMPILED_CHOICE=yes)" ;;
    packed_vs_padded) [ "${GPU_CHECK_PACKED:-no}" != no ] && echo on || echo "off (optional: GPU_CHECK_PACKED=yes)" ;;
    kernels_tests) [ "$TESTS" != none ] && echo on || echo "off (optional: GPU_CHECK_TESTS=cuda or all)" ;;
  esac
}

command_of() {  # name, limit: sets CMD (empty with SKIP_REASON set when the step cannot run in this mode)
  local name=$1 limit=$2
  CMD=(); SKIP_REASON=""
  local device=cuda; [ "$MODE" = dry ] && device=cpu
  case "$name" in
    replay)
      CMD=(python benchmarks/replay.py --device "$device" --out-dir "$OUT_DIR")
      [ "$MODE" = dry ] && CMD+=(--tiny)
      [ -n "${GPU_CHECK_REPLAY_INNER:-}" ] && CMD+=(--inner "$GPU_CHECK_REPLAY_INNER")
      # shellcheck disable=SC2206  # word splitting wanted: extra arguments
      [ -n "${GPU_CHECK_REPLAY_ARGS:-}" ] && CMD+=(${GPU_CHECK_REPLAY_ARGS})
      ;;
    longest_sequence)
      CMD=(python benchmarks/longest_sequence.py --device "$device" --out-dir "$OUT_DIR"
           --budget-s $(( limit > 30 ? limit - 10 : limit )))
      [ "$MODE" = dry ] && CMD+=(--tiny)
      # shellcheck disable=SC2206  # word splitting wanted: extra arguments
      [ -n "${GPU_CHECK_LONGEST_ARGS:-}" ] && CMD+=(${GPU_CHECK_LONGEST_ARGS})
      ;;
    profile)
      CMD=(python benchmarks/profile_blocks.py --device "$device" --budget-s $(( limit > 30 ? limit - 10 : limit )) --out-dir "$OUT_DIR")
      if [ "$MODE" = dry ]; then CMD+=(--tiny --inner eager)
      else CMD+=(--repeats 5 --recompute none full --inner "${GPU_CHECK_PROFILE_INNER:-aot_eager}"); fi
      ;;
    single_gpu)
      CMD=(python benchmarks/single_gpu.py --device "$device" --out-dir "$OUT_DIR"
           --budget-s "${GPU_CHECK_SINGLE_BUDGET:-$(( limit > 40 ? limit - 20 : limit / 2 ))}")
      [ "$MODE" = dry ] && CMD+=(--tiny --inner eager --layers 1 --steps 2 --profile-repeats 1 --tokens-per-step 400)
      ;;
    kernels_bench)
      CMD=(python benchmarks/kernel_benchmarks.py --out-dir "$OUT_DIR")
      if [ "$MODE" = dry ]; then CMD+=(--tiny); elif [ "$BENCH" = quick ]; then CMD+=(--quick); fi
      # shellcheck disable=SC2206  # word splitting wanted: extra arguments
      CMD+=(${GPU_CHECK_KERNELS_ARGS:-})
      ;;
    varlen_choice_tests)
      local selection=cuda; [ "$MODE" = dry ] && selection="not cuda"
      CMD=(python -m pytest tests/kernels/test_kernels_attention_choice.py -q -rs -k "$selection" -p no:cacheprovider)
      ;;
    dit_inductor_step)
      CMD=(python benchmarks/dit_inductor_step.py --device "$device" --out-dir "$OUT_DIR")
      if [ "$MODE" = dry ]; then CMD+=(--tiny --inner aot_eager eager --layers 1 --latents 1x8x8 3x8x12 --repeats 1)
      else
        # shellcheck disable=SC2206  # word splitting wanted: extra arguments
        CMD+=(${GPU_CHECK_DIT_ARGS:---layers 2 --repeats 3})
      fi
      ;;
    compiled_choice_tests)
      local selection=cuda; [ "$MODE" = dry ] && selection="not cuda"
      CMD=(python -m pytest tests/test_compiled_kernel_choice.py -q -rs -k "$selection" -p no:cacheprovider)
      ;;
    packed_vs_padded)
      if [ "$MODE" = dry ]; then
        SKIP_REASON="no tiny mode in benchmarks/packed_vs_padded.py, and it writes to benchmarks/results/: GPU only"
      else
        CMD=(bash -c 'python benchmarks/packed_vs_padded.py --device cuda --repeats 5 && cp benchmarks/results/packed_vs_padded_cuda.* "$1"/' _ "$OUT_DIR")
      fi
      ;;
    kernels_tests)
      local selection=(); [ "$TESTS" = cuda ] && selection=(-k cuda)
      [ "$MODE" = dry ] && [ "$TESTS" = cuda ] && selection=(-k "not cuda")
      CMD=(python -m pytest tests/kernels -q -rs -p no:cacheprovider --durations=15 "${selection[@]}")
      ;;
  esac
}

if [ "$PRINT_PLAN" = 1 ]; then
  echo -e "# mode\t$MODE"
  echo -e "# order\tname\tbudget_s\tstate\ttables\tcommand"
  order=0; sum_on=0
  for name in "${STEPS[@]}"; do
    order=$((order + 1))
    budget=$(budget_of "$name"); state=$(enabled_of "$name")
    [ "$state" = on ] && sum_on=$((sum_on + budget))
    command_of "$name" "$budget"
    shown="skipped: $SKIP_REASON"; [ "${#CMD[@]}" -gt 0 ] && printf -v shown '%q ' "${CMD[@]}"
    echo -e "step\t$order\t$name\t$budget\t$state\t${TABLES[$name]}\t${shown% }"
  done
  echo -e "total\t$TOTAL"
  echo -e "sum_on\t$sum_on"
  exit 0
fi

mkdir -p "$OUT_DIR"
STARTED=$(date +%s)
status=0
SUMMARY="$OUT_DIR/gpu_check_summary.md"
declare -A RESULT LIMIT USED WROTE
for name in "${STEPS[@]}"; do RESULT[$name]="not reached"; LIMIT[$name]="-"; USED[$name]="-"; WROTE[$name]=""; done

write_summary() {  # rewritten after every step: a killed check still leaves it
  local now=$(( $(date +%s) - STARTED )) order=0
  {
    echo "# GPU check: ${DEVICE_NAME:-device not yet known}"
    echo
    [ "$MODE" = dry ] && echo "**$DRY_LABEL**: every step at tiny sizes on the CPU; it checks the scripts and measures nothing worth reading." && echo
    echo "\`bash benchmarks/gpu_check.sh$([ "$MODE" = dry ] && echo ' --dry-run')\` at ${COMMIT:-unknown commit}; GPU_CHECK_TOTAL=${TOTAL} s, ${now} s used so far."
    echo
    echo "| # | step | budget (s) | limit given (s) | used (s) | result | tables written |"
    echo "|---:|---|---:|---:|---:|---|---|"
    for name in "${STEPS[@]}"; do
      order=$((order + 1))
      echo "| $order | $name | $(budget_of "$name") | ${LIMIT[$name]} | ${USED[$name]} | ${RESULT[$name]} | ${WROTE[$name]:--} |"
    done
  } > "$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
}
write_summary

# --- setup: the device, versions, the backend's entry point -------------------------------------
unset DCP_KERNELS
[ "$MODE" = gpu ] && unset TRITON_INTERPRET  # the GPU run compiles real kernels: never interpret
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  [ "$MODE" = dry ] && echo "$DRY_LABEL: no GPU is used"
  nvidia-smi 2>&1 || echo "nvidia-smi unavailable"
} > "$OUT_DIR/kernels_nvidia_smi.txt"
DEVICE_NAME=$(python - <<'PY' 2>>"$OUT_DIR/kernels_nvidia_smi.txt"
import torch
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "not installed"
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE"
print(f"{name} (torch {torch.__version__}, CUDA {torch.version.cuda}, Triton {triton_version})")
PY
)
echo "device: $DEVICE_NAME" | tee -a "$OUT_DIR/kernels_nvidia_smi.txt"
[ "$MODE" = dry ] && DEVICE_NAME="CPU, $DRY_LABEL (${DEVICE_NAME#* (}"
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "a copy without git")
if [ "$MODE" = gpu ] && [[ "$DEVICE_NAME" == "NO CUDA DEVICE"* ]]; then
  echo "gpu_check.sh: no CUDA device visible. On a machine without a GPU run \`bash benchmarks/gpu_check.sh --dry-run\`." | tee -a "$OUT_DIR/kernels_nvidia_smi.txt" >&2
  write_summary
  exit 2
fi

# torch.compile finds backend="dcp" through the package's entry point, so the package must be installed,
# not only importable from this folder. The device image is offline: no build isolation (it would fetch
# setuptools), no dependency changes.
if ! python - <<'PY' 2>/dev/null
import importlib.metadata as metadata, sys
sys.exit(not any(e.name == "dcp" for e in metadata.entry_points(group="torch_dynamo_backends")))
PY
then
  if [ "$MODE" = dry ]; then
    echo "gpu_check.sh: backend \"dcp\" is not registered (no entry point): run \`pip install -e .\` in this checkout." >&2
    exit 2
  fi
  pip install -e . --no-deps --no-build-isolation -q
fi
write_summary

# --- the steps -------------------------------------------------------------------------------------
run_step() {  # name: run it under its limit, log to $OUT_DIR/<name>.log, record the result
  local name=$1 budget state left limit floor rc started wrote pattern missing shown
  budget=$(budget_of "$name"); state=$(enabled_of "$name")
  if [ "$state" != on ]; then RESULT[$name]="$state"; write_summary; return; fi
  left=$(( TOTAL - ($(date +%s) - STARTED) ))
  limit=$(( budget < left - GRACE ? budget : left - GRACE ))
  floor=$(( MIN_STEP < budget ? MIN_STEP : budget ))
  if [ "$limit" -lt "$floor" ]; then
    RESULT[$name]="skipped: ${left} s left of GPU_CHECK_TOTAL=${TOTAL} s"
    echo "== $name ${RESULT[$name]}"; write_summary; return
  fi
  command_of "$name" "$limit"
  if [ -n "$SKIP_REASON" ]; then RESULT[$name]="skipped: $SKIP_REASON"; echo "== $name ${RESULT[$name]}"; write_summary; return; fi
  LIMIT[$name]=$limit
  printf -v shown '%q ' "${CMD[@]}"
  echo "== $name (up to ${limit} s; $(( $(date +%s) - STARTED )) s used of ${TOTAL} s): $shown"
  touch "$OUT_DIR/.step_started"
  started=$(date +%s)
  GPU_CHECK_STEP_BUDGET_S=$limit timeout --signal=INT --kill-after=$GRACE "$limit" "${CMD[@]}" 2>&1 | tee "$OUT_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  USED[$name]=$(( $(date +%s) - started ))
  wrote=(); missing=()
  for pattern in ${TABLES[$name]}; do
    local found
    found=$(find "$OUT_DIR" -maxdepth 1 -name "$pattern" -newer "$OUT_DIR/.step_started" -size +0 -printf '%f ' 2>/dev/null)
    if [ -n "$found" ]; then wrote+=($found); else missing+=("$pattern"); fi
  done
  WROTE[$name]="${wrote[*]:-}"
  case "$rc" in
    0) RESULT[$name]="ok" ;;
    124) RESULT[$name]="timed out at ${limit} s (stopped by SIGINT): tables partial" ;;
    137) RESULT[$name]="timed out at ${limit} s and killed ${GRACE} s later: tables as last written" ;;
    *) RESULT[$name]="failed (exit code $rc): see $name.log" ;;
  esac
  [ "$rc" -eq 0 ] || status=1
  if [ "${#missing[@]}" -gt 0 ]; then
    RESULT[$name]="${RESULT[$name]}; NOT WRITTEN: ${missing[*]}"
    status=1
  fi
  echo "$name: ${RESULT[$name]} (${USED[$name]} s)"
  write_summary
}

for name in "${STEPS[@]}"; do run_step "$name"; done
rm -f "$OUT_DIR/.step_started"
write_summary
echo "== done in $(( $(date +%s) - STARTED )) s of ${TOTAL} s; summary: $SUMMARY"
cat "$SUMMARY"
exit "$status"
