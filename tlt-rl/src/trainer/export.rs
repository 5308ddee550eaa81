//! The run's byproduct: the RL-trained policy as a Hugging Face directory and its drafter in the EAGLE format
//! SGLang and vLLM serve, side by side, with a `SERVE.md` giving both engines' command lines for the pair.
//!
//! Layout of an export directory (written atomically: a complete new export or the previous one):
//! - `policy/`: `config.json`, `model.safetensors`, and with a text environment `tokenizer.json` and
//!   `tokenizer_config.json` (the chat template the run rendered prompts with, BOS/EOS tokens);
//! - `drafter/` (TLT runs with an EAGLE drafter): `config.json` + `model.safetensors`, EAGLE-2 in the original
//!   layout ([`tlt_drafter::checkpoint::save_eagle2_serving`]) or EAGLE-3 in the SGLang/vLLM format;
//! - `SERVE.md`: the SGLang and vLLM command lines for this pair.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::json;
use tlt_drafter::{DrafterKind, SaveDType};
use tlt_model::Llama;
use tokenizers::Tokenizer;

use super::{Environment, Trainer};
use crate::{Error, Result};

/// The policy directory of an export.
pub const EXPORT_POLICY_DIR: &str = "policy";
/// The drafter directory of an export.
pub const EXPORT_DRAFTER_DIR: &str = "drafter";
/// The serving instructions of an export.
pub const SERVE_FILE: &str = "SERVE.md";

/// When and how a run exports its policy and drafter (the `[export]` table of a run config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExportConfig {
    /// Export at the end of the run, to `<run>/export`. Default true.
    pub at_end: bool,
    /// Also export at every checkpoint, to `<run>/exports/step-<n>`. Default false.
    pub at_checkpoints: bool,
    /// Dtype of the policy weights. Default f32: RL updates (lr ~1e-6..1e-5) are far below bf16's resolution, so
    /// a bf16 export would round most of them away.
    pub policy_dtype: SaveDType,
    /// Dtype of the drafter weights. Default bf16, what SpecForge exports and the engines serve.
    pub drafter_dtype: SaveDType,
}

impl Default for ExportConfig {
    fn default() -> Self {
        Self { at_end: true, at_checkpoints: false, policy_dtype: SaveDType::F32, drafter_dtype: SaveDType::Bf16 }
    }
}

/// What [`Trainer::export`] wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Exported {
    /// The export directory.
    pub dir: PathBuf,
    /// RL steps the exported policy has had.
    pub step: u64,
    /// The drafter's kind, when the run has an EAGLE drafter (`None`: model-free or no drafter).
    pub drafter: Option<DrafterKind>,
}

impl Exported {
    /// The policy directory.
    pub fn policy(&self) -> PathBuf {
        self.dir.join(EXPORT_POLICY_DIR)
    }

    /// The drafter directory, when there is one.
    pub fn drafter_dir(&self) -> Option<PathBuf> {
        self.drafter.map(|_| self.dir.join(EXPORT_DRAFTER_DIR))
    }
}

impl<E: Environment> Trainer<E> {
    /// Exports the policy as it is now and its drafter to `dir` (see the module docs), replacing any
    /// export there.
    ///
    /// # Errors
    /// On an I/O failure (the previous export, if any, is left in place).
    pub fn export(&self, dir: &Path, cfg: &ExportConfig) -> Result<Exported> {
        let mut drafter = None;
        tlt_model::write_dir_atomic(dir, |tmp| -> Result<()> {
            let policy = tmp.join(EXPORT_POLICY_DIR);
            save_policy(&self.policy, self.env().hf_tokenizer(), self.env().hf_chat_template(), &policy, cfg)?;
            if let Some(d) = &self.drafter {
                drafter = d.export(&tmp.join(EXPORT_DRAFTER_DIR), cfg.drafter_dtype)?;
            }
            let serve = serve_instructions(dir, self.step, drafter);
            let path = tmp.join(SERVE_FILE);
            std::fs::write(&path, serve).map_err(|e| Error::io(path, e))?;
            make_readable(tmp)
        })?;
        tracing::info!(dir = %dir.display(), step = self.step, drafter = ?drafter, "exported policy and drafter");
        Ok(Exported { dir: dir.to_path_buf(), step: self.step, drafter })
    }
}

/// Makes every file under `dir` readable by all (mode 0644 on Unix): safetensors writes through a private
/// temporary file (0600), and a serving engine often runs as another user or in a container.
///
/// # Errors
/// On an I/O failure.
pub fn make_readable(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        if path.is_dir() {
            make_readable(&path)?;
        } else {
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))
                    .map_err(|e| Error::io(&path, e))?;
            }
        }
    }
    Ok(())
}

/// Writes `policy` as an HF directory; with a tokenizer, also `tokenizer.json` and a `tokenizer_config.json`.
fn save_policy(
    policy: &Llama,
    tokenizer: Option<&Tokenizer>,
    chat_template: Option<&str>,
    dir: &Path,
    cfg: &ExportConfig,
) -> Result<()> {
    tlt_model::save_hf_dir(policy, tokenizer, dir, cfg.policy_dtype.dtype())?;
    if let Some(tok) = tokenizer {
        let text = serde_json::to_string_pretty(&tokenizer_config(policy.config(), tok, chat_template))?;
        let path = dir.join("tokenizer_config.json");
        std::fs::write(&path, text).map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

/// `tokenizer_config.json` for transformers' `AutoTokenizer` (the fast tokenizer of `tokenizer.json`, as is),
/// with the special tokens of `cfg` and the chat template.
pub fn tokenizer_config(
    cfg: &tlt_model::LlamaConfig,
    tok: &Tokenizer,
    chat_template: Option<&str>,
) -> serde_json::Value {
    let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i));
    let mut v = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": false,
        "add_bos_token": false,
        "add_eos_token": false,
    });
    if let Some(obj) = v.as_object_mut() {
        if let Some(bos) = name(cfg.bos_token_id) {
            obj.insert("bos_token".into(), json!(bos));
        }
        if let Some(eos) = name(cfg.eos_ids().first().copied()) {
            obj.insert("eos_token".into(), json!(eos.clone()));
            obj.insert("pad_token".into(), json!(eos));
        }
        if let Some(t) = chat_template {
            obj.insert("chat_template".into(), json!(t));
        }
    }
    v
}

/// `SERVE.md` of an export at `dir` (absolute when it can be resolved) after `step` RL steps.
pub fn serve_instructions(dir: &Path, step: u64, drafter: Option<DrafterKind>) -> String {
    let base = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mut s = format!(
        "# Serving this export\n\n`policy/` is the policy after {step} RL steps (a Hugging Face checkpoint: \
         `config.json`, `model.safetensors`, tokenizer files when the run had them).\n\n"
    );
    match drafter {
        Some(kind) => s.push_str(&format!(
            "`drafter/` is its {} drafter, trained online on the policy's own rollouts. It shares the policy's \
             embedding and LM head, so serve it with this policy only.\n\n",
            kind_name(kind)
        )),
        None => s.push_str(
            "This run has no trained drafter. Serve the policy alone, or with model-free n-gram drafting:\n\n",
        ),
    }
    let draft = base.join(EXPORT_DRAFTER_DIR);
    s.push_str(&serve_commands(&base.join(EXPORT_POLICY_DIR), drafter.map(|k| (draft.as_path(), k))));
    s
}

fn kind_name(kind: DrafterKind) -> &'static str {
    match kind {
        DrafterKind::Eagle2 => "EAGLE-2 (original EAGLE layout)",
        DrafterKind::Eagle3 => "EAGLE-3 (SGLang/vLLM format)",
    }
}

/// The SGLang and vLLM command lines (Markdown) serving `model` with the EAGLE `drafter` of the given kind
/// (`--speculative-algorithm EAGLE`/`EAGLE3`, `method: "eagle"`/`"eagle3"`), or with n-gram drafting.
pub fn serve_commands(model: &Path, drafter: Option<(&Path, DrafterKind)>) -> String {
    let p = model.display();
    let Some((draft, kind)) = drafter else {
        return format!(
            "```sh\npython -m sglang.launch_server --model-path {p} --speculative-algorithm NGRAM\n\
             vllm serve {p} --speculative-config '{{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \
             \"prompt_lookup_max\": 4}}'\n```\n"
        );
    };
    let d = draft.display();
    let (sglang, vllm) = match kind {
        DrafterKind::Eagle2 => ("EAGLE", "eagle"),
        DrafterKind::Eagle3 => ("EAGLE3", "eagle3"),
    };
    format!(
        "SGLang:\n\n```sh\npython -m sglang.launch_server --model-path {p} \\\n  --speculative-algorithm {sglang} \
         --speculative-draft-model-path {d} \\\n  --speculative-num-steps 3 --speculative-eagle-topk 4 \
         --speculative-num-draft-tokens 8\n```\n\n\
         vLLM:\n\n```sh\nvllm serve {p} \\\n  --speculative-config '{{\"method\": \"{vllm}\", \"model\": \"{d}\", \
         \"num_speculative_tokens\": 3}}'\n```\n"
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests: a panic is the failure report.
mod tests {
    use super::*;

    #[test]
    fn serve_instructions_name_each_engines_algorithm() {
        let e2 = serve_instructions(Path::new("/runs/a/export"), 3, Some(DrafterKind::Eagle2));
        assert!(e2.contains("--speculative-algorithm EAGLE --speculative-draft-model-path /runs/a/export/drafter"));
        assert!(e2.contains("\"method\": \"eagle\", \"model\": \"/runs/a/export/drafter\""));
        assert!(e2.contains("--model-path /runs/a/export/policy"));
        let e3 = serve_instructions(Path::new("/x"), 1, Some(DrafterKind::Eagle3));
        assert!(e3.contains("--speculative-algorithm EAGLE3") && e3.contains("\"method\": \"eagle3\""));
        let none = serve_instructions(Path::new("/x"), 1, None);
        assert!(none.contains("NGRAM") && !none.contains("draft-model-path"));
    }

    #[test]
    fn tokenizer_config_names_the_special_tokens_and_template() {
        use tokenizers::models::wordlevel::WordLevel;
        let vocab = [("<s>", 0u32), ("</s>", 1), ("a", 2), ("[UNK]", 3)];
        let model = WordLevel::builder()
            .vocab(vocab.iter().map(|(t, i)| (t.to_string(), *i)).collect())
            .unk_token("[UNK]".into())
            .build()
            .unwrap();
        let tok = Tokenizer::new(model);
        let mut cfg = tlt_model::LlamaConfig::tiny(4, 8, 1);
        cfg.bos_token_id = Some(0);
        cfg.eos_token_id = Some(tlt_model::EosTokens::One(1));
        let v = tokenizer_config(&cfg, &tok, Some("{{ x }}"));
        assert_eq!(v["bos_token"], "<s>");
        assert_eq!(v["eos_token"], "</s>");
        assert_eq!(v["chat_template"], "{{ x }}");
        assert_eq!(v["tokenizer_class"], "PreTrainedTokenizerFast");
        assert!(tokenizer_config(&cfg, &tok, None).get("chat_template").is_none());
    }
}
