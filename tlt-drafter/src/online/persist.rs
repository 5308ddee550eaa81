//! [`OnlineBuffer`] checkpoints: every held sample's tokens and hidden rows in one safetensors file, so a resumed
//! run trains its drafter on exactly the samples the interrupted run held.
//!
//! Layout: `tokens` (U32, all samples' tokens concatenated), `hidden` (F32, `[rows, width]`, all samples' rows
//! concatenated) and the metadata key `tlt_online_buffer` holding [`Index`] as JSON (per sample its id, RL step,
//! response start and length; the buffer's counters). A buffer without samples has no tensors.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use tlt_spec_decode::HiddenStates;

use super::buffer::BufferParts;
use super::{BufferConfig, FeatureSample, OnlineBuffer};
use crate::{Error, Result};

/// Metadata key of the index.
const META_KEY: &str = "tlt_online_buffer";
/// Format tag of [`Index`].
const FORMAT: &str = "tlt-online-buffer/1";

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Index {
    format: String,
    width: usize,
    next_id: u64,
    step: u64,
    evicted: u64,
    /// `(id, rl_step, response_start, tokens)` per sample, oldest first.
    items: Vec<(u64, u64, usize, usize)>,
}

impl OnlineBuffer {
    /// Writes every held sample and the buffer's counters to `path` (safetensors; see the module docs).
    ///
    /// # Errors
    /// Samples of different hidden widths, or an I/O failure.
    pub fn save(&self, path: &Path) -> Result<()> {
        let parts = self.parts();
        let width = parts.items.first().map_or(0, |(_, s)| s.hidden.width());
        let mut tokens: Vec<u8> = Vec::new();
        let mut hidden: Vec<u8> = Vec::new();
        let mut items = Vec::with_capacity(parts.items.len());
        for (id, s) in &parts.items {
            if s.hidden.width() != width {
                return Err(Error::InvalidArgument(format!(
                    "buffer sample {id} has hidden width {}, others {width}",
                    s.hidden.width()
                )));
            }
            tokens.extend(s.tokens.iter().flat_map(|t| t.to_le_bytes()));
            hidden.extend(s.hidden.as_flat().iter().flat_map(|x| x.to_le_bytes()));
            items.push((*id, s.rl_step, s.response_start, s.tokens.len()));
        }
        let index = Index {
            format: FORMAT.into(),
            width,
            next_id: parts.next_id,
            step: parts.step,
            evicted: parts.evicted,
            items,
        };
        let meta = HashMap::from([(
            META_KEY.to_string(),
            serde_json::to_string(&index).map_err(|e| Error::malformed(path, "safetensors", e))?,
        )]);
        let (n_tok, n_rows) = (tokens.len() / 4, hidden.len() / 4 / width.max(1));
        let mut views = Vec::new();
        if !index.items.is_empty() {
            let bad = |e| Error::malformed(path, "safetensors", e);
            views.push(("tokens".to_string(), TensorView::new(Dtype::U32, vec![n_tok], &tokens).map_err(bad)?));
            views.push(("hidden".to_string(), TensorView::new(Dtype::F32, vec![n_rows, width], &hidden).map_err(bad)?));
        }
        safetensors::serialize_to_file(views, Some(meta), path).map_err(|e| Error::malformed(path, "safetensors", e))
    }

    /// The buffer saved at `path` by [`Self::save`], with limits `cfg`.
    ///
    /// # Errors
    /// [`Error::Malformed`] for a file that is not such a checkpoint (missing index, sizes that do not add up,
    /// invalid samples), or an I/O failure.
    pub fn load(cfg: BufferConfig, path: &Path) -> Result<Self> {
        let bad = |reason: String| Error::malformed(path, "safetensors", reason);
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
        let text = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(META_KEY))
            .ok_or_else(|| bad(format!("no `{META_KEY}` metadata: not an online buffer checkpoint")))?;
        let index: Index = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        if index.format != FORMAT {
            return Err(bad(format!("format {:?}, expected {FORMAT:?}", index.format)));
        }
        let (tokens, hidden) = if index.items.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            let st = SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
            let read = |name: &str, dtype: Dtype| -> Result<Vec<u8>> {
                let v = st.tensor(name).map_err(|e| bad(format!("`{name}`: {e}")))?;
                if v.dtype() != dtype {
                    return Err(bad(format!("`{name}` is {:?}, expected {dtype:?}", v.dtype())));
                }
                Ok(v.data().to_vec())
            };
            (read("tokens", Dtype::U32)?, read("hidden", Dtype::F32)?)
        };
        let tokens: Vec<u32> = tokens.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let hidden: Vec<f32> = hidden.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let (mut t, mut h) = (0usize, 0usize);
        let mut items = Vec::with_capacity(index.items.len());
        for &(id, rl_step, response_start, len) in &index.items {
            let rows = len.checked_sub(1).ok_or_else(|| bad(format!("sample {id} has no tokens")))?;
            let floats = rows.checked_mul(index.width).ok_or_else(|| bad(format!("sample {id} is too large")))?;
            let (Some(toks), Some(hid)) = (tokens.get(t..t + len), hidden.get(h..h + floats)) else {
                return Err(bad(format!("sample {id} runs past the stored tensors")));
            };
            let sample = FeatureSample {
                tokens: toks.to_vec(),
                hidden: HiddenStates::from_flat(index.width, hid.to_vec()).map_err(|e| bad(e.to_string()))?,
                response_start,
                rl_step,
            };
            items.push((id, Arc::new(sample)));
            (t, h) = (t + len, h + floats);
        }
        if t != tokens.len() || h != hidden.len() {
            return Err(bad("the stored tensors hold more than the index describes".into()));
        }
        let parts = BufferParts { items, next_id: index.next_id, step: index.step, evicted: index.evicted };
        Self::from_parts(cfg, parts).map_err(|e| bad(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize, step: u64, seed: f32) -> FeatureSample {
        FeatureSample {
            tokens: (0..len as u32).map(|t| t * 7 + 1).collect(),
            hidden: HiddenStates::from_flat(3, (0..3 * (len - 1)).map(|i| seed + i as f32 / 3.0).collect()).unwrap(),
            response_start: 2,
            rl_step: step,
        }
    }

    #[test]
    fn a_saved_buffer_loads_identically_and_draws_the_same_samples() {
        let dir = std::env::temp_dir().join(format!("tlt-buffer-persist-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = BufferConfig { max_samples: 4, keep_steps: 2, ..BufferConfig::default() };
        let b = OnlineBuffer::new(cfg).unwrap();
        for i in 0..6 {
            b.push(sample(3 + i, i as u64 / 2, i as f32)).unwrap();
        }
        b.set_step(3);
        let path = dir.join("buffer.safetensors");
        b.save(&path).unwrap();
        let c = OnlineBuffer::load(cfg, &path).unwrap();
        assert_eq!(c.parts(), b.parts());
        assert_eq!(c.stats(), b.stats());
        let draw = |x: &OnlineBuffer| x.sample(9, &mut tlt_kernels::SeededRng::new(5));
        assert_eq!(draw(&c), draw(&b));
        // Both go on identically.
        for x in [&b, &c] {
            x.push(sample(4, 3, 9.0)).unwrap();
            x.set_step(4);
        }
        assert_eq!(c.parts(), b.parts());

        // An empty buffer round-trips too.
        let empty = OnlineBuffer::new(cfg).unwrap();
        empty.save(&path).unwrap();
        assert_eq!(OnlineBuffer::load(cfg, &path).unwrap().parts(), empty.parts());

        // Not a buffer checkpoint, a truncated file, a smaller limit: clear errors.
        std::fs::write(&path, b"garbage").unwrap();
        assert!(matches!(OnlineBuffer::load(cfg, &path), Err(Error::Malformed { .. })));
        b.push(sample(5, 4, 1.0)).unwrap();
        assert!(b.stats().held > 1);
        b.save(&path).unwrap();
        let small = BufferConfig { max_samples: 1, keep_steps: 2, ..BufferConfig::default() };
        assert!(matches!(OnlineBuffer::load(small, &path), Err(Error::Malformed { .. })));
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 8]).unwrap();
        assert!(OnlineBuffer::load(cfg, &path).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
