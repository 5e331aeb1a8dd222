//! `fp8nsa quantize`: convert a checkpoint, load it back with `Fp8BlockWeight::load`.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use candle_core::{DType, Device, Tensor};
use fp8nsa::Fp8BlockWeight;
use fp8nsa_cli::convert::{quantize_checkpoint, QuantizeOptions};
use fp8nsa_test_support::*;

/// A small Llama-like checkpoint (f32 and bf16, shapes not multiples of 128) and its config.
fn write_checkpoint(dir: &Path, rng: &mut rand::rngs::StdRng) -> HashMap<String, Tensor> {
    let mut t = HashMap::new();
    let mut add = |name: &str, dims: &[usize], dtype: DType, rng: &mut rand::rngs::StdRng| {
        let n = dims.iter().product();
        let v = tensor(
            hetero(rng, n / dims[dims.len() - 1], dims[dims.len() - 1], 64, 64),
            &[n],
        )
        .reshape(dims)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
        t.insert(name.to_string(), v);
    };
    add("model.embed_tokens.weight", &[50, 200], DType::BF16, rng);
    add(
        "model.layers.0.input_layernorm.weight",
        &[200],
        DType::BF16,
        rng,
    );
    add(
        "model.layers.0.self_attn.q_proj.weight",
        &[200, 200],
        DType::F32,
        rng,
    );
    add(
        "model.layers.0.self_attn.q_proj.bias",
        &[200],
        DType::F32,
        rng,
    );
    add(
        "model.layers.0.mlp.up_proj.weight",
        &[300, 200],
        DType::BF16,
        rng,
    );
    add(
        "model.layers.0.mlp.down_proj.weight",
        &[200, 300],
        DType::F16,
        rng,
    );
    add("lm_head.weight", &[50, 200], DType::BF16, rng);
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 200}"#,
    )
    .unwrap();
    t
}

fn check_output(out: &Path, orig: &HashMap<String, Tensor>, block: [usize; 2]) {
    let map = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
    let converted = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj",
    ];
    for name in converted {
        assert_eq!(
            map[&format!("{name}.weight")].dtype(),
            DType::F8E4M3,
            "{name}"
        );
    }
    // untouched tensors are bit-identical
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "lm_head.weight",
    ] {
        let (a, b) = (&map[name], &orig[name]);
        assert_eq!(a.dtype(), b.dtype(), "{name}");
        let d = (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap()).unwrap();
        assert_eq!(
            d.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap(),
            0.0
        );
    }
    let vb = candle_nn::VarBuilder::from_tensors(map, DType::F32, &Device::Cpu);
    for name in converted {
        let w = Fp8BlockWeight::load(vb.pp(name), block).unwrap();
        let want = orig[&format!("{name}.weight")]
            .to_dtype(DType::F32)
            .unwrap();
        let back = w.dequantize(DType::F32).unwrap();
        // per element: half an fp8 ulp, or half the subnormal step of its block
        let scales: Vec<Vec<f32>> = w.scales().to_vec2().unwrap();
        let (a, b): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
            (back.to_vec2().unwrap(), want.to_vec2().unwrap());
        for (r, (ra, rb)) in a.iter().zip(&b).enumerate() {
            for (c, (x, y)) in ra.iter().zip(rb).enumerate() {
                let s = scales[r / block[0]][c / block[1]];
                assert!(
                    (x - y).abs() <= (y.abs() / 16.0).max(s / 1024.0) * 1.0001,
                    "{name} {r},{c}"
                );
            }
        }
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["hidden_size"], 200);
    let qc = &cfg["quantization_config"];
    assert_eq!(qc["quant_method"], "fp8");
    assert_eq!(qc["fmt"], "e4m3");
    assert_eq!(qc["activation_scheme"], "dynamic");
    assert_eq!(qc["weight_block_size"], serde_json::json!(block));
    assert_eq!(
        qc["modules_to_not_convert"],
        serde_json::json!(["lm_head", "model.embed_tokens"])
    );
}

#[test]
fn cli_quantizes_a_directory_and_load_reads_it_back() {
    let mut rng = rng("cli_quantize");
    let src = tempfile::tempdir().unwrap();
    let dst = tempfile::tempdir().unwrap();
    let orig = write_checkpoint(src.path(), &mut rng);
    let out = Command::new(env!("CARGO_BIN_EXE_fp8nsa"))
        .args(["quantize", src.path().to_str().unwrap(), "-o"])
        .arg(dst.path())
        .args(["--block", "64x128"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("converted 3 weights"), "{stdout}");
    check_output(dst.path(), &orig, [64, 128]);
}

#[test]
fn library_quantizes_a_single_file() {
    let mut rng = rng("lib_quantize");
    let src = tempfile::tempdir().unwrap();
    let dst = tempfile::tempdir().unwrap();
    let orig = write_checkpoint(src.path(), &mut rng);
    let mut seen = vec![];
    let report = quantize_checkpoint(
        &src.path().join("model.safetensors"),
        &dst.path().join("model.safetensors"),
        &QuantizeOptions::default(),
        &mut |name, _| seen.push(name.to_string()),
    )
    .unwrap();
    assert_eq!(report.converted, seen);
    assert_eq!(report.converted.len(), 3);
    check_output(dst.path(), &orig, [128, 128]);
}

#[test]
fn cli_errors_are_messages_not_panics() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_fp8nsa"))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (ok, err) = run(&[
        "quantize",
        "/nonexistent/model.safetensors",
        "-o",
        "/tmp/x.safetensors",
    ]);
    assert!(
        !ok && err.contains("/nonexistent/model.safetensors"),
        "{err}"
    );
    let (ok, err) = run(&["quantize", "a", "-o", "b", "--block", "0x128"]);
    assert!(!ok && err.contains("positive"), "{err}");
    let (ok, err) = run(&["quantize", "a", "-o", "b", "--scale-dtype", "f8"]);
    assert!(!ok && err.contains("f32 or bf16"), "{err}");
    // not a safetensors file
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.safetensors");
    std::fs::write(&bad, b"not a checkpoint").unwrap();
    let (ok, err) = run(&[
        "quantize",
        bad.to_str().unwrap(),
        "-o",
        dir.path().join("o.safetensors").to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("bad.safetensors"), "{err}");
    // refusing to overwrite the input
    let src = tempfile::tempdir().unwrap();
    write_checkpoint(src.path(), &mut rng("cli_errors"));
    let p = src.path().join("model.safetensors");
    let (ok, err) = run(&["quantize", p.to_str().unwrap(), "-o", p.to_str().unwrap()]);
    assert!(!ok && err.contains("overwrite"), "{err}");
}

#[test]
fn shards_get_an_index_and_same_folder_output_keeps_the_input_config() {
    let mut rng = rng("shards");
    let src = tempfile::tempdir().unwrap();
    let orig = write_checkpoint(src.path(), &mut rng);
    // split into two shards
    let (a, b): (Vec<_>, Vec<_>) = orig.iter().partition(|(n, _)| n.contains("mlp"));
    let to_map = |v: Vec<(&String, &Tensor)>| {
        v.into_iter()
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect::<HashMap<_, _>>()
    };
    std::fs::remove_file(src.path().join("model.safetensors")).unwrap();
    candle_core::safetensors::save(
        &to_map(a),
        src.path().join("model-00001-of-00002.safetensors"),
    )
    .unwrap();
    candle_core::safetensors::save(
        &to_map(b),
        src.path().join("model-00002-of-00002.safetensors"),
    )
    .unwrap();
    let dst = tempfile::tempdir().unwrap();
    quantize_checkpoint(
        src.path(),
        dst.path(),
        &QuantizeOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dst.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(
        map["model.layers.0.mlp.up_proj.weight_scale_inv"],
        "model-00001-of-00002.safetensors"
    );
    assert_eq!(
        map["model.layers.0.self_attn.q_proj.weight"],
        "model-00002-of-00002.safetensors"
    );
    assert_eq!(map.len(), orig.len() + 3);

    // file mode with the output beside the input: config.json is left alone
    let before = std::fs::read_to_string(src.path().join("config.json")).unwrap();
    let f = src.path().join("model-00001-of-00002.safetensors");
    quantize_checkpoint(
        &f,
        &src.path().join("fp8.safetensors"),
        &QuantizeOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(
        std::fs::read_to_string(src.path().join("config.json")).unwrap(),
        before
    );
    let qc: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(src.path().join("quantization_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(qc["quant_method"], "fp8");
}

/// Every file in `dir` (recursively), relative, with its bytes.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                out.push((rel, std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// A checkpoint that already holds `X.weight_scale_inv` beside a dense `X.weight` is an error
/// naming both, not a panic inside the safetensors writer (issue: reliability, item 2).
#[test]
fn a_stale_scale_beside_a_dense_weight_is_an_error() {
    let src = tempfile::tempdir().unwrap();
    let mut t = write_checkpoint(src.path(), &mut rng("stale_scale"));
    t.insert(
        "model.layers.0.mlp.up_proj.weight_scale_inv".into(),
        Tensor::ones((3, 2), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&t, src.path().join("model.safetensors")).unwrap();
    let err = quantize_fails(src.path());
    assert!(
        err.contains("model.layers.0.mlp.up_proj.weight_scale_inv would be written twice")
            && err.contains("model.layers.0.mlp.up_proj.weight,"),
        "{err}"
    );
}

/// Runs `fp8nsa quantize SRC -o PARENT/out`, which must fail with a message, not a panic, and
/// write nothing (no output, no staging folder); returns its stderr.
fn quantize_fails(src: &Path) -> String {
    let parent = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_fp8nsa"))
        .args(["quantize", src.to_str().unwrap(), "-o"])
        .arg(parent.path().join("out"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        std::fs::read_dir(parent.path()).unwrap().next().is_none(),
        "{err}"
    );
    err
}

/// The output is complete or untouched (issue: reliability, items 14 and 15): an existing
/// output needs --force; a run that fails on shard 2 leaves the old output exactly as it was
/// and no partial files; a good --force run replaces it whole; `-o` at the input's
/// config.json is refused; written files have ordinary permissions.
#[test]
fn output_is_replaced_whole_or_not_at_all() {
    let mut rng = rng("atomic_output");
    let src = tempfile::tempdir().unwrap();
    let orig = write_checkpoint(src.path(), &mut rng);
    let parent = tempfile::tempdir().unwrap();
    let dst = parent.path().join("out");
    let opts = QuantizeOptions::default();
    quantize_checkpoint(src.path(), &dst, &opts, &mut |_, _| {}).unwrap();
    let first = snapshot(&dst);
    #[cfg(unix)]
    for name in ["model.safetensors", "config.json"] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dst.join(name))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o644, "{name}: {mode:o}");
    }

    // a second run into the same, non-empty folder
    let e = quantize_checkpoint(src.path(), &dst, &opts, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("--force"), "{e}");

    // two shards, the second one broken: --force fails and changes nothing
    std::fs::remove_file(src.path().join("model.safetensors")).unwrap();
    let (a, b): (Vec<_>, Vec<_>) = orig.into_iter().partition(|(n, _)| n.contains("mlp"));
    let mut b: HashMap<_, _> = b.into_iter().collect();
    candle_core::safetensors::save(
        &a.into_iter().collect::<HashMap<_, _>>(),
        src.path().join("model-00001-of-00002.safetensors"),
    )
    .unwrap();
    let shard2 = src.path().join("model-00002-of-00002.safetensors");
    std::fs::write(&shard2, b"truncated").unwrap();
    let force = QuantizeOptions {
        force: true,
        ..QuantizeOptions::default()
    };
    let e = quantize_checkpoint(src.path(), &dst, &force, &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("model-00002-of-00002"), "{e}");
    assert_eq!(snapshot(&dst), first, "the old output changed");
    let left: Vec<_> = std::fs::read_dir(parent.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["out"], "partial files left behind");

    // repaired: --force replaces the output as a whole
    b.remove("lm_head.weight");
    candle_core::safetensors::save(&b, &shard2).unwrap();
    quantize_checkpoint(src.path(), &dst, &force, &mut |_, _| {}).unwrap();
    let names: Vec<String> = snapshot(&dst).into_iter().map(|f| f.0).collect();
    assert_eq!(
        names,
        [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json"
        ]
    );
    let left = std::fs::read_dir(parent.path()).unwrap().count();
    assert_eq!(left, 1);
    // an output inside the input folder, or holding it, is refused even with --force
    for out in [
        src.path().join("config.json"),
        src.path().join("sub"),
        src.path().parent().unwrap().to_path_buf(),
    ] {
        let e = quantize_checkpoint(src.path(), &out, &force, &mut |_, _| {}).unwrap_err();
        assert!(
            e.to_string().contains("overlaps the input"),
            "{}: {e}",
            out.display()
        );
    }
    assert!(src.path().join("config.json").is_file());
    // --force over a file where the output folder goes
    let file = parent.path().join("was_a_file");
    std::fs::write(&file, b"x").unwrap();
    quantize_checkpoint(src.path(), &file, &force, &mut |_, _| {}).unwrap();
    assert!(file.join("config.json").is_file());
    assert_eq!(std::fs::read_dir(parent.path()).unwrap().count(), 2);

    // -o at the input's own config.json: refused, config untouched
    let cfg = src.path().join("config.json");
    let before = std::fs::read(&cfg).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_fp8nsa"))
        .args([
            "quantize",
            src.path()
                .join("model-00001-of-00002.safetensors")
                .to_str()
                .unwrap(),
            "-o",
        ])
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(".safetensors"),
        "{err}"
    );
    assert_eq!(std::fs::read(&cfg).unwrap(), before);
}

/// A weight the converter cannot take (here an empty [0, 4] one) is named with its file.
#[test]
fn a_bad_weight_is_named_with_its_file() {
    let src = tempfile::tempdir().unwrap();
    let mut t = write_checkpoint(src.path(), &mut rng("bad_weight_named"));
    t.insert(
        "model.layers.0.mlp.gate_proj.weight".into(),
        Tensor::zeros((0, 4), DType::F32, &Device::Cpu).unwrap(),
    );
    let file = src.path().join("model.safetensors");
    candle_core::safetensors::save(&t, &file).unwrap();
    let parent = tempfile::tempdir().unwrap();
    let e = quantize_checkpoint(
        src.path(),
        &parent.path().join("out"),
        &QuantizeOptions::default(),
        &mut |_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(&file.display().to_string())
            && e.contains("tensor model.layers.0.mlp.gate_proj.weight")
            && e.contains("[0, 4]"),
        "{e}"
    );
    assert!(std::fs::read_dir(parent.path()).unwrap().next().is_none());
}

/// A dense weight holding an Inf (or a NaN) is refused end to end through the CLI, naming the
/// tensor, with nothing written: no Inf scale reaches a file (issue: reliability, item 9).
#[test]
fn a_non_finite_weight_is_refused_and_nothing_is_written() {
    for bad in [f32::INFINITY, f32::NAN] {
        let src = tempfile::tempdir().unwrap();
        let mut t = write_checkpoint(src.path(), &mut rng("non_finite_weight"));
        let name = "model.layers.0.mlp.up_proj.weight";
        let w = &t[name];
        let mut v: Vec<f32> = w
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mid = v.len() / 2;
        v[mid] = bad;
        let poisoned = Tensor::from_vec(v, w.dims(), &Device::Cpu)
            .unwrap()
            .to_dtype(w.dtype())
            .unwrap();
        t.insert(name.into(), poisoned);
        candle_core::safetensors::save(&t, src.path().join("model.safetensors")).unwrap();
        let err = quantize_fails(src.path());
        assert!(err.contains(name), "{bad}: {err}");
    }
}
