#!/usr/bin/env bash
# The whole GPU check as one device command, sized for a session's 15 minutes of device time
# (a machine start takes about 30 s of it): run_gpu.sh's tests, benches and peers, then
# compute-sanitizer, each phase under its own time limit, and everything packed into one file,
# since the device tool brings back at most 8 files from $OUT.
#   here:  bash benches/peers/prepare_gpu.sh
#   there: bash benches/peers/gpu_session.sh        (device tool: carry [".device", ".whl"],
#                                                     timeout_s 570)
#   here:  tar xzf /work/.device/<n>/gpu.tgz  ->  gpu/run/ and gpu/san/, to commit under
#          benches/results/gpu/<date>-<gpu>/
# On the first H100 run (2026-11-26) the first phase took about 200 s and the second about 150 s;
# on the third, with the PJRT suite passing (95 s of XLA compilation), the first phase ran past
# its old 265 s in fla's NSA peers, hence 330 s.
set -uo pipefail
cd "$(dirname "$0")/../.."
dest=${OUT:-/tmp/fp8nsa-out}
work=$(mktemp -d)/gpu
mkdir -p "$work/run" "$work/san"
# a phase cut off by its budget leaves its step running (each `timeout` is its own process
# group): end what it started before the next phase uses the GPU
stray() {
  pkill -f 'compute-sanitizer' 2> /dev/null
  pkill -f '\.device/' 2> /dev/null
  pkill -f '(fp8_gemm|nsa)\.py --json' 2> /dev/null
  sleep 1
}
OUT="$work/run" FP8NSA_STEP_TIMEOUT="${FP8NSA_STEP_TIMEOUT:-150}" \
  timeout "${FP8NSA_RUN_BUDGET:-330}" bash benches/peers/run_gpu.sh > "$work/run.txt" 2>&1
run_rc=$?
echo "run_gpu.sh exit $run_rc (124: out of time)" >> "$work/run.txt"
stray
OUT="$work/san" FP8NSA_SANITIZE=only FP8NSA_SANITIZE_TIMEOUT="${FP8NSA_SANITIZE_TIMEOUT:-140}" \
  timeout "${FP8NSA_SANITIZE_BUDGET:-205}" bash benches/peers/run_gpu.sh > "$work/san.txt" 2>&1
san_rc=$?
echo "run_gpu.sh (sanitizer) exit $san_rc (124: out of time)" >> "$work/san.txt"
stray
mkdir -p "$dest"
tar czf "$dest/gpu.tgz" -C "$(dirname "$work")" gpu
# the console: failures and summaries first, then the report
grep -E "test result|FAILED|panicked|exited|failed|hazards|ERROR SUMMARY" "$work/run.txt" "$work/san.txt"
cat "$work/run/report.md" 2> /dev/null
rm -rf "$(dirname "$work")"
# fails when either phase failed (the logs are packed either way)
[ "$run_rc" -eq 0 ] && [ "$san_rc" -eq 0 ]
