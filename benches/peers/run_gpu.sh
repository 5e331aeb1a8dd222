#!/usr/bin/env bash
# One device command for the GPU checks and benchmarks, on the GPU machine (device tool):
#   .device/ staged by ../shared/gpu/stage.sh with the test and bench binaries,
#   .whl/ holding the fla-core, einops and packaging wheels (the machine has no network).
# Usage there:
#   bash benches/peers/run_gpu.sh TEST_FP8 TEST_NSA BENCH_FP8 BENCH_NSA [BENCH_MOE [TEST_NCCL [TEST_PJRT]]]
#   bash benches/peers/run_gpu.sh      # all seven, as benches/peers/prepare_gpu.sh staged them
# (the staged binary names; TEST_NCCL is the `cuda_nccl` test, built with `--features nccl`;
# TEST_PJRT the `pjrt` test built with `--features pjrt`, run against the machine's XLA CUDA
# plugin from jax-cuda13-pjrt). FP8NSA_SANITIZE=1 runs the tests and then compute-sanitizer
# over them instead of the benches (a second phase: gpu_session.sh runs both in one command);
# FP8NSA_SANITIZE=only runs the sanitizer alone, when the plain tests already ran in this
# session. A session's whole device time may be 15 minutes, so every step can be bounded:
# FP8NSA_STEP_TIMEOUT (seconds, each test, bench and peer script; unset: none) and
# FP8NSA_SANITIZE_TIMEOUT (seconds, each sanitizer run; default 130). A step cut off by its
# timeout exits 124 and is listed as failed, so an incomplete run never reads as a pass.
# Logs and tables land in $OUT.
set -uo pipefail
if [ $# -eq 0 ] && [ -f .device/bins ]; then
  # shellcheck disable=SC2046  # one binary name per line, no spaces
  set -- $(cat .device/bins)
fi
if [ $# -lt 4 ] || [ $# -gt 7 ]; then
  echo "usage: bash benches/peers/run_gpu.sh TEST_FP8 TEST_NSA BENCH_FP8 BENCH_NSA [BENCH_MOE [TEST_NCCL [TEST_PJRT]]]" >&2
  exit 2
fi
out=$(realpath -m "${OUT:-/tmp/fp8nsa-out}")
mkdir -p "$out"
rm -f "$out"/*.jsonl  # the writers append; a warm machine keeps the last run's rows
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# a missing GPU fails the tests instead of skipping them
export FP8NSA_REQUIRE_GPU=1
failed=()
step=()
if [ -n "${FP8NSA_STEP_TIMEOUT:-}" ]; then
  step=(timeout "$FP8NSA_STEP_TIMEOUT")
fi
# a staged test binary: its test lines, and when it fails (a loader error prints no test
# line) its exit status and the log's tail
run_test() {
  local name=$1
  shift
  ${step[@]+"${step[@]}"} .device/run.sh "$@" --test-threads=1 > "$out/$name.log" 2>&1
  local rc=$?
  grep -E "^test |test result|panicked" "$out/$name.log"
  if [ $rc -ne 0 ]; then
    echo "== $name exited with status $rc; the log ends:"
    tail -n 40 "$out/$name.log"
    failed+=("$name")
  fi
}
if [ "${FP8NSA_SANITIZE:-0}" != only ]; then
  run_test test_fp8 "$1"
  run_test test_nsa "$2"
fi
# FP8NSA_SANITIZE=1: compute-sanitizer (issue 16, item 1) instead of the benches, as its own
# device command (a command gets 10 minutes): memcheck, then racecheck for the shared-memory
# kernels, on a reduced sweep (the tests that reach every fp8 path, the grouped experts, and
# every NSA kernel path: splits, varlen, adversarial rows, pages, tokens).
if [ "${FP8NSA_SANITIZE:-0}" = 1 ] || [ "${FP8NSA_SANITIZE:-0}" = only ]; then
  if ! command -v compute-sanitizer >/dev/null; then
    echo "== no compute-sanitizer on PATH"
    exit 1
  fi
  sanitize() {
    local tool=$1 name=$2 bin=$3
    shift 3
    timeout "${FP8NSA_SANITIZE_TIMEOUT:-130}" compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 9 \
      .device/run.sh "$bin" --test-threads=1 "$@" > "$out/sanitize_${tool}_$name.log" 2>&1
    local rc=$?
    local log="$out/sanitize_${tool}_$name.log"
    echo "== compute-sanitizer $tool $name: exit $rc (124: out of time)"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|test result" "$log" | tail -n 4
    # racecheck also reports hazards inside NVIDIA's closed cuBLASLt kernels (nvjet_*: the
    # block-scaled fp8 GEMM; 36 of them on the first H100 run, 2026-11-26), which nothing here
    # can fix. They are counted and shown apart; a hazard in any other kernel, or a failed
    # test, still fails the run.
    if [ "$tool" = racecheck ] && [ $rc -eq 9 ] && grep -q "^test result: ok" "$log"; then
      local vendor ours
      vendor=$(grep "Race reported between" "$log" | grep -c -E " at (nvjet_|cublasLt)")
      ours=$(grep "Race reported between" "$log" | grep -c -v -E " at (nvjet_|cublasLt)")
      echo "   hazards: $ours in our kernels, $vendor in cuBLASLt's own (nvjet) kernels"
      # only a run whose every reported race is a vendor kernel's passes
      [ "$ours" -eq 0 ] && [ "$vendor" -gt 0 ] && rc=0
    fi
    [ $rc -eq 0 ] || failed+=("sanitize_${tool}_$name")
  }
  for tool in memcheck racecheck; do
    sanitize "$tool" fp8 "$1" every_path_writes_every_element bad_input_is_an_error experts_grouped
    sanitize "$tool" nsa "$2" decode_batch_splits varlen_matches adversarial_selections \
      paged_kv_and_token_selection backend_writes_every_element
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "== failed: ${failed[*]}"
    exit 1
  fi
  exit 0
fi
# a staged bench binary, its output shown and kept; a failure is listed at the end
run_bench() {
  local name=$1
  shift
  ${step[@]+"${step[@]}"} .device/run.sh "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "== $name exited with status $rc"; failed+=("$name"); }
}
run_bench bench_fp8 "$3" --json "$out/fp8_ours.jsonl"
${step[@]+"${step[@]}"} python3 benches/peers/fp8_gemm.py --json "$out/fp8_peers.jsonl" > "$out/peers_fp8.log" 2>&1 \
  || failed+=(peers_fp8)
run_bench bench_nsa "$4" --json "$out/nsa_ours.jsonl"
# the grouped expert GEMM vs per-expert fp8 and bf16 loops (its peers run in the same binary)
if [ $# -ge 5 ]; then
  run_bench bench_moe "$5" --json "$out/moe_ours.jsonl"
fi
# fla's NSA peers before the NCCL and PJRT suites: the PJRT suite's XLA compilation is the
# longest step (95 s on the H100), and a run cut off by its time limit keeps the peers' rows
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
(cd benches/peers && ${step[@]+"${step[@]}"} python3 nsa.py --json "$out/nsa_peers.jsonl") > "$out/peers_nsa.log" 2>&1 \
  || failed+=(peers_nsa)
# the report of every row so far, rewritten at the end (a run cut off after this still has one)
(cd benches/peers && python3 report.py "$out") > "$out/report.md"
# a one-rank NCCL group; libnccl.so.2 comes from the machine's nvidia-nccl-cu13 (PyTorch's)
if [ $# -ge 6 ]; then
  nccl_dir=$(find / -xdev -name 'libnccl.so.2' -printf '%h\n' 2>/dev/null | head -1)
  if [ -z "$nccl_dir" ]; then
    echo "== no libnccl.so.2 on this machine; the NCCL test will not load"
  else
    echo "== libnccl.so.2 from $nccl_dir"
  fi
  LD_LIBRARY_PATH="${nccl_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" run_test test_nccl "$6"
fi
# the PJRT suite on the XLA CUDA plugin (issue 16, item 3)
if [ $# -ge 7 ]; then
  plugin=$(python3 -c "import jax_plugins.xla_cuda13 as p, os; d = os.path.dirname(p.__file__); print(next(os.path.join(d, f) for f in os.listdir(d) if f.endswith('.so')))" 2>/dev/null)
  [ -n "$plugin" ] || plugin=$(find / -xdev -path '*jax_plugins*' -name '*.so' 2>/dev/null | grep -i cuda | head -1)
  if [ -z "$plugin" ]; then
    echo "== no XLA CUDA PJRT plugin found; the PJRT GPU run is skipped"
    failed+=("pjrt_plugin_missing")
  else
    echo "== XLA CUDA PJRT plugin: $plugin"
    FP8NSA_PJRT_PLUGIN="$plugin" FP8NSA_REQUIRE_PJRT=1 FP8NSA_PJRT_DUMP="$out" run_test test_pjrt_gpu "$7"
  fi
fi
(cd benches/peers && python3 report.py "$out") > "$out/report.md"
cat "$out/report.md"
if [ ${#failed[@]} -gt 0 ]; then
  echo "== failed: ${failed[*]}"
  exit 1
fi
