#!/usr/bin/env python3
"""Writes a multi-GB Llama-shaped fp8 checkpoint (DeepSeek-V3 / Qwen3-FP8 layout: F8_E4M3
weights + F32 `weight_scale_inv` per 128x128 block, bf16 embeddings, norms and head) in
several shards with a `model.safetensors.index.json`, for measuring the loader's peak memory.

The safetensors files are written by hand (header JSON + raw bytes) so that no ML library is
needed: numpy has no fp8 dtype, and random e4m3 codes are just random bytes with the NaN codes
(0x7f, 0xff) masked out. Values are random: the checkpoint is for load and speed measurements
only.

    python3 benches/load/gen_fp8_checkpoint.py OUT_DIR [--layers 12] [--hidden 4096]
"""
import argparse
import json
import os
import struct

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--layers-per-shard", type=int, default=4)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(0)
    h, i, hd = a.hidden, a.intermediate, a.hidden // a.heads
    q, kv = a.heads * hd, a.kv_heads * hd

    def fp8(n, k):
        codes = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
        scales = (10.0 ** rng.uniform(-4, -2, size=(-(-n // 128), -(-k // 128)))).astype("<f4")
        return [("weight", "F8_E4M3", codes), ("weight_scale_inv", "F32", scales)]

    def bf16(*dims):
        x = rng.standard_normal(dims, dtype=np.float32) * 0.02
        return ("weight", "BF16", (x.view(np.uint32) >> 16).astype("<u2"))

    shards = []  # list of dict name -> (dtype, array)
    cur = {}
    cur["model.embed_tokens.weight"] = bf16(a.vocab, h)[1:]
    for l in range(a.layers):
        p = f"model.layers.{l}"
        for name, (n, k) in {
            "self_attn.q_proj": (q, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
        }.items():
            for suffix, dt, arr in fp8(n, k):
                cur[f"{p}.{name}.{suffix}"] = (dt, arr)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            cur[f"{p}.{norm}.weight"] = ("BF16", np.full(h, 0x3F80, dtype="<u2"))
        if (l + 1) % a.layers_per_shard == 0:
            shards.append(cur)
            cur = {}
    cur["model.norm.weight"] = ("BF16", np.full(h, 0x3F80, dtype="<u2"))
    cur["lm_head.weight"] = bf16(a.vocab, h)[1:]
    shards.append(cur)

    weight_map = {}
    total = 0
    for s, tensors in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {}, 0
        for name, (dt, arr) in tensors.items():
            header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + arr.nbytes]}
            off += arr.nbytes
            weight_map[name] = fname
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        with open(os.path.join(a.out, fname), "wb") as f:
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            for dt, arr in tensors.values():
                f.write(np.ascontiguousarray(arr).tobytes())
        total += off
        print(f"wrote {fname}: {off / 2**30:.2f} GiB", flush=True)
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": h,
        "intermediate_size": i,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "vocab_size": a.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(f"total {total / 2**30:.2f} GiB in {len(shards)} shards", flush=True)


if __name__ == "__main__":
    main()
