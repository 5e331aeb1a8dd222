#!/usr/bin/env bash
# A short device command for a change to the fp8 kernels, when a session's GPU time left is
# less than gpu_session.sh needs (about 6 minutes of the device tool's 15): the fp8 tests,
# the small-M sweep, the fp8 and MoE benches, and compute-sanitizer (memcheck, racecheck) over
# the fp8 tests that reach every path, each step under its own limit, logs into $OUT.
#   here:   bash benches/peers/prepare_gpu.sh && bash benches/gpu/gemv_sweep.sh build c78ecb1
#   there:  bash benches/gpu/small_m_check.sh      (device tool: carry [".device"], timeout_s 480:
#           the steps' limits add up to 425 s)
#   here:   tar xzf /work/.device/<n>/check.tgz    (every log; the tool returns at most 8 files)
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${OUT:-/tmp/fp8nsa-out}
out=$(mktemp -d)/check
mkdir -p "$dest" "$out"
# shellcheck disable=SC2207  # one binary name per line, no spaces
bins=($(cat .device/bins))
test_fp8=${bins[0]} bench_fp8=${bins[2]} bench_moe=${bins[4]}
export FP8NSA_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
failed=()
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc (124: out of time) in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || failed+=("$name")
  # packed after every step: a command cut off by the device tool still brings these back
  tar czf "$dest/check.tgz" -C "$(dirname "$out")" check
}
step test_fp8 120 .device/run.sh "$test_fp8" --test-threads=1
OUT="$out" FP8NSA_SWEEP_TIMEOUT=50 step gemv_sweep_run 55 bash benches/gpu/gemv_sweep.sh
step bench_fp8 60 .device/run.sh "$bench_fp8" --json "$out/fp8_ours.jsonl"
step bench_moe 40 .device/run.sh "$bench_moe" --json "$out/moe_ours.jsonl"
sub=(every_path_writes_every_element bad_input_is_an_error experts_grouped)
step sanitize_memcheck_fp8 50 compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 \
  .device/run.sh "$test_fp8" --test-threads=1 "${sub[@]}"
step sanitize_racecheck_fp8 100 compute-sanitizer --tool racecheck --target-processes all --error-exitcode 9 \
  .device/run.sh "$test_fp8" --test-threads=1 every_path_writes_every_element
# racecheck also reports hazards inside cuBLASLt's closed nvjet_* kernels (run_gpu.sh): count apart
races=$(grep "Race reported between" "$out/sanitize_racecheck_fp8.log")
ours=$(grep -c -v -E " at (nvjet_|cublasLt)" < <(printf "%s" "$races"))
echo "== racecheck hazards: $ours in our kernels," \
  "$(grep -c -E " at (nvjet_|cublasLt)" < <(printf "%s" "$races")) in cuBLASLt's own"
if [ "$ours" -eq 0 ] && grep -q "^test result: ok" "$out/sanitize_racecheck_fp8.log"; then
  kept=()
  for f in ${failed[@]+"${failed[@]}"}; do
    [ "$f" = sanitize_racecheck_fp8 ] || kept+=("$f")
  done
  failed=(${kept[@]+"${kept[@]}"})
fi
grep -h -E "test result|ERROR SUMMARY|RACECHECK SUMMARY|panicked|FAILED" "$out"/*.log
grep -E "picked|before" "$out/gemv_sweep.txt"
tar czf "$dest/check.tgz" -C "$(dirname "$out")" check
if [ ${#failed[@]} -gt 0 ]; then
  echo "== failed: ${failed[*]}"
  exit 1
fi
