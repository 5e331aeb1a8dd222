//! The full NSA layer against the f64 reference, plus the properties that pin its math.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use fp8nsa::nsa::{
    BlockSelection, Compressor, Gates, NativeSparseAttention, NsaCache, NsaConfig, NsaDims,
    SelectionAttention, SelectionRanges,
};
use fp8nsa::reference;
use fp8nsa_test_support::*;
use rand::rngs::StdRng;

fn qkv(rng: &mut StdRng, tq: usize, tk: usize, dims: NsaDims) -> (Tensor, Tensor, Tensor) {
    let mk = |rng: &mut StdRng, dims: &[usize]| tensor(gaussian(rng, dims.iter().product()), dims);
    (
        mk(rng, &[1, tq, dims.hq(), dims.d()]),
        mk(rng, &[1, tk, dims.hkv(), dims.d()]),
        mk(rng, &[1, tk, dims.hkv(), dims.dv()]),
    )
}

/// The layer's head layout.
fn dims(hq: usize, hkv: usize, d: usize, dv: usize) -> NsaDims {
    NsaDims::new(hq, hkv, d, dv).unwrap()
}

/// The layer with the mean-pool compressor and fixed gates (what the f64 reference models).
fn layer(cfg: NsaConfig, dims: NsaDims, gates: [f32; 3]) -> NativeSparseAttention {
    NativeSparseAttention::new(cfg, dims, Compressor::MeanPool, Gates::Fixed(gates)).unwrap()
}

fn zeros(shape: impl Into<candle_core::Shape>) -> Tensor {
    Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap()
}

fn small_cfg() -> NsaConfig {
    NsaConfig {
        compress_block: 16,
        compress_stride: 8,
        select_block: 32,
        num_selected: 4,
        num_initial: 1,
        num_local: 2,
        window: 48,
        ..NsaConfig::default()
    }
}

fn rows(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn sel_rows(s: &BlockSelection) -> Vec<i32> {
    s.indices().flatten_all().unwrap().to_vec1().unwrap()
}

/// Whether two top-n rows differ only by blocks whose importance ties within `tol` (relative
/// to the row's largest importance): f32 and f64 rounding may then pick either.
fn near_tie(a: &[i32], b: &[i32], imp: &[f64], tol: f64) -> bool {
    let max = imp.iter().cloned().fold(0.0, f64::max).max(1e-30);
    let only_a: Vec<usize> = a
        .iter()
        .filter(|x| **x >= 0 && !b.contains(x))
        .map(|&x| x as usize)
        .collect();
    let only_b: Vec<usize> = b
        .iter()
        .filter(|x| **x >= 0 && !a.contains(x))
        .map(|&x| x as usize)
        .collect();
    only_a.len() == only_b.len()
        && only_a
            .iter()
            .all(|&x| only_b.iter().any(|&y| (imp[x] - imp[y]).abs() <= tol * max))
}

/// rms ratio over the (token) rows where `keep[t]`.
fn rms_rows(a: &[f32], b: &[f32], row: usize, keep: &[bool]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (t, k) in keep.iter().enumerate() {
        if *k {
            for i in t * row..(t + 1) * row {
                num += ((a[i] - b[i]) as f64).powi(2);
                den += (b[i] as f64).powi(2);
            }
        }
    }
    (num / den.max(1e-300)).sqrt()
}

/// Runs the layer and the reference; selections must agree except at near-ties, and outputs
/// must agree on every token whose selections agree.
fn compare_with_reference(
    cfg: NsaConfig,
    dims: NsaDims,
    tq: usize,
    tk: usize,
    gates: [f32; 3],
    what: &str,
) {
    let mut rng = rng(what);
    let (q, k, v) = qkv(&mut rng, tq, tk, dims);
    let nsa = layer(cfg.clone(), dims, gates);
    let x = zeros((1, tq, 4));
    let out = nsa.forward_detailed(&x, &q, &k, &v).unwrap();
    let want = reference::nsa_layer(&cfg, &q, &k, &v, gates.map(|g| g as f64)).unwrap();
    let (ours, theirs) = (sel_rows(&out.selection), &want.selection);
    let n = cfg.num_selected;
    let nb = tk.div_ceil(cfg.select_block);
    let imp = rows(&out.importance);
    let mut keep = vec![true; tq];
    let mut ties = 0;
    for (r, (a, b)) in ours.chunks(n).zip(theirs.chunks(n)).enumerate() {
        let ref_imp = &want.importance[r * nb..(r + 1) * nb];
        for (x, y) in imp[r * nb..(r + 1) * nb].iter().zip(ref_imp) {
            assert!(
                (*x as f64 - y).abs() < 1e-4 * (1.0 + y.abs()),
                "{what}: importance {x} vs {y}"
            );
        }
        if a != b {
            assert!(
                near_tie(a, b, ref_imp, 1e-5),
                "{what}: row {r}: {a:?} vs {b:?}, importance {ref_imp:?}"
            );
            keep[r / dims.hkv()] = false;
            ties += 1;
        }
    }
    assert!(
        ties * 20 <= ours.len() / n,
        "{what}: {ties} near-ties is too many"
    );
    let err = rms_rows(&rows(&out.o), &rows(&want.o), dims.hq() * dims.dv(), &keep);
    assert!(err < 1e-4, "{what}: rms ratio {err:e}");
}

#[test]
fn layer_matches_reference_small_blocks() {
    let dims = dims(8, 2, 32, 32);
    compare_with_reference(
        small_cfg(),
        dims,
        300,
        300,
        [0.3, 0.5, 0.7],
        "prefill small blocks",
    );
    compare_with_reference(
        small_cfg(),
        dims,
        50,
        300,
        [0.3, 0.5, 0.7],
        "chunked prefill",
    );
    compare_with_reference(small_cfg(), dims, 1, 301, [1.0, 1.0, 1.0], "decode");
    // fewer keys than a compressed block: the compressed branch is empty
    compare_with_reference(small_cfg(), dims, 10, 10, [0.3, 0.5, 0.7], "tiny context");
}

#[test]
fn layer_matches_reference_paper_defaults() {
    // 18 selection blocks of 64 > 16 selected, so the ranking matters
    let dims = dims(4, 1, 64, 32);
    compare_with_reference(
        NsaConfig::default(),
        dims,
        64,
        1100,
        [0.2, 0.6, 0.2],
        "paper defaults",
    );
}

#[test]
fn covering_selection_and_window_equal_dense_causal_attention() {
    let mut rng = rng("covering");
    let t = 200;
    let dims = dims(8, 2, 32, 32);
    let cfg = NsaConfig {
        num_selected: 7,
        window: 256,
        ..small_cfg()
    }; // 7 * 32 >= 200
    let (q, k, v) = qkv(&mut rng, t, t, dims);
    let nsa = layer(cfg, dims, [0.0, 1.0, 0.0]);
    let x = zeros((1, t, 4));
    let out = nsa.forward_detailed(&x, &q, &k, &v).unwrap();
    let all = SelectionRanges::new(
        Tensor::from_vec(
            [0i32, t as i32].repeat(t * 2),
            (1, t, 2, 1, 2),
            &Device::Cpu,
        )
        .unwrap(),
    )
    .unwrap();
    let (dense, _) = reference::nsa_selection(&q, &k, &v, &all, None, None).unwrap();
    let all_rows = vec![true; t];
    for (name, o) in [
        ("selection", &out.selected),
        ("window", &out.window),
        ("gated", &out.o),
    ] {
        let err = rms_rows(&rows(o), &rows(&dense), dims.hq() * dims.dv(), &all_rows);
        assert!(err < 1e-4, "{name} branch vs dense: {err:e}");
    }
}

#[test]
fn non_finite_keys_and_values_reach_no_query_that_does_not_attend_them() {
    // docs/nsa.md "Non-finite values": NaN / Inf in the last tokens' keys and values, which
    // no earlier query attends in any branch (compressed, selected, window)
    let mut rng = rng("layer_non_finite");
    let t = 120;
    let dims = dims(4, 2, 16, 16);
    let (q, k, v) = qkv(&mut rng, t, t, dims);
    let poke = |x: &Tensor, vals: [f32; 2]| {
        let mut r = rows(x);
        let row = r.len() / t;
        r[(t - 1) * row] = vals[0];
        r[(t - 2) * row + 1] = vals[1];
        Tensor::from_vec(r, x.dims(), &Device::Cpu).unwrap()
    };
    let (kb, vb) = (
        poke(&k, [f32::NAN, f32::INFINITY]),
        poke(&v, [-f32::INFINITY, f32::NAN]),
    );
    let x = zeros((1, t, 4));
    for min_len in [0, usize::MAX] {
        let nsa = layer(small_cfg(), dims, [0.3, 0.3, 0.4])
            .with_attention(SelectionAttention::new().min_len(min_len));
        let bad = nsa.forward_detailed(&x, &q, &kb, &vb).unwrap();
        let good = nsa.forward_detailed(&x, &q, &k, &v).unwrap();
        let row = dims.hq() * dims.dv();
        for (name, a, b) in [
            ("compressed", &bad.compressed, &good.compressed),
            ("selected", &bad.selected, &good.selected),
            ("window", &bad.window, &good.window),
            ("gated", &bad.o, &good.o),
        ] {
            let (a, b) = (rows(a), rows(b));
            // the bad entries sit in kv head 0 at tokens t - 2 and t - 1: bit-for-bit
            // everywhere else; the last two tokens' query heads 0 and 1 attend them (window,
            // own selection block; the compressed block of keys 104..120 from token 119 on)
            // and turn non-finite
            let half = row / 2;
            let first = if name == "compressed" { t - 1 } else { t - 2 };
            for i in 0..t {
                let (a, b) = (&a[i * row..(i + 1) * row], &b[i * row..(i + 1) * row]);
                let what = format!("{name}, min_len {min_len}, token {i}");
                if i < first {
                    assert_eq!(a, b, "{what}");
                } else {
                    assert!(a[..half].iter().any(|x| !x.is_finite()), "{what}");
                    assert_eq!(a[half..], b[half..], "{what}");
                }
            }
        }
        let imp = rows(&good.importance).len() / t;
        assert_eq!(
            rows(&bad.importance)[..(t - 1) * imp],
            rows(&good.importance)[..(t - 1) * imp]
        );
    }
}

#[test]
fn prefill_equals_successive_decode_steps() {
    let mut rng = rng("prefill_vs_decode");
    let dims = dims(4, 2, 32, 32);
    let cfg = small_cfg();
    let t = 180;
    let (q, k, v) = qkv(&mut rng, t, t, dims);
    let nsa = layer(cfg.clone(), dims, [0.4, 0.4, 0.4]);
    let x = zeros((1, t, 4));
    let full = nsa.forward_detailed(&x, &q, &k, &v).unwrap();
    let (o_full, sel_full, imp_full) = (
        rows(&full.o),
        sel_rows(&full.selection),
        rows(&full.importance),
    );
    let nb = t.div_ceil(cfg.select_block);
    // a 37-token chunk first, then one token at a time
    let mut cache = NsaCache::new();
    let mut pos = 0;
    let mut keep = vec![true; t];
    let mut o_steps = vec![0f32; o_full.len()];
    let row = dims.hq() * dims.dv();
    for len in std::iter::once(37).chain(std::iter::repeat_n(1, t - 37)) {
        let n = |x: &Tensor| x.narrow(1, pos, len).unwrap();
        let out = nsa
            .forward_step_detailed(&n(&x), &n(&q), &n(&k), &n(&v), &mut cache)
            .unwrap();
        assert_eq!(cache.len(), pos + len);
        assert_eq!(cache.compressed_len(), cfg.compressed_len(pos + len));
        o_steps[pos * row..(pos + len) * row].copy_from_slice(&rows(&out.o));
        let sel = sel_rows(&out.selection);
        let imp = rows(&out.importance);
        let nb_now = (pos + len).div_ceil(cfg.select_block);
        for i in 0..len {
            for h in 0..dims.hkv() {
                let r = (pos + i) * dims.hkv() + h;
                let a = &sel[(i * dims.hkv() + h) * cfg.num_selected..][..cfg.num_selected];
                let b = &sel_full[r * cfg.num_selected..][..cfg.num_selected];
                let imp_full_row: Vec<f64> = imp_full[r * nb..r * nb + nb_now]
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                let imp_row = &imp[(i * dims.hkv() + h) * nb_now..][..nb_now];
                for (x, y) in imp_row.iter().zip(&imp_full_row) {
                    assert!(
                        (*x as f64 - y).abs() < 1e-5,
                        "importance at {}: {x} vs {y}",
                        pos + i
                    );
                }
                if a != b {
                    assert!(
                        near_tie(a, b, &imp_full_row, 1e-5),
                        "pos {}: {a:?} vs {b:?}",
                        pos + i
                    );
                    keep[pos + i] = false;
                }
            }
        }
        pos += len;
    }
    // compressed keys of the cache are exactly those of a prefill
    let ck_full = {
        let mut c = NsaCache::new();
        nsa.forward_step(&x, &q, &k, &v, &mut c).unwrap();
        rows(&c.compressed_keys().unwrap().unwrap())
    };
    assert_eq!(rows(&cache.compressed_keys().unwrap().unwrap()), ck_full);
    let err = rms_rows(&o_steps, &o_full, row, &keep);
    assert!(err < 1e-5, "decode steps vs prefill: {err:e}");

    // clones are independent; truncation rolls back keys and compressed blocks
    let mut fork = cache.try_clone().unwrap();
    let one = |x: &Tensor, p: usize| x.narrow(1, p, 1).unwrap();
    nsa.forward_step(
        &one(&x, 0),
        &one(&q, 0),
        &one(&k, 0),
        &one(&v, 0),
        &mut fork,
    )
    .unwrap();
    assert_eq!((fork.len(), cache.len()), (t + 1, t));
    cache.truncate(100, &cfg).unwrap();
    assert_eq!(
        (cache.len(), cache.compressed_len()),
        (100, cfg.compressed_len(100))
    );
    let o100 = nsa
        .forward_step(
            &one(&x, 100),
            &one(&q, 100),
            &one(&k, 100),
            &one(&v, 100),
            &mut cache,
        )
        .unwrap();
    if keep[100] {
        let err = rms_rows(&rows(&o100), &o_full[100 * row..101 * row], row, &[true]);
        assert!(err < 1e-5, "after truncate: {err:e}");
    }
    assert_eq!(
        rows(&fork.keys().unwrap().unwrap().narrow(1, 0, t).unwrap()),
        rows(&k)
    );
}

#[test]
fn top_n_never_looks_ahead_and_keeps_forced_blocks() {
    let mut rng = rng("top_n_properties");
    let dims = dims(4, 2, 32, 32);
    for cfg in [
        small_cfg(),
        NsaConfig {
            num_selected: 5,
            num_initial: 2,
            num_local: 1,
            ..small_cfg()
        },
    ] {
        let (tq, tk) = (120, 400);
        let (q, k, v) = qkv(&mut rng, tq, tk, dims);
        let nsa = layer(cfg.clone(), dims, [1.0; 3]);
        let x = zeros((1, tq, 4));
        let out = nsa.forward_detailed(&x, &q, &k, &v).unwrap();
        out.selection.validate(tk).unwrap();
        let sel = sel_rows(&out.selection);
        for (r, row) in sel.chunks(cfg.num_selected).enumerate() {
            let p = tk - tq + r / dims.hkv();
            let cur = p / cfg.select_block;
            let chosen: Vec<usize> = row
                .iter()
                .filter(|&&j| j >= 0)
                .map(|&j| j as usize)
                .collect();
            assert!(
                chosen.iter().all(|&j| j <= cur),
                "future block at p = {p}: {row:?}"
            );
            assert_eq!(chosen.len(), cfg.num_selected.min(cur + 1));
            for j in (0..cfg.num_initial).chain(cur + 1 - cfg.num_local..=cur) {
                assert!(
                    chosen.contains(&j),
                    "forced block {j} missing at p = {p}: {row:?}"
                );
            }
        }
    }
}

#[test]
fn learned_gates_and_mlp_compressor_load_from_a_varbuilder() {
    let mut rng = rng("load_layer");
    let dims = dims(4, 2, 16, 16);
    let hidden = 24;
    let cfg = NsaConfig {
        compressor: fp8nsa::nsa::CompressorKind::Mlp,
        mlp_hidden: 20,
        ..small_cfg()
    };
    let l = cfg.compress_block;
    let mut w = HashMap::new();
    let mut put = |name: &str, dims: &[usize], rng: &mut StdRng| {
        let v: Vec<f32> = gaussian(rng, dims.iter().product())
            .into_iter()
            .map(|x| x * 0.1)
            .collect();
        w.insert(name.to_string(), tensor(v, dims));
    };
    put("attn.gate.weight", &[3 * dims.hq(), hidden], &mut rng);
    put("attn.gate.bias", &[3 * dims.hq()], &mut rng);
    for kv in ["k_compress", "v_compress"] {
        put(&format!("attn.{kv}.pos"), &[l, dims.d()], &mut rng);
        put(
            &format!("attn.{kv}.fc1.weight"),
            &[20, l * dims.d()],
            &mut rng,
        );
        put(&format!("attn.{kv}.fc1.bias"), &[20], &mut rng);
        put(&format!("attn.{kv}.fc2.weight"), &[dims.d(), 20], &mut rng);
        put(&format!("attn.{kv}.fc2.bias"), &[dims.d()], &mut rng);
    }
    let vb = candle_nn::VarBuilder::from_tensors(w.clone(), DType::F32, &Device::Cpu);
    let nsa = NativeSparseAttention::load(cfg.clone(), dims, hidden, vb.pp("attn")).unwrap();
    let t = 70;
    let (q, k, v) = qkv(&mut rng, t, t, dims);
    let x = tensor(gaussian(&mut rng, t * hidden), &[1, t, hidden]);
    let out = nsa.forward_detailed(&x, &q, &k, &v).unwrap();

    // gates: sigmoid(x W^T + b), [compressed | selected | window] each Hq wide
    let (gw, gb) = (&w["attn.gate.weight"], &w["attn.gate.bias"]);
    let lin = x
        .matmul(&gw.t().unwrap().unsqueeze(0).unwrap())
        .unwrap()
        .broadcast_add(gb)
        .unwrap();
    let g = candle_nn::ops::sigmoid(&lin)
        .unwrap()
        .reshape((1, t, 3, dims.hq()))
        .unwrap();
    let gate = |i: usize| {
        g.narrow(2, i, 1)
            .unwrap()
            .squeeze(2)
            .unwrap()
            .unsqueeze(3)
            .unwrap()
    };
    let want = ((out.compressed.broadcast_mul(&gate(0)).unwrap()
        + out.selected.broadcast_mul(&gate(1)).unwrap())
    .unwrap()
        + out.window.broadcast_mul(&gate(2)).unwrap())
    .unwrap();
    let all = vec![true; t];
    assert!(rms_rows(&rows(&out.o), &rows(&want), dims.hq() * dims.dv(), &all) < 1e-6);

    // MLP compressor: block i = fc2(gelu(fc1(flatten(k[i*s .. i*s + l] + pos))))
    let mut cache = NsaCache::new();
    nsa.forward_step(&x, &q, &k, &v, &mut cache).unwrap();
    let ck = cache.compressed_keys().unwrap().unwrap();
    let s = cfg.compress_stride;
    for (i, h) in [(0, 0), (3, 1), (cfg.compressed_len(t) - 1, 1)] {
        let block = k
            .narrow(1, i * s, l)
            .unwrap()
            .narrow(2, h, 1)
            .unwrap()
            .reshape((l, dims.d()))
            .unwrap();
        let flat = (block + &w["attn.k_compress.pos"])
            .unwrap()
            .reshape((1, l * dims.d()))
            .unwrap();
        let lin = |x: &Tensor, n: &str| {
            x.matmul(&w[&format!("attn.k_compress.{n}.weight")].t().unwrap())
                .unwrap()
                .broadcast_add(&w[&format!("attn.k_compress.{n}.bias")])
                .unwrap()
        };
        let want = lin(&lin(&flat, "fc1").gelu().unwrap(), "fc2");
        let got = ck
            .narrow(1, i, 1)
            .unwrap()
            .narrow(2, h, 1)
            .unwrap()
            .reshape((1, dims.d()))
            .unwrap();
        let err = rel_frobenius(&got, &want);
        assert!(err < 1e-5, "compressed key {i}, head {h}: {err:e}");
    }
}

#[test]
fn config_deserializes_and_validates() {
    let cfg: NsaConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(cfg, NsaConfig::default());
    assert_eq!(
        (
            cfg.compress_block,
            cfg.compress_stride,
            cfg.select_block,
            cfg.num_selected,
            cfg.num_initial,
            cfg.num_local,
            cfg.window
        ),
        (32, 16, 64, 16, 1, 2, 512)
    );
    let cfg: NsaConfig =
        serde_json::from_str(r#"{"select_block": 128, "compressor": "mlp"}"#).unwrap();
    assert_eq!(cfg.compressor, fp8nsa::nsa::CompressorKind::Mlp);
    cfg.validate().unwrap();
    let bad = |c: NsaConfig, field: &str| {
        let e = c.validate().unwrap_err();
        assert!(
            matches!(e, fp8nsa::Error::Invalid { arg, .. } if arg == field),
            "{field}: {e}"
        );
    };
    bad(
        NsaConfig {
            select_block: 72,
            ..NsaConfig::default()
        },
        "select_block",
    );
    bad(
        NsaConfig {
            compress_block: 40,
            ..NsaConfig::default()
        },
        "compress_block",
    );
    bad(
        NsaConfig {
            num_selected: 2,
            ..NsaConfig::default()
        },
        "num_selected",
    );
    bad(
        NsaConfig {
            window: 0,
            ..NsaConfig::default()
        },
        "window",
    );
    // sizes that once passed and then spent minutes in the importance remap, and forced blocks
    // whose count overflows (issue: reliability, items 5 and 8)
    bad(
        NsaConfig {
            select_block: 1 << 31,
            ..NsaConfig::default()
        },
        "select_block",
    );
    bad(
        NsaConfig {
            compress_block: 1 << 20,
            select_block: 1 << 20,
            ..NsaConfig::default()
        },
        "compress_block",
    );
    bad(
        NsaConfig {
            compress_stride: 1,
            compress_block: 4096,
            select_block: 1 << 16,
            ..NsaConfig::default()
        },
        "compress_stride",
    );
    bad(
        NsaConfig {
            num_initial: usize::MAX,
            ..NsaConfig::default()
        },
        "num_selected",
    );
    bad(
        NsaConfig {
            num_initial: usize::MAX,
            num_local: usize::MAX,
            num_selected: usize::MAX,
            ..NsaConfig::default()
        },
        "num_selected",
    );
    // every query's top-n row is num_selected long: bounded (found by tests/fuzz.rs)
    bad(
        NsaConfig {
            num_selected: (1 << 16) + 1,
            ..NsaConfig::default()
        },
        "num_selected",
    );
}

#[test]
fn bad_shapes_are_errors() {
    let mut rng = rng("layer_errors");
    let dims = dims(4, 2, 16, 16);
    let nsa = layer(small_cfg(), dims, [1.0; 3]);
    let x = zeros((1, 8, 4));
    let (q, k, v) = qkv(&mut rng, 8, 8, dims);
    let k3 = zeros((1, 8, 3, 16));
    let e = nsa.forward(&x, &q, &k3, &v).unwrap_err();
    assert!(
        matches!(&e, fp8nsa::Error::Shape { arg: "k", got, .. } if got == &[1, 8, 3, 16]),
        "{e}"
    );
    let (q9, _, _) = qkv(&mut rng, 9, 8, dims);
    let e = nsa.forward(&x, &q9, &k, &v).unwrap_err();
    assert!(matches!(e, fp8nsa::Error::Invalid { arg: "q", .. }), "{e}");
    // dims the layer cannot take cannot be made: refused where they are constructed
    let e = NsaDims::new(3, 2, 16, 16).unwrap_err();
    assert!(
        matches!(e, fp8nsa::types::Error::Invalid { arg: "hq", .. }),
        "{e}"
    );
    // the cache refuses keys of another shape
    let mut cache = NsaCache::new();
    nsa.forward_step(&x, &q, &k, &v, &mut cache).unwrap();
    let (q1, _, _) = qkv(&mut rng, 1, 1, dims);
    let k1 = zeros((1, 1, 2, 8));
    let e = nsa
        .forward_step(&x.narrow(1, 0, 1).unwrap(), &q1, &k1, &k1, &mut cache)
        .unwrap_err();
    assert!(
        matches!(&e, fp8nsa::Error::Shape { arg: "k", got, .. } if got == &[1, 1, 2, 8]),
        "{e}"
    );
    // more queries than new keys (issue: reliability, item 13): an error, the cache unchanged
    let len = cache.len();
    let (q2, k1, v1) = qkv(&mut rng, 2, 1, dims);
    let e = nsa
        .forward_step(&x.narrow(1, 0, 2).unwrap(), &q2, &k1, &v1, &mut cache)
        .unwrap_err();
    assert!(
        matches!(&e, fp8nsa::Error::Invalid { arg: "q", msg } if msg.contains("2 query tokens for 1 new")),
        "{e}"
    );
    assert_eq!(cache.len(), len);
    let _ = SelectionAttention::new();
}

#[test]
fn a_failed_step_leaves_the_cache_as_it_was() {
    let mut rng = rng("cache_rollback");
    let dims = dims(4, 2, 16, 16);
    let nsa = layer(small_cfg(), dims, [1.0; 3]);
    let (q, k, v) = qkv(&mut rng, 40, 40, dims);
    let x = zeros((1, 40, 4));
    let mut cache = NsaCache::new();
    nsa.forward_step(&x, &q, &k, &v, &mut cache).unwrap();
    let (len, n_c) = (cache.len(), cache.compressed_len());
    let one = |t: &Tensor| t.narrow(1, 0, 1).unwrap();
    // q of the wrong head count: rejected after k/v were appended, so they must be rolled back
    let bad_q = zeros((1, 1, 3, 16));
    let e = nsa
        .forward_step(&one(&x), &bad_q, &one(&k), &one(&v), &mut cache)
        .unwrap_err();
    assert!(
        matches!(&e, fp8nsa::Error::Shape { arg: "q", got, .. } if got == &[1, 1, 3, 16]),
        "{e}"
    );
    assert_eq!((cache.len(), cache.compressed_len()), (len, n_c));
    // v of another dtype than the cache: rejected before anything is appended
    let v16 = one(&v).to_dtype(DType::F16).unwrap();
    let e = nsa
        .forward_step(&one(&x), &one(&q), &one(&k), &v16, &mut cache)
        .unwrap_err();
    assert!(
        matches!(e, fp8nsa::Error::Shape { arg: "k_new", .. }),
        "{e}"
    );
    assert_eq!(cache.len(), len);
    // and the cache still works
    nsa.forward_step(&one(&x), &one(&q), &one(&k), &one(&v), &mut cache)
        .unwrap();
    assert_eq!(cache.len(), len + 1);
    // no query token on a filled cache: q named (it was candle's "cat expects at least one
    // tensor"), and the token appended for it rolled back
    let no_q = q.narrow(1, 0, 0).unwrap();
    let e = nsa
        .forward_step(&one(&x), &no_q, &one(&k), &one(&v), &mut cache)
        .unwrap_err();
    assert!(matches!(e, fp8nsa::Error::Shape { arg: "q", .. }), "{e}");
    assert_eq!(cache.len(), len + 1);
    // zero new tokens on an empty cache: an error, not a panic
    let none = |t: &Tensor| t.narrow(1, 0, 0).unwrap();
    let mut empty = NsaCache::new();
    let e = nsa
        .forward_step(&none(&x), &none(&q), &none(&k), &none(&v), &mut empty)
        .unwrap_err();
    assert!(
        matches!(e, fp8nsa::Error::Invalid { arg: "k_new", .. }),
        "{e}"
    );
}

/// Errors a server logs say what was wrong with which argument (issue: reliability, "unclear
/// errors"): zero query tokens, Dv = 0 (blamed on v, not q), a gate input of the wrong width
/// (not a raw matmul error); and through `candle_core::Error` no backtrace is appended.
#[test]
fn argument_errors_name_the_argument() {
    let z = |d: &[usize]| Tensor::zeros(d, DType::F32, &Device::Cpu).unwrap();
    let ranges = |t: usize| {
        SelectionRanges::new(
            Tensor::from_vec([0i32, 1].repeat(t), (1, t, 1, 1, 2), &Device::Cpu).unwrap(),
        )
        .unwrap()
    };
    for min_len in [0, usize::MAX] {
        let attn = SelectionAttention::new().min_len(min_len);
        let e = attn
            .forward(
                &z(&[1, 0, 2, 16]),
                &z(&[1, 8, 1, 16]),
                &z(&[1, 8, 1, 16]),
                &ranges(0),
            )
            .unwrap_err();
        assert!(
            matches!(&e, fp8nsa::Error::Invalid { arg: "q", msg } if msg.contains("no query tokens")),
            "{e}"
        );
        let e = attn
            .forward(
                &z(&[1, 4, 2, 16]),
                &z(&[1, 4, 1, 16]),
                &z(&[1, 4, 1, 0]),
                &ranges(4),
            )
            .unwrap_err();
        assert!(matches!(&e, fp8nsa::Error::Shape { arg: "v", .. }), "{e}");
    }
    let dims = dims(4, 2, 16, 16);
    let vb = candle_nn::VarBuilder::zeros(DType::F32, &Device::Cpu);
    let nsa = NativeSparseAttention::load(small_cfg(), dims, 64, vb).unwrap();
    let (q, k, v) = (z(&[1, 8, 4, 16]), z(&[1, 8, 2, 16]), z(&[1, 8, 2, 16]));
    let e = nsa.forward(&z(&[1, 8, 65]), &q, &k, &v).unwrap_err();
    assert!(
        matches!(&e, fp8nsa::Error::Shape { arg: "gate_input", expected, got } if expected.contains("[1, 8, 64]") && got == &[1, 8, 65]),
        "{e}"
    );
    assert!(nsa.forward(&z(&[1, 8, 64]), &q, &k, &v).is_ok());
    // into candle's error type: our message, wrapped, with no backtrace captured
    let c = candle_core::Error::from(e);
    assert!(matches!(&c, candle_core::Error::Wrapped(_)), "{c:?}");
}

/// `NsaCache` is a convenience over per-sequence paged states on pools it owns: a batch of three
/// sequences decoded one token at a time, far past its first pools (which grow, doubling),
/// equals the stateless prefill of each sequence; a clone is independent of the original.
/// Decode picks the blocks prefill picks, bit for bit: the importance of a query does not
/// depend on how many queries or compressed blocks its call holds. The importance used to come from the compressed branch's probabilities, whose rounding did
/// depend on the call's shape, and a near tie then flipped a selection now and then.
#[test]
fn decode_importance_and_selection_equal_prefill_bit_for_bit() {
    let mut rng = rng("decode_importance");
    let dims = dims(6, 2, 16, 16);
    let t = 260;
    let (q, k, v) = qkv(&mut rng, t, t, dims);
    let nsa = layer(small_cfg(), dims, [0.4, 0.4, 0.4]);
    let x = zeros((1, t, 4));
    let full = nsa.forward_detailed(&x, &q, &k, &v).unwrap();
    let (imp, sel) = (rows(&full.importance), sel_rows(&full.selection));
    let nb = t.div_ceil(small_cfg().select_block);
    let n = small_cfg().num_selected;
    let mut cache = NsaCache::new();
    for pos in 0..t {
        let one = |x: &Tensor| x.narrow(1, pos, 1).unwrap();
        let step = nsa
            .forward_step_detailed(&one(&x), &one(&q), &one(&k), &one(&v), &mut cache)
            .unwrap();
        let nb1 = (pos + 1).div_ceil(small_cfg().select_block);
        let got = rows(&step.importance);
        for h in 0..dims.hkv() {
            let want = &imp[(pos * dims.hkv() + h) * nb..][..nb1];
            assert_eq!(
                &got[h * nb1..(h + 1) * nb1],
                want,
                "position {pos} head {h}"
            );
        }
        let want = &sel[pos * dims.hkv() * n..(pos + 1) * dims.hkv() * n];
        assert_eq!(sel_rows(&step.selection), want, "position {pos}");
    }
}

#[test]
fn the_cache_grows_keeps_batch_rows_apart_and_clones_deep() {
    let mut rng = rng("cache_grows");
    let dims = dims(4, 2, 32, 32);
    let (b, t) = (3, 700);
    let mk =
        |rng: &mut StdRng, h: usize, d: usize| tensor(gaussian(rng, b * t * h * d), &[b, t, h, d]);
    let (q, k, v) = (
        mk(&mut rng, dims.hq(), dims.d()),
        mk(&mut rng, dims.hkv(), dims.d()),
        mk(&mut rng, dims.hkv(), dims.dv()),
    );
    let nsa = layer(small_cfg(), dims, [0.4, 0.4, 0.4]);
    let x = zeros((b, t, 4));
    let full = rows(&nsa.forward(&x, &q, &k, &v).unwrap());
    let mut cache = NsaCache::new();
    let mut snapshot = None;
    let row = dims.hq() * dims.dv();
    let mut pos = 0;
    for len in std::iter::once(5).chain(std::iter::repeat_n(1, t - 5)) {
        let n = |x: &Tensor| x.narrow(1, pos, len).unwrap();
        let o = rows(
            &nsa.forward_step(&n(&x), &n(&q), &n(&k), &n(&v), &mut cache)
                .unwrap(),
        );
        for s in 0..b {
            for i in 0..len {
                let got = &o[(s * len + i) * row..][..row];
                let want = &full[(s * t + pos + i) * row..][..row];
                let err = got
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(err < 1e-4, "sequence {s} position {}: {err:e}", pos + i);
            }
        }
        pos += len;
        if pos == 300 {
            snapshot = Some(cache.try_clone().unwrap());
        }
    }
    assert_eq!(
        cache.keys().unwrap().unwrap().dims(),
        &[b, t, dims.hkv(), dims.d()]
    );
    assert_eq!(rows(&cache.keys().unwrap().unwrap()), rows(&k));
    assert_eq!(rows(&cache.values().unwrap().unwrap()), rows(&v));
    let snapshot = snapshot.unwrap();
    assert_eq!(snapshot.len(), 300);
    assert_eq!(
        rows(&snapshot.keys().unwrap().unwrap()),
        rows(&k.narrow(1, 0, 300).unwrap())
    );
    // a batch of another size is refused and changes nothing
    let mut c = cache.try_clone().unwrap();
    let one = |x: &Tensor| x.narrow(0, 0, 1).unwrap().narrow(1, 0, 1).unwrap();
    let e = nsa
        .forward_step(&one(&x), &one(&q), &one(&k), &one(&v), &mut c)
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(&e, fp8nsa::Error::Shape { arg: "k_new", .. }),
        "{e}"
    );
    assert_eq!(c.len(), t);
    // a first append that fails (values of another dtype) leaves the cache empty and free to
    // take any batch size
    let mut fresh = NsaCache::new();
    let bad_v = one(&v).to_dtype(DType::BF16).unwrap();
    assert!(nsa.append_kv(&one(&k), &bad_v, &mut fresh).is_err());
    assert!(fresh.is_empty() && fresh.keys().unwrap().is_none());
    let two = |x: &Tensor| x.narrow(0, 0, 2).unwrap().narrow(1, 0, 1).unwrap();
    nsa.append_kv(&two(&k), &two(&v), &mut fresh).unwrap();
    assert_eq!(
        fresh.keys().unwrap().unwrap().dims(),
        &[2, 1, dims.hkv(), dims.d()]
    );
}
