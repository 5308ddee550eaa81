//! Where `/update_weights_from_disk` may load from: only under the server's `--weights-dir` roots, canonicalised
//! (symlinks resolved, so neither `..` nor a link escapes them), and every file of a model directory under them too.
//! Refusals say "not allowed" or "not a model directory" and nothing else: not whether the path exists, not a byte
//! of a file (the loader's own error, which can quote a file's first bytes, goes to the server's log only).

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The canonical roots weight updates may read from; none: every update from disk is refused.
#[derive(Debug, Clone, Default)]
pub struct WeightRoots(Vec<PathBuf>);

/// A refusal of `model_path` that tells nothing about the path.
fn not_allowed() -> Error {
    Error::Forbidden {
        field: "model_path".into(),
        reason: "not allowed: give a model directory or .gguf file under one of the server's --weights-dir \
                 directories"
            .into(),
    }
}

/// A path under the roots that does not load.
fn not_a_model() -> Error {
    Error::Invalid {
        field: "model_path".into(),
        reason: "not a model directory (config.json, safetensors, tokenizer.json) or a .gguf file this server \
                 can load"
            .into(),
    }
}

impl WeightRoots {
    /// The roots `dirs`, canonicalised.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming `weights_dir` when one is not an existing directory.
    pub fn new(dirs: &[PathBuf]) -> Result<Self> {
        let mut roots = Vec::with_capacity(dirs.len());
        for d in dirs {
            let bad = |reason: String| Error::Invalid { field: "weights_dir".into(), reason };
            let c = d.canonicalize().map_err(|e| bad(format!("{}: {e}", d.display())))?;
            if !c.is_dir() {
                return Err(bad(format!("{} is not a directory", d.display())));
            }
            roots.push(c);
        }
        Ok(Self(roots))
    }

    /// Whether no update from disk is allowed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn contains(&self, canonical: &Path) -> bool {
        self.0.iter().any(|r| canonical.starts_with(r))
    }

    /// `requested` canonicalised, when it and (for a directory) every entry in it lie under a root.
    ///
    /// # Errors
    /// [`Error::Forbidden`] ("not allowed") for anything else, whether or not it exists.
    pub fn resolve(&self, requested: &str) -> Result<PathBuf> {
        if self.0.is_empty() || requested.is_empty() {
            return Err(not_allowed());
        }
        let path = Path::new(requested).canonicalize().map_err(|_| not_allowed())?;
        if !self.contains(&path) {
            return Err(not_allowed());
        }
        if path.is_dir() {
            let entries = std::fs::read_dir(&path).map_err(|_| not_allowed())?;
            for e in entries {
                let e = e.map_err(|_| not_allowed())?;
                // A link out of the roots (to a blob elsewhere) is refused as the path itself would be.
                match e.path().canonicalize() {
                    Ok(c) if self.contains(&c) => {}
                    _ => return Err(not_allowed()),
                }
            }
        }
        Ok(path)
    }

    /// Loads the model at `requested` (see [`WeightRoots::resolve`]); the loader's error is logged, not returned.
    ///
    /// # Errors
    /// "not allowed" ([`Error::Forbidden`]) or "not a model directory" ([`Error::Invalid`]), both naming
    /// `model_path`.
    pub fn load(&self, requested: &str) -> Result<tlt_model::LoadedModel> {
        let path = self.resolve(requested)?;
        tlt_model::load(&path).map_err(|e| {
            tracing::warn!(path = %path.display(), error = %e, "update_weights_from_disk: the checkpoint does not load");
            not_a_model()
        })
    }
}
