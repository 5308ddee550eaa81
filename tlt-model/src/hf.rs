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

/// Writes a whole directory so that a kill at any instruction leaves a complete one to find: `write` fills the
/// fixed sibling `.NAME.partial`, everything in it is fsync'ed, it is renamed to `.NAME.next` (complete from then
/// on), the current `dir` (if any) is renamed to `.NAME.old`, `.NAME.next` is renamed to `dir`, and `.NAME.old` is
/// removed, with the parent fsync'ed after each rename. [`recover_dir`] (run first here, and by readers before they
/// look) finishes or undoes whatever a kill interrupted: `dir` is then the old complete directory or the new one.
/// On an error of `write` the partial directory is removed and `dir` is untouched. One writer per `dir` at a time.
///
/// # Errors
/// `write`'s error, or [`Error::Io`] from the file system (converted into `E`).
pub fn write_dir_atomic<E: From<Error>>(
    dir: &Path,
    write: impl FnOnce(&Path) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    if crate::chaos::fires("ckpt.two_rename") {
        return write_dir_two_renames(dir, write);
    }
    recover_dir(dir)?;
    write_dir_steps(dir, write, usize::MAX)
}

/// The chaos harness's negative control (kill point `ckpt.two_rename` armed): the protocol this crate used before
/// [`write_dir_atomic`], which moves the current `dir` aside and then renames the new one into place, so a kill
/// between the two renames (`ckpt.two_rename.between`) leaves no `dir`. [`recover_dir`] is off while it is armed,
/// as no recovery existed then.
fn write_dir_two_renames<E: From<Error>>(
    dir: &Path,
    write: impl FnOnce(&Path) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let at = |tag: &str| dir.with_file_name(format!(".{name}.{tag}-{}-0", std::process::id()));
    let (tmp, aside) = (at("tmp"), at("old"));
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    write(&tmp)?;
    sync_tree(&tmp)?;
    if dir.exists() {
        rename_synced(dir, &aside)?;
    }
    crate::chaos::kill_point_on("ckpt.two_rename.between", Some(dir));
    rename_synced(&tmp, dir)?;
    if aside.exists() {
        std::fs::remove_dir_all(&aside).map_err(|e| Error::io(&aside, e))?;
    }
    Ok(())
}

/// [`write_dir_atomic`]'s protocol, stopping after its first `stop` steps as a kill there would (the tests' crash
/// points): 1 partial written and synced, 2 renamed to next, 3 the old `dir` moved aside, 4 next in place, 5 the old
/// one removed.
fn write_dir_steps<E: From<Error>>(
    dir: &Path,
    write: impl FnOnce(&Path) -> std::result::Result<(), E>,
    stop: usize,
) -> std::result::Result<(), E> {
    let [partial, next, old] = siblings(dir)?;
    let filled = (|| {
        if partial.exists() {
            std::fs::remove_dir_all(&partial).map_err(|e| Error::io(&partial, e))?;
        }
        std::fs::create_dir_all(&partial).map_err(|e| Error::io(&partial, e))?;
        write(&partial)?;
        crate::chaos::kill_point_on("ckpt.written", Some(dir));
        sync_tree(&partial).map_err(E::from)
    })();
    if let Err(e) = filled {
        let _ = std::fs::remove_dir_all(&partial);
        return Err(e);
    }
    let steps: [&dyn Fn() -> Result<()>; 4] = [
        &|| rename_synced(&partial, &next),
        &|| if dir.exists() { rename_synced(dir, &old) } else { Ok(()) },
        &|| rename_synced(&next, dir),
        &|| if old.exists() { std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e)) } else { Ok(()) },
    ];
    const AFTER: [&str; 4] = ["ckpt.rename.next", "ckpt.rename.old", "ckpt.rename.in", "ckpt.removed.old"];
    for (step, point) in steps.iter().zip(AFTER).take(stop.saturating_sub(1)) {
        step()?;
        crate::chaos::kill_point_on(point, Some(dir));
    }
    Ok(())
}

/// Brings `dir` (written by [`write_dir_atomic`]) to a complete state after a kill: a complete `.NAME.next` is put
/// in place (the interrupted write finished), a partial `.NAME.partial` and a leftover `.NAME.old` are removed; a
/// `dir` lost by the earlier two-rename protocol (its aside copy `.NAME.old-PID-N` left, `dir` gone) is restored from
/// that copy, and that protocol's temporaries are removed. Returns whether `dir` exists. Safe to run when nothing
/// was interrupted (it then changes nothing), and by several processes at once (a rename another one made first is
/// not an error).
///
/// # Errors
/// [`Error::Io`] from the file system.
pub fn recover_dir(dir: &Path) -> Result<bool> {
    if crate::chaos::fires("ckpt.two_rename") {
        return Ok(dir.exists());
    }
    let [partial, next, old] = siblings(dir)?;
    let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    let remove = |p: &Path| match std::fs::remove_dir_all(p) {
        Err(e) if !gone(&e) => Err(Error::io(p, e)),
        _ => Ok(()),
    };
    if partial.exists() {
        remove(&partial)?;
    }
    if next.exists() {
        if dir.exists() {
            remove(&old)?;
            rename_synced(dir, &old).or_else(|e| if dir.exists() { Err(e) } else { Ok(()) })?;
        }
        rename_synced(&next, dir).or_else(|e| if dir.exists() { Ok(()) } else { Err(e) })?;
    }
    // The earlier protocol's leftovers: `.NAME.old-PID-N` (the replaced directory) and `.NAME.tmp-PID-N`.
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if let Some(name) = dir.file_name().map(|n| n.to_string_lossy().into_owned()) {
        let mut legacy_old = Vec::new();
        if let Ok(entries) = std::fs::read_dir(parent) {
            for entry in entries.flatten() {
                let file = entry.file_name().to_string_lossy().into_owned();
                if file.starts_with(&format!(".{name}.old-")) {
                    legacy_old.push(entry.path());
                } else if file.starts_with(&format!(".{name}.tmp-")) {
                    remove(&entry.path())?;
                }
            }
        }
        if !dir.exists() {
            if let Some(newest) = legacy_old.iter().max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok()) {
                rename_synced(newest, dir).or_else(|e| if dir.exists() { Ok(()) } else { Err(e) })?;
            }
        }
        for p in legacy_old.iter().filter(|p| p.exists()) {
            remove(p)?;
        }
    }
    if old.exists() {
        remove(&old)?;
    }
    Ok(dir.exists())
}

/// Renames `from` to `to` and fsyncs the parent of `to` (the rename is durable once this returns).
fn rename_synced(from: &Path, to: &Path) -> Result<()> {
    std::fs::rename(from, to).map_err(|e| Error::io(to, e))?;
    match to.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => sync(parent),
        None => Ok(()),
    }
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
/// The fixed siblings of `dir` that [`write_dir_atomic`] uses: `.NAME.partial`, `.NAME.next`, `.NAME.old`.
fn siblings(dir: &Path) -> Result<[PathBuf; 3]> {
    let name = dir.file_name().ok_or_else(|| {
        Error::io(dir, std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path has no final component"))
    })?;
    let at = |tag: &str| {
        let file = format!(".{}.{tag}", name.to_string_lossy());
        match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.join(file),
            _ => PathBuf::from(file),
        }
    };
    Ok([at("partial"), at("next"), at("old")])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.
    use super::*;

    /// A fresh directory under the system's temporary one, removed on drop.
    struct Root(PathBuf);

    impl Root {
        fn new() -> Self {
            static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p = std::env::temp_dir().join(format!("tlt-dir-atomic-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Self(p)
        }
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Root {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn content(dir: &Path) -> Option<String> {
        std::fs::read_to_string(dir.join("state")).ok()
    }

    fn write_state(text: &'static str) -> impl FnOnce(&Path) -> Result<()> {
        move |d: &Path| std::fs::write(d.join("state"), text).map_err(|e| Error::io(d, e))
    }

    fn leftovers(parent: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(parent)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect();
        v.sort();
        v
    }

    /// A kill after every step of the protocol, with and without an earlier directory: recovery always leaves a
    /// complete directory (the old one before the new one is complete, the new one from then on) and nothing else.
    #[test]
    fn a_kill_at_every_step_of_a_directory_write_leaves_a_complete_directory() {
        for existed in [false, true] {
            for stop in 1..=5 {
                let root = Root::new();
                let dir = root.path().join("checkpoint");
                if existed {
                    write_dir_atomic(&dir, write_state("old")).unwrap();
                }
                write_dir_steps(&dir, write_state("new"), stop).unwrap();
                let exists = recover_dir(&dir).unwrap();
                let want = match (stop, existed) {
                    (1, false) => None,
                    (1, true) => Some("old"),
                    _ => Some("new"),
                };
                assert_eq!(content(&dir).as_deref(), want, "existed {existed}, killed after step {stop}");
                assert_eq!(exists, want.is_some());
                assert!(leftovers(root.path()).is_empty(), "{:?}", leftovers(root.path()));
                // Recovery changes nothing when nothing was interrupted, and the next write succeeds.
                assert_eq!(recover_dir(&dir).unwrap(), exists);
                write_dir_atomic(&dir, write_state("next")).unwrap();
                assert_eq!(content(&dir).as_deref(), Some("next"));
            }
        }
    }

    /// The earlier protocol (old directory renamed aside, then the new one renamed into place) killed between its
    /// two renames: the directory is gone, which a reader took as "no checkpoint" (the negative control); recovery
    /// restores the aside copy and removes that protocol's temporary.
    #[test]
    fn the_two_rename_protocol_loses_the_directory_and_recovery_restores_it() {
        let root = Root::new();
        let dir = root.path().join("checkpoint");
        write_dir_atomic(&dir, write_state("old")).unwrap();
        let (tmp, aside) = (root.path().join(".checkpoint.tmp-77-0"), root.path().join(".checkpoint.old-77-1"));
        std::fs::create_dir(&tmp).unwrap();
        std::fs::write(tmp.join("state"), "new").unwrap();
        std::fs::rename(&dir, &aside).unwrap();
        // Killed here: no checkpoint directory.
        assert!(!dir.exists(), "the control must lose the directory");
        assert!(recover_dir(&dir).unwrap());
        assert_eq!(content(&dir).as_deref(), Some("old"));
        assert!(leftovers(root.path()).is_empty(), "{:?}", leftovers(root.path()));
    }

    /// A failing `write` leaves the earlier directory untouched and no partial one.
    #[test]
    fn a_failed_write_leaves_the_directory_as_it_was() {
        let root = Root::new();
        let dir = root.path().join("checkpoint");
        write_dir_atomic(&dir, write_state("old")).unwrap();
        let e = write_dir_atomic(&dir, |_: &Path| -> Result<()> { Err(Error::InvalidInput("disk full".into())) });
        assert!(e.is_err());
        assert_eq!(content(&dir).as_deref(), Some("old"));
        assert!(leftovers(root.path()).is_empty());
    }
}
