//! [`Target`] for `tlt_model::Llama` with its `KvCache`.

use candle_core::Tensor;
use tlt_model::{KvCache, Llama, LogitsFor, SeqId, SeqInput, Tap};

use crate::{Error, Result, SeqHandle, Target, TargetInput, TargetOutput};

fn model_err(e: impl std::fmt::Display) -> Error {
    Error::Target(e.to_string())
}

/// A `Llama` target whose hidden features are the given taps side by side (e.g. [`Tap::eagle3`] for an EAGLE-3
/// drafter: three layers' inputs and the final norm), instead of the final-norm state alone.
#[derive(Debug, Clone, Copy)]
pub struct TappedLlama<'a> {
    /// The model.
    pub model: &'a Llama,
    /// The taps, concatenated in this order into each hidden row.
    pub taps: &'a [Tap],
}

/// The batched forward of both `Llama` targets; hidden rows are `taps` concatenated.
fn forward_with_taps(
    model: &Llama,
    state: &mut KvCache,
    inputs: &[TargetInput<'_>],
    taps: &[Tap],
) -> Result<TargetOutput> {
    let seq_inputs: Vec<SeqInput<'_>> = inputs
        .iter()
        .map(|i| SeqInput {
            seq: SeqId(i.seq.0),
            tokens: i.tokens,
            tree: i.tree,
            logits: if i.logits { LogitsFor::All } else { LogitsFor::None },
        })
        .collect();
    let out = Llama::forward(model, state, &seq_inputs, taps).map_err(model_err)?;
    let vocab = model.config().vocab_size;
    let logits: Vec<f32> = out.logits.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(model_err)?;
    let (hidden_size, hidden) = if out.taps.is_empty() {
        (0, None)
    } else {
        let cat = Tensor::cat(&out.taps, 1).map_err(model_err)?;
        let width = cat.dim(1).map_err(model_err)?;
        (width, Some(cat.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(model_err)?))
    };
    Ok(TargetOutput { vocab, logits, logit_rows: out.logit_rows, hidden_size, hidden, hidden_rows: out.token_rows })
}

impl Target for Llama {
    type State = KvCache;

    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }

    fn eos_ids(&self) -> Vec<u32> {
        self.config().eos_ids()
    }

    fn max_context(&self) -> Option<usize> {
        Some(self.config().max_position_embeddings)
    }

    fn new_state(&self) -> KvCache {
        self.new_cache()
    }

    fn new_sequence(&self, state: &mut KvCache) -> SeqHandle {
        SeqHandle(state.add_sequence().0)
    }

    fn remove(&self, state: &mut KvCache, seq: SeqHandle) -> Result<()> {
        state.remove(SeqId(seq.0)).map_err(model_err)
    }

    fn truncate(&self, state: &mut KvCache, seq: SeqHandle, len: usize) -> Result<()> {
        state.truncate(SeqId(seq.0), len).map_err(model_err)
    }

    fn forward(&self, state: &mut KvCache, inputs: &[TargetInput<'_>], hidden: bool) -> Result<TargetOutput> {
        forward_with_taps(self, state, inputs, if hidden { &[Tap::FinalNorm] } else { &[] })
    }

    fn commit(&self, state: &mut KvCache, seq: SeqHandle, path: &[usize]) -> Result<()> {
        state.commit(SeqId(seq.0), path).map_err(model_err)
    }

    fn fork(&self, state: &mut KvCache, seq: SeqHandle) -> Result<Option<SeqHandle>> {
        state.fork(SeqId(seq.0)).map(|s| Some(SeqHandle(s.0))).map_err(model_err)
    }
}

impl Target for TappedLlama<'_> {
    type State = KvCache;

    fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    fn eos_ids(&self) -> Vec<u32> {
        self.model.eos_ids()
    }

    fn max_context(&self) -> Option<usize> {
        self.model.max_context()
    }

    fn new_state(&self) -> KvCache {
        self.model.new_state()
    }

    fn new_sequence(&self, state: &mut KvCache) -> SeqHandle {
        self.model.new_sequence(state)
    }

    fn remove(&self, state: &mut KvCache, seq: SeqHandle) -> Result<()> {
        self.model.remove(state, seq)
    }

    fn truncate(&self, state: &mut KvCache, seq: SeqHandle, len: usize) -> Result<()> {
        self.model.truncate(state, seq, len)
    }

    fn forward(&self, state: &mut KvCache, inputs: &[TargetInput<'_>], hidden: bool) -> Result<TargetOutput> {
        forward_with_taps(self.model, state, inputs, if hidden { self.taps } else { &[] })
    }

    fn commit(&self, state: &mut KvCache, seq: SeqHandle, path: &[usize]) -> Result<()> {
        self.model.commit(state, seq, path)
    }

    fn fork(&self, state: &mut KvCache, seq: SeqHandle) -> Result<Option<SeqHandle>> {
        self.model.fork(state, seq)
    }
}
