//! Loading Llama/Qwen2/Qwen3 GGUF files: metadata → config, tensors dequantized to f32 with llama.cpp's q/k row
//! permutation undone (llama only: its converter does not permute the qwen architectures), and the embedded
//! tokenizer.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use tlt_kernels::quant::blocks_from_bytes;
use tlt_kernels::{Matrix, WeightDType};
use tokenizers::Tokenizer;

use crate::config::{LlamaConfig, RopeScaling};
use crate::model::Llama;
use crate::tokenizer::{tokenizer_from_gguf_vocab, GgufVocab};
use crate::weights::{LlamaWeights, TensorSource};
use crate::{Error, LoadedModel, Result};

/// An open GGUF file: parsed header and a reader for tensor data.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
}

impl GgufFile {
    /// Opens `path` and parses its header (metadata and tensor index).
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let mut reader = BufReader::new(file);
        crate::gguf_check::check_header(&mut reader, path)?;
        let content = Content::read(&mut reader).map_err(|e| Error::malformed(path, "gguf", e))?;
        Ok(Self { path: path.to_path_buf(), content, reader })
    }

    /// The raw metadata.
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<String> {
        self.string("general.architecture")
    }

    fn value(&self, key: &str) -> Result<&Value> {
        self.content.metadata.get(key).ok_or_else(|| Error::InvalidConfig {
            field: key.into(),
            value: "<absent>".into(),
            reason: "required GGUF metadata key is missing",
        })
    }

    fn string(&self, key: &str) -> Result<String> {
        let v = self.value(key)?;
        v.to_string().cloned().map_err(|_| self.bad_type(key, v))
    }

    fn usize(&self, key: &str) -> Result<usize> {
        let v = self.value(key)?;
        let n = match v {
            Value::U8(x) => *x as u64,
            Value::U16(x) => *x as u64,
            Value::U32(x) => *x as u64,
            Value::U64(x) => *x,
            Value::I8(x) if *x >= 0 => *x as u64,
            Value::I16(x) if *x >= 0 => *x as u64,
            Value::I32(x) if *x >= 0 => *x as u64,
            Value::I64(x) if *x >= 0 => *x as u64,
            _ => return Err(self.bad_type(key, v)),
        };
        usize::try_from(n).map_err(|_| self.bad_type(key, v))
    }

    fn f64(&self, key: &str) -> Result<f64> {
        let v = self.value(key)?;
        match v {
            Value::F32(x) => Ok(*x as f64),
            Value::F64(x) => Ok(*x),
            _ => Err(self.bad_type(key, v)),
        }
    }

    fn optional<T>(&self, key: &str, get: impl Fn(&Self, &str) -> Result<T>) -> Result<Option<T>> {
        if self.content.metadata.contains_key(key) {
            get(self, key).map(Some)
        } else {
            Ok(None)
        }
    }

    fn string_array(&self, key: &str) -> Result<Vec<String>> {
        let v = self.value(key)?;
        let items = v.to_vec().map_err(|_| self.bad_type(key, v))?;
        items.iter().map(|x| x.to_string().cloned().map_err(|_| self.bad_type(key, x))).collect()
    }

    fn bad_type(&self, key: &str, v: &Value) -> Error {
        Error::malformed(
            &self.path,
            "gguf",
            format!("metadata `{key}` has unexpected type or value {:?}", v.value_type()),
        )
    }

    /// The model configuration implied by the metadata, in Hugging Face terms.
    pub fn config(&self) -> Result<LlamaConfig> {
        let arch = self.architecture()?;
        if !matches!(arch.as_str(), "llama" | "qwen2" | "qwen3") {
            return Err(Error::Unsupported { path: self.path.clone(), what: "GGUF architecture", value: arch });
        }
        if self.content.tensor_infos.contains_key("rope_freqs.weight") {
            return Err(Error::Unsupported {
                path: self.path.clone(),
                what: "rope scaling",
                value: "per-dimension rope_freqs tensor (Llama-3.1 GGUF); load the HF checkpoint instead".into(),
            });
        }
        let key = |k: &str| format!("{arch}.{k}");
        let embd = self
            .content
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| Error::MissingTensor { path: self.path.clone(), name: "token_embd.weight".into() })?;
        let heads = self.usize(&key("attention.head_count"))?;
        let hidden = self.usize(&key("embedding_length"))?;
        // llama.cpp's head width: `attention.key_length` (written when config.json names a head_dim, e.g. Qwen3),
        // else the rotary width, else hidden / heads. Partial rotary and unequal key/value widths do not exist in
        // the architectures read here: refuse them rather than compute something else.
        let key_len = self.optional(&key("attention.key_length"), Self::usize)?;
        let value_len = self.optional(&key("attention.value_length"), Self::usize)?;
        let rope_dims = self.optional(&key("rope.dimension_count"), Self::usize)?;
        let head_dim = key_len.or(rope_dims);
        for (what, other) in [("attention.value_length", value_len), ("rope.dimension_count", rope_dims)] {
            if let (Some(d), Some(o)) = (head_dim, other) {
                if o != d {
                    return Err(Error::Unsupported {
                        path: self.path.clone(),
                        what: "GGUF head layout",
                        value: format!("{arch}.{what} = {o} with a head width of {d}"),
                    });
                }
            }
        }
        let rope_scaling = match self.optional(&key("rope.scaling.type"), Self::string)?.as_deref() {
            None | Some("none") => None,
            Some("linear") => Some(RopeScaling::Linear { factor: self.f64(&key("rope.scaling.factor"))? }),
            Some(other) => {
                return Err(Error::Unsupported { path: self.path.clone(), what: "rope scaling", value: other.into() })
            }
        };
        let cfg = LlamaConfig {
            model_type: arch.clone(),
            hidden_size: hidden,
            intermediate_size: self.usize(&key("feed_forward_length"))?,
            num_hidden_layers: self.usize(&key("block_count"))?,
            num_attention_heads: heads,
            num_key_value_heads: Some(self.optional(&key("attention.head_count_kv"), Self::usize)?.unwrap_or(heads)),
            // llama.cpp's default is hidden / heads; explicit whenever it differs, and always for Qwen3 (whose
            // config.json default is 128).
            head_dim: head_dim
                .or(hidden.checked_div(heads))
                .filter(|&d| arch == "qwen3" || Some(d) != hidden.checked_div(heads)),
            vocab_size: embd.shape.dims().first().copied().unwrap_or(0),
            rms_norm_eps: self.f64(&key("attention.layer_norm_rms_epsilon"))?,
            rope_theta: self.optional(&key("rope.freq_base"), Self::f64)?.unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: self.optional(&key("context_length"), Self::usize)?.unwrap_or(4096),
            tie_word_embeddings: !self.content.tensor_infos.contains_key("output.weight"),
            bos_token_id: self.optional("tokenizer.ggml.bos_token_id", Self::usize)?.map(|x| x as u32),
            eos_token_id: self
                .optional("tokenizer.ggml.eos_token_id", Self::usize)?
                .map(|x| crate::config::EosTokens::One(x as u32)),
            hidden_act: "silu".into(),
            attention_bias: false,
            mlp_bias: false,
            use_sliding_window: None,
            layer_types: None,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The embedded tokenizer, if the file has one.
    pub fn tokenizer(&self) -> Result<Option<Tokenizer>> {
        if !self.content.metadata.contains_key("tokenizer.ggml.tokens") {
            return Ok(None);
        }
        let token_types = match self.content.metadata.get("tokenizer.ggml.token_type") {
            None => Vec::new(),
            Some(v) => {
                let items = v.to_vec().map_err(|_| self.bad_type("tokenizer.ggml.token_type", v))?;
                items
                    .iter()
                    .map(|x| x.to_i32().map_err(|_| self.bad_type("tokenizer.ggml.token_type", x)))
                    .collect::<Result<_>>()?
            }
        };
        let vocab = GgufVocab {
            model: self.string("tokenizer.ggml.model")?,
            pre: self.optional("tokenizer.ggml.pre", Self::string)?.unwrap_or_else(|| "default".into()),
            tokens: self.string_array("tokenizer.ggml.tokens")?,
            merges: self.optional("tokenizer.ggml.merges", Self::string_array)?.unwrap_or_default(),
            token_types,
        };
        tokenizer_from_gguf_vocab(&vocab, &self.path).map(Some)
    }

    /// The chat template (`tokenizer.chat_template`), if any.
    pub fn chat_template(&self) -> Option<String> {
        self.content.metadata.get("tokenizer.chat_template").and_then(|v| v.to_string().ok().cloned())
    }

    /// Reads and dequantizes the GGUF tensor `name` (GGUF naming) to f32.
    pub fn tensor_f32(&mut self, name: &str) -> Result<Option<Tensor>> {
        match self.qtensor(name)? {
            Some(q) => Ok(Some(q.dequantize(&Device::Cpu)?)),
            None => Ok(None),
        }
    }

    /// The 2-D tensor `name` kept in its stored Q8_0/Q4_0/Q4_1 blocks, with rows reordered to HF order when
    /// `heads` (count, head_dim) says it is a rope-permuted q/k weight; `None` if absent or stored otherwise.
    pub fn tensor_blocks(&mut self, name: &str, heads: Option<(usize, usize)>) -> Result<Option<Matrix>> {
        let Some(q) = self.qtensor(name)? else { return Ok(None) };
        let dtype = match q.dtype() {
            GgmlDType::Q8_0 => WeightDType::Q8_0,
            GgmlDType::Q4_0 => WeightDType::Q4_0,
            GgmlDType::Q4_1 => WeightDType::Q4_1,
            _ => return Ok(None),
        };
        let (n, k) = q.shape().dims2()?;
        let raw = q.data()?;
        let row = dtype.row_bytes(k);
        let bytes: Vec<u8> = match heads {
            None => raw.into_owned(),
            Some((count, d)) if count * d != n || d % 2 != 0 => {
                return Err(Error::InvalidInput(format!("`{name}`: {n} rows are not {count} heads of {d}")))
            }
            Some((_, d)) => (0..n)
                .flat_map(|r| {
                    // HF row h*d + i*(d/2) + j comes from GGUF row h*d + 2j + i.
                    let (h, i, j) = (r / d, (r % d) / (d / 2), r % (d / 2));
                    let src = h * d + 2 * j + i;
                    raw[src * row..(src + 1) * row].iter().copied()
                })
                .collect(),
        };
        let bad = || Error::malformed(&self.path, "gguf", format!("tensor `{name}`: truncated blocks"));
        let m = match dtype {
            WeightDType::Q8_0 => Matrix::from_q8_0(n, k, blocks_from_bytes(&bytes).ok_or_else(bad)?)?,
            WeightDType::Q4_0 => Matrix::from_q4_0(n, k, blocks_from_bytes(&bytes).ok_or_else(bad)?)?,
            _ => Matrix::from_q4_1(n, k, blocks_from_bytes(&bytes).ok_or_else(bad)?)?,
        };
        Ok(Some(m))
    }

    fn qtensor(&mut self, name: &str) -> Result<Option<QTensor>> {
        let Some(info) = self.content.tensor_infos.get(name) else { return Ok(None) };
        // candle sizes the read as elements / block * type size, in wrapping arithmetic: dims whose product
        // (or its f32 size) overflows would pass its length check with a wrapped size and fail later in the
        // allocator. Their f32 copy must have a size.
        let elems = info.shape.dims().iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if elems.and_then(|e| e.checked_mul(4)).is_none_or(|b| b > isize::MAX as usize) {
            return Err(Error::malformed(
                &self.path,
                "gguf",
                format!("tensor `{name}`: dims {:?} overflow", info.shape.dims()),
            ));
        }
        if matches!(info.ggml_dtype, GgmlDType::Q8_1 | GgmlDType::Q8K) {
            return Err(Error::UnsupportedDType {
                path: self.path.clone(),
                name: name.into(),
                dtype: format!("{:?}", info.ggml_dtype),
            });
        }
        let q = info
            .read(&mut self.reader, self.content.tensor_data_offset, &Device::Cpu)
            .map_err(|e| Error::malformed(&self.path, "gguf", format!("tensor `{name}`: {e}")))?;
        Ok(Some(q))
    }
}

/// Adapts a GGUF file to HF tensor names, undoing llama.cpp's q/k permutation for `llama`.
struct GgufSource<'a> {
    file: &'a mut GgufFile,
    cfg: &'a LlamaConfig,
    permuted_qk: bool,
}

impl TensorSource for GgufSource<'_> {
    fn path(&self) -> &Path {
        &self.file.path
    }

    fn get(&mut self, name: &str) -> Result<Option<Tensor>> {
        let Some(gguf_name) = hf_to_gguf_name(name) else { return Ok(None) };
        let Some(t) = self.file.tensor_f32(&gguf_name)? else { return Ok(None) };
        let heads = if name.ends_with("q_proj.weight") {
            Some(self.cfg.num_attention_heads)
        } else if name.ends_with("k_proj.weight") {
            Some(self.cfg.kv_heads())
        } else {
            None
        };
        match heads {
            Some(n) if self.permuted_qk && t.rank() == 2 => Ok(Some(unpermute_rows(&t, n, self.cfg.head_dim())?)),
            _ => Ok(Some(t)),
        }
    }
}

/// Maps an HF parameter name to its llama.cpp GGUF name.
pub fn hf_to_gguf_name(hf: &str) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let kind = match module {
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{kind}.{suffix}"))
}

/// Undoes llama.cpp's rope permutation of a q or k weight `[n_heads * head_dim, in]`:
/// HF row `h*d + i*(d/2) + j` = GGUF row `h*d + 2j + i`.
pub fn unpermute_rows(w: &Tensor, n_heads: usize, head_dim: usize) -> Result<Tensor> {
    let (rows, inp) = w.dims2()?;
    if rows != n_heads * head_dim {
        return Err(Error::InvalidInput(format!("cannot unpermute {rows} rows as {n_heads} heads of {head_dim}")));
    }
    Ok(w.reshape((n_heads, head_dim / 2, 2, inp))?.transpose(1, 2)?.contiguous()?.reshape((rows, inp))?)
}

/// What the inference forward of a GGUF model reads for its linear layers and LM head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GgufWeights {
    /// Everything dequantized to f32 (exact reference; 4 bytes per weight streamed).
    #[default]
    F32,
    /// Q8_0/Q4_0/Q4_1 tensors kept in the file's blocks for inference (others read as f32). The f32 copy
    /// stays for training and saving.
    AsStored,
}

/// Loads a GGUF model (weights dequantized to f32) with its embedded tokenizer and chat template.
pub fn load_gguf(path: &Path) -> Result<LoadedModel> {
    load_gguf_with(path, GgufWeights::F32)
}

/// [`load_gguf`], choosing what the inference forward reads.
pub fn load_gguf_with(path: &Path, inference: GgufWeights) -> Result<LoadedModel> {
    let mut file = GgufFile::open(path)?;
    let cfg = file.config()?;
    let tokenizer = file.tokenizer()?;
    let chat_template = file.chat_template();
    let permuted_qk = cfg.model_type == "llama";
    let mut weights = LlamaWeights::load(&cfg, &mut GgufSource { file: &mut file, cfg: &cfg, permuted_qk })?;
    if inference == GgufWeights::AsStored {
        for (name, lin) in weights.linears_mut() {
            let heads = match permuted_qk {
                true if name.ends_with("q_proj") => Some((cfg.num_attention_heads, cfg.head_dim())),
                true if name.ends_with("k_proj") => Some((cfg.kv_heads(), cfg.head_dim())),
                _ => None,
            };
            let gguf_name = hf_to_gguf_name(&format!("{name}.weight")).unwrap_or_default();
            lin.packed = file.tensor_blocks(&gguf_name, heads)?.map(Arc::new);
        }
        let head = if cfg.tie_word_embeddings { "token_embd.weight" } else { "output.weight" };
        weights.head_packed = file.tensor_blocks(head, None)?.map(Arc::new);
    }
    Ok(LoadedModel { model: Llama::new(cfg, weights)?, tokenizer, chat_template })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways_we_need() {
        assert_eq!(hf_to_gguf_name("model.layers.7.self_attn.k_proj.bias").unwrap(), "blk.7.attn_k.bias");
        assert_eq!(hf_to_gguf_name("model.layers.0.post_attention_layernorm.weight").unwrap(), "blk.0.ffn_norm.weight");
        assert_eq!(hf_to_gguf_name("lm_head.weight").unwrap(), "output.weight");
        assert_eq!(hf_to_gguf_name("model.layers.3.self_attn.k_norm.weight").unwrap(), "blk.3.attn_k_norm.weight");
        assert!(hf_to_gguf_name("model.layers.0.bogus.weight").is_none());
    }

    #[test]
    fn unpermute_matches_index_formula() {
        let (n, d, inp) = (3, 8, 2);
        let data: Vec<f32> = (0..n * d * inp).map(|x| x as f32).collect();
        let w = Tensor::from_vec(data, (n * d, inp), &Device::Cpu).unwrap();
        let hf = unpermute_rows(&w, n, d).unwrap().to_vec2::<f32>().unwrap();
        let gg = w.to_vec2::<f32>().unwrap();
        for h in 0..n {
            for i in 0..2 {
                for j in 0..d / 2 {
                    assert_eq!(hf[h * d + i * (d / 2) + j], gg[h * d + 2 * j + i]);
                }
            }
        }
    }
}
