//! The LM head of the policy update in row chunks: `[rows, vocab]` logits exist one chunk at a time, in the
//! forward and in the backward.
//!
//! The GRPO loss depends on the head only through each token's log-probability (and entropy). So the loss is
//! built on detached per-token values (`Var`s), its backward gives their gradients, and [`ChunkedHead::backward`]
//! turns those into the head's and the hidden states' gradients chunk by chunk: `d loss / d θ = Σ_rows
//! g_row · d logp_row / d θ`. Mathematically the same gradient as one backward through full-vocabulary logits;
//! with SmolLM2's 49,152-entry vocabulary that graph held several `[rows, vocab]` f32 copies (~200 MB each for
//! 1,000 rows).

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use tlt_model::{accumulate_grads, Llama};

use crate::grpo::logprobs_and_entropy;
use crate::{Error, Result};

/// Rows of logits per chunk (256 x 49,152 f32 = 50 MB).
const CHUNK_ROWS: usize = 256;

/// Per-token log-probabilities (and entropies) of response rows, as leaves for the loss.
pub(crate) struct ChunkedHead {
    /// `[n, hidden]` final-norm states of the rows, attached to the model's graph (or a checkpoint).
    hidden: Tensor,
    /// `[n]` target tokens.
    targets: Tensor,
    /// `[b, r]` log-probabilities (a leaf: the loss's gradient w.r.t. them drives [`Self::backward`]).
    pub logp: Var,
    /// `[b, r]` entropies when asked for.
    pub entropy: Option<Var>,
    temperature: f64,
}

/// Log-probabilities and entropies of `targets` (`[n]`) under `head` (`[vocab, hidden]`) applied to `hidden` rows
/// (`[n, hidden]`), flat `[n]` each.
fn head_rows(
    head: &Tensor,
    hidden: &Tensor,
    targets: &Tensor,
    temperature: f64,
    entropy: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let n = hidden.dim(0)?;
    let logits = hidden.matmul(&head.t()?)?.reshape((1, n, ()))?;
    let (lp, ent) = logprobs_and_entropy(&logits, &targets.reshape((1, n))?, temperature, entropy)?;
    Ok((lp.flatten_all()?, ent.map(|e| e.flatten_all()).transpose()?))
}

/// `(start, len)` of each chunk of `n` rows.
fn chunks(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n).step_by(CHUNK_ROWS).map(move |s| (s, CHUNK_ROWS.min(n - s)))
}

impl ChunkedHead {
    /// The values for `hidden` rows `[b * r, hidden]` and `targets` `[b, r]`, computed chunk by chunk without a graph.
    pub(crate) fn new(
        model: &Llama,
        hidden: Tensor,
        targets: &Tensor,
        temperature: f64,
        entropy: bool,
    ) -> Result<Self> {
        let (b, r) = targets.dims2()?;
        let targets = targets.flatten_all()?;
        // Values only: detached inputs build no graph.
        let (detached, head) = (hidden.detach(), model.weights().lm_head().detach());
        let (mut lps, mut ents) = (Vec::new(), Vec::new());
        for (s, len) in chunks(b * r) {
            let (lp, ent) =
                head_rows(&head, &detached.narrow(0, s, len)?, &targets.narrow(0, s, len)?, temperature, entropy)?;
            lps.push(lp.detach());
            ents.extend(ent.map(|e| e.detach()));
        }
        let logp = Var::from_tensor(&Tensor::cat(&lps, 0)?.reshape((b, r))?)?;
        let entropy = if entropy { Some(Var::from_tensor(&Tensor::cat(&ents, 0)?.reshape((b, r))?)?) } else { None };
        Ok(Self { hidden, targets, logp, entropy, temperature })
    }

    /// The gradients of the loss whose backward gave `loss_grads`, for the head's weights and, through the hidden
    /// states' graph, every other parameter (or the checkpointed states).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the loss did not use the log-probabilities, and tensor errors.
    pub(crate) fn backward(self, loss_grads: &GradStore, model: &Llama) -> Result<GradStore> {
        let g_lp = loss_grads
            .get(self.logp.as_tensor())
            .ok_or_else(|| Error::InvalidArgument("the loss does not use the log-probabilities".into()))?
            .flatten_all()?
            .detach();
        let g_ent = match &self.entropy {
            Some(e) => {
                Some(loss_grads.get(e.as_tensor()).map(|g| Ok::<_, Error>(g.flatten_all()?.detach())).transpose()?)
            }
            None => None,
        }
        .flatten();
        let detached = self.hidden.detach();
        let (mut head_grads, mut g_hidden) = (None::<GradStore>, Vec::new());
        for (s, len) in chunks(g_lp.dim(0)?) {
            // Each chunk's rows are their own leaf, so its gradient is chunk-sized.
            let rows = Var::from_tensor(&detached.narrow(0, s, len)?)?;
            let targets = self.targets.narrow(0, s, len)?;
            let (lp, ent) =
                head_rows(model.weights().lm_head(), rows.as_tensor(), &targets, self.temperature, g_ent.is_some())?;
            let mut surrogate = (lp * g_lp.narrow(0, s, len)?)?.sum_all()?;
            if let (Some(e), Some(g)) = (ent, &g_ent) {
                surrogate = (surrogate + (e * g.narrow(0, s, len)?)?.sum_all()?)?;
            }
            let mut g = surrogate.backward()?;
            g_hidden
                .push(g.remove(rows.as_tensor()).ok_or_else(|| Error::InvalidArgument("no hidden gradient".into()))?);
            // Detached as kept: a kept gradient would keep this chunk's logits alive through its graph.
            accumulate_grads(&mut head_grads, g)?;
        }
        // Leaf gradients carry a graph to the head's weights (candle builds them from the weights): detach.
        let g_h = Tensor::cat(&g_hidden, 0)?.detach();
        accumulate_grads(&mut head_grads, (self.hidden * g_h)?.sum_all()?.backward()?)?;
        head_grads.ok_or_else(|| Error::InvalidArgument("no rows to differentiate".into()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use candle_core::{Device, Tensor, Var};
    use tlt_model::{Llama, LlamaConfig};

    use super::*;

    fn max_rel_err(a: &Tensor, b: &Tensor) -> f32 {
        let (a, b) =
            (a.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    /// Over 600 rows (three chunks), the chunked head's values and gradients (head weights and hidden states) are
    /// the full-vocabulary graph's, for a loss weighting log-probabilities and entropies.
    #[test]
    fn chunked_head_matches_the_full_graph() {
        let mut model = Llama::random(LlamaConfig::tiny(40, 16, 1), 9).unwrap();
        let vars = model.make_trainable().unwrap();
        let (b, r) = (3, 200);
        let dev = Device::Cpu;
        let hidden = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b * r, 16), &dev).unwrap()).unwrap();
        let targets =
            Tensor::from_vec((0..(b * r) as u32).map(|i| (i * 7) % 40).collect::<Vec<_>>(), (b, r), &dev).unwrap();
        let w_lp = Tensor::randn(0f32, 1.0, (b, r), &dev).unwrap();
        let w_ent = Tensor::randn(0f32, 1.0, (b, r), &dev).unwrap();
        let loss = |lp: &Tensor, ent: &Tensor| {
            ((lp * &w_lp).unwrap().sum_all().unwrap() + (ent * &w_ent).unwrap().sum_all().unwrap()).unwrap()
        };

        let logits =
            hidden.as_tensor().matmul(&model.weights().lm_head().t().unwrap()).unwrap().reshape((b, r, 40)).unwrap();
        let (lp, ent) = logprobs_and_entropy(&logits, &targets, 0.7, true).unwrap();
        let full = loss(&lp, ent.as_ref().unwrap()).backward().unwrap();

        let head = ChunkedHead::new(&model, hidden.as_tensor().clone(), &targets, 0.7, true).unwrap();
        assert!(max_rel_err(&lp, head.logp.as_tensor()) < 1e-6);
        let loss_grads = loss(head.logp.as_tensor(), head.entropy.as_ref().unwrap().as_tensor()).backward().unwrap();
        let chunked = head.backward(&loss_grads, &model).unwrap();
        let mut checked = 0;
        for v in vars.iter().map(|(_, v)| v).chain([&hidden]) {
            if let Some(want) = full.get(v) {
                let got = chunked.get(v).expect("a gradient for every tensor the full graph reaches");
                assert!(
                    max_rel_err(want, got) < 1e-5,
                    "gradient {checked} differs by {}: {} vs {}",
                    max_rel_err(want, got),
                    want.abs().unwrap().sum_all().unwrap(),
                    got.abs().unwrap().sum_all().unwrap()
                );
                checked += 1;
            }
        }
        assert_eq!(checked, 2, "the head weights and the hidden states");
    }
}
