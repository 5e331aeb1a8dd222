//! Small, complete GGUF files for the loaders' suites.

use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// Writes a whole one-layer llama GGUF to `path` (hidden 32, feed-forward 64, two heads,
/// eight tokens) whose metadata claims `context_length` and `rope.dimension_count`, with
/// random f32 tensors drawn from `seed`. Returns the offset of its tensor data (where the
/// header and tensor infos end).
///
/// ```
/// let path = std::env::temp_dir().join(format!("doc-tiny-{}.gguf", std::process::id()));
/// let data_at = fp8nsa_test_support::gguf::tiny_llama(&path, 1, 64, 16);
/// assert!(data_at > 0 && (data_at as u64) < std::fs::metadata(&path).unwrap().len());
/// # std::fs::remove_file(path).unwrap();
/// ```
pub fn tiny_llama(path: &Path, seed: u64, context: u32, rope_dims: u32) -> usize {
    use gguf_file::Value as V;
    let (hidden, ff, vocab) = (32usize, 64usize, 8usize);
    let tokens = V::Array((0..vocab).map(|i| V::String(format!("t{i}"))).collect());
    let (arch, ctx, emb, blocks, ffl, heads, rope, eps) = (
        V::String("llama".into()),
        V::U32(context),
        V::U32(hidden as u32),
        V::U32(1),
        V::U32(ff as u32),
        V::U32(2),
        V::U32(rope_dims),
        V::F32(1e-5),
    );
    let meta: Vec<(&str, &V)> = vec![
        ("general.architecture", &arch),
        ("llama.context_length", &ctx),
        ("llama.embedding_length", &emb),
        ("llama.block_count", &blocks),
        ("llama.feed_forward_length", &ffl),
        ("llama.attention.head_count", &heads),
        ("llama.attention.head_count_kv", &heads),
        ("llama.rope.dimension_count", &rope),
        ("llama.attention.layer_norm_rms_epsilon", &eps),
        ("tokenizer.ggml.tokens", &tokens),
    ];
    let shapes: Vec<(&str, Vec<usize>)> = vec![
        ("token_embd.weight", vec![vocab, hidden]),
        ("output_norm.weight", vec![hidden]),
        ("blk.0.attn_norm.weight", vec![hidden]),
        ("blk.0.ffn_norm.weight", vec![hidden]),
        ("blk.0.attn_q.weight", vec![hidden, hidden]),
        ("blk.0.attn_k.weight", vec![hidden, hidden]),
        ("blk.0.attn_v.weight", vec![hidden, hidden]),
        ("blk.0.attn_output.weight", vec![hidden, hidden]),
        ("blk.0.ffn_gate.weight", vec![ff, hidden]),
        ("blk.0.ffn_up.weight", vec![ff, hidden]),
        ("blk.0.ffn_down.weight", vec![hidden, ff]),
    ];
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
    let qs: Vec<(&str, QTensor)> = shapes
        .iter()
        .map(|(name, dims)| {
            let n = dims.iter().product();
            let t = Tensor::from_vec(crate::gaussian(&mut rng, n), dims.as_slice(), &Device::Cpu)
                .unwrap();
            (*name, QTensor::quantize(&t, GgmlDType::F32).unwrap())
        })
        .collect();
    let refs: Vec<(&str, &QTensor)> = qs.iter().map(|(n, q)| (*n, q)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta, &refs).unwrap();
    let mut f = std::fs::File::open(path).unwrap();
    gguf_file::Content::read(&mut f).unwrap().tensor_data_offset as usize
}
