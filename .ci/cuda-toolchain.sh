# Source this file (bash): `source .ci/cuda-toolchain.sh`
#
# A CUDA 13.0 build toolchain on a machine without one, from NVIDIA's wheels on PyPI: nvcc,
# ptxas, headers and cudart, plus the libraries candle's and our `cuda` feature link against
# (cublas, cublasLt, curand, nvrtc), and NCCL for the `nccl` feature. libcuda comes with a GPU driver, which a build machine
# lacks: a stub with every driver entry point cudarc declares is generated to link against
# (binaries that touch no GPU, like the plan and emulator tests, also run with it).
#
# 13.0 exactly: the GPU machines run driver 580 (CUDA 13.0), and a driver cannot JIT PTX
# made by a newer nvcc. Exports CUDA_ROOT/CUDA_PATH/CUDA_HOME, CUDA_COMPUTE_CAP, PATH,
# LIBRARY_PATH, and FP8NSA_CUDA_LIB_PATH (prepend it to LD_LIBRARY_PATH to run CUDA-linked
# binaries here). Idempotent; the first run downloads ~1 GB into ~/.cache.

fp8nsa_cuda_toolchain() {
  local root="${FP8NSA_CUDA_DIR:-$HOME/.cache/fp8nsa-cuda-13.0}"
  local py="${PYTHON:-python3}"
  local pip=("$py" -m pip install -q --no-deps --upgrade --disable-pip-version-check)
  if [ ! -x "$root/tk/nvidia/cu13/bin/nvcc" ]; then
    echo "cuda-toolchain: installing the CUDA 13.0 compiler wheels into $root/tk" >&2
    "${pip[@]}" --target "$root/tk" \
      nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 \
      nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 || return 1
  fi
  if [ ! -e "$root/libs/nvidia/cu13/lib/libcublasLt.so.13" ]; then
    echo "cuda-toolchain: installing the cuBLAS / cuRAND / NVRTC wheels into $root/libs" >&2
    "${pip[@]}" --target "$root/libs" \
      nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88 || return 1
  fi
  # to link against: binaries name the soname libnccl.so.2 and load the GPU machine's own copy
  # there (it comes with PyTorch)
  if [ ! -e "$root/nccl/nvidia/nccl/lib/libnccl.so.2" ]; then
    echo "cuda-toolchain: installing the NCCL wheel into $root/nccl" >&2
    "${pip[@]}" --target "$root/nccl" nvidia-nccl-cu13==2.28.9 || return 1
  fi
  local tk="$root/tk/nvidia/cu13" libs="$root/libs/nvidia/cu13/lib" nccl="$root/nccl/nvidia/nccl/lib"
  ln -sf libnccl.so.2 "$nccl/libnccl.so"
  ln -sf libcudart.so.13 "$tk/lib/libcudart.so"
  for l in cublas cublasLt nvrtc; do ln -sf "lib$l.so.13" "$libs/lib$l.so"; done
  ln -sf libcurand.so.10 "$libs/libcurand.so"

  if [ ! -e "$root/stub/libcuda.so.1" ]; then
    local sys
    sys=$(ls -d "$HOME"/.cargo/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs 2>/dev/null | tail -1)
    if [ -z "$sys" ]; then
      echo "cuda-toolchain: no cudarc source in ~/.cargo/registry yet; run 'cargo fetch' first" >&2
      return 1
    fi
    mkdir -p "$root/stub"
    grep -ohE "fn cu[A-Z][A-Za-z0-9_]*\(" "$sys" \
      | sed -E 's/^fn (.*)\($/void \1(void){}/' | sort -u > "$root/stub/libcuda_stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/stub/libcuda.so" "$root/stub/libcuda_stub.c" || return 1
    ln -sf libcuda.so "$root/stub/libcuda.so.1"
  fi

  export CUDA_ROOT="$tk" CUDA_PATH="$tk" CUDA_HOME="$tk"
  export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
  export PATH="$tk/bin:$PATH"
  export LIBRARY_PATH="$tk/lib:$libs:$nccl:$root/stub${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export FP8NSA_CUDA_LIB_PATH="$root/stub:$libs:$tk/lib:$nccl"
  echo "cuda-toolchain: $(nvcc --version | tail -1)" >&2
}
fp8nsa_cuda_toolchain
