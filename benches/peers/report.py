"""Puts our GPU bench results and the peers' (JSON lines from one device run) side by side:

    python3 benches/peers/report.py OUT_DIR > OUT_DIR/report.md

reads OUT_DIR/{fp8_ours,fp8_peers,nsa_ours,nsa_peers}.jsonl and prints markdown tables with
the ratios the issues' targets are stated in."""
import json
import os
import sys


def load(path):
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:  # blank, or cut short by a timeout
                pass
    return rows


def main(out):
    fp8 = load(f"{out}/fp8_ours.jsonl") + load(f"{out}/fp8_peers.jsonl")
    nsa = load(f"{out}/nsa_ours.jsonl") + load(f"{out}/nsa_peers.jsonl")
    gpu = next((r.get("gpu") for r in fp8 + nsa if r.get("gpu")), "unknown GPU")
    print(f"# GPU results: {gpu}\n")
    copy = next((r["gbs"] for r in fp8 if r.get("op") == "copy"), None)
    if fp8:
        print(f"## fp8 linear (copy bandwidth {copy:.0f} GB/s)\n" if copy else "## fp8 linear\n")
        print("| M | N | K | path | fp8nsa ms | TFLOPS | vs candle bf16 | vs torch bf16 | vs torch scaled_mm | vs scaled_mm + quant | x weight-read floor | host ms |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        ours = [r for r in fp8 if r.get("impl") == "fp8nsa" and r.get("op") == "fp8_linear"]
        for r in ours:
            key = (r["m"], r["n"], r["k"])

            def peer(impl):
                p = next((x for x in fp8 if x.get("impl") == impl and (x["m"], x["n"], x["k"]) == key and "ms" in x), None)
                return f"{p['ms'] / r['ms']:.2f}x" if p else "-"

            floor = f"{r['ms'] / r['floor_ms']:.2f}" if r["m"] <= 16 else "-"
            host = f"{r['host_ms']:.4f}" if r.get("host_ms") is not None else "-"
            print(f"| {r['m']} | {r['n']} | {r['k']} | {r['path']} | {r['ms']:.4f} | {r['tflops']:.1f} | "
                  f"{peer('candle_bf16')} | {peer('torch_bf16')} | {peer('torch_scaled_mm')} | "
                  f"{peer('torch_scaled_mm_with_quant')} | {floor} | {host} |")
        print("\nRatios are peer time / fp8nsa time (> 1: fp8nsa faster). host ms: the CPU's time to "
              "enqueue one call (M <= 16); where it reaches fp8nsa ms the call is launch-bound.\n")
    if nsa:
        print("## NSA selection (Hq 64, Hkv 4, D 128, 16 x 64 blocks, bf16)\n")
        print("| case | fp8nsa ms | candle dense ms | vs candle dense | dense flash ms | vs dense flash | fla ms | vs fla |")
        print("|---|---|---|---|---|---|---|---|")
        for r in (x for x in nsa if x.get("impl") == "fp8nsa" and x.get("op") in ("nsa_prefill", "nsa_decode")):
            match = (lambda x: x.get("t") == r.get("t")) if r["op"] == "nsa_prefill" else (lambda x: x.get("tk") == r.get("tk"))
            def ms(impl):
                p = next((x for x in nsa if x.get("op") == r["op"] and x.get("impl") == impl and match(x) and "ms" in x), None)
                return p["ms"] if p else None
            cdense, dense, fla = ms("candle_dense"), ms("sdpa_flash_dense"), ms("fla_parallel_nsa")
            case = f"prefill T={r['t']}" if r["op"] == "nsa_prefill" else f"decode B={r['b']} Tk={r['tk']}"
            f = lambda v: f"{v:.3f}" if v else "-"
            g = lambda v: f"{v / r['ms']:.2f}x" if v else "-"
            print(f"| {case} | {r['ms']:.3f} | {f(cdense)} | {g(cdense)} | {f(dense)} | {g(dense)} | {f(fla)} | {g(fla)} |")
        # the server's shapes (issue 19): each row's time and its ratio to the first (ours)
        for op, title in (("nsa_paged_decode", "Paged batched decode (16 sequences of mixed lengths)"),
                          ("nsa_tokens_decode", "Token-level selection, decode (Hq 16, Hkv 1)")):
            rows = [x for x in nsa if x.get("op") == op and "ms" in x]
            if rows:
                print(f"\n## {title}\n")
                print("| impl | ms | time / first row's |")
                print("|---|---|---|")
                for x in rows:
                    print(f"| {x['impl']} | {x['ms']:.4f} | {x['ms'] / rows[0]['ms']:.2f}x |")
    if not any(r.get("impl") == "fp8nsa" for r in fp8 + nsa):
        print("No fp8nsa rows: see bench_fp8.log / bench_nsa.log.\n")
    errs = [x for x in nsa + fp8 if "error" in x]
    if errs:
        print("\n## Errors\n")
    for e in errs:
        where = " ".join(f"{key}={e[key]}" for key in ("m", "n", "k", "t", "b", "tk") if key in e)
        print(f"- {e.get('impl', '?')} {where}: {e['error']}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
