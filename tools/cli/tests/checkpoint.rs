//! A Hugging Face checkpoint through `fp8nsa quantize` and back into the decoder: fp8 layers
//! are picked up from `quantization_config`, `modules_to_not_convert` stays dense.

use candle_core::{DType, Tensor};
use fp8nsa::models::{Llama, LlamaConfig, ModelOptions, Weights};
use fp8nsa_cli::convert::{quantize_checkpoint, QuantizeOptions};

fn write_hf(dir: &std::path::Path, cfg: &LlamaConfig) {
    let w = Weights::random(cfg, 5).unwrap();
    let map: std::collections::HashMap<String, Tensor> = w
        .names()
        .map(|n| (n.clone(), w.get(n).unwrap().to_dtype(DType::BF16).unwrap()))
        .collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.kv_heads(),
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": true
    });
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
}

#[test]
fn quantized_hf_checkpoint_loads_as_fp8_and_matches_dense() {
    let cfg = LlamaConfig {
        num_hidden_layers: 2,
        ..LlamaConfig::tiny()
    };
    let src = tempfile::tempdir().unwrap();
    let dst = tempfile::tempdir().unwrap();
    write_hf(src.path(), &cfg);
    // keep layer 1's MLP dense, as a checkpoint's modules_to_not_convert would
    let opts = QuantizeOptions {
        exclude: "(embed|lm_head|norm|layers\\.1\\.mlp)".into(),
        ..QuantizeOptions::default()
    };
    let report = quantize_checkpoint(src.path(), dst.path(), &opts, &mut |_, _| {}).unwrap();
    assert_eq!(report.converted.len(), 2 * 7 - 3);

    let (dcfg, dense_w) = Weights::load_hf_dir(src.path()).unwrap();
    let (qcfg, fp8_w) = Weights::load_hf_dir(dst.path()).unwrap();
    assert_eq!(dcfg, qcfg);
    assert_eq!(fp8_w.fp8_block, Some([128, 128]));
    assert!(fp8_w
        .modules_to_not_convert
        .contains(&"model.layers.1.mlp.up_proj".to_string()));
    let dense = Llama::new(&dcfg, &dense_w, &ModelOptions::default()).unwrap();
    // LinearKind::Dense still loads the stored fp8 weights as fp8
    let fp8 = Llama::new(&qcfg, &fp8_w, &ModelOptions::default()).unwrap();
    assert_eq!(fp8.fp8_layer_count(), 11);
    assert_eq!(dense.fp8_layer_count(), 0);

    let ids: Vec<u32> = (0..40)
        .map(|i| (i * 13 + 5) % cfg.vocab_size as u32)
        .collect();
    let a = dense.forward(&ids, &mut dense.new_cache()).unwrap();
    let b = fp8.forward(&ids, &mut fp8.new_cache()).unwrap();
    let rel = ((&a - &b)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        / a.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap())
    .sqrt();
    assert!(rel > 0.0 && rel < 0.2, "fp8 checkpoint vs dense: {rel}");
}
