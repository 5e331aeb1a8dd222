#!/usr/bin/env bash
# The serving benchmark: llama.cpp's llama-server and `fp8nsa serve` on the same model
# (SmolLM2-135M-Instruct) under the same load from benches/serve/loadgen.py, one server at a time
# on 127.0.0.1, rows appended to benches/results/serve/<date>-<cpu-slug>.jsonl (the slug from
# benches/cpu_label.py: model name, family / model, SIMD level).
#
# Usage (from anywhere; not part of CI: it builds llama.cpp and takes many minutes):
#   bash benches/serve/run.sh
# Environment:
#   CONCURRENCY        loadgen levels (default 1,4,16,64)
#   ROWS               space-separated subset of the row labels below (default: all)
#   FP8NSA_BIN         our binary (default: target/release/fp8nsa, built here first with
#                      `cargo build --release -p fp8nsa-cli`, so the rows measure the checkout)
#   LOADGEN_ARGS       extra loadgen.py arguments, e.g. "--requests 8 --max-out 64"
#   HEALTH_TIMEOUT     seconds to wait for a server's GET /health to answer 200 (default 300)
#   FP8NSA_PEERS_CACHE where llama.cpp and the GGUFs are cached (see benches/peers/llama-cpp.sh)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"

concurrency=${CONCURRENCY:-1,4,16,64}
fp8nsa_bin=${FP8NSA_BIN:-target/release/fp8nsa}
health_timeout=${HEALTH_TIMEOUT:-300}
read -r -a loadgen_extra <<< "${LOADGEN_ARGS:-}"

log() { echo "[serve/run.sh] $*" >&2; }

# a binary left from an earlier checkout would be measured silently: build the default one
if [ -z "${FP8NSA_BIN:-}" ]; then
  log "building $fp8nsa_bin (cargo build --release -p fp8nsa-cli)"
  cargo build --release -q -p fp8nsa-cli >&2
fi

python3 -c 'import httpx' 2> /dev/null || {
  log "installing httpx for loadgen.py"
  python3 -m pip install --quiet httpx >&2
}

# llama.cpp binaries and the three GGUFs (built once, cached): KEY=path lines
declare -A path
while IFS='=' read -r key value; do
  [ -n "$key" ] && path[$key]=$value
done < <(bash benches/peers/llama-cpp.sh build)
for key in LLAMA_SERVER GGUF_Q8_0 GGUF_Q4_1; do
  [ -n "${path[$key]:-}" ] || {
    log "llama-cpp.sh build printed no $key"
    exit 1
  }
done

# model name, family / model and SIMD level: "AMD EPYC" alone is both the AVX2 and the Zen 4 VMs
cpu_slug=$(python3 benches/cpu_label.py --slug)
out_dir=benches/results/serve
mkdir -p "$out_dir"
out=$out_dir/$(date +%Y-%m-%d)-$cpu_slug.jsonl
logs=$(mktemp -d /tmp/fp8nsa-serve.XXXXXX)
log "results -> $out; server logs -> $logs"

# A port the kernel just handed out and released: free unless something grabs it in between.
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

server_pid=
stop_server() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2> /dev/null; then
    kill "$server_pid" 2> /dev/null || true
    # a server that ignores SIGTERM for 20 s gets SIGKILL, so the next row has the cores to itself
    for _ in $(seq 1 40); do
      kill -0 "$server_pid" 2> /dev/null || break
      sleep 0.5
    done
    kill -9 "$server_pid" 2> /dev/null || true
    wait "$server_pid" 2> /dev/null || true
  fi
  server_pid=
}
trap stop_server EXIT
trap 'exit 130' INT TERM

# GET /health until 200 (llama-server answers 503 while it loads the model); fails early when the
# server process dies.
wait_healthy() {
  local port=$1 deadline=$((SECONDS + health_timeout)) code
  while [ $SECONDS -lt $deadline ]; do
    kill -0 "$server_pid" 2> /dev/null || return 1
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "http://127.0.0.1:$port/health" || true)
    [ "$code" = 200 ] && return 0
    sleep 1
  done
  return 1
}

# run_row LABEL COMMAND...: start the server (the command gets --host/--port appended), wait for
# /health, load it, stop it.
run_row() {
  local label=$1
  shift
  if [ -n "${ROWS:-}" ] && [[ " $ROWS " != *" $label "* ]]; then
    return 0
  fi
  local port
  port=$(free_port)
  log "$label: starting on 127.0.0.1:$port: $*"
  "$@" --host 127.0.0.1 --port "$port" > "$logs/$label.log" 2>&1 &
  server_pid=$!
  if ! wait_healthy "$port"; then
    log "$label: no 200 from /health within $health_timeout s (or the server died); its log ends:"
    tail -n 20 "$logs/$label.log" >&2
    stop_server
    failed+=("$label")
    return 0
  fi
  # the rows go to the results file as they come (tee), so a later failure loses nothing
  if ! python3 benches/serve/loadgen.py --base-url "http://127.0.0.1:$port" --label "$label" \
    --concurrency "$concurrency" "${loadgen_extra[@]}" | tee -a "$out"; then
    failed+=("$label")
  fi
  stop_server
}

failed=()

# llama-server: -t 2 for the two cores, 16 slots (-np) with continuous batching, and a context
# for 16 requests at once of up to 1024 prompt + 256 output tokens each, plus slack for BOS and the
# word-count approximation of prompt lengths: 16 x 1536.
llama_args=(-t 2 -np 16 -c $((16 * 1536)))
run_row llama.cpp-Q8_0 "${path[LLAMA_SERVER]}" -m "${path[GGUF_Q8_0]}" "${llama_args[@]}"
run_row llama.cpp-Q4_1 "${path[LLAMA_SERVER]}" -m "${path[GGUF_Q4_1]}" "${llama_args[@]}"

# Our server, on the Q4_1 GGUF (the one checkpoint the registries ship; fp8nsa converts it to
# its own linear formats at load). Skipped, saying so, for a FP8NSA_BIN without `serve`.
if [ ! -x "$fp8nsa_bin" ]; then
  log "skipping the fp8nsa rows: $fp8nsa_bin does not exist (cargo build --release, or set FP8NSA_BIN)"
elif ! "$fp8nsa_bin" serve --help > /dev/null 2>&1; then
  log "skipping the fp8nsa rows: '$fp8nsa_bin serve --help' fails, so this build has no serve subcommand yet"
else
  run_row fp8nsa-fp8 "$fp8nsa_bin" serve --gguf "${path[GGUF_Q4_1]}" --linear fp8
  # f16 KV pages, as llama-server keeps its cache by default
  run_row fp8nsa-fp8-f16kv "$fp8nsa_bin" serve --gguf "${path[GGUF_Q4_1]}" --linear fp8 --kv-dtype f16
  run_row fp8nsa-dense "$fp8nsa_bin" serve --gguf "${path[GGUF_Q4_1]}" --linear dense
  run_row fp8nsa-fp8-nsa "$fp8nsa_bin" serve --gguf "${path[GGUF_Q4_1]}" --linear fp8 --attention nsa
fi

if [ ${#failed[@]} -gt 0 ]; then
  log "rows that failed: ${failed[*]} (logs in $logs)"
  exit 1
fi
log "done: $out"
