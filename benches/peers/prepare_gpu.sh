#!/usr/bin/env bash
# Builds and stages everything run_gpu.sh runs, on the build machine (no GPU needed):
#   bash benches/peers/prepare_gpu.sh
# and then, with the device tool (carry [".device", ".whl"]), one command that fits a session's
# 15 minutes of device time and packs its logs into one file:
#   bash benches/peers/gpu_session.sh   # run_gpu.sh (tests, benches, peers, NCCL, PJRT, report),
#                                       # then FP8NSA_SANITIZE=only run_gpu.sh (compute-sanitizer)
#
# GPU sessions are short and start on a fresh machine, so the build is CI's: the same target
# folder, profile (dev, which is opt-level 3 in this workspace) and feature set. candle's CUDA
# kernels (~10 minutes of nvcc on 2 cores) then compile once for CI and for the GPU, and after
# `bash .ci/run` only the three GPU benches are new. Set FP8NSA_GPU_PROFILE=release for
# host code without debug assertions, at the price of a second full CUDA build.
#
# Checks before anything goes to a GPU: every binary is found, links against the CUDA 13
# libraries the GPU machine has (with the toolchain's stub for the driver's libcuda), the test
# binaries load and list their tests (a loader error shows now, not on the GPU), and .device +
# .whl fit the device tool's 64 MiB carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
stage=../shared/gpu/stage.sh
if [ ! -x "$stage" ] && [ ! -f "$stage" ]; then
  echo "prepare_gpu: $stage not found (the workplace's staging script)" >&2
  exit 2
fi
export CARGO_TARGET_DIR="${FP8NSA_CI_TARGET_DIR:-$HOME/.cache/fp8nsa-ci-target}"
profile="${FP8NSA_GPU_PROFILE:-dev}"
source .ci/cuda-toolchain.sh
features=cuda,nccl,fp8nsa-cuda/emu
json=$(mktemp)
smoke=$(mktemp -d)
trap 'rm -rf "$json" "$smoke"' EXIT

echo "== building (profile $profile, target $CARGO_TARGET_DIR)"
cargo test --workspace --features "$features" --profile "$profile" \
  --test cuda_fp8 --test cuda_nsa --test cuda_nccl --no-run --message-format=json >> "$json"
cargo bench --workspace --features "$features" --profile "$profile" \
  --bench gpu_fp8 --bench gpu_nsa --bench gpu_moe --no-run --message-format=json >> "$json"
cargo test --features pjrt --profile "$profile" --test pjrt --no-run --message-format=json >> "$json"

# the order run_gpu.sh takes them in
targets=(cuda_fp8 cuda_nsa gpu_fp8 gpu_nsa gpu_moe cuda_nccl pjrt)
bins=()
for t in "${targets[@]}"; do
  p=$(python3 - "$json" "$t" <<'EOF'
import json, sys
path = None
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[2]:
        path = m["executable"]
print(path or "")
EOF
)
  if [ -z "$p" ]; then
    echo "prepare_gpu: no executable for $t in cargo's output" >&2
    exit 1
  fi
  bins+=("$p")
done

rm -rf .device
bash "$stage" "${bins[@]}"
: > .device/bins
for p in "${bins[@]}"; do basename "$p" >> .device/bins; done

echo "== fla's Triton NSA kernel and its dependencies for the peer script (no network there)"
rm -rf .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --disable-pip-version-check \
  -d .whl fla-core==0.6.0 einops packaging

echo "== smoke test of the staged copies (here, without a GPU or driver: the toolchain's stub libcuda)"
cp -r .device/. "$smoke/"
for f in "$smoke"/*.xz; do xz -d "$f"; done
export LD_LIBRARY_PATH="$FP8NSA_CUDA_LIB_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
i=0
while read -r name; do
  i=$((i + 1))
  if ldd "$smoke/$name" | grep -q 'not found'; then
    echo "prepare_gpu: $name is missing libraries (besides the driver's, stubbed here):" >&2
    ldd "$smoke/$name" | grep 'not found' >&2
    exit 1
  fi
  # the test binaries (1, 2, 6, 7 in run_gpu.sh's order) list their tests without touching
  # CUDA; the benches would call the stub, so they are only linked
  case $i in
    3 | 4 | 5) echo "$name: links" ;;
    *)
      if ! "$smoke/$name" --list > "$smoke/$name.list" 2>&1; then
        echo "prepare_gpu: the staged $name does not run here:" >&2
        tail -n 20 "$smoke/$name.list" >&2
        exit 1
      fi
      echo "$name: $(grep -c ': test$' "$smoke/$name.list") tests"
      ;;
  esac
done < .device/bins

bytes=$(du -sbc .device .whl | tail -n 1 | cut -f 1)
limit=$((64 * 1024 * 1024))
echo "== .device + .whl: $((bytes / 1024)) KiB of the carry's $((limit / 1024)) KiB"
if [ "$bytes" -ge "$limit" ]; then
  echo "prepare_gpu: too large for the device tool's carry" >&2
  exit 1
fi
echo "== ready: one device command (carry [\".device\", \".whl\"], timeout_s 570):"
echo "   bash benches/peers/gpu_session.sh"
echo "   (or the two phases by hand: bash benches/peers/run_gpu.sh; FP8NSA_SANITIZE=only bash benches/peers/run_gpu.sh)"
