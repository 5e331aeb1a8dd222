//! DeepSeek-V3 / V3.2 through `Model::load_hf` on generated checkpoints in the published layout
//! (fp8 e4m3 projections with `weight_scale_inv` over partial 128x128 blocks, bf16 norms,
//! router, embeddings and head, an F32 router bias, sharded with an index, the MTP layer
//! present), against an f64 forward written here from the published definitions, without the
//! latent absorption the model uses.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use fp8nsa_models::{Cache, DeepSeekConfig, Error, Model, ModelOptions};
use fp8nsa_ops::Fp8BlockWeight;
use fp8nsa_test_support::{e4m3_value, f64s};

/// The tiny config with a hidden size that leaves partial fp8 blocks everywhere.
fn config(topk: Option<usize>) -> DeepSeekConfig {
    let mut c = DeepSeekConfig {
        hidden_size: 200,
        ..DeepSeekConfig::tiny()
    };
    c.index_topk = topk;
    if topk.is_none() {
        c.index_n_heads = None;
        c.index_head_dim = None;
    }
    c
}

/// Whether the published checkpoints store `name` (a `.weight`) in fp8.
fn is_fp8(name: &str) -> bool {
    let Some(module) = name.strip_suffix(".weight") else {
        return false;
    };
    let projs = [
        "q_a_proj",
        "q_b_proj",
        "q_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "indexer.wq_b",
        "indexer.wk",
    ];
    module.starts_with("model.layers.") && projs.iter().any(|p| module.ends_with(p))
}

/// The stored tensors (what the checkpoint holds) and their f64 values.
struct Ckpt {
    stored: Vec<(String, Tensor)>,
    values: HashMap<String, (Vec<f64>, Vec<usize>)>,
}

fn checkpoint(cfg: &DeepSeekConfig, seed: u64) -> Ckpt {
    checkpoint_with(cfg, seed, &is_fp8)
}

/// [`checkpoint`] with the `.weight`s `fp8` names stored in fp8.
fn checkpoint_with(cfg: &DeepSeekConfig, seed: u64, fp8: &dyn Fn(&str) -> bool) -> Ckpt {
    let w = cfg.random_weights(seed).unwrap();
    let mut names: Vec<String> = w.names().cloned().collect();
    names.sort();
    let (mut stored, mut values) = (Vec::new(), HashMap::new());
    for name in names {
        let t = w.get(&name).unwrap();
        let dims = t.dims().to_vec();
        if fp8(&name) {
            let q = Fp8BlockWeight::quantize(&t, [128, 128]).unwrap();
            // the dequantized value, exactly: code times block scale, in f64
            let bytes: Vec<u8> = q.data().flatten_all().unwrap().to_vec1().unwrap();
            let codes: Vec<f64> = bytes.iter().map(|&b| e4m3_value(b)).collect();
            let scales = f64s(q.scales());
            let sc = q.scales().dims()[1];
            let v: Vec<f64> = codes
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let (r, col) = (i / dims[1], i % dims[1]);
                    c * scales[(r / 128) * sc + col / 128]
                })
                .collect();
            values.insert(name.clone(), (v, dims.clone()));
            let scale = name.replace(".weight", ".weight_scale_inv");
            let data = Tensor::from_raw_buffer(&bytes, DType::F8E4M3, &dims, &Device::Cpu).unwrap();
            stored.push((name, data));
            stored.push((scale, q.scales().to_dtype(DType::F32).unwrap()));
        } else if name.ends_with("e_score_correction_bias") {
            values.insert(name.clone(), (f64s(&t), dims));
            stored.push((name, t));
        } else {
            let b = t.to_dtype(DType::BF16).unwrap();
            values.insert(name.clone(), (f64s(&b), dims));
            stored.push((name, b));
        }
    }
    Ckpt { stored, values }
}

/// Writes the checkpoint as two shards with an index, plus MTP tensors, under `model_type`.
fn write(dir: &Path, cfg: &DeepSeekConfig, ck: &Ckpt, model_type: &str) {
    let n = cfg.num_hidden_layers;
    let mut shards: [HashMap<String, Tensor>; 2] = [HashMap::new(), HashMap::new()];
    let mut map = serde_json::Map::new();
    for (i, (name, t)) in ck.stored.iter().enumerate() {
        shards[i % 2].insert(name.clone(), t.clone());
        map.insert(
            name.clone(),
            format!("model-0000{}-of-00003.safetensors", i % 2 + 1).into(),
        );
    }
    // the multi-token-prediction module: a third shard the model must not need
    let mtp = Tensor::ones(
        (cfg.hidden_size, 2 * cfg.hidden_size),
        DType::BF16,
        &Device::Cpu,
    )
    .unwrap();
    let mut third = HashMap::new();
    for name in [
        "eh_proj.weight",
        "enorm.weight",
        "self_attn.kv_b_proj.weight",
    ] {
        let full = format!("model.layers.{n}.{name}");
        third.insert(full.clone(), mtp.clone());
        map.insert(full, "model-00003-of-00003.safetensors".into());
    }
    for (i, s) in shards.iter().enumerate() {
        candle_core::safetensors::save(
            s,
            dir.join(format!("model-0000{}-of-00003.safetensors", i + 1)),
        )
        .unwrap();
    }
    candle_core::safetensors::save(&third, dir.join("model-00003-of-00003.safetensors")).unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let mut json = serde_json::to_value(cfg).unwrap();
    json["model_type"] = model_type.into();
    json["num_nextn_predict_layers"] = 1.into();
    json["quantization_config"] = serde_json::json!({"activation_scheme": "dynamic",
        "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]});
    if model_type == "deepseek_v32" {
        json["quantization_config"]["scale_fmt"] = "ue8m0".into();
    }
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
}

fn load(cfg: &DeepSeekConfig, ck: &Ckpt, model_type: &str) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), cfg, ck, model_type);
    let m = Model::load_hf(dir.path(), &ModelOptions::default()).unwrap();
    assert_eq!(m.model_type(), model_type);
    (dir, m)
}

// ---- the f64 reference ----

struct Ref<'a> {
    cfg: &'a DeepSeekConfig,
    v: &'a HashMap<String, (Vec<f64>, Vec<usize>)>,
}

impl Ref<'_> {
    fn w(&self, name: &str) -> &[f64] {
        &self.v.get(name).unwrap_or_else(|| panic!("{name}")).0
    }

    /// `W x` for `W [out, in]`.
    fn lin(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let (w, dims) = self.v.get(&format!("{name}.weight")).unwrap();
        assert_eq!(dims[1], x.len(), "{name}");
        w.chunks(dims[1])
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    }

    fn rms(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ms + self.cfg.rms_norm_eps).sqrt();
        x.iter().zip(self.w(name)).map(|(v, g)| v * r * g).collect()
    }

    fn layer_norm(&self, p: &str, x: &[f64]) -> Vec<f64> {
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let r = 1.0 / (var + 1e-6).sqrt();
        let (g, b) = (self.w(&format!("{p}.weight")), self.w(&format!("{p}.bias")));
        x.iter()
            .enumerate()
            .map(|(i, v)| (v - mean) * r * g[i] + b[i])
            .collect()
    }

    /// YaRN inverse frequencies of the rotated dimensions, from HF's DeepSeek-V3 code's rule.
    fn inv_freq(&self) -> Vec<f64> {
        let d = self.cfg.qk_rope_head_dim as f64;
        let base = self.cfg.rope_theta;
        let rs = self.cfg.rope_scaling.as_ref().unwrap();
        let f = |k: &str| rs[k].as_f64().unwrap();
        let (factor, orig) = (f("factor"), f("original_max_position_embeddings"));
        let corr =
            |rot: f64| d * (orig / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
        let low = corr(f("beta_fast")).floor().max(0.0);
        let mut high = corr(f("beta_slow")).ceil().min(d - 1.0);
        if low == high {
            high += 0.001;
        }
        (0..self.cfg.qk_rope_head_dim / 2)
            .map(|i| {
                let extra = base.powf(-((2 * i) as f64) / d);
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                extra / factor * ramp + extra * (1.0 - ramp)
            })
            .collect()
    }

    /// Rotates `x` (the rotated part only) at `pos`: interleaved pairs `(2i, 2i + 1)` or halves
    /// `(i, i + n / 2)`.
    fn rope(&self, x: &mut [f64], pos: usize, interleaved: bool) {
        let inv = self.inv_freq();
        let half = x.len() / 2;
        for (i, f) in inv.iter().enumerate() {
            let (s, c) = (pos as f64 * f).sin_cos();
            let (a, b) = if interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (x0, x1) = (x[a], x[b]);
            x[a] = x0 * c - x1 * s;
            x[b] = x0 * s + x1 * c;
        }
    }

    fn swiglu(&self, p: &str, x: &[f64]) -> Vec<f64> {
        let g = self.lin(&format!("{p}.gate_proj"), x);
        let u = self.lin(&format!("{p}.up_proj"), x);
        let a: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        self.lin(&format!("{p}.down_proj"), &a)
    }

    fn moe(&self, p: &str, x: &[f64]) -> Vec<f64> {
        let c = self.cfg;
        let e = c.n_routed_experts.unwrap();
        let logits = self.lin(&format!("{p}.mlp.gate"), x);
        let score: Vec<f64> = logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect();
        let bias = self.w(&format!("{p}.mlp.gate.e_score_correction_bias"));
        let choice: Vec<f64> = score.iter().zip(bias).map(|(s, b)| s + b).collect();
        let size = e / c.n_group;
        let top = |v: &[f64], among: Vec<usize>, k: usize| {
            let mut a = among;
            a.sort_by(|&i, &j| v[j].total_cmp(&v[i]).then(i.cmp(&j)));
            a.truncate(k);
            a
        };
        let gs: Vec<f64> = (0..c.n_group)
            .map(|g| {
                let grp = &choice[g * size..(g + 1) * size];
                top(grp, (0..size).collect(), 2)
                    .iter()
                    .map(|&i| grp[i])
                    .sum()
            })
            .collect();
        let groups = top(&gs, (0..c.n_group).collect(), c.topk_group);
        let cand: Vec<usize> = groups
            .iter()
            .flat_map(|&g| g * size..(g + 1) * size)
            .collect();
        let picks = top(&choice, cand, c.num_experts_per_tok.unwrap());
        let sum: f64 = picks.iter().map(|&i| score[i]).sum();
        let mut y = self.swiglu(&format!("{p}.mlp.shared_experts"), x);
        for &i in &picks {
            let wt = score[i] / sum * c.routed_scaling_factor;
            let o = self.swiglu(&format!("{p}.mlp.experts.{i}"), x);
            for (y, o) in y.iter_mut().zip(o) {
                *y += wt * o;
            }
        }
        y
    }

    /// The keys query `t` attends in layer `p` (all causal ones without an indexer).
    fn selected(&self, p: &str, xs: &[Vec<f64>], cqs: &[Vec<f64>], t: usize) -> Vec<usize> {
        let Some(ix) = self.cfg.indexer() else {
            return (0..=t).collect();
        };
        if t < ix.topk {
            return (0..=t).collect();
        }
        let (d, rd) = (ix.head_dim, self.cfg.qk_rope_head_dim);
        let key = |s: usize| {
            let mut k = self.layer_norm(
                &format!("{p}.indexer.k_norm"),
                &self.lin(&format!("{p}.indexer.wk"), &xs[s]),
            );
            self.rope(&mut k[..rd], s, false);
            k
        };
        let q = self.lin(&format!("{p}.indexer.wq_b"), &cqs[t]);
        let w = self.lin(&format!("{p}.indexer.weights_proj"), &xs[t]);
        let mut qs: Vec<Vec<f64>> = q.chunks(d).map(|c| c.to_vec()).collect();
        for qh in &mut qs {
            self.rope(&mut qh[..rd], t, false);
        }
        let score: Vec<f64> = (0..=t)
            .map(|s| {
                let k = key(s);
                qs.iter()
                    .zip(&w)
                    .map(|(qh, wh)| {
                        let dot: f64 = qh.iter().zip(&k).map(|(a, b)| a * b).sum();
                        wh * (ix.heads as f64).powf(-0.5) * dot.max(0.0) * (d as f64).powf(-0.5)
                    })
                    .sum()
            })
            .collect();
        let mut keys: Vec<usize> = (0..=t).collect();
        keys.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
        keys.truncate(ix.topk);
        keys
    }

    fn attention(&self, p: &str, xs: &[Vec<f64>]) -> Vec<Vec<f64>> {
        let c = self.cfg;
        let (h, nope, rd, v, r) = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let cqs: Vec<Vec<f64>> = xs
            .iter()
            .map(|x| {
                self.rms(
                    &format!("{p}.q_a_layernorm.weight"),
                    &self.lin(&format!("{p}.q_a_proj"), x),
                )
            })
            .collect();
        // per token: per-head queries [nope | rope], keys [k_nope | k_pe], values
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (t, x) in xs.iter().enumerate() {
            let q = self.lin(&format!("{p}.q_b_proj"), &cqs[t]);
            let kv = self.lin(&format!("{p}.kv_a_proj_with_mqa"), x);
            let lat = self.rms(&format!("{p}.kv_a_layernorm.weight"), &kv[..r]);
            let mut kpe = kv[r..].to_vec();
            self.rope(&mut kpe, t, true);
            let kvb = self.lin(&format!("{p}.kv_b_proj"), &lat);
            let (mut qt, mut kt, mut vt) = (Vec::new(), Vec::new(), Vec::new());
            for hh in 0..h {
                let mut qh = q[hh * (nope + rd)..(hh + 1) * (nope + rd)].to_vec();
                self.rope(&mut qh[nope..], t, true);
                qt.push(qh);
                let part = &kvb[hh * (nope + v)..(hh + 1) * (nope + v)];
                let mut kh = part[..nope].to_vec();
                kh.extend_from_slice(&kpe);
                kt.push(kh);
                vt.push(part[nope..].to_vec());
            }
            qs.push(qt);
            ks.push(kt);
            vs.push(vt);
        }
        // DeepSeek's rule, from the config's JSON here (not the crate's `softmax_scale`):
        // (nope + rope)^-0.5 · m², m = 0.1 · mscale_all_dim · ln(factor) + 1
        let rs = c.rope_scaling.as_ref().expect("the test configs use YaRN");
        let (all, factor) = (
            rs["mscale_all_dim"].as_f64().unwrap(),
            rs["factor"].as_f64().unwrap(),
        );
        let m = 0.1 * all * factor.ln() + 1.0;
        let scale = ((c.qk_nope_head_dim + c.qk_rope_head_dim) as f64).powf(-0.5) * m * m;
        (0..xs.len())
            .map(|t| {
                let keys = self.selected(p, xs, &cqs, t);
                let mut o = Vec::new();
                for hh in 0..h {
                    let s: Vec<f64> = keys
                        .iter()
                        .map(|&j| {
                            qs[t][hh]
                                .iter()
                                .zip(&ks[j][hh])
                                .map(|(a, b)| a * b)
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    let mut oh = vec![0.0; v];
                    for (pj, &j) in e.iter().zip(&keys) {
                        for (a, b) in oh.iter_mut().zip(&vs[j][hh]) {
                            *a += pj / z * b;
                        }
                    }
                    o.extend(oh);
                }
                self.lin(&format!("{p}.o_proj"), &o)
            })
            .collect()
    }

    fn logits(&self, tokens: &[u32]) -> Vec<Vec<f64>> {
        let c = self.cfg;
        let emb = self.w("model.embed_tokens.weight");
        let hs = c.hidden_size;
        let mut x: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| emb[t as usize * hs..(t as usize + 1) * hs].to_vec())
            .collect();
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let xn: Vec<Vec<f64>> = x
                .iter()
                .map(|v| self.rms(&format!("{p}.input_layernorm.weight"), v))
                .collect();
            let a = self.attention(&format!("{p}.self_attn"), &xn);
            for (x, a) in x.iter_mut().zip(a) {
                for (x, a) in x.iter_mut().zip(a) {
                    *x += a;
                }
                let xn = self.rms(&format!("{p}.post_attention_layernorm.weight"), x);
                // the published rule, not the crate's `is_moe_layer`
                let moe = c.n_routed_experts.is_some_and(|e| e > 0)
                    && l >= c.first_k_dense_replace
                    && l % c.moe_layer_freq == 0;
                let m = if moe {
                    self.moe(&p, &xn)
                } else {
                    self.swiglu(&format!("{p}.mlp"), &xn)
                };
                for (x, m) in x.iter_mut().zip(m) {
                    *x += m;
                }
            }
        }
        x.iter()
            .map(|v| self.lin("lm_head", &self.rms("model.norm.weight", v)))
            .collect()
    }
}

/// `max |dlogit| / rms(logits)` over every position.
fn deviation(got: &Tensor, want: &[Vec<f64>]) -> f64 {
    let got: Vec<Vec<f32>> = got.to_vec2().unwrap();
    let (mut max, mut ss, mut n) = (0f64, 0f64, 0usize);
    for (g, w) in got.iter().zip(want) {
        for (g, w) in g.iter().zip(w) {
            max = max.max((*g as f64 - w).abs());
            ss += w * w;
            n += 1;
        }
    }
    max / (ss / n as f64).sqrt()
}

fn tokens(cfg: &DeepSeekConfig, n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 97 + seed * 31 + 7) % cfg.vocab_size as u32)
        .collect()
}

/// The model's logits for `ids` (one prefill) against the f64 reference's: the largest
/// deviation relative to the logits' rms.
fn against_reference(cfg: &DeepSeekConfig, ck: &Ckpt, model: &Model, ids: &[u32]) -> f64 {
    let got = model.forward(ids, &mut model.new_cache()).unwrap();
    let want = Ref { cfg, v: &ck.values }.logits(ids);
    deviation(&got, &want)
}

#[test]
fn v3_logits_match_the_f64_reference() {
    let cfg = config(None);
    let ck = checkpoint(&cfg, 1);
    let (_dir, model) = load(&cfg, &ck, "deepseek_v3");
    let d = against_reference(&cfg, &ck, &model, &tokens(&cfg, 11, 1));
    eprintln!("max |dlogit| / rms(logits) = {d:.2e}");
    assert!(d < 2e-3, "deviation {d}");
    // every projection but kv_b (absorbed) runs fp8: 4 in attention per layer, the dense MLP's
    // 3, 8 experts' and the shared expert's 3 each
    assert_eq!(model.llama().fp8_layer_count(), 4 * 2 + 3 + 3 * 9);
}

/// A router stored in fp8 (published checkpoints keep it bf16, a converter may not) is read
/// with its block scales, not as raw codes.
#[test]
fn an_fp8_router_is_dequantized_with_its_scales() {
    let cfg = config(None);
    let ck = checkpoint_with(&cfg, 3, &|n| is_fp8(n) || n.ends_with(".mlp.gate.weight"));
    assert!(ck
        .stored
        .iter()
        .any(|(n, t)| n.ends_with(".mlp.gate.weight") && t.dtype() == DType::F8E4M3));
    let (_dir, model) = load(&cfg, &ck, "deepseek_v3");
    let d = against_reference(&cfg, &ck, &model, &tokens(&cfg, 9, 3));
    assert!(d < 2e-3, "deviation {d}");
}

#[test]
fn v32_logits_match_the_f64_reference_with_selection() {
    // 16 tokens, 5 kept: queries 5.. attend a strict subset chosen by the indexer
    let cfg = config(Some(5));
    let ck = checkpoint(&cfg, 2);
    let (_dir, model) = load(&cfg, &ck, "deepseek_v32");
    let d = against_reference(&cfg, &ck, &model, &tokens(&cfg, 16, 2));
    eprintln!("max |dlogit| / rms(logits) = {d:.2e}");
    assert!(d < 2e-3, "deviation {d}");
}

#[test]
fn v32_with_topk_past_the_sequence_is_v3_and_a_smaller_topk_is_not() {
    let all = config(Some(64));
    let ck = checkpoint(&all, 3);
    let (_a, v32) = load(&all, &ck, "deepseek_v32");
    // the same weights under V3: the indexer's tensors are there but not read
    let (_b, v3) = load(&all, &ck, "deepseek_v3");
    let ids = tokens(&all, 14, 3);
    let (mut ca, mut cb) = (v32.new_cache(), v3.new_cache());
    let a = v32.forward(&ids, &mut ca).unwrap();
    let b = v3.forward(&ids, &mut cb).unwrap();
    // V3 runs no indexer (no index keys cached), V3.2 does
    let latent = all.kv_lora_rank + all.qk_rope_head_dim;
    assert_eq!(cb.floats_per_token(), Some(2 * latent));
    assert_eq!(ca.floats_per_token(), Some(2 * (latent + 32)));
    let rel = fp8nsa_test_support::rel_frobenius(&a, &b);
    assert!(rel < 1e-6, "{rel}");
    let few = config(Some(4));
    let (_c, sparse) = load(&few, &ck, "deepseek_v32");
    let c = sparse.forward(&ids, &mut sparse.new_cache()).unwrap();
    // the first 4 positions see all their keys either way; later ones lose some
    let head = |t: &Tensor| t.narrow(0, 0, 4).unwrap();
    assert!(fp8nsa_test_support::rel_frobenius(&head(&c), &head(&b)) < 1e-6);
    let tail = |t: &Tensor| t.narrow(0, 6, 8).unwrap();
    let moved = fp8nsa_test_support::rel_frobenius(&tail(&c), &tail(&b));
    assert!(moved > 1e-3, "{moved}");
}

#[test]
fn prefill_equals_decode_through_the_cache() {
    for topk in [None, Some(5)] {
        let cfg = config(topk);
        let ck = checkpoint(&cfg, 4);
        let ty = if topk.is_some() {
            "deepseek_v32"
        } else {
            "deepseek_v3"
        };
        let (_dir, model) = load(&cfg, &ck, ty);
        let ids = tokens(&cfg, 13, 4);
        let whole = model.forward(&ids, &mut model.new_cache()).unwrap();
        // a 4-token chunk, then one token at a time
        let mut cache: Cache = model.new_cache();
        let mut parts = vec![model.forward(&ids[..4], &mut cache).unwrap()];
        for i in 4..ids.len() {
            parts.push(model.forward(&ids[i..i + 1], &mut cache).unwrap());
        }
        let stepped = Tensor::cat(&parts, 0).unwrap();
        let rel = fp8nsa_test_support::rel_frobenius(&stepped, &whole);
        assert!(rel < 1e-5, "{ty}: {rel}");
        assert_eq!(cache.len(), ids.len());
        // the cache keeps the latent row (and V3.2's index key) per token and layer
        let per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim + topk.map_or(0, |_| 32);
        assert_eq!(cache.floats_per_token(), Some(2 * per_layer));
    }
}

#[test]
fn configs_and_checkpoints_that_cannot_run_are_typed_errors() {
    let cfg = config(None);
    let ck = checkpoint(&cfg, 5);
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), &cfg, &ck, "deepseek_v3");
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let p = dir.path().join("config.json");
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(&p, v.to_string()).unwrap();
        Model::load_hf(dir.path(), &ModelOptions::default()).map(|_| ())
    };
    let arg = |r: Result<(), Error>| match r {
        Err(Error::Invalid { arg, .. }) => arg,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        arg(edit(&|v| v["scoring_func"] = "softmax".into())),
        "scoring_func"
    );
    assert_eq!(
        arg(edit(&|v| {
            v["scoring_func"] = "sigmoid".into();
            v["n_group"] = 3.into();
        })),
        "n_group"
    );
    // more layers than the weights hold, and fewer (layer 1 would pass for the MTP module)
    assert_eq!(
        arg(edit(&|v| {
            v["n_group"] = 4.into();
            v["num_hidden_layers"] = 4.into();
        })),
        "num_hidden_layers"
    );
    assert_eq!(
        arg(edit(&|v| v["num_hidden_layers"] = 1.into())),
        "num_hidden_layers"
    );
    // sizes whose products (the projections' widths) overflow: typed errors, not a panic or
    // a wrapped width (found by tests/fuzz.rs::deepseek_config_json)
    assert_eq!(
        arg(edit(&|v| {
            v["num_hidden_layers"] = 2.into();
            v["n_shared_experts"] = u64::MAX.into();
        })),
        "n_shared_experts"
    );
    assert_eq!(
        arg(edit(&|v| {
            v["n_shared_experts"] = 1.into();
            v["qk_nope_head_dim"] = u64::MAX.into();
        })),
        "qk_nope_head_dim"
    );
    assert_eq!(
        arg(edit(&|v| {
            v["qk_nope_head_dim"] = 32.into();
            v["v_head_dim"] = u64::MAX.into();
        })),
        "v_head_dim"
    );
    edit(&|v| v["v_head_dim"] = 32.into()).unwrap(); // the sizes restored: it loads
                                                     // V3.2 without its indexer fields
    assert_eq!(
        arg(edit(&|v| {
            v["num_hidden_layers"] = 2.into();
            v["model_type"] = "deepseek_v32".into();
        })),
        "index_topk"
    );
    // back to a good config: it loads; a shard named outside the directory does not
    edit(&|v| v["model_type"] = "deepseek_v3".into()).unwrap();
    let idx = dir.path().join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&idx).unwrap();
    std::fs::write(&idx, text.replacen("model-00001", "../model-00001", 1)).unwrap();
    assert!(matches!(
        Model::load_hf(dir.path(), &ModelOptions::default()),
        Err(Error::File { .. })
    ));
}

/// The serving engine's ragged step: four sequences prefilled in chunks of different sizes,
/// joining at different steps, then decoded together; each new token's logits equal the
/// sequence run alone through the cache with the same chunks. V3.2 keeps 5 keys, so most
/// queries run the indexer's selection over the sequence's pages.
#[test]
fn batched_paged_step_gives_each_sequence_its_own_logits() {
    use fp8nsa_models::{BatchSeq, Logits, SeqKv};
    for (topk, ty) in [(None, "deepseek_v3"), (Some(5), "deepseek_v32")] {
        let cfg = config(topk);
        let ck = checkpoint(&cfg, 6);
        let (_dir, model) = load(&cfg, &ck, ty);
        let lens = [13usize, 3, 20, 1];
        let chunks = [4usize, 8, 7, 1];
        let prompts: Vec<Vec<u32>> = (0..4)
            .map(|i| tokens(&cfg, lens[i], i as u32 + 9))
            .collect();
        // MLA's latent pages stay f32
        assert!(matches!(
            model.new_kv_pool(16, 4, DType::F16),
            Err(fp8nsa_models::Error::Invalid {
                arg: "kv_dtype",
                ..
            })
        ));
        let pool = model.new_kv_pool(16, 4, DType::F32).unwrap();
        let mut kv: Vec<SeqKv> = (0..4).map(|_| pool.new_seq()).collect();
        let mut fed: Vec<Vec<Vec<u32>>> = vec![Vec::new(); 4];
        let mut got: Vec<Vec<Tensor>> = vec![Vec::new(); 4];
        let (mut done, mut decoded) = ([0usize; 4], [0usize; 4]);
        for step in 0..30 {
            let mut parts: Vec<(usize, Vec<u32>)> = Vec::new();
            for i in (0..4).filter(|&i| step >= i) {
                if done[i] < lens[i] {
                    let n = chunks[i].min(lens[i] - done[i]);
                    parts.push((i, prompts[i][done[i]..done[i] + n].to_vec()));
                    done[i] += n;
                } else if decoded[i] < 4 {
                    parts.push((i, vec![(step * 37 + i * 11) as u32 % 300]));
                    decoded[i] += 1;
                }
            }
            if parts.is_empty() {
                break;
            }
            let mut slots: Vec<Option<&mut SeqKv>> = kv.iter_mut().map(Some).collect();
            let mut batch: Vec<BatchSeq> = parts
                .iter()
                .map(|(i, toks)| BatchSeq {
                    tokens: toks,
                    kv: slots[*i].take().unwrap(),
                })
                .collect();
            let out = model.forward_batch(&pool, &mut batch, Logits::All).unwrap();
            for ((i, toks), o) in parts.into_iter().zip(out) {
                fed[i].push(toks);
                got[i].push(o);
            }
        }
        assert_eq!(decoded, [4; 4]);
        for i in 0..4 {
            let mut cache = model.new_cache();
            for (chunk, o) in fed[i].iter().zip(&got[i]) {
                let want = model.forward(chunk, &mut cache).unwrap();
                let e = fp8nsa_test_support::rel_frobenius(o, &want);
                assert!(e < 1e-5, "{ty} sequence {i} at {}: {e}", cache.len());
            }
        }
        drop(kv);
        assert_eq!(pool.free_pages(), 16, "{ty}: pages back");
    }
}
