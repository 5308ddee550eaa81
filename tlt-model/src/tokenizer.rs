//! Tokenizers: `tokenizer.json` files, and the byte-level BPE tokenizer embedded in GGUF metadata.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::{Error, Result};

/// GGUF `token_type` of control tokens (`<|im_start|>`, `<|endoftext|>`, ...).
const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF `token_type` of user-defined tokens.
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// The Llama-3 pre-tokenizer regex (llama.cpp `llama-bpe`).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The Qwen2 pre-tokenizer regex (llama.cpp `qwen2`).
const QWEN2_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The special tokens of [`byte_tokenizer`], with ids 256, 257 and 258 after the 256 bytes.
pub const BYTE_TOKENIZER_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// A byte-level BPE tokenizer without merges: one token per byte (id = the byte), then ChatML's special tokens
/// ([`BYTE_TOKENIZER_SPECIALS`], ids 256-258): 259 tokens. For tiny test models and fixtures that need real text
/// in and out (`save_hf_dir` writes it as `tokenizer.json`).
///
/// # Errors
/// Never in practice; the `tokenizers` crate's error, as [`Error::Tokenizer`], if it refused the definition.
pub fn byte_tokenizer() -> Result<Tokenizer> {
    // GPT-2's byte-to-character map: printable bytes stand for themselves, the others for 256 + their rank.
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut extra = 0;
    let mut vocab = serde_json::Map::new();
    for b in 0u32..256 {
        let c = if printable(b) {
            char::from_u32(b)
        } else {
            extra += 1;
            char::from_u32(255 + extra)
        };
        vocab.insert(c.unwrap_or('\u{fffd}').to_string(), b.into());
    }
    let added: Vec<serde_json::Value> = BYTE_TOKENIZER_SPECIALS
        .iter()
        .enumerate()
        .map(|(i, content)| {
            serde_json::json!({"id": 256 + i, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let byte_level =
        serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let value = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": byte_level, "post_processor": null, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []}
    });
    serde_json::from_value(value).map_err(|e| Error::Tokenizer(e.to_string()))
}

/// Loads a Hugging Face `tokenizer.json`.
///
/// The text is parsed as JSON first and the tokenizer built from that value: `tokenizers` deserializes some
/// components (decoders, normalizers) through helpers that panic on a JSON syntax error inside them (e.g. nesting
/// past serde_json's recursion limit), where a whole-document parse reports the error.
pub fn load_tokenizer_json(path: &Path) -> Result<Tokenizer> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| Error::malformed(path, "tokenizer.json", e))?;
    check_bpe_merges(&value["model"]).map_err(|reason| Error::malformed(path, "tokenizer.json", reason))?;
    // Backstop: a panic the checks above did not foresee is this loader's typed error too (fuzzing found a BPE
    // `continuing_subword_prefix` longer than a merge's right part, which the merge check now reports).
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serde_json::from_value::<Tokenizer>(value))) {
        Ok(r) => r.map_err(|e| Error::malformed(path, "tokenizer.json", e)),
        Err(p) => {
            let msg = p.downcast_ref::<String>().map(String::as_str).or_else(|| p.downcast_ref::<&str>().copied());
            let reason = format!("inconsistent tokenizer (the tokenizers crate panicked: {})", msg.unwrap_or(""));
            Err(Error::malformed(path, "tokenizer.json", reason))
        }
    }
}

/// Checks what `tokenizers`' BPE builder assumes of a model's merges: each `(a, b)` merges into a vocabulary
/// token `a + b` (with `b`'s `continuing_subword_prefix` dropped, which `b` must start with). The builder writes
/// the merged bytes into a buffer as long as the longest token and cuts `b`'s prefix by length, so a violation
/// panics (or builds a non-UTF-8 string) there instead of reporting the missing token. Anything else (not a BPE
/// model, merges in another shape) is left to `tokenizers`.
fn check_bpe_merges(model: &serde_json::Value) -> std::result::Result<(), String> {
    let (Some(vocab), Some(merges)) = (model.get("vocab").and_then(|v| v.as_object()), model.get("merges")) else {
        return Ok(());
    };
    let Some(merges) = merges.as_array() else { return Ok(()) };
    let prefix = model.get("continuing_subword_prefix").and_then(|p| p.as_str()).unwrap_or("");
    for m in merges {
        let (a, b) = match m {
            // As `tokenizers` reads them: `#version` lines skipped, anything but two parts its error.
            serde_json::Value::String(s) => match s.split(' ').collect::<Vec<_>>().as_slice() {
                [a, b] if !s.starts_with("#version") => (*a, *b),
                _ => continue,
            },
            serde_json::Value::Array(pair) => match pair.as_slice() {
                [serde_json::Value::String(a), serde_json::Value::String(b)] => (a.as_str(), b.as_str()),
                _ => continue,
            },
            _ => continue,
        };
        check_merge(a, b, prefix, |t| vocab.contains_key(t))?;
    }
    Ok(())
}

/// Checks one merge `(a, b)` (see [`check_bpe_merges`]).
fn check_merge(a: &str, b: &str, prefix: &str, known: impl Fn(&str) -> bool) -> std::result::Result<(), String> {
    let rest = b.strip_prefix(prefix).ok_or_else(|| format!("merge `{a} {b}`: `{b}` lacks the prefix `{prefix}`"))?;
    let merged = format!("{a}{rest}");
    if !known(a) || !known(b) || !known(&merged) {
        return Err(format!("merge `{a} {b}` refers to tokens missing from the vocabulary"));
    }
    Ok(())
}

/// The pieces of a GGUF-embedded tokenizer (`tokenizer.ggml.*` metadata).
#[derive(Debug, Clone)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model` (only `gpt2`, byte-level BPE, is supported).
    pub model: String,
    /// `tokenizer.ggml.pre`, selecting the pre-tokenizer regex.
    pub pre: String,
    /// Token strings by id.
    pub tokens: Vec<String>,
    /// Merges as `"a b"` strings, highest priority first.
    pub merges: Vec<String>,
    /// Token types by id (3 = control, 4 = user-defined); empty if absent.
    pub token_types: Vec<i32>,
}

/// Builds the byte-level BPE tokenizer llama.cpp would use for this vocabulary.
///
/// `path` only labels errors.
pub fn tokenizer_from_gguf_vocab(vocab: &GgufVocab, path: &Path) -> Result<Tokenizer> {
    if vocab.model != "gpt2" {
        return Err(Error::Unsupported { path: path.into(), what: "tokenizer model", value: vocab.model.clone() });
    }
    let pre: PreTokenizerWrapper = match vocab.pre.as_str() {
        "smollm" | "starcoder" | "refact" | "default" | "gpt2" | "gpt-2" => {
            let byte_level = ByteLevel::new(false, true, true);
            if vocab.pre == "gpt2" || vocab.pre == "gpt-2" || vocab.pre == "default" {
                byte_level.into()
            } else {
                Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
            }
        }
        "llama-bpe" | "llama3" | "qwen2" => {
            let regex = if vocab.pre == "qwen2" { QWEN2_REGEX } else { LLAMA3_REGEX };
            let split = Split::new(SplitPattern::Regex(regex.into()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| Error::Tokenizer(e.to_string()))?;
            Sequence::new(vec![split.into(), ByteLevel::new(false, true, false).into()]).into()
        }
        other => {
            return Err(Error::Unsupported { path: path.into(), what: "tokenizer pre-tokenizer", value: other.into() })
        }
    };
    let token_ids: tokenizers::models::bpe::Vocab =
        vocab.tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    if token_ids.len() != vocab.tokens.len() {
        return Err(Error::malformed(path, "gguf", "tokenizer.ggml.tokens holds duplicate tokens"));
    }
    let merges = vocab
        .merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| Error::malformed(path, "gguf", format!("merge `{m}` is not `a b`")))
        })
        .collect::<Result<Vec<_>>>()?;
    for (a, b) in &merges {
        check_merge(a, b, "", |t| token_ids.contains_key(t))
            .map_err(|reason| Error::malformed(path, "gguf", reason))?;
    }
    let bpe = BPE::builder()
        .vocab_and_merges(token_ids, merges)
        .build()
        .map_err(|e| Error::malformed(path, "gguf", format!("tokenizer: {e}")))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    let added = |kind: i32, special: bool| -> Vec<AddedToken> {
        vocab
            .token_types
            .iter()
            .zip(&vocab.tokens)
            .filter(|(t, _)| **t == kind)
            .map(|(_, tok)| AddedToken::from(tok.clone(), special))
            .collect()
    };
    tokenizer.add_special_tokens(added(TOKEN_TYPE_CONTROL, true)).map_err(|e| Error::Tokenizer(e.to_string()))?;
    tokenizer.add_tokens(added(TOKEN_TYPE_USER_DEFINED, false)).map_err(|e| Error::Tokenizer(e.to_string()))?;
    Ok(tokenizer)
}

/// Encodes `text` (special tokens like `<|im_start|>` are recognised; no BOS is added).
pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let enc = tokenizer.encode(text, false).map_err(|e| Error::Tokenizer(e.to_string()))?;
    Ok(enc.get_ids().to_vec())
}

/// Decodes ids to text, keeping special tokens.
pub fn decode(tokenizer: &Tokenizer, ids: &[u32]) -> Result<String> {
    tokenizer.decode(ids, false).map_err(|e| Error::Tokenizer(e.to_string()))
}
