//! Drafter checkpoints: EAGLE-3 as SGLang and vLLM load it, EAGLE-2 in the fastrl/TLT layout and in the original
//! layout the serving engines load ([`save_eagle2_serving`]).
//!
//! Both are a directory with `config.json` (an HF `LlamaConfig` with `num_hidden_layers = 1` plus extras) and
//! `model.safetensors`. Every file is written to `<name>.tmp` and renamed, so a crash never leaves a
//! half-written checkpoint file. Loading checks names, shapes, dtypes and the pairing with the target and
//! fails with a specific [`crate::Error`] variant rather than half-loading.

mod eagle2;
mod eagle3;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};
use safetensors::{Dtype, SafeTensors, View};
use serde::{Deserialize, Serialize};

pub use eagle2::{load_eagle2, save_eagle2, save_eagle2_serving, Eagle2Checkpoint};
pub use eagle3::{load_eagle3, save_eagle3, Eagle3Checkpoint, EAGLE3_ARCHITECTURES};

use crate::{Error, Result};

/// The dtype floating-point weights are saved in (integer and bool buffers keep theirs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SaveDType {
    /// bfloat16: what SpecForge exports and SGLang/vLLM serve (the default for EAGLE-3).
    Bf16,
    /// float16: the original Vicuna/LLaMA-3 EAGLE releases (overflows on Qwen2 targets).
    F16,
    /// float32: lossless, for round trips and resuming training.
    F32,
}

impl SaveDType {
    /// The candle dtype.
    pub fn dtype(self) -> DType {
        match self {
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
            Self::F32 => DType::F32,
        }
    }

    /// The `torch_dtype` string of `config.json`.
    pub fn torch_dtype(self) -> &'static str {
        match self {
            Self::Bf16 => "bfloat16",
            Self::F16 => "float16",
            Self::F32 => "float32",
        }
    }
}

/// Owned bytes of one tensor, ready for `safetensors::serialize_to_file`.
pub(crate) struct Blob {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for Blob {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

impl Blob {
    /// A float tensor converted to `dtype`.
    pub fn float(t: &Tensor, dtype: SaveDType) -> Result<Self> {
        let flat = t.to_dtype(dtype.dtype())?.flatten_all()?;
        let data: Vec<u8> = match dtype {
            SaveDType::Bf16 => flat.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
            SaveDType::F16 => flat.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
            SaveDType::F32 => flat.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        let st_dtype = match dtype {
            SaveDType::Bf16 => Dtype::BF16,
            SaveDType::F16 => Dtype::F16,
            SaveDType::F32 => Dtype::F32,
        };
        Ok(Self { dtype: st_dtype, shape: t.dims().to_vec(), data })
    }

    /// An int64 vector.
    pub fn i64s(v: &[i64]) -> Self {
        Self { dtype: Dtype::I64, shape: vec![v.len()], data: v.iter().flat_map(|x| x.to_le_bytes()).collect() }
    }

    /// A bool vector (one byte each, 0 or 1, as numpy and torch store it).
    pub fn bools(v: &[bool]) -> Self {
        Self { dtype: Dtype::BOOL, shape: vec![v.len()], data: v.iter().map(|&b| u8::from(b)).collect() }
    }
}

/// Writes through `write` to `path.tmp`, then renames it over `path`.
pub(crate) fn atomic_write(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    write(&tmp)?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// Writes `model.safetensors` (with `format: pt` metadata) and `config.json` into `dir`, atomically each.
pub(crate) fn write_checkpoint(dir: &Path, tensors: Vec<(String, Blob)>, config: &serde_json::Value) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    atomic_write(&dir.join("model.safetensors"), |tmp| {
        safetensors::serialize_to_file(tensors, Some(meta), tmp).map_err(|e| Error::malformed(tmp, "safetensors", e))
    })?;
    let text = serde_json::to_string_pretty(config).map_err(|e| Error::malformed(dir, "config.json", e))?;
    atomic_write(&dir.join("config.json"), |tmp| std::fs::write(tmp, text).map_err(|e| Error::io(tmp, e)))
}

/// Reads `dir/config.json` as JSON.
pub(crate) fn read_config(dir: &Path) -> Result<(PathBuf, serde_json::Value)> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let value = serde_json::from_str(&text).map_err(|e| Error::malformed(&path, "config.json", e))?;
    Ok((path, value))
}

/// A safetensors file read into memory, with its tensor index.
pub(crate) struct StFile {
    pub path: PathBuf,
    bytes: Vec<u8>,
    /// Name -> (dtype, shape), for every tensor in the file.
    pub index: HashMap<String, (Dtype, Vec<usize>)>,
}

impl StFile {
    pub fn open(path: PathBuf) -> Result<Self> {
        let bytes = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| Error::malformed(&path, "safetensors", e))?;
        let index = st.iter().map(|(n, v)| (n.to_string(), (v.dtype(), v.shape().to_vec()))).collect();
        drop(st);
        Ok(Self { path, bytes, index })
    }

    fn view(&self, name: &str) -> Result<safetensors::tensor::TensorView<'_>> {
        let st = SafeTensors::deserialize(&self.bytes).map_err(|e| Error::malformed(&self.path, "safetensors", e))?;
        st.tensor(name).map_err(|e| Error::malformed(&self.path, "safetensors", format!("`{name}`: {e}")))
    }

    fn checked(&self, name: &str, shape: &[usize], allowed: &[Dtype], expected: &'static str) -> Result<Option<()>> {
        let Some((dtype, got)) = self.index.get(name) else { return Ok(None) };
        if !allowed.contains(dtype) {
            return Err(Error::WrongDType {
                path: self.path.clone(),
                name: name.into(),
                expected,
                got: format!("{dtype:?}"),
            });
        }
        if got != shape {
            return Err(Error::ShapeMismatch {
                path: self.path.clone(),
                name: name.into(),
                expected: shape.to_vec(),
                got: got.clone(),
            });
        }
        Ok(Some(()))
    }

    /// The float tensor `name` as f32, checking dtype and shape; `None` if absent.
    pub fn float(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        let floats = [Dtype::BF16, Dtype::F16, Dtype::F32, Dtype::F64];
        if self.checked(name, shape, &floats, "BF16, F16, F32 or F64")?.is_none() {
            return Ok(None);
        }
        Ok(Some(self.view(name)?.load(&Device::Cpu)?.to_dtype(DType::F32)?.contiguous()?))
    }

    /// Like [`Self::float`], but a missing tensor is an error.
    pub fn required(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.float(name, shape)?.ok_or_else(|| Error::MissingTensor { path: self.path.clone(), name: name.into() })
    }

    /// The int64 vector `name` of length `len`; `None` if absent.
    pub fn i64s(&self, name: &str, len: usize) -> Result<Option<Vec<i64>>> {
        if self.checked(name, &[len], &[Dtype::I64], "I64")?.is_none() {
            return Ok(None);
        }
        let data = self.view(name)?.data().to_vec();
        Ok(Some(
            data.chunks_exact(8)
                .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
        ))
    }

    /// The bool vector `name` of length `len`; `None` if absent.
    pub fn bools(&self, name: &str, len: usize) -> Result<Option<Vec<bool>>> {
        if self.checked(name, &[len], &[Dtype::BOOL], "BOOL")?.is_none() {
            return Ok(None);
        }
        Ok(Some(self.view(name)?.data().iter().map(|&b| b != 0).collect()))
    }
}

/// Parses the HF `LlamaConfig` part of a drafter `config.json` and validates it.
pub(crate) fn parse_llama(path: &Path, value: &serde_json::Value) -> Result<tlt_model::LlamaConfig> {
    let cfg: tlt_model::LlamaConfig =
        serde_json::from_value(value.clone()).map_err(|e| Error::malformed(path, "config.json", e))?;
    cfg.validate()?;
    Ok(cfg)
}

/// The `architectures` entries of a config, empty when absent.
pub(crate) fn architectures(value: &serde_json::Value) -> Vec<String> {
    value
        .get("architectures")
        .and_then(|a| a.as_array())
        .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// Checks that a checkpoint's layer config has the target's hidden and vocabulary sizes.
pub(crate) fn check_layer_matches(llama: &tlt_model::LlamaConfig, target: &tlt_model::LlamaConfig) -> Result<()> {
    if llama.hidden_size != target.hidden_size {
        return Err(Error::HiddenSizeMismatch {
            what: "hidden_size",
            drafter: llama.hidden_size,
            target: target.hidden_size,
        });
    }
    if llama.vocab_size != target.vocab_size {
        return Err(Error::VocabMismatch { drafter: llama.vocab_size, target: target.vocab_size });
    }
    Ok(())
}
