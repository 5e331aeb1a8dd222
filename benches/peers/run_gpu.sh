#!/usr/bin/env bash
# One device command for the GPU checks and benchmarks, on the GPU machine (device tool):
#   .device/ staged by ../shared/gpu/stage.sh with the test and bench binaries,
#   .whl/ holding the fla-core, einops and packaging wheels (the machine has no network).
# Usage there:
#   bash benches/peers/run_gpu.sh TEST_FP8 TEST_NSA BENCH_FP8 BENCH_NSA [BENCH_MOE [TEST_NCCL]]
# (the staged binary names; TEST_NCCL is the `cuda_nccl` test, built with `--features nccl`).
# Logs and tables land in $OUT.
set -uo pipefail
if [ $# -lt 4 ] || [ $# -gt 6 ]; then
  echo "usage: bash benches/peers/run_gpu.sh TEST_FP8 TEST_NSA BENCH_FP8 BENCH_NSA [BENCH_MOE [TEST_NCCL]]" >&2
  exit 2
fi
out=$(realpath -m "${OUT:-/tmp/fp8nsa-out}")
mkdir -p "$out"
rm -f "$out"/*.jsonl  # the writers append; a warm machine keeps the last run's rows
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# a missing GPU fails the tests instead of skipping them
export FP8NSA_REQUIRE_GPU=1
failed=()
# a staged test binary: its test lines, and when it fails (a loader error prints no test
# line) its exit status and the log's tail
run_test() {
  local name=$1
  shift
  .device/run.sh "$@" --test-threads=1 > "$out/$name.log" 2>&1
  local rc=$?
  grep -E "^test |test result|panicked" "$out/$name.log"
  if [ $rc -ne 0 ]; then
    echo "== $name exited with status $rc; the log ends:"
    tail -n 40 "$out/$name.log"
    failed+=("$name")
  fi
}
run_test test_fp8 "$1"
run_test test_nsa "$2"
.device/run.sh "$3" --json "$out/fp8_ours.jsonl" 2>&1 | tee "$out/bench_fp8.log"
python3 benches/peers/fp8_gemm.py --json "$out/fp8_peers.jsonl" > "$out/peers_fp8.log" 2>&1
.device/run.sh "$4" --json "$out/nsa_ours.jsonl" 2>&1 | tee "$out/bench_nsa.log"
# the grouped expert GEMM vs per-expert fp8 and bf16 loops (its peers run in the same binary)
if [ $# -ge 5 ]; then
  .device/run.sh "$5" --json "$out/moe_ours.jsonl" 2>&1 | tee "$out/bench_moe.log"
fi
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
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
(cd benches/peers && python3 nsa.py --json "$out/nsa_peers.jsonl") > "$out/peers_nsa.log" 2>&1
(cd benches/peers && python3 report.py "$out") > "$out/report.md"
cat "$out/report.md"
if [ ${#failed[@]} -gt 0 ]; then
  echo "== failed: ${failed[*]}"
  exit 1
fi
