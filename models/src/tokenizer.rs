//! A byte-level BPE tokenizer built from a GGUF file's metadata (`tokenizer.ggml.*`).

use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::{Error, Result};

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

/// The `gpt2`-model tokenizer of a GGUF file: vocabulary and merges from the metadata, control
/// tokens (token type 3) as special tokens, digits split individually before byte-level BPE
/// (the SmolLM / cosmo2 pre-tokenizer).
pub fn from_gguf(content: &gguf_file::Content) -> Result<Tokenizer> {
    let md = &content.metadata;
    let get = |k: &str| md.get(k).ok_or_else(|| tok_err(format!("missing {k}")));
    let model = get("tokenizer.ggml.model")?.to_string().map_err(tok_err)?;
    if model != "gpt2" {
        return Err(tok_err(format!(
            "only byte-level BPE (gpt2) is supported, got {model}"
        )));
    }
    // digits one by one then byte-level BPE is SmolLM's (cosmo2) scheme; plain gpt2 has no
    // digit split; other schemes (llama-bpe, qwen2, ...) use regexes we do not build
    let pre = md
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok().cloned())
        .unwrap_or_else(|| "default".into());
    let split_digits = match pre.as_str() {
        "smollm" => true,
        "gpt2" | "default" => false,
        other => {
            return Err(tok_err(format!(
                "unsupported pre-tokenizer {other:?} (supported: smollm, gpt2)"
            )))
        }
    };
    let tokens: Vec<String> = get("tokenizer.ggml.tokens")?
        .to_vec()
        .map_err(tok_err)?
        .iter()
        .map(|v| v.to_string().cloned().map_err(tok_err))
        .collect::<Result<_>>()?;
    let merges: Vec<(String, String)> = get("tokenizer.ggml.merges")?
        .to_vec()
        .map_err(tok_err)?
        .iter()
        .map(|v| {
            let s = v.to_string().map_err(tok_err)?;
            let (a, b) = s
                .split_once(' ')
                .ok_or_else(|| tok_err(format!("bad merge {s:?}")))?;
            Ok((a.to_string(), b.to_string()))
        })
        .collect::<Result<_>>()?;
    let types: Vec<u32> = match md.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()
            .map_err(tok_err)?
            .iter()
            .map(|t| {
                t.to_u32()
                    .or_else(|_| t.to_i32().map(|x| x as u32))
                    .map_err(tok_err)
            })
            .collect::<Result<_>>()?,
        None => vec![1; tokens.len()],
    };
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(tok_err)?;
    let mut tok = Tokenizer::new(bpe);
    let mut pre_tokenizers = Vec::new();
    if split_digits {
        pre_tokenizers.push(Digits::new(true).into());
    }
    pre_tokenizers.push(ByteLevel::new(false, true, true).into());
    tok.with_pre_tokenizer(Some(Sequence::new(pre_tokenizers)));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &t)| t == 3)
        .map(|(s, _)| AddedToken::from(s.clone(), true))
        .collect();
    tok.add_special_tokens(special).map_err(tok_err)?;
    // user text is text: "<|im_end|>" typed by a user must not become a control token
    // (prompt injection into the chat template); `encode_with_special_tokens` is the way in
    tok.set_encode_special_tokens(true);
    Ok(tok)
}

/// Token ids of `text` as plain text: the text of a special token (`<|im_start|>`, ...) is
/// encoded like any other characters, never as the control token. Use this for anything a
/// user typed; [`chatml`] builds a chat prompt around it.
pub fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tok.encode(text, false).map_err(tok_err)?.get_ids().to_vec())
}

/// Token ids of trusted `text` (a template the application wrote) in which the text of each
/// special token becomes that control token; the rest is encoded as by [`encode`].
pub fn encode_with_special_tokens(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let mut specials: Vec<(String, u32)> = tok
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special && !t.content.is_empty())
        .map(|(id, t)| (t.content, id))
        .collect();
    // the longest match first where one special token is a prefix of another
    specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
    let mut ids = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let next = specials
            .iter()
            .filter_map(|(s, id)| rest.find(s.as_str()).map(|at| (at, s.len(), *id)))
            .min_by_key(|&(at, len, _)| (at, std::cmp::Reverse(len)));
        let Some((at, len, id)) = next else {
            ids.extend(encode(tok, rest)?);
            break;
        };
        if at > 0 {
            ids.extend(encode(tok, &rest[..at])?);
        }
        ids.push(id);
        rest = &rest[at + len..];
    }
    Ok(ids)
}

/// A ChatML prompt (SmolLM2's template): each `(role, content)` as
/// `<|im_start|>role\ncontent<|im_end|>\n`, then `<|im_start|>assistant\n`. The markers are
/// control tokens; roles and contents are plain text, whatever they contain.
pub fn chatml(tok: &Tokenizer, messages: &[(&str, &str)]) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for (role, content) in messages {
        ids.extend(encode_with_special_tokens(tok, "<|im_start|>")?);
        ids.extend(encode(tok, &format!("{role}\n{content}"))?);
        ids.extend(encode_with_special_tokens(tok, "<|im_end|>\n")?);
    }
    ids.extend(encode_with_special_tokens(tok, "<|im_start|>assistant\n")?);
    Ok(ids)
}

/// Text of `ids`, special tokens skipped.
pub fn decode(tok: &Tokenizer, ids: &[u32]) -> Result<String> {
    tok.decode(ids, true).map_err(tok_err)
}
