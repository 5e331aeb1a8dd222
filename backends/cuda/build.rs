//! Compiles `kernels/*.cu` to PTX with nvcc, one PTX per kernel file and target family, and
//! writes `ptx.rs` (included by `src/ptx.rs`) with the embedded texts. The families:
//! - `sm80`: generic Ampere PTX (no fp8 tensor cores; fp8 decoded in software);
//! - `sm89`: fp8 `mma.sync` (Ada, Hopper and later run it; JIT-compiled for the device).
//!
//! Needs nvcc from CUDA >= 12.9 (cuBLASLt block scaling): `CUDA_ROOT`, `CUDA_PATH`,
//! `CUDA_HOME` or `PATH`. `.ci/cuda-toolchain.sh` provides one from PyPI wheels.

use std::path::{Path, PathBuf};
use std::process::Command;

/// (family, nvcc virtual architecture).
const FAMILIES: &[(&str, &str)] = &[("sm80", "compute_80"), ("sm89", "compute_89")];

/// (kernel file stem, lowest family it is built for).
const KERNELS: &[(&str, &str)] = &[
    ("fp8_quant", "sm80"),
    ("fp8_gemv", "sm80"),
    ("fp8_gemm", "sm89"),
    ("nsa_selection", "sm80"),
];

fn nvcc() -> PathBuf {
    for var in ["CUDA_ROOT", "CUDA_PATH", "CUDA_HOME"] {
        println!("cargo:rerun-if-env-changed={var}");
        if let Ok(root) = std::env::var(var) {
            let p = Path::new(&root).join("bin/nvcc");
            if p.exists() {
                return p;
            }
        }
    }
    // on PATH: resolve it, so the toolkit's include directory can be found next to it
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("nvcc"))
                .find(|p| p.exists())
        })
        .unwrap_or_else(|| PathBuf::from("nvcc"))
}

/// The CPU emulator (`emu` feature): emu/emu.cpp with the kernels compiled as C++.
#[cfg(feature = "emu")]
fn build_emulator(nvcc: &Path) {
    let include = nvcc
        .parent()
        .and_then(Path::parent)
        .map(|root| root.join("include"))
        .filter(|p| p.join("cuda_fp8.h").exists())
        .unwrap_or_else(|| {
            panic!(
                "fp8nsa-cuda emu: no include/cuda_fp8.h next to {}",
                nvcc.display()
            )
        });
    println!("cargo:rerun-if-changed=emu");
    cc::Build::new()
        .cpp(true)
        .file("emu/emu.cpp")
        .include("emu")
        .include("kernels")
        .include(include)
        .define("FP8NSA_EMU", None)
        .flag("-std=c++17")
        .flag_if_supported("-Wno-unknown-pragmas")
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .compile("fp8nsa_emu");
}

fn nvcc_version(nvcc: &Path) -> (u32, u32) {
    let out = Command::new(nvcc)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| {
            panic!(
            "fp8nsa-cuda: cannot run {} ({e}). The `cuda` feature needs nvcc from CUDA >= 12.9: \
             set CUDA_ROOT, or `source .ci/cuda-toolchain.sh`",
            nvcc.display()
        )
        });
    let text = String::from_utf8_lossy(&out.stdout);
    let release = text
        .split("release ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap_or_else(|| panic!("fp8nsa-cuda: unexpected `nvcc --version` output: {text}"));
    let mut it = release
        .trim()
        .split('.')
        .map(|x| x.parse::<u32>().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("kernels");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed={}", dir.display());
    for entry in std::fs::read_dir(&dir).unwrap() {
        println!("cargo:rerun-if-changed={}", entry.unwrap().path().display());
    }

    let nvcc = nvcc();
    let (major, minor) = nvcc_version(&nvcc);
    if (major, minor) < (12, 9) {
        panic!(
            "fp8nsa-cuda: nvcc {major}.{minor} found at {}; CUDA >= 12.9 is required \
             (cuBLASLt 128-element / 128x128 block scaling)",
            nvcc.display()
        );
    }
    println!("cargo:rustc-env=FP8NSA_NVCC_VERSION={major}.{minor}");
    #[cfg(feature = "emu")]
    build_emulator(&nvcc);

    let family_rank = |f: &str| FAMILIES.iter().position(|(n, _)| *n == f).unwrap();
    let mut jobs = Vec::new();
    for (stem, lowest) in KERNELS {
        for (family, arch) in FAMILIES {
            if family_rank(family) < family_rank(lowest) {
                continue;
            }
            let src = dir.join(format!("{stem}.cu"));
            let dst = out.join(format!("{stem}_{family}.ptx"));
            jobs.push((
                stem.to_string(),
                family.to_string(),
                arch.to_string(),
                src,
                dst,
            ));
        }
    }
    // nvcc runs are independent: all at once, a thread each
    let handles: Vec<_> = jobs
        .iter()
        .cloned()
        .map(|(_, _, arch, src, dst)| {
            let nvcc = nvcc.clone();
            let inc = dir.clone();
            std::thread::spawn(move || {
                let res = Command::new(&nvcc)
                    .args(["-std=c++17", "-O3", "-lineinfo", "-ptx"])
                    .arg(format!("-arch={arch}"))
                    .arg("-I")
                    .arg(&inc)
                    .arg(&src)
                    .arg("-o")
                    .arg(&dst)
                    .output()
                    .expect("nvcc runs");
                (src, res)
            })
        })
        .collect();
    for h in handles {
        let (src, res) = h.join().unwrap();
        if !res.status.success() {
            panic!(
                "fp8nsa-cuda: nvcc failed on {}:\n{}{}",
                src.display(),
                String::from_utf8_lossy(&res.stdout),
                String::from_utf8_lossy(&res.stderr)
            );
        }
    }

    let mut table = String::from(
        "/// (module, family, PTX text) for every kernel file and family it is built for.\n\
         pub(crate) static MODULES: &[(&str, &str, &str)] = &[\n",
    );
    for (stem, family, _, _, dst) in &jobs {
        table.push_str(&format!(
            "    ({stem:?}, {family:?}, include_str!({:?})),\n",
            dst.display().to_string()
        ));
    }
    table.push_str("];\n");
    std::fs::write(out.join("ptx.rs"), table).unwrap();
}
