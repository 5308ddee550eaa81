//! [`Target`] for `tlt_model::Llama` with its `KvCache`.

use tlt_model::{KvCache, Llama, LogitsFor, SeqId, SeqInput, Tap};

use crate::{Error, Result, SeqHandle, Target, TargetInput, TargetOutput};

fn model_err(e: impl std::fmt::Display) -> Error {
    Error::Target(e.to_string())
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
        let seq_inputs: Vec<SeqInput<'_>> = inputs
            .iter()
            .map(|i| SeqInput {
                seq: SeqId(i.seq.0),
                tokens: i.tokens,
                tree: i.tree,
                logits: if i.logits { LogitsFor::All } else { LogitsFor::None },
            })
            .collect();
        let taps: &[Tap] = if hidden { &[Tap::FinalNorm] } else { &[] };
        let out = Llama::forward(self, state, &seq_inputs, taps).map_err(model_err)?;
        let vocab = self.config().vocab_size;
        let logits: Vec<f32> = out.logits.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(model_err)?;
        let (hidden_size, hidden_buf) = match out.taps.first() {
            Some(t) if hidden => {
                (self.config().hidden_size, Some(t.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(model_err)?))
            }
            _ => (0, None),
        };
        Ok(TargetOutput {
            vocab,
            logits,
            logit_rows: out.logit_rows,
            hidden_size,
            hidden: hidden_buf,
            hidden_rows: out.token_rows,
        })
    }

    fn commit(&self, state: &mut KvCache, seq: SeqHandle, path: &[usize]) -> Result<()> {
        state.commit(SeqId(seq.0), path).map_err(model_err)
    }
}
