//! The drafter's single decoder layer: parameters, seeded initialisation, and its differentiable forward.

use candle_core::{DType, Device, Tensor, Var, D};
use tlt_kernels::SeededRng;
use tlt_model::nn::{linear, repeat_kv, rms_norm, rope};
use tlt_model::{Linear, Projections};

use crate::config::{DrafterConfig, DrafterKind};
use crate::{Error, Result};

/// The parameters of a drafter's decoder layer. Linear weights are `[out, in]` ([`Linear`], as in `tlt-model`),
/// so an inference forward can reuse `tlt-model`'s kernels.
#[derive(Debug, Clone)]
pub struct DraftLayer {
    /// The attention and MLP projections (`qkv_in` = H for EAGLE-2, 2H for EAGLE-3 on q/k/v).
    pub proj: Projections,
    /// EAGLE-3: RMSNorm of the token embedding. EAGLE-2: `None` (the input norm is the identity).
    pub input_layernorm: Option<Tensor>,
    /// EAGLE-3: RMSNorm of the feature. EAGLE-2: `None`.
    pub hidden_norm: Option<Tensor>,
    /// RMSNorm before the MLP.
    pub post_attention_layernorm: Tensor,
}

/// Standard normal by Box-Muller.
pub(crate) fn normal(rng: &mut SeededRng) -> f64 {
    let u1 = rng.uniform().max(f64::MIN_POSITIVE);
    let u2 = rng.uniform();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// `[out, inp]` with entries ~ N(0, 1/inp).
pub(crate) fn random_matrix(rng: &mut SeededRng, out: usize, inp: usize) -> Result<Tensor> {
    let std = 1.0 / (inp as f64).sqrt();
    let data: Vec<f32> = (0..out * inp).map(|_| (std * normal(rng)) as f32).collect();
    Ok(Tensor::from_vec(data, (out, inp), &Device::Cpu)?)
}

pub(crate) fn ones(n: usize) -> Result<Tensor> {
    Ok(Tensor::ones(n, DType::F32, &Device::Cpu)?)
}

fn zeros(n: usize) -> Result<Tensor> {
    Ok(Tensor::zeros(n, DType::F32, &Device::Cpu)?)
}

/// Turns `t` into a contiguous variable (copying it) unless it already is one.
pub(crate) fn make_var(t: &mut Tensor) -> Result<()> {
    if !t.is_variable() {
        *t = Var::from_tensor(&t.contiguous()?)?.as_tensor().clone();
    }
    Ok(())
}

/// Checks `t` has `shape`, naming it `name` in the error.
pub(crate) fn check_shape(name: &str, t: &Tensor, shape: &[usize]) -> Result<()> {
    if t.dims() != shape {
        return Err(Error::ShapeMismatch {
            path: "<weights>".into(),
            name: name.into(),
            expected: shape.to_vec(),
            got: t.dims().to_vec(),
        });
    }
    Ok(())
}

impl DraftLayer {
    /// A freshly initialised layer for `cfg`: matrices ~ N(0, 1/fan_in), norms 1, biases 0 (f32).
    pub fn random(cfg: &DrafterConfig, rng: &mut SeededRng) -> Result<Self> {
        let h = cfg.llama.hidden_size;
        let proj = Projections::build(&Self::projection_shapes(cfg), |p| -> Result<Linear> {
            let bias = if p.bias { Some(zeros(p.out)?) } else { None };
            Ok(Linear::new(random_matrix(rng, p.out, p.inp)?, bias))
        })?;
        let eagle3 = cfg.kind == DrafterKind::Eagle3;
        Ok(Self {
            proj,
            input_layernorm: if eagle3 { Some(ones(h)?) } else { None },
            hidden_norm: if eagle3 { Some(ones(h)?) } else { None },
            post_attention_layernorm: ones(h)?,
        })
    }

    /// The projections' names and shapes for `cfg`.
    fn projection_shapes(cfg: &DrafterConfig) -> [tlt_model::ProjectionShape; 7] {
        let l = &cfg.llama;
        Projections::shapes(
            l.hidden_size,
            l.q_dim(),
            l.kv_dim(),
            l.intermediate_size,
            cfg.qkv_in(),
            cfg.attention_bias(),
        )
    }

    /// A layer for `cfg` whose parameters `get(name, shape)` supplies, named under `prefix` as in
    /// [`Self::expected_shapes`] (loaders check the shape inside `get`).
    pub(crate) fn from_source(
        cfg: &DrafterConfig,
        prefix: &str,
        get: &mut dyn FnMut(&str, &[usize]) -> Result<Tensor>,
    ) -> Result<Self> {
        let h = cfg.llama.hidden_size;
        let proj = Projections::build(&Self::projection_shapes(cfg), |p| -> Result<Linear> {
            let w = get(&format!("{prefix}{}.weight", p.name), &[p.out, p.inp])?;
            let b = if p.bias { Some(get(&format!("{prefix}{}.bias", p.name), &[p.out])?) } else { None };
            Ok(Linear::new(w, b))
        })?;
        let (input_layernorm, hidden_norm) = if cfg.kind == DrafterKind::Eagle3 {
            (
                Some(get(&format!("{prefix}input_layernorm.weight"), &[h])?),
                Some(get(&format!("{prefix}hidden_norm.weight"), &[h])?),
            )
        } else {
            (None, None)
        };
        let post_attention_layernorm = get(&format!("{prefix}post_attention_layernorm.weight"), &[h])?;
        Ok(Self { proj, input_layernorm, hidden_norm, post_attention_layernorm })
    }

    /// Every parameter with its name under `prefix` (e.g. `"midlayer."`), in a fixed order.
    pub fn entries_mut(&mut self, prefix: &str) -> Vec<(String, &mut Tensor)> {
        let Self { proj, input_layernorm, hidden_norm, post_attention_layernorm } = self;
        let mut out = Vec::new();
        for (name, lin) in proj.named_mut() {
            out.push((format!("{prefix}{name}.weight"), &mut lin.weight));
            if let Some(b) = lin.bias.as_mut() {
                out.push((format!("{prefix}{name}.bias"), b));
            }
        }
        for (name, norm) in [("input_layernorm", input_layernorm), ("hidden_norm", hidden_norm)] {
            if let Some(t) = norm.as_mut() {
                out.push((format!("{prefix}{name}.weight"), t));
            }
        }
        out.push((format!("{prefix}post_attention_layernorm.weight"), post_attention_layernorm));
        out
    }

    /// The names and shapes `cfg` implies under `prefix`, in [`Self::entries_mut`] order.
    pub fn expected_shapes(cfg: &DrafterConfig, prefix: &str) -> Vec<(String, Vec<usize>)> {
        let h = cfg.llama.hidden_size;
        let mut out = Vec::new();
        for p in Self::projection_shapes(cfg) {
            out.push((format!("{prefix}{}.weight", p.name), vec![p.out, p.inp]));
            if p.bias {
                out.push((format!("{prefix}{}.bias", p.name), vec![p.out]));
            }
        }
        if cfg.kind == DrafterKind::Eagle3 {
            out.push((format!("{prefix}input_layernorm.weight"), vec![h]));
            out.push((format!("{prefix}hidden_norm.weight"), vec![h]));
        }
        out.push((format!("{prefix}post_attention_layernorm.weight"), vec![h]));
        out
    }

    /// Checks that the layer has exactly the parameters and shapes `cfg` implies.
    pub(crate) fn check(&mut self, cfg: &DrafterConfig) -> Result<()> {
        let expected = Self::expected_shapes(cfg, "");
        let entries = self.entries_mut("");
        for (name, shape) in &expected {
            match entries.iter().find(|(n, _)| n == name) {
                Some((_, t)) => check_shape(name, t, shape)?,
                None => return Err(Error::MissingTensor { path: "<weights>".into(), name: name.clone() }),
            }
        }
        if let Some((name, _)) = entries.iter().find(|(n, _)| !expected.iter().any(|(e, _)| e == n)) {
            return Err(Error::UnexpectedTensor { path: "<weights>".into(), name: name.clone() });
        }
        Ok(())
    }

    /// Self-attention of `x_in: [b, t, qkv_in]` at the rotary angles `cos`/`sin` (`[b, 1, t, head_dim]`).
    ///
    /// `kv` holds the keys and values (already repeated to all heads) of earlier training-time-test steps;
    /// this step's are appended. The query attends to the FIRST entry's keys under `mask` (additive, broadcast to
    /// `[b, heads, t, t]`) and to the same-position (diagonal) key of every later entry (EAGLE-3's TTT). With an
    /// empty `kv` this is ordinary masked attention. Returns `[b, t, H]` after `o_proj`.
    pub(crate) fn attention(
        &self,
        cfg: &DrafterConfig,
        x_in: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        kv: &mut Vec<(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let l = &cfg.llama;
        let (nh, nkv, hd) = (l.num_attention_heads, l.kv_heads(), l.head_dim());
        let (b, t, _) = x_in.dims3()?;
        let heads = |lin: &Linear, n: usize| -> Result<Tensor> {
            Ok(linear(x_in, lin)?.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous()?)
        };
        let q = rope(&heads(&self.proj.q_proj, nh)?, cos, sin)?;
        let k = repeat_kv(&rope(&heads(&self.proj.k_proj, nkv)?, cos, sin)?, nh / nkv)?;
        let v = repeat_kv(&heads(&self.proj.v_proj, nkv)?, nh / nkv)?;
        kv.push((k, v));
        let scale = 1.0 / (hd as f64).sqrt();
        let (k0, v0) = &kv[0];
        let mut scores = vec![(q.matmul(&k0.t()?)? * scale)?.broadcast_add(mask)?];
        for (ki, _) in &kv[1..] {
            scores.push(((&q * ki)?.sum_keepdim(D::Minus1)? * scale)?);
        }
        let probs = candle_nn::ops::softmax(&Tensor::cat(&scores, D::Minus1)?, D::Minus1)?;
        let mut out = probs.narrow(D::Minus1, 0, t)?.matmul(v0)?;
        for (i, (_, vi)) in kv.iter().enumerate().skip(1) {
            out = (out + probs.narrow(D::Minus1, t + i - 1, 1)?.broadcast_mul(vi)?)?;
        }
        let out = out.transpose(1, 2)?.reshape((b, t, nh * hd))?;
        linear(&out, &self.proj.o_proj).map_err(Error::from)
    }

    /// `x + down(silu(gate(n)) * up(n))` with `n = post_attention_layernorm(x)`.
    pub(crate) fn mlp_residual(&self, x: &Tensor, eps: f64) -> Result<Tensor> {
        let n = rms_norm(x, &self.post_attention_layernorm, eps)?;
        let act = (candle_nn::ops::silu(&linear(&n, &self.proj.gate_proj)?)? * linear(&n, &self.proj.up_proj)?)?;
        Ok((x + linear(&act, &self.proj.down_proj)?)?)
    }
}
