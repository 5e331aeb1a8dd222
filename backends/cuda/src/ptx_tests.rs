//! The PTX built into the crate, checked without a GPU: every kernel a launcher can ask for
//! is in the PTX of every family it can run on, and each PTX assembles with ptxas for real
//! targets of its family without register spills.

use std::path::PathBuf;
use std::process::Command;

use crate::fp8::names as f;
use crate::nsa::{names as n, HEAD_DIMS, VALUE_DIMS};
use crate::ptx::{self, Family};

/// (module, kernel names) a device of `family` may launch.
fn wanted(family: Family) -> Vec<(&'static str, Vec<String>)> {
    let mut quant: Vec<String> = f::PAD.iter().map(|s| s.to_string()).collect();
    let mut gemv = Vec::new();
    let mut gemm = Vec::new();
    for s in f::SUFFIXES {
        quant.push(f::act(s, false));
        quant.push(f::act(s, true));
        quant.extend(f::ELEMENTWISE.iter().map(|w| f::elementwise(w, s)));
        gemv.extend(f::GEMV_TOKENS.iter().map(|&t| f::gemv(t, s)));
        gemv.extend(f::GEMV_TOKENS.iter().map(|&t| f::grouped_gemv(t, s)));
        gemm.extend(f::TILES.iter().map(|&t| f::gemm(t, s)));
        gemm.extend(f::TILES.iter().map(|&t| f::grouped_gemm(t, s)));
    }
    let mut nsa = Vec::new();
    for s in n::SUFFIXES {
        nsa.push(n::merge(s));
        for d in HEAD_DIMS {
            for dv in VALUE_DIMS {
                nsa.extend(n::WARPS.iter().map(|&w| n::selection(s, d, dv, w)));
            }
        }
    }
    let mut out = vec![
        (f::QUANT_MODULE, quant),
        (f::GEMV_MODULE, gemv),
        (n::MODULE, nsa),
    ];
    // the fp8 tensor-core kernel exists from sm_89 on; the planner never picks it below
    if family >= Family::Sm89 {
        out.push((f::GEMM_MODULE, gemm));
    }
    out
}

#[test]
fn every_launched_kernel_is_in_its_family_ptx() {
    for family in [Family::Sm80, Family::Sm89] {
        for (module, names) in wanted(family) {
            let text = ptx::find(module, family)
                .unwrap_or_else(|| panic!("{module} not built for {}", family.name()));
            let entries = ptx::entries(text);
            for name in names {
                assert!(
                    entries.contains(&name.as_str()),
                    "{name} missing from {module} ({}); entries: {entries:?}",
                    family.name()
                );
            }
        }
    }
    assert!(ptx::find(f::GEMM_MODULE, Family::Sm80).is_none());
}

/// The emulator holds every kernel a plan may name (its registrars are linked).
#[cfg(feature = "emu")]
#[test]
fn emulator_holds_every_kernel() {
    for (_, names) in wanted(Family::Sm89) {
        for name in names {
            assert!(crate::emu::has_kernel(&name), "{name} not in the emulator");
        }
    }
}

#[test]
fn family_follows_compute_capability() {
    assert_eq!(Family::for_capability((7, 5)), None);
    assert_eq!(Family::for_capability((8, 0)), Some(Family::Sm80));
    assert_eq!(Family::for_capability((8, 6)), Some(Family::Sm80));
    assert_eq!(Family::for_capability((8, 9)), Some(Family::Sm89));
    assert_eq!(Family::for_capability((9, 0)), Some(Family::Sm89));
    assert_eq!(Family::for_capability((12, 0)), Some(Family::Sm89));
}

fn ptxas() -> Option<PathBuf> {
    let from_root = ["CUDA_ROOT", "CUDA_PATH", "CUDA_HOME"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .map(|r| PathBuf::from(r).join("bin/ptxas"))
        .find(|p| p.exists());
    from_root.or_else(|| {
        Command::new("ptxas")
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|_| PathBuf::from("ptxas"))
    })
}

/// What the device's JIT will do with our PTX, done ahead by ptxas: it must assemble for each
/// target of the family, and no kernel may spill registers to local memory.
#[test]
fn ptx_assembles_for_real_targets_without_spills() {
    let Some(ptxas) = ptxas() else {
        eprintln!(
            "ptx_assembles_for_real_targets_without_spills: skipped, no ptxas (set CUDA_ROOT)"
        );
        return;
    };
    let dir = std::env::temp_dir().join(format!("fp8nsa-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (module, family, _) in ptx::built_modules() {
        let text = ptx::find(
            module,
            if family == "sm80" {
                Family::Sm80
            } else {
                Family::Sm89
            },
        )
        .unwrap();
        let file = dir.join(format!("{module}_{family}.ptx"));
        std::fs::write(&file, text).unwrap();
        let targets: &[&str] = if family == "sm80" {
            &["sm_80", "sm_86"]
        } else {
            &["sm_89", "sm_90"]
        };
        for target in targets {
            let out = Command::new(&ptxas)
                .args(["-v", "-arch", target, "-o", "/dev/null"])
                .arg(&file)
                .output()
                .unwrap();
            let log = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "ptxas {target} {module}: {log}");
            let spills: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("spill stores") && !l.contains(" 0 bytes spill stores"))
                .collect();
            assert!(spills.is_empty(), "{module} on {target} spills: {spills:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
