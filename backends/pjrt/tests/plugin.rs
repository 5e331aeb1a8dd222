//! The binding against the real XLA CPU plugin (`pip install xla-cpu-pjrt`; skipped, saying
//! so, when it is absent, and failing then under `FP8NSA_REQUIRE_PJRT=1`, as in CI).

use fp8nsa_pjrt::programs::AttnShape;
use fp8nsa_pjrt::{safe, Error, PjrtRuntime};
use fp8nsa_types::{ActQuant, TpuKernel};

/// The leak check counts live objects process-wide: tests of this binary take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn runtime() -> Option<PjrtRuntime> {
    let p = fp8nsa_test_support::resource::pjrt_plugin()?;
    Some(PjrtRuntime::load(&p.to_string_lossy()).expect("plugin loads"))
}

fn e4m3(c: u8) -> f32 {
    fp8nsa_test_support::e4m3_value(c) as f32
}

#[test]
fn w8a16_matches_a_direct_computation() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(rt) = runtime() else { return };
    assert_eq!(rt.platform(), "cpu");
    assert!(rt.api_version() >= (0, 81));
    let (m, n, k, block) = (3, 5, 7, [2, 4]);
    let codes: Vec<u8> = (0..n * k)
        .map(|i| ((i * 37 + 5) % 0x7e) as u8 | if i % 3 == 0 { 0x80 } else { 0 })
        .collect();
    let scales: Vec<f32> = (0..3 * 2).map(|i| 0.5 + i as f32).collect();
    let bias: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let x: Vec<f32> = (0..m * k).map(|i| (i as f32 - 10.0) / 3.0).collect();
    let w = rt
        .upload_weight(&codes, &scales, Some(&bias), n, k, block)
        .unwrap();
    let y = rt
        .fp8_linear(&x, m, &w, ActQuant::None, TpuKernel::V1)
        .unwrap();
    for r in 0..m {
        for c in 0..n {
            let mut want = bias[c] as f64;
            for i in 0..k {
                let s = scales[(c / block[0]) * 2 + i / block[1]] as f64;
                want += x[r * k + i] as f64 * e4m3(codes[c * k + i]) as f64 * s;
            }
            assert!(
                (y[r * n + c] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                "{r},{c}: {} vs {want}",
                y[r * n + c]
            );
        }
    }
    // compiled once, reused
    rt.fp8_linear(&x, m, &w, ActQuant::None, TpuKernel::V1)
        .unwrap();
    assert_eq!(rt.cached_programs(), 1);
    // every activation scheme compiles and runs
    for act in [ActQuant::Group, ActQuant::Block2d { bm: 2 }] {
        assert_eq!(
            rt.fp8_linear(&x, m, &w, act, TpuKernel::V1).unwrap().len(),
            m * n
        );
    }
}

#[test]
fn masked_attention_runs_and_empty_rows_are_zero() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(rt) = runtime() else { return };
    let s = AttnShape {
        tq: 2,
        tk: 3,
        hq: 2,
        hkv: 1,
        d: 2,
        dv: 2,
    };
    let q = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.5];
    let k = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
    let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    let ninf = f32::NEG_INFINITY;
    let mask = [0.0, ninf, ninf, ninf, ninf, ninf]; // query 0 sees key 0; query 1 nothing
    let (o, lse) = rt.nsa_selection(s, &q, &k, &v, &mask, 1.0).unwrap();
    assert_eq!(&o[..4], &[1.0, 2.0, 1.0, 2.0]);
    assert_eq!(&o[4..], &[0.0; 4]);
    assert_eq!((lse[0], lse[1]), (1.0, 0.0));
    assert!(lse[2..].iter().all(|&x| x == ninf));
}

#[test]
fn errors_come_back_as_errors() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(rt) = runtime() else { return };
    let bad = rt.executable("bad", || {
        "module @bad { func.func @main( this is not MLIR }".into()
    });
    match bad {
        Err(Error::Plugin { code, message, .. }) => {
            assert!(code > 0 && message.contains("error"), "{code} {message}")
        }
        other => panic!("expected a plugin error, got {:?}", other.map(|_| ())),
    }
    let w = rt
        .upload_weight(&[0x38; 6], &[1.0], None, 2, 3, [128, 128])
        .unwrap();
    let e = rt
        .fp8_linear(&[1.0; 4], 1, &w, ActQuant::Group, TpuKernel::V1)
        .unwrap_err();
    assert!(matches!(e, Error::Invalid { arg: "x", .. }), "{e}");
    let e = rt
        .upload_weight(&[0x38; 6], &[1.0, 2.0], None, 2, 3, [128, 128])
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(e, Error::Invalid { arg: "scales", .. }), "{e}");
    for k in [TpuKernel::V2, TpuKernel::V3] {
        let e = rt
            .fp8_linear(&[1.0; 3], 1, &w, ActQuant::Group, k)
            .unwrap_err();
        assert!(
            matches!(&e, Error::NotOnPlatform { what, platform }
                if *what == format!("TpuKernel::{k:?}") && platform == "cpu"),
            "{e}"
        );
    }
    let e = "v4".parse::<TpuKernel>().unwrap_err();
    assert!(
        matches!(&e, fp8nsa_types::Error::Setting { got, .. } if got == "v4"),
        "{e}"
    );
    let e = PjrtRuntime::load("/nonexistent/plugin.so").unwrap_err();
    assert!(
        matches!(&e, Error::Load { path, .. } if path == "/nonexistent/plugin.so"),
        "{e}"
    );
}

#[test]
fn repeated_execution_frees_everything() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(rt) = runtime() else { return };
    let w = rt
        .upload_weight(&[0x38; 12], &[1.0], None, 3, 4, [128, 128])
        .unwrap();
    rt.fp8_linear(&[1.0; 8], 2, &w, ActQuant::Group, TpuKernel::V1)
        .unwrap();
    let before = safe::live_objects();
    for _ in 0..100 {
        rt.fp8_linear(&[1.0; 8], 2, &w, ActQuant::Group, TpuKernel::V1)
            .unwrap();
    }
    assert_eq!(
        safe::live_objects(),
        before,
        "[clients, executables, buffers, events]"
    );
}
