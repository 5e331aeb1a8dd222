#!/usr/bin/env bash
# The small-M kernel's sweep (gemv_sweep.cu): kernel-only times with CUDA events.
#   here:   bash benches/gpu/gemv_sweep.sh build [REV]
#           builds .device/gemv_sweep with the CUDA 13 toolchain (.ci/cuda-toolchain.sh), with
#           the small-M kernel as it was at git revision REV (renamed, benches/gpu/old_gemv.cuh
#           generated and removed again) timed as "before" in the same run; no REV: without it.
#           REV must hold the kernel's first form (one CTA per row group, no `tpg` field), as
#           `c78ecb1` does: the renaming and the "before" launch know that form only.
#   there:  bash benches/gpu/gemv_sweep.sh          (device tool, carry [".device"])
#           runs it into $OUT/gemv_sweep.txt; without .device/gemv_sweep it builds with the
#           machine's nvcc first (no "before" then)
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = build ]; then
  set -e
  source .ci/cuda-toolchain.sh > /dev/null
  defs=()
  trap 'rm -f benches/gpu/old_gemv.cuh' EXIT
  if [ -n "${2:-}" ]; then
    if git show "$2:backends/cuda/kernels/fp8_gemv.cu" | grep -q "int tpg"; then
      echo "gemv_sweep: $2's small-M kernel is the group form; name a revision with the first form (c78ecb1)" >&2
      exit 2
    fi
    git show "$2:backends/cuda/kernels/fp8_gemv.cu" | python3 -c '
import re, sys
s = sys.stdin.read()
s = s[: s.index("#define GEMV(")].replace("#include \"common.cuh\"", "")
s = s.replace("GemvParams", "OldGemvParams").replace("fp8nsa_fp8_", "old_fp8nsa_fp8_")
s = re.sub(r"\bfp8_gemv\b", "old_fp8_gemv", s).replace("fp8_gemv_grouped", "old_fp8_gemv_grouped")
s += "\ntemplate <int MT, int ROWS> __global__ void __launch_bounds__(256) old_gemv_f32(const OldGemvParams p) {\n    old_fp8_gemv<MT, ROWS, float>(p);\n}\n"
print(s)' > benches/gpu/old_gemv.cuh
    defs=(-DFP8NSA_SWEEP_OLD)
  fi
  mkdir -p .device
  nvcc -O3 -std=c++17 -arch=sm_90 ${defs[@]+"${defs[@]}"} benches/gpu/gemv_sweep.cu -o .device/gemv_sweep
  echo "built .device/gemv_sweep${2:+ (before: $2)}"
  exit 0
fi
out=${OUT:-/tmp/fp8nsa-out}
mkdir -p "$out"
bin=.device/gemv_sweep
if [ ! -x "$bin" ]; then
  bin=/tmp/gemv_sweep
  nvcc -O3 -std=c++17 -arch=sm_90 benches/gpu/gemv_sweep.cu -o "$bin" || exit 1
fi
timeout "${FP8NSA_SWEEP_TIMEOUT:-100}" "$bin" > "$out/gemv_sweep.txt" 2>&1
rc=$?
echo "gemv_sweep exit $rc" >> "$out/gemv_sweep.txt"
exit $rc
