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
