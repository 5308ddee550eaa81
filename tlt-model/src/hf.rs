//! Hugging Face checkpoints: `config.json` + `model.safetensors` (or a sharded index) + `tokenizer.json`.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use safetensors::Dtype;
use tokenizers::Tokenizer;

use crate::config::LlamaConfig;
use crate::model::Llama;
use crate::tokenizer::load_tokenizer_json;
use crate::weights::{LlamaWeights, TensorSource};
use crate::{Error, LoadedModel, Result};

/// Memory-mapped safetensors shards with a name → shard index.
struct SafetensorsSource {
    dir: PathBuf,
    shards: Vec<(PathBuf, MmapedSafetensors)>,
    index: HashMap<String, (usize, Dtype)>,
}

impl SafetensorsSource {
    fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Error::malformed(&index_path, "safetensors index", e))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::malformed(&index_path, "safetensors index", "no `weight_map` object"))?;
            let names: BTreeSet<&str> = map.values().filter_map(|f| f.as_str()).collect();
            if names.iter().any(|n| n.contains('/') || n.contains("..")) {
                return Err(Error::malformed(&index_path, "safetensors index", "shard names must be plain file names"));
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            vec![single]
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for (i, path) in files.into_iter().enumerate() {
            if !path.exists() {
                return Err(Error::io(&path, std::io::Error::from(std::io::ErrorKind::NotFound)));
            }
            // SAFETY: the file is mapped read-only; we do not modify it while it is mapped.
            let st = unsafe { MmapedSafetensors::new(&path) }.map_err(|e| Error::malformed(&path, "safetensors", e))?;
            for (name, view) in st.tensors() {
                index.insert(name, (i, view.dtype()));
            }
            shards.push((path, st));
        }
        Ok(Self { dir: dir.to_path_buf(), shards, index })
    }
}

impl TensorSource for SafetensorsSource {
    fn path(&self) -> &Path {
        &self.dir
    }

    fn get(&mut self, name: &str) -> Result<Option<Tensor>> {
        let Some(&(shard, dtype)) = self.index.get(name) else { return Ok(None) };
        let (path, st) = &self.shards[shard];
        if !matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64) {
            return Err(Error::UnsupportedDType { path: path.clone(), name: name.into(), dtype: format!("{dtype:?}") });
        }
        let t =
            st.load(name, &Device::Cpu).map_err(|e| Error::malformed(path, "safetensors", format!("`{name}`: {e}")))?;
        Ok(Some(t.to_dtype(DType::F32)?))
    }
}

/// Loads an HF model directory (`config.json`, safetensors weights, optional `tokenizer.json`).
pub fn load_hf_dir(dir: &Path) -> Result<LoadedModel> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?;
    let cfg = LlamaConfig::from_json(&text, &cfg_path)?;
    let weights = LlamaWeights::load(&cfg, &mut SafetensorsSource::open(dir)?)?;
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = if tok_path.exists() { Some(load_tokenizer_json(&tok_path)?) } else { None };
    Ok(LoadedModel { model: Llama::new(cfg, weights)?, tokenizer, chat_template: None })
}

/// Writes `model` as an HF checkpoint transformers can load: `config.json` and `model.safetensors`
/// (tensors in `dtype`, `format: pt` metadata), plus `tokenizer.json` when given. Each file is written to a
/// temporary name and renamed, so a crash never leaves a half-written file behind.
pub fn save_hf_dir(model: &Llama, tokenizer: Option<&Tokenizer>, dir: &Path, dtype: DType) -> Result<()> {
    let torch_dtype = match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        other => return Err(Error::InvalidInput(format!("cannot save weights as {other:?}"))),
    };
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let tensors = model
        .weights()
        .named_tensors()
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_dtype(dtype)?)))
        .collect::<Result<Vec<_>>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    atomic_write(&dir.join("model.safetensors"), |tmp| {
        safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(meta), tmp)
            .map_err(|e| Error::malformed(tmp, "safetensors", e))
    })?;
    let cfg = serde_json::to_string_pretty(&model.config().to_hf_json(torch_dtype)?)
        .map_err(|e| Error::InvalidInput(e.to_string()))?;
    atomic_write(&dir.join("config.json"), |tmp| std::fs::write(tmp, cfg).map_err(|e| Error::io(tmp, e)))?;
    if let Some(tok) = tokenizer {
        atomic_write(&dir.join("tokenizer.json"), |tmp| {
            tok.save(tmp, false).map_err(|e| Error::Tokenizer(e.to_string()))
        })?;
    }
    Ok(())
}

/// Writes through `write` to `path.tmp`, then renames it over `path`.
pub fn atomic_write(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    write(&tmp)?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// Writes a whole directory atomically: `write` fills a fresh temporary sibling of `dir`, everything in it is
/// fsync'ed, and it is renamed into place (an existing `dir` is moved aside first and removed after), so `dir`
/// is always either the old complete directory or the new complete one. On a failure the temporary directory
/// is removed and `dir` is untouched.
///
/// # Errors
/// `write`'s error, or [`Error::Io`] from the file system (converted into `E`).
pub fn write_dir_atomic<E: From<Error>>(
    dir: &Path,
    write: impl FnOnce(&Path) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let tmp = sibling(dir, "tmp")?;
    let out = (|| {
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
        }
        std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
        write(&tmp)?;
        sync_tree(&tmp).map_err(E::from)
    })();
    if let Err(e) = out {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if dir.exists() {
        let old = sibling(dir, "old")?;
        std::fs::rename(dir, &old).map_err(|e| Error::io(dir, e))?;
        std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
        std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
    } else {
        std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync(parent)?;
    }
    Ok(())
}

fn sync(path: &Path) -> Result<()> {
    std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(|e| Error::io(path, e))
}

fn sync_tree(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        if path.is_dir() {
            sync_tree(&path)?;
        } else {
            sync(&path)?;
        }
    }
    sync(dir)
}

/// A hidden sibling path of `dir` unique to this process and call.
fn sibling(dir: &Path, tag: &str) -> Result<PathBuf> {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let name = dir.file_name().ok_or_else(|| {
        Error::io(dir, std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path has no final component"))
    })?;
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = format!(".{}.{tag}-{}-{n}", name.to_string_lossy(), std::process::id());
    Ok(match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.join(file),
        _ => PathBuf::from(file),
    })
}
