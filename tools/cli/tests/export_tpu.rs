//! `fp8nsa export-tpu` end to end: the Pallas kernels exported for the tpu platform (jax, no TPU
//! needed), the manifest selecting a program, the inspector on its Mosaic, and the CPU plugin
//! refusing the TPU-only variants with an error naming its platform.

use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use fp8nsa::{ActQuant, Backend, Fp8BlockWeight, Fp8Linear, PjrtRuntime, TpuKernel};
use fp8nsa_test_support::resource;

#[test]
fn exported_tpu_programs_load_and_are_refused_off_tpu() {
    let Some(plugin) = resource::pjrt_plugin() else {
        return;
    };
    if !resource::jax() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fp8nsa"))
        .args(["export-tpu", "--out"])
        .arg(dir.path())
        .args([
            "--shapes",
            "256,384",
            "--buckets",
            "8,32",
            "--variants",
            "v2,v3",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let m = fp8nsa_pjrt::tpu::TpuManifest::load(dir.path()).unwrap();
    assert_eq!(m.entries.len(), 4);
    let e = m
        .select(
            fp8nsa::TpuKernel::V3,
            9,
            256,
            384,
            [128, 128],
            fp8nsa::ActQuant::Group,
        )
        .unwrap();
    assert_eq!(e.m_bucket, 32);
    let report =
        fp8nsa_inspect::inspect(&std::fs::read_to_string(dir.path().join(&e.mlir)).unwrap());
    assert!(report.satisfies(fp8nsa_inspect::Variant::V3));
    // the CPU plugin runs v1 only
    let rt2 = Arc::new(
        PjrtRuntime::load(&plugin.to_string_lossy())
            .unwrap()
            .with_tpu_programs(dir.path())
            .unwrap(),
    );
    let w = Fp8BlockWeight::quantize(
        &Tensor::ones((256, 384), DType::F32, &Device::Cpu).unwrap(),
        [128, 128],
    )
    .unwrap();
    let layer = Fp8Linear::new(w, None, ActQuant::Group)
        .unwrap()
        .with_backend(Backend::Pjrt(rt2.clone()));
    let x = Tensor::ones((9, 384), DType::F32, &Device::Cpu).unwrap();
    // the runtime refuses, naming its platform, even with the programs loaded
    let refusal = rt2.check_kernel(TpuKernel::V3).unwrap_err();
    assert!(
        matches!(&refusal, fp8nsa_pjrt::Error::NotOnPlatform { platform, .. } if platform == "cpu"),
        "{refusal}"
    );
    // the layer returns that refusal as it is, `Error::Pjrt(..)`, and `Module::forward` as
    // candle's text
    let v3 = layer.clone().with_tpu_kernel(TpuKernel::V3);
    let err = v3.forward_t(&x).unwrap_err();
    assert!(
        matches!(&err, fp8nsa::Error::Pjrt(fp8nsa_pjrt::Error::NotOnPlatform { platform, .. })
            if platform == "cpu" && err.to_string() == refusal.to_string()),
        "{err}"
    );
    let through_candle = v3.forward(&x).unwrap_err();
    assert_eq!(
        fp8nsa_test_support::wrapped_message(&through_candle),
        Some(err.to_string()),
        "{through_candle}"
    );
    assert!(layer.with_tpu_kernel(TpuKernel::V1).forward(&x).is_ok());
}
