//! The decoder's parameters, named as in Hugging Face checkpoints.

use std::path::{Path, PathBuf};

use std::sync::Arc;

use candle_core::{DType, Tensor};
use tlt_kernels::Matrix;

use crate::config::{AttentionBias, LlamaConfig};
use crate::{Error, Result};

/// A linear layer with weights stored `[out, in]` (the `nn.Linear` layout).
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out_features, in_features]`, f32: what training, saving and (unless `packed`) inference read.
    pub weight: Tensor,
    /// `[out_features]`, present on Qwen2's q/k/v projections (and q/k/v/o with `attention_bias`).
    pub bias: Option<Tensor>,
    /// A converted copy (e.g. Q8_0) the inference forward reads instead of `weight`; see
    /// [`crate::Llama::pack_for_inference`]. Training does not update it.
    pub packed: Option<Arc<Matrix>>,
}

impl Linear {
    /// A layer without a packed inference copy.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias, packed: None }
    }
}

/// The seven linear layers of a Llama-family decoder block (attention and SwiGLU MLP), as the model's blocks
/// and the EAGLE drafters' single layer both hold them. Weights are `[out, in]`.
#[derive(Debug, Clone)]
pub struct Projections {
    /// Query projection, `[heads * head_dim, in]`.
    pub q_proj: Linear,
    /// Key projection, `[kv_heads * head_dim, in]`.
    pub k_proj: Linear,
    /// Value projection, `[kv_heads * head_dim, in]`.
    pub v_proj: Linear,
    /// Attention output projection, `[hidden, heads * head_dim]`.
    pub o_proj: Linear,
    /// SwiGLU gate projection, `[intermediate, hidden]`.
    pub gate_proj: Linear,
    /// SwiGLU up projection, `[intermediate, hidden]`.
    pub up_proj: Linear,
    /// SwiGLU down projection, `[hidden, intermediate]`.
    pub down_proj: Linear,
}

/// One projection's place in a block: its HF module name (under the block's prefix), `[out, in]`, and whether it
/// has a bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProjectionShape {
    /// HF module name, e.g. `self_attn.q_proj`.
    pub name: &'static str,
    /// Output features.
    pub out: usize,
    /// Input features.
    pub inp: usize,
    /// Whether the layer has a bias (Qwen2's q/k/v; q/k/v/o with `attention_bias`).
    pub bias: bool,
}

impl Projections {
    /// The shapes of a block with `hidden` features, `q`/`kv` attention widths, `ffn` MLP features, attention
    /// inputs of width `qkv_in` (`hidden`, or `2 * hidden` for an EAGLE-3 layer) and the attention biases `bias`,
    /// in field order.
    pub fn shapes(
        hidden: usize,
        q: usize,
        kv: usize,
        ffn: usize,
        qkv_in: usize,
        bias: AttentionBias,
    ) -> [ProjectionShape; 7] {
        let s = |name, out, inp, bias| ProjectionShape { name, out, inp, bias };
        [
            s("self_attn.q_proj", q, qkv_in, bias.qkv),
            s("self_attn.k_proj", kv, qkv_in, bias.qkv),
            s("self_attn.v_proj", kv, qkv_in, bias.qkv),
            s("self_attn.o_proj", hidden, q, bias.o),
            s("mlp.gate_proj", ffn, hidden, false),
            s("mlp.up_proj", ffn, hidden, false),
            s("mlp.down_proj", hidden, ffn, false),
        ]
    }

    /// Builds the seven layers from `shapes` (as [`Projections::shapes`] gives them), one `make` call each.
    ///
    /// # Errors
    /// The first error of `make`.
    pub fn build<E>(
        shapes: &[ProjectionShape; 7],
        mut make: impl FnMut(&ProjectionShape) -> std::result::Result<Linear, E>,
    ) -> std::result::Result<Self, E> {
        Ok(Self {
            q_proj: make(&shapes[0])?,
            k_proj: make(&shapes[1])?,
            v_proj: make(&shapes[2])?,
            o_proj: make(&shapes[3])?,
            gate_proj: make(&shapes[4])?,
            up_proj: make(&shapes[5])?,
            down_proj: make(&shapes[6])?,
        })
    }

    /// The seven layers with their HF module names, in field order.
    pub fn named_mut(&mut self) -> [(&'static str, &mut Linear); 7] {
        let Self { q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj } = self;
        [
            ("self_attn.q_proj", q_proj),
            ("self_attn.k_proj", k_proj),
            ("self_attn.v_proj", v_proj),
            ("self_attn.o_proj", o_proj),
            ("mlp.gate_proj", gate_proj),
            ("mlp.up_proj", up_proj),
            ("mlp.down_proj", down_proj),
        ]
    }

    /// The seven layers, in field order.
    pub fn all(&self) -> [&Linear; 7] {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj, &self.gate_proj, &self.up_proj, &self.down_proj]
    }
}

/// Qwen3's per-head RMSNorm weights of the queries and keys (`[head_dim]` each), applied to every head's vector
/// before RoPE with the model's `rms_norm_eps`.
#[derive(Debug, Clone)]
pub struct QkNorm {
    /// `self_attn.q_norm.weight`.
    pub q_norm: Tensor,
    /// `self_attn.k_norm.weight`.
    pub k_norm: Tensor,
}

/// The parameters of one decoder block.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// The attention and MLP projections.
    pub proj: Projections,
    /// RMSNorm weight before attention.
    pub input_layernorm: Tensor,
    /// RMSNorm weight before the MLP.
    pub post_attention_layernorm: Tensor,
    /// Qwen3: the q/k head norms; `None` for architectures without them.
    pub qk_norm: Option<QkNorm>,
}

/// A block's norms, each with its HF module name: the input and post-attention norms, then q/k head norms.
type NamedNorms<'a> = Vec<(&'static str, &'a mut Tensor)>;

impl LayerWeights {
    /// The block's linear layers and norms, each with its HF module name.
    fn parts_mut(&mut self) -> ([(&'static str, &mut Linear); 7], NamedNorms<'_>) {
        let LayerWeights { proj, input_layernorm, post_attention_layernorm, qk_norm } = self;
        let mut norms =
            vec![("input_layernorm", input_layernorm), ("post_attention_layernorm", post_attention_layernorm)];
        if let Some(QkNorm { q_norm, k_norm }) = qk_norm {
            norms.extend([("self_attn.q_norm", q_norm), ("self_attn.k_norm", k_norm)]);
        }
        (proj.named_mut(), norms)
    }
}

/// All parameters of a Llama-family decoder.
#[derive(Debug, Clone)]
pub struct LlamaWeights {
    /// `[vocab, hidden]` token embedding.
    pub embed_tokens: Tensor,
    /// The decoder blocks.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm weight.
    pub norm: Tensor,
    /// `[vocab, hidden]` output projection; `None` when tied to the embedding.
    pub lm_head: Option<Tensor>,
    /// A converted copy of the output projection for inference (see [`Linear::packed`]).
    pub head_packed: Option<Arc<Matrix>>,
}

/// Where tensors come from while loading: a checkpoint that hands out f32 tensors by HF name.
pub trait TensorSource {
    /// The file or directory, for error messages.
    fn path(&self) -> &Path;
    /// The tensor called `name` (HF naming), converted to f32, or `None` if absent.
    fn get(&mut self, name: &str) -> Result<Option<Tensor>>;
}

impl LlamaWeights {
    /// Loads every parameter `cfg` implies from `src`, checking names and shapes.
    pub fn load(cfg: &LlamaConfig, src: &mut dyn TensorSource) -> Result<Self> {
        let bias = cfg.attention_bias()?;
        let (h, v, ffn, hd) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.head_dim());
        let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
        let mut loader = Loader { src, path: PathBuf::new() };
        loader.path = loader.src.path().to_path_buf();
        let embed_tokens = loader.required("model.embed_tokens.weight", &[v, h])?;
        // Not `with_capacity(num_hidden_layers)`: the count comes from the file, and the tensors it names are
        // checked one layer at a time (a bogus count fails at the first missing layer, not in the allocator).
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers.min(256));
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let shapes = Projections::shapes(h, q, kv, ffn, h, bias);
            let qk_norm = if cfg.qk_norm() {
                Some(QkNorm {
                    q_norm: loader.required(&format!("{p}.self_attn.q_norm.weight"), &[hd])?,
                    k_norm: loader.required(&format!("{p}.self_attn.k_norm.weight"), &[hd])?,
                })
            } else {
                None
            };
            layers.push(LayerWeights {
                proj: Projections::build(&shapes, |s| loader.linear(&format!("{p}.{}", s.name), s.out, s.inp, s.bias))?,
                input_layernorm: loader.required(&format!("{p}.input_layernorm.weight"), &[h])?,
                post_attention_layernorm: loader.required(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                qk_norm,
            });
        }
        let norm = loader.required("model.norm.weight", &[h])?;
        let lm_head = if cfg.tie_word_embeddings { None } else { Some(loader.required("lm_head.weight", &[v, h])?) };
        Ok(Self { embed_tokens, layers, norm, lm_head, head_packed: None })
    }

    /// The output projection (the embedding when tied).
    pub fn lm_head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Every linear layer with its HF name prefix (without `.weight`).
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter_mut().enumerate() {
            let (linears, _) = l.parts_mut();
            out.extend(linears.into_iter().map(|(name, lin)| (format!("model.layers.{i}.{name}"), lin)));
        }
        out
    }

    /// Every parameter with its HF name, mutable, in a fixed order (a tied head appears once).
    pub fn entries_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        let mut out: Vec<(String, &mut Tensor)> = vec![("model.embed_tokens.weight".into(), &mut self.embed_tokens)];
        for (i, l) in self.layers.iter_mut().enumerate() {
            let (linears, norms) = l.parts_mut();
            for (name, lin) in linears {
                out.push((format!("model.layers.{i}.{name}.weight"), &mut lin.weight));
                if let Some(b) = lin.bias.as_mut() {
                    out.push((format!("model.layers.{i}.{name}.bias"), b));
                }
            }
            out.extend(norms.into_iter().map(|(name, t)| (format!("model.layers.{i}.{name}.weight"), t)));
        }
        out.push(("model.norm.weight".into(), &mut self.norm));
        if let Some(head) = self.lm_head.as_mut() {
            out.push(("lm_head.weight".into(), head));
        }
        out
    }

    /// Every parameter with its HF name (cheap clones sharing storage), in [`Self::entries_mut`] order.
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut shallow = self.clone();
        shallow.entries_mut().into_iter().map(|(n, t)| (n, t.clone())).collect()
    }

    /// Total number of scalar parameters.
    pub fn num_params(&self) -> usize {
        self.named_tensors().iter().map(|(_, t)| t.elem_count()).sum()
    }
}

struct Loader<'a> {
    src: &'a mut dyn TensorSource,
    path: PathBuf,
}

impl Loader<'_> {
    fn required(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t =
            self.src.get(name)?.ok_or_else(|| Error::MissingTensor { path: self.path.clone(), name: name.into() })?;
        if t.dims() != shape {
            return Err(Error::ShapeMismatch {
                path: self.path.clone(),
                name: name.into(),
                expected: shape.to_vec(),
                got: t.dims().to_vec(),
            });
        }
        Ok(t.to_dtype(DType::F32)?.contiguous()?)
    }

    fn linear(&mut self, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
        let weight = self.required(&format!("{prefix}.weight"), &[out, inp])?;
        let bias = if bias { Some(self.required(&format!("{prefix}.bias"), &[out])?) } else { None };
        Ok(Linear::new(weight, bias))
    }
}
