//! A Hugging Face checkpoint through `fp8nsa quantize` and back into the decoder: fp8 layers
//! are picked up from `quantization_config`, `modules_to_not_convert` stays dense.

use candle_core::{DType, Tensor};
use fp8nsa::models::{LinearKind, Llama, LlamaConfig, Model, ModelOptions, Weights};
use fp8nsa::{ActQuant, Fp8BlockWeight, ScaleDType};
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

fn rel(a: &Tensor, b: &Tensor) -> f32 {
    let sq = |t: &Tensor| {
        t.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    (sq(&(a - b).unwrap()) / sq(a)).sqrt()
}

/// Qwen3-FP8 stores `weight_scale_inv` in bf16 (some checkpoints in f16): `fp8nsa quantize
/// --scale-dtype bf16` writes that layout, and checkpoints with bf16 or f16 scales load with
/// their scale values widened exactly.
#[test]
fn bf16_and_f16_scales_are_written_and_loaded_exactly() {
    let cfg = LlamaConfig {
        num_hidden_layers: 2,
        ..LlamaConfig::tiny()
    };
    let src = tempfile::tempdir().unwrap();
    write_hf(src.path(), &cfg);
    let convert = |scale_dtype| {
        let dst = tempfile::tempdir().unwrap();
        let opts = QuantizeOptions {
            scale_dtype,
            ..QuantizeOptions::default()
        };
        quantize_checkpoint(src.path(), dst.path(), &opts, &mut |_, _| {}).unwrap();
        dst
    };
    let f32_dir = convert(ScaleDType::F32);
    let bf16_dir = convert(ScaleDType::Bf16);
    let file = |d: &tempfile::TempDir| d.path().join("model.safetensors");
    let scale = "model.layers.0.mlp.down_proj.weight_scale_inv";
    let bytes = std::fs::read(file(&bf16_dir)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor(scale).unwrap().dtype(), safetensors::Dtype::BF16);
    let bytes = std::fs::read(file(&f32_dir)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor(scale).unwrap().dtype(), safetensors::Dtype::F32);

    // the f32 checkpoint with its scales narrowed to f16, as some checkpoints ship them (the
    // weights' scales here, ~1e-4, are normal f16 numbers)
    let f16_dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        f32_dir.path().join("config.json"),
        f16_dir.path().join("config.json"),
    )
    .unwrap();
    let mut tensors =
        candle_core::safetensors::load(file(&f32_dir), &candle_core::Device::Cpu).unwrap();
    for (name, t) in tensors.iter_mut() {
        if name.ends_with("_scale_inv") {
            *t = t.to_dtype(DType::F16).unwrap();
        }
    }
    candle_core::safetensors::save(&tensors, file(&f16_dir)).unwrap();
    let want_f16: Vec<f32> = tensors[scale]
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();

    let ids: Vec<u32> = (0..24)
        .map(|i| (i * 7 + 3) % cfg.vocab_size as u32)
        .collect();
    let (_, dense_w) = Weights::load_hf_dir(src.path()).unwrap();
    let dense = Llama::new(&cfg, &dense_w, &ModelOptions::default()).unwrap();
    let reference = dense.forward(&ids, &mut dense.new_cache()).unwrap();
    // W8A16, so the comparison sees the weights alone (a W8A8 model's activation codes flip
    // under any perturbation, which would hide the scales' effect)
    let w8a16 = w8a16();
    let (_, w32) = Weights::load_hf_dir(f32_dir.path()).unwrap();
    let m32 = Llama::new(&cfg, &w32, &w8a16).unwrap();
    let base = m32.forward(&ids, &mut m32.new_cache()).unwrap();
    let module = "model.layers.0.mlp.down_proj";
    for (dir, want_scales) in [(&bf16_dir, None), (&f16_dir, Some(&want_f16))] {
        let (_, w) = Weights::load_hf_dir(dir.path()).unwrap();
        let (_, scales, block) = w.fp8(module).unwrap().expect("stored as fp8");
        assert_eq!(block, [128, 128]);
        let got: Vec<f32> = scales.flatten_all().unwrap().to_vec1().unwrap();
        let m = Llama::new(&cfg, &w, &w8a16).unwrap();
        assert_eq!(m.fp8_layer_count(), 2 * 7);
        let logits = m.forward(&ids, &mut m.new_cache()).unwrap();
        match want_scales {
            // f16: the f32 checkpoint's codes, scales off by at most f16's half step (2^-12)
            Some(want) => {
                assert_eq!(&got, want);
                let r = rel(&base, &logits);
                assert!(r > 0.0 && r < 2e-3, "f16 scales vs f32 scales: {r}");
            }
            // bf16: its own codes for its rounded-up scales, as accurate as f32 scales
            None => {
                assert!(got.iter().all(|s| s.to_bits() & 0xffff == 0 && *s > 0.0));
                let (r, r32) = (rel(&reference, &logits), rel(&reference, &base));
                assert!(
                    r < 0.2 && r < 1.5 * r32,
                    "bf16 scales vs dense: {r} (f32: {r32})"
                );
            }
        }
    }
}

/// W8A16: stored fp8 weights, activations unquantized, so a model compares tightly with an f64
/// forward on the dequantized weights.
fn w8a16() -> ModelOptions {
    ModelOptions {
        linear: LinearKind::Fp8 {
            block: [128, 128],
            act: ActQuant::None,
        },
        ..Default::default()
    }
}

/// Tensor `name` of a loaded checkpoint in f64, fp8 weights dequantized.
fn dequantized(w: &Weights, name: &str) -> Vec<f64> {
    let module = name.strip_suffix(".weight").unwrap_or(name);
    let t = match w.fp8(module).unwrap() {
        Some((data, scales, block)) => Fp8BlockWeight::from_parts(data, scales, block)
            .unwrap()
            .dequantize(DType::F32)
            .unwrap(),
        None => w.get(name).unwrap(),
    };
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `model`'s logits for `tokens` against the f64 forward's `want [T, vocab]` (relative
/// Frobenius error under 1e-4): one prefill of all tokens, then the same positions through the
/// cache, `prefill` tokens at once and one per step after.
fn check_against_f64(model: &Model, want: &[f64], tokens: &[u32], prefill: usize) {
    let rel_to_want = |got: &[f32], want: &[f64]| {
        let num: f64 = got
            .iter()
            .zip(want)
            .map(|(g, w)| (*g as f64 - w).powi(2))
            .sum();
        let den: f64 = want.iter().map(|w| w * w).sum();
        (num / den).sqrt()
    };
    let logits = |t: &[u32], cache: &mut fp8nsa::models::Cache| -> Vec<f32> {
        let l = model.forward(t, cache).unwrap();
        l.flatten_all().unwrap().to_vec1().unwrap()
    };
    let r = rel_to_want(&logits(tokens, &mut model.new_cache()), want);
    assert!(r < 1e-4, "prefill vs f64 reference: {r}");
    let v = want.len() / tokens.len();
    let mut cache = model.new_cache();
    logits(&tokens[..prefill], &mut cache);
    for (i, &t) in tokens.iter().enumerate().skip(prefill) {
        let r = rel_to_want(&logits(&[t], &mut cache), &want[i * v..(i + 1) * v]);
        assert!(r < 1e-4, "decode at {i} vs f64 reference: {r}");
    }
}

/// A row-major `[rows, cols]` f64 matrix times a vector: `W x`.
fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks_exact(x.len())
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * r * g).collect()
}

/// Qwen3's forward in f64 from plain weights, written from the architecture's definition
/// (embedding; per layer RMSNorm, q/k/v, per-head q/k RMSNorm, RoPE on halves, causal GQA
/// softmax attention, o; RMSNorm, SiLU(gate) * up, down — or, in a Qwen3-MoE layer, the top-k
/// experts' SwiGLU weighted by the router's softmax; final RMSNorm, tied head): logits
/// `[T, vocab]` for `tokens` from position 0.
/// RoPE's inverse frequencies for `cfg`: `theta^(-2i/d)`, or with `llama3` scaling Meta's
/// published rule (wavelengths under `orig / high_freq_factor` kept, over `orig /
/// low_freq_factor` divided by `factor`, smoothly interpolated between).
fn inv_freqs(cfg: &LlamaConfig) -> Vec<f64> {
    let hd = cfg.head_dim();
    let plain = (0..hd / 2).map(|i| cfg.rope_theta.powf(-2.0 * i as f64 / hd as f64));
    let Some(s) = cfg.rope_scaling.as_ref() else {
        return plain.collect();
    };
    assert_eq!(
        s["rope_type"], "llama3",
        "the reference knows llama3 scaling only"
    );
    let f = |k: &str| s[k].as_f64().unwrap();
    let (factor, low, high, orig) = (
        f("factor"),
        f("low_freq_factor"),
        f("high_freq_factor"),
        f("original_max_position_embeddings"),
    );
    plain
        .map(|fr| {
            let wavelen = 2.0 * std::f64::consts::PI / fr;
            if wavelen < orig / high {
                fr
            } else if wavelen > orig / low {
                fr / factor
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                (1.0 - smooth) * fr / factor + smooth * fr
            }
        })
        .collect()
}

/// The f64 forward of a Llama-family checkpoint (`qk_norm`: Qwen3's per-head q/k RMSNorm; MoE
/// layers as `cfg.moe` says; RoPE per [`inv_freqs`]).
fn qwen3_reference(cfg: &LlamaConfig, w: &dyn Fn(&str) -> Vec<f64>, tokens: &[u32]) -> Vec<f64> {
    reference_forward(cfg, w, tokens, true)
}

fn reference_forward(
    cfg: &LlamaConfig,
    w: &dyn Fn(&str) -> Vec<f64>,
    tokens: &[u32],
    qk_norm: bool,
) -> Vec<f64> {
    let (h, hd) = (cfg.hidden_size, cfg.head_dim());
    let freqs = inv_freqs(cfg);
    let (hq, hkv) = (cfg.num_attention_heads, cfg.kv_heads());
    let eps = cfg.rms_norm_eps;
    let embed = w("model.embed_tokens.weight");
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| embed[t as usize * h..(t as usize + 1) * h].to_vec())
        .collect();
    let rope = |v: &mut [f64], pos: usize| {
        for i in 0..hd / 2 {
            let a = pos as f64 * freqs[i];
            let (x1, x2) = (v[i], v[i + hd / 2]);
            v[i] = x1 * a.cos() - x2 * a.sin();
            v[i + hd / 2] = x2 * a.cos() + x1 * a.sin();
        }
    };
    for l in 0..cfg.num_hidden_layers {
        let p = |n: &str| w(&format!("model.layers.{l}.{n}"));
        let (wq, wk, wv, wo) = (
            p("self_attn.q_proj.weight"),
            p("self_attn.k_proj.weight"),
            p("self_attn.v_proj.weight"),
            p("self_attn.o_proj.weight"),
        );
        let (qn, kn) = if qk_norm {
            (p("self_attn.q_norm.weight"), p("self_attn.k_norm.weight"))
        } else {
            (vec![1.0; hd], vec![1.0; hd])
        };
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let y = rms_norm(x, &p("input_layernorm.weight"), eps);
            let (mut q, mut k) = (matvec(&wq, &y), matvec(&wk, &y));
            for head in q.chunks_exact_mut(hd).filter(|_| qk_norm) {
                let n = rms_norm(head, &qn, eps);
                head.copy_from_slice(&n);
            }
            for head in k.chunks_exact_mut(hd).filter(|_| qk_norm) {
                let n = rms_norm(head, &kn, eps);
                head.copy_from_slice(&n);
            }
            for head in q.chunks_exact_mut(hd).chain(k.chunks_exact_mut(hd)) {
                rope(head, pos);
            }
            qs.push(q);
            ks.push(k);
            vs.push(matvec(&wv, &y));
        }
        for (i, x) in xs.iter_mut().enumerate() {
            let mut o = vec![0f64; hq * hd];
            for head in 0..hq {
                let kvh = head / (hq / hkv);
                let q = &qs[i][head * hd..(head + 1) * hd];
                let s: Vec<f64> = (0..=i)
                    .map(|j| {
                        let k = &ks[j][kvh * hd..(kvh + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    let v = &vs[j][kvh * hd..(kvh + 1) * hd];
                    for (d, vv) in v.iter().enumerate() {
                        o[head * hd + d] += ej / z * vv;
                    }
                }
            }
            for (xv, a) in x.iter_mut().zip(matvec(&wo, &o)) {
                *xv += a;
            }
            let y = rms_norm(x, &p("post_attention_layernorm.weight"), eps);
            let swiglu = |pre: &str| {
                let g = matvec(&p(&format!("{pre}gate_proj.weight")), &y);
                let u = matvec(&p(&format!("{pre}up_proj.weight")), &y);
                let a: Vec<f64> = g
                    .iter()
                    .zip(&u)
                    .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                    .collect();
                matvec(&p(&format!("{pre}down_proj.weight")), &a)
            };
            let m = &cfg.moe;
            let out = if m.is_moe_layer(l) {
                // softmax over the router's logits, the top k, renormalized if asked
                let logits = matvec(&p("mlp.gate.weight"), &y);
                let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = logits.iter().map(|v| (v - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                let mut order: Vec<usize> = (0..e.len()).collect();
                order.sort_by(|&a, &b| e[b].total_cmp(&e[a]));
                let top = &order[..m.num_experts_per_tok];
                let zk: f64 = top.iter().map(|&i| e[i]).sum();
                let mut acc = vec![0f64; h];
                for &ex in top {
                    let wgt = if m.norm_topk_prob {
                        e[ex] / zk
                    } else {
                        e[ex] / z
                    };
                    for (a, v) in acc.iter_mut().zip(swiglu(&format!("mlp.experts.{ex}."))) {
                        *a += wgt * v;
                    }
                }
                acc
            } else {
                swiglu("mlp.")
            };
            for (xv, d) in x.iter_mut().zip(out) {
                *xv += d;
            }
        }
    }
    let norm = w("model.norm.weight");
    xs.iter()
        .flat_map(|x| matvec(&embed, &rms_norm(x, &norm, eps)))
        .collect()
}

/// A random Qwen3 checkpoint in the published layout (bf16 tensors, per-head `q_norm` /
/// `k_norm`, explicit `head_dim` with heads x head_dim != hidden, a non-aligned intermediate
/// size), quantized the way Qwen ships it (bf16 `weight_scale_inv`), loaded through
/// `Model::load_hf` and run W8A16: its logits against an f64 forward on the dequantized
/// weights, for prefill and for token-by-token decode.
#[test]
fn qwen3_fp8_checkpoint_matches_an_f64_reference() {
    let cfg = LlamaConfig {
        vocab_size: 300,
        hidden_size: 256,
        intermediate_size: 320,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: Some(128),
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        ..LlamaConfig::tiny()
    };
    let src = tempfile::tempdir().unwrap();
    let w = Weights::random(&cfg, 11).unwrap();
    let mut map: std::collections::HashMap<String, Tensor> = w
        .names()
        .map(|n| (n.clone(), w.get(n).unwrap().to_dtype(DType::BF16).unwrap()))
        .collect();
    for l in 0..cfg.num_hidden_layers {
        for (j, n) in ["q_norm", "k_norm"].iter().enumerate() {
            let g: Vec<f32> = (0..128)
                .map(|i| 1.0 + 0.3 * ((i * 7 + l * 5 + j * 3) as f32).sin())
                .collect();
            let t = Tensor::new(g, &candle_core::Device::Cpu).unwrap();
            map.insert(
                format!("model.layers.{l}.self_attn.{n}.weight"),
                t.to_dtype(DType::BF16).unwrap(),
            );
        }
    }
    candle_core::safetensors::save(&map, src.path().join("model.safetensors")).unwrap();
    let json = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": 2,
        "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": true,
        "attention_bias": false, "torch_dtype": "bfloat16", "hidden_act": "silu"
    });
    std::fs::write(src.path().join("config.json"), json.to_string()).unwrap();
    let dst = tempfile::tempdir().unwrap();
    let opts = QuantizeOptions {
        scale_dtype: ScaleDType::Bf16,
        ..QuantizeOptions::default()
    };
    quantize_checkpoint(src.path(), dst.path(), &opts, &mut |_, _| {}).unwrap();

    let w8a16 = w8a16();
    let model = Model::load_hf(dst.path(), &w8a16).unwrap();
    assert_eq!(model.model_type(), "qwen3");
    assert_eq!(model.llama().fp8_layer_count(), 2 * 7);

    let (_, qw) = Weights::load_hf_dir(dst.path()).unwrap();
    let get = |name: &str| dequantized(&qw, name);
    let tokens: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % 300).collect();
    let want = qwen3_reference(&cfg, &get, &tokens);
    check_against_f64(&model, &want, &tokens, 5);
}

#[test]
fn unknown_model_types_are_refused_with_the_supported_list() {
    let cfg = LlamaConfig {
        num_hidden_layers: 1,
        ..LlamaConfig::tiny()
    };
    let dir = tempfile::tempdir().unwrap();
    write_hf(dir.path(), &cfg);
    let path = dir.path().join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    // write_hf's config has no model_type: that is an error too
    let e = Model::load_hf(dir.path(), &ModelOptions::default()).unwrap_err();
    assert!(
        matches!(
            e,
            fp8nsa::models::Error::Invalid {
                arg: "model_type",
                ..
            }
        ),
        "{e}"
    );
    for (t, ok) in [("llama", true), ("mixtral", false), ("qwen3", false)] {
        json["model_type"] = t.into();
        std::fs::write(&path, json.to_string()).unwrap();
        let r = Model::load_hf(dir.path(), &ModelOptions::default());
        match (ok, r) {
            (true, Ok(m)) => assert_eq!(m.model_type(), t),
            (false, Err(fp8nsa::models::Error::Invalid { arg, msg })) => {
                // an unknown type names the supported ones; qwen3 without q/k norms is refused
                assert!(arg == "model_type" || arg == "weights", "{t}: {arg}: {msg}");
                if arg == "model_type" {
                    assert!(msg.contains("llama, qwen3"), "{msg}");
                }
            }
            (_, r) => panic!("{t}: {:?}", r.map(|m| m.model_type().to_string())),
        }
    }
}

/// A random Qwen3-MoE checkpoint in the published layout (router `mlp.gate.weight`, experts
/// `mlp.experts.{e}.{gate,up,down}_proj`, a dense layer through `mlp_only_layers`, expert width
/// not a multiple of the block), quantized by `fp8nsa quantize` (router, norms and embeddings
/// kept, bf16 scales), loaded by `Model::load_hf` and run W8A16 against the f64 forward; the
/// dense source runs its experts as a per-expert loop, against the f64 forward too.
#[test]
fn qwen3_moe_fp8_checkpoint_matches_an_f64_reference() {
    let mut rng = fp8nsa_test_support::rng("qwen3_moe_checkpoint");
    let (e, k_top, mi) = (4usize, 2usize, 192usize);
    let cfg = LlamaConfig {
        vocab_size: 300,
        hidden_size: 256,
        intermediate_size: 320,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: Some(64),
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        moe: fp8nsa::models::MoeConfig {
            num_experts: e,
            num_experts_per_tok: k_top,
            moe_intermediate_size: mi,
            norm_topk_prob: true,
            decoder_sparse_step: Some(1),
            mlp_only_layers: vec![1],
        },
        ..LlamaConfig::tiny()
    };
    let dense_cfg = LlamaConfig {
        moe: Default::default(),
        ..cfg.clone()
    };
    let w = Weights::random(&dense_cfg, 21).unwrap();
    let mut map: std::collections::HashMap<String, Tensor> = w
        .names()
        .filter(|n| !n.starts_with("model.layers.0.mlp."))
        .map(|n| (n.clone(), w.get(n).unwrap().to_dtype(DType::BF16).unwrap()))
        .collect();
    let mut put = |name: String, dims: &[usize], std: f32| {
        let v: Vec<f32> = fp8nsa_test_support::gaussian(&mut rng, dims.iter().product())
            .iter()
            .map(|x| x * std)
            .collect();
        let t = Tensor::from_vec(v, dims, &candle_core::Device::Cpu).unwrap();
        map.insert(name, t.to_dtype(DType::BF16).unwrap());
    };
    // a router with well separated logits, so f32 and f64 route alike
    put("model.layers.0.mlp.gate.weight".into(), &[e, 256], 0.5);
    for ex in 0..e {
        let p = format!("model.layers.0.mlp.experts.{ex}");
        put(format!("{p}.gate_proj.weight"), &[mi, 256], 0.05);
        put(format!("{p}.up_proj.weight"), &[mi, 256], 0.05);
        put(format!("{p}.down_proj.weight"), &[256, mi], 0.05);
    }
    // Qwen3's per-head q/k norms, at their initial value
    for l in 0..2 {
        for n in ["q_norm", "k_norm"] {
            let t = Tensor::ones(64, DType::BF16, &candle_core::Device::Cpu).unwrap();
            map.insert(format!("model.layers.{l}.self_attn.{n}.weight"), t);
        }
    }
    let src = tempfile::tempdir().unwrap();
    candle_core::safetensors::save(&map, src.path().join("model.safetensors")).unwrap();
    let json = serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 300, "hidden_size": 256, "intermediate_size": 320,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": true,
        "num_experts": e, "num_experts_per_tok": k_top, "moe_intermediate_size": mi,
        "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [1],
        "torch_dtype": "bfloat16"
    });
    std::fs::write(src.path().join("config.json"), json.to_string()).unwrap();
    let dst = tempfile::tempdir().unwrap();
    let opts = QuantizeOptions {
        scale_dtype: ScaleDType::Bf16,
        ..QuantizeOptions::default()
    };
    let report = quantize_checkpoint(src.path(), dst.path(), &opts, &mut |_, _| {}).unwrap();
    assert!(report
        .not_converted
        .contains(&"model.layers.0.mlp.gate".to_string()));
    assert!(report
        .converted
        .contains(&"model.layers.0.mlp.experts.3.down_proj.weight".to_string()));

    let w8a16 = w8a16();
    let model = Model::load_hf(dst.path(), &w8a16).unwrap();
    assert_eq!(model.model_type(), "qwen3_moe");
    // attention 4 x 2 layers, 3 x 4 experts, one dense MLP
    assert_eq!(model.llama().fp8_layer_count(), 8 + 12 + 3);

    let (qcfg, qw) = Weights::load_hf_dir(dst.path()).unwrap();
    assert_eq!(qcfg.moe, cfg.moe);
    let get = |name: &str| dequantized(&qw, name);
    let tokens: Vec<u32> = (0..7).map(|i| (i * 41 + 3) % 300).collect();
    let want = qwen3_reference(&qcfg, &get, &tokens);
    check_against_f64(&model, &want, &tokens, 4);
    // the bf16 source with dense experts: the per-expert loop, against the f64 forward on the
    // source weights
    let dense = Model::load_hf(src.path(), &ModelOptions::default()).unwrap();
    assert_eq!(dense.llama().fp8_layer_count(), 0);
    let (scfg, sw) = Weights::load_hf_dir(src.path()).unwrap();
    let get = |name: &str| dequantized(&sw, name);
    check_against_f64(&dense, &qwen3_reference(&scfg, &get, &tokens), &tokens, 4);
}

/// A random Llama 3.1-style checkpoint (`rope_scaling` of type `llama3`, with
/// `original_max_position_embeddings` small enough that the test's positions and head
/// frequencies cover all three of the rule's regions), quantized with f32 scales, loaded by
/// `Model::load_hf` and run W8A16 against the f64 forward with the published scaling rule.
#[test]
fn llama3_rope_scaled_fp8_checkpoint_matches_an_f64_reference() {
    let scaling = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    let cfg = LlamaConfig {
        vocab_size: 300,
        hidden_size: 256,
        intermediate_size: 320,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: Some(64),
        rms_norm_eps: 1e-5,
        rope_theta: 500_000.0,
        rope_scaling: Some(scaling.clone()),
        ..LlamaConfig::tiny()
    };
    // the rule keeps, interpolates and divides some of this head's frequencies
    let (plain, scaled) = (
        inv_freqs(&LlamaConfig {
            rope_scaling: None,
            ..cfg.clone()
        }),
        inv_freqs(&cfg),
    );
    let kept = plain.iter().zip(&scaled).filter(|(a, b)| a == b).count();
    let divided = plain
        .iter()
        .zip(&scaled)
        .filter(|(a, b)| **a == *b * 8.0)
        .count();
    assert!(kept > 0 && divided > 0 && kept + divided < plain.len());

    let src = tempfile::tempdir().unwrap();
    let w = Weights::random(&cfg, 13).unwrap();
    // q and k 8x larger than the rest: peaked attention, so positions (and RoPE) matter
    let map: std::collections::HashMap<String, Tensor> = w
        .names()
        .map(|n| {
            let t = w.get(n).unwrap();
            let qk = n.ends_with("q_proj.weight") || n.ends_with("k_proj.weight");
            let t = if qk { (t * 8.0).unwrap() } else { t };
            (n.clone(), t.to_dtype(DType::BF16).unwrap())
        })
        .collect();
    candle_core::safetensors::save(&map, src.path().join("model.safetensors")).unwrap();
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 300, "hidden_size": 256, "intermediate_size": 320,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": true,
        "rope_scaling": scaling, "torch_dtype": "bfloat16", "hidden_act": "silu"
    });
    std::fs::write(src.path().join("config.json"), json.to_string()).unwrap();
    let dst = tempfile::tempdir().unwrap();
    quantize_checkpoint(
        src.path(),
        dst.path(),
        &QuantizeOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();

    let model = Model::load_hf(dst.path(), &w8a16()).unwrap();
    assert_eq!(model.model_type(), "llama");
    assert_eq!(model.llama().fp8_layer_count(), 2 * 7);
    let (qcfg, qw) = Weights::load_hf_dir(dst.path()).unwrap();
    assert_eq!(qcfg.rope_scaling, cfg.rope_scaling);
    let get = |name: &str| dequantized(&qw, name);
    let tokens: Vec<u32> = (0..9).map(|i| (i * 53 + 7) % 300).collect();
    let want = reference_forward(&qcfg, &get, &tokens, false);
    check_against_f64(&model, &want, &tokens, 5);
    // the same checkpoint without its scaling is measurably another model
    let unscaled = reference_forward(
        &LlamaConfig {
            rope_scaling: None,
            ..qcfg.clone()
        },
        &get,
        &tokens,
        false,
    );
    let diff: f64 = want.iter().zip(&unscaled).map(|(a, b)| (a - b).abs()).sum();
    assert!(
        diff > 1e-3 * want.iter().map(|a| a.abs()).sum::<f64>(),
        "{diff}"
    );
}
