//! `fp8nsa`: the command-line tool. `fp8nsa quantize --help` for the checkpoint converter.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use fp8nsa::convert::{bytes_to_convert, quantize_checkpoint, QuantizeOptions};

#[derive(Parser)]
#[command(
    name = "fp8nsa",
    version,
    about = "fp8 block-scaled linear layers and Native Sparse Attention for Candle"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
        #[arg(long, default_value = "(embed|lm_head|norm)")]
        exclude: String,
    },
}

fn parse_block(s: &str) -> Result<[usize; 2], String> {
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
        Command::Quantize {
            input,
            output,
            block,
            include,
            exclude,
        } => quantize(
            input,
            output,
            QuantizeOptions {
                block,
                include,
                exclude,
            },
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn quantize(input: PathBuf, output: PathBuf, opts: QuantizeOptions) -> fp8nsa::Result<()> {
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
