//! GGUF files a server may be handed: malformed metadata is an error, never a panic inside the
//! reader (issue: reliability, item 3).

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use fp8nsa_models::*;

/// A small GGUF file with `general.alignment` set to `alignment` (or absent).
fn gguf_with(alignment: Option<gguf_file::Value>) -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "fp8nsa-gguf-{}-{}.gguf",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let arch = gguf_file::Value::String("llama".into());
    let names: Vec<gguf_file::Value> = (0..3)
        .map(|i| gguf_file::Value::String(format!("tok{i}")))
        .collect();
    let tokens = gguf_file::Value::Array(names);
    let mut meta: Vec<(&str, &gguf_file::Value)> = vec![
        ("general.architecture", &arch),
        ("tokenizer.ggml.tokens", &tokens),
    ];
    if let Some(a) = &alignment {
        meta.push(("general.alignment", a));
    }
    let t = Tensor::ones((4, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, GgmlDType::F32).unwrap();
    let mut f = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut f, &meta, &[("token_embd.weight", &q)]).unwrap();
    path
}

#[test]
fn zero_alignment_is_an_error_not_a_panic() {
    use gguf_file::Value as V;
    for zero in [
        V::U8(0),
        V::I8(0),
        V::U16(0),
        V::I16(0),
        V::U32(0),
        V::I32(0),
    ] {
        let what = format!("{zero:?}");
        let path = gguf_with(Some(zero));
        let e = Weights::load_gguf(&path, &mut |_, _| {})
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(&e, Error::File { msg, .. } if msg.contains("general.alignment is 0")),
            "{what}: {e}"
        );
        let _ = std::fs::remove_file(path);
    }
    // a legal alignment, or none, gets past this check (to the config, which this file lacks)
    for a in [Some(V::U32(32)), Some(V::U64(0)), None] {
        let what = format!("{a:?}");
        let path = gguf_with(a);
        if let Err(e) = Weights::load_gguf(&path, &mut |_, _| {}) {
            assert!(!e.to_string().contains("alignment"), "{what}: {e}");
        }
        let _ = std::fs::remove_file(path);
    }
}

fn temp_gguf(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("fp8nsa-gguf-{tag}-{}.gguf", std::process::id()))
}

/// A tensor name written twice (candle's reader keeps the last silently) is an error naming
/// the count; so is a tensor whose dims are huge, or whose product wraps, before anything is
/// allocated from them (issue: reliability, items 4 and 13).
#[test]
fn repeated_names_and_impossible_dims_are_errors() {
    let arch = gguf_file::Value::String("llama".into());
    let meta: Vec<(&str, &gguf_file::Value)> = vec![("general.architecture", &arch)];
    let t = Tensor::ones((4, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, GgmlDType::F32).unwrap();

    let path = temp_gguf("dup");
    let mut f = std::fs::File::create(&path).unwrap();
    gguf_file::write(
        &mut f,
        &meta,
        &[("blk.0.attn_q.weight", &q), ("blk.0.attn_q.weight", &q)],
    )
    .unwrap();
    drop(f);
    let e = Weights::load_gguf(&path, &mut |_, _| {})
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(&e, Error::File { msg, .. } if msg.contains("declares 2 tensors but 1 distinct")),
        "{e}"
    );
    let _ = std::fs::remove_file(&path);

    // the dims of the one tensor, patched: [32, 4] -> [huge, 4] and [2^63, 4] (bytes wrap)
    let mut f = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut f, &meta, &[("token_embd.weight", &q)]).unwrap();
    drop(f);
    let bytes = std::fs::read(&path).unwrap();
    let name = b"token_embd.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    // n_dims (u32) then the dims (u64 each, innermost first)
    assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 2);
    for huge in [1u64 << 40, 1 << 63, u64::MAX] {
        let mut b = bytes.clone();
        b[at + 4..at + 12].copy_from_slice(&huge.to_le_bytes());
        std::fs::write(&path, &b).unwrap();
        let e = Weights::load_gguf(&path, &mut |_, _| {})
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(&e, Error::File { msg, .. } if msg.contains("token_embd.weight") && msg.contains("does not fit")),
            "{huge}: {e}"
        );
    }
    let _ = std::fs::remove_file(&path);
}

/// Sizes a GGUF file claims are not allocated from (issue: reliability, item 4): a
/// `context_length` of 0xFFFFFFFF loads and gives the logits of an honest 4096 (RoPE tables
/// follow the positions in use), and a `rope.dimension_count` of 2^30 is an error naming the
/// head dim, checked against the weights, not an allocation abort.
#[test]
fn absurd_context_and_rope_sizes_in_gguf_metadata() {
    use rand::Rng;
    let seed: u64 = fp8nsa_test_support::rng("gguf_absurd_sizes").random();
    let logits = |context: u32, rope: u32| -> Result<Vec<f32>> {
        let path = temp_gguf(&format!("ctx{context}-rope{rope}"));
        fp8nsa_test_support::gguf::tiny_llama(&path, seed, context, rope);
        let out = (|| {
            let (cfg, w, _) = Weights::load_gguf(&path, &mut |_, _| {})?;
            let model = Llama::new(&cfg, &w, &ModelOptions::default())?;
            let mut cache = model.new_cache();
            let y = model.forward(&[1, 5, 2, 7], &mut cache)?;
            Ok(y.flatten_all()?.to_vec1::<f32>()?)
        })();
        let _ = std::fs::remove_file(path);
        out
    };
    let honest = logits(4096, 16).unwrap();
    assert!(honest.iter().all(|x| x.is_finite()));
    assert_eq!(logits(u32::MAX, 16).unwrap(), honest);
    let e = logits(4096, 1 << 30).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Invalid {
                arg: "head_dim",
                ..
            }
        ),
        "{e}"
    );
}
