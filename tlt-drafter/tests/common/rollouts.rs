//! Drafters, training configs and greedy speculative rollouts on the tiny targets: shared by the training tests and
//! the device drafter's tests, which compare acceptance between executors.

use std::sync::Arc;

use tlt_drafter::online::{FeatureSample, WeightsSlot};
use tlt_drafter::train::{train_offline, Budget};
use tlt_drafter::{
    DraftExecutor, DraftRuntime, DrafterConfig, DrafterKind, DrafterTrainer, Eagle2Drafter, Eagle3Drafter,
    EagleProposer, FrozenTarget, RuntimeOptions, TrainConfig, VocabMap,
};
use tlt_kernels::WeightDType;
use tlt_model::optim::LrSchedule;
use tlt_model::{Llama, Tap};
use tlt_spec_decode::{Counters, Engine, Finished, Plan, SpecParams, TappedLlama, Target};

use super::{tokens, LAYERS, VOCAB};

/// Drafter runtimes in f32 (no hot vocabulary).
pub const F32: RuntimeOptions =
    RuntimeOptions { layer_dtype: WeightDType::F32, head_dtype: WeightDType::F32, hot_vocab: None };

/// A seeded EAGLE-2 drafter of `target` (no `fc` bias).
pub fn eagle2(target: &Llama, seed: u64) -> Eagle2Drafter {
    let cfg = DrafterConfig::eagle2_from_target(target.config(), false);
    Eagle2Drafter::random(cfg, FrozenTarget::new(target), seed).unwrap()
}

/// A seeded EAGLE-3 drafter of `target` with a draft vocabulary of 20.
pub fn eagle3(target: &Llama, seed: u64) -> Eagle3Drafter {
    let cfg = DrafterConfig::eagle3_from_target(target.config(), 20);
    let vocab = VocabMap::from_tokens(tokens(4, 20, 2).into_iter().flatten(), VOCAB, 20, &[2]).unwrap();
    Eagle3Drafter::random(cfg, vocab, FrozenTarget::new(target), seed).unwrap()
}

/// A trainer of a seeded drafter of `kind`.
pub fn trainer(target: &Llama, kind: DrafterKind, cfg: TrainConfig) -> DrafterTrainer {
    match kind {
        DrafterKind::Eagle2 => DrafterTrainer::new(eagle2(target, 11), cfg).unwrap(),
        DrafterKind::Eagle3 => DrafterTrainer::new(eagle3(target, 11), cfg).unwrap(),
    }
}

/// A small-model training config: windows of 32, rows of 64, 4 samples per step.
pub fn small_cfg(lr: f64) -> TrainConfig {
    TrainConfig {
        schedule: LrSchedule::constant(lr),
        window: 32,
        row_len: 64,
        tokens_per_step: 128,
        samples_per_step: 4,
        grad_clip: Some(1.0),
        seed: 3,
        ..TrainConfig::default()
    }
}

/// Greedy decoding of `n` tokens, no stop tokens.
pub fn params(n: usize) -> SpecParams {
    SpecParams { stop_token_ids: Some(vec![]), ..SpecParams::greedy(n) }
}

/// Greedy rollouts of `prompts` (`n` tokens each) through the engine, recording hidden states.
pub fn rollout<T: Target>(t: T, prompts: &[Vec<u32>], n: usize, drafter: Option<&mut EagleProposer>) -> Vec<Finished> {
    let mut e = Engine::new(t, params(n)).unwrap();
    e.record_hidden(true);
    for p in prompts {
        e.add_request(p).unwrap();
    }
    let plan = Plan { steps: 3, top_k: 2, verify_tokens: 6 };
    e.run_to_completion(drafter.map(|d| d as &mut dyn tlt_spec_decode::Drafter), &plan).unwrap();
    let mut f = e.take_finished();
    f.sort_by_key(|f| f.id);
    f
}

/// Samples recorded as `kind` needs them: final-norm rows for EAGLE-2, `Tap::eagle3` rows for EAGLE-3.
pub fn samples(target: &Llama, kind: DrafterKind, prompts: &[Vec<u32>], n: usize) -> Vec<Arc<FeatureSample>> {
    let taps = Tap::eagle3(LAYERS);
    let fin = match kind {
        DrafterKind::Eagle2 => rollout(target, prompts, n, None),
        DrafterKind::Eagle3 => rollout(TappedLlama { model: target, taps: &taps }, prompts, n, None),
    };
    fin.iter().map(|f| Arc::new(FeatureSample::from_finished(f, 0).unwrap())).collect()
}

/// Greedy speculative decoding of `prompts` (`n` tokens each) on the CPU target with `proposer` under `plan`: the
/// engine's counters and the tokens of every request, in request order.
pub fn greedy_sd<E: DraftExecutor>(
    target: &Llama,
    kind: DrafterKind,
    proposer: &mut EagleProposer<E>,
    prompts: &[Vec<u32>],
    n: usize,
    plan: &Plan,
) -> (Counters, Vec<Vec<u32>>) {
    let taps = Tap::eagle3(LAYERS);
    let mut e = match kind {
        DrafterKind::Eagle2 => Engine::new(TappedLlama { model: target, taps: &[Tap::FinalNorm] }, params(n)),
        DrafterKind::Eagle3 => Engine::new(TappedLlama { model: target, taps: &taps }, params(n)),
    }
    .unwrap();
    e.record_hidden(true);
    for q in prompts {
        e.add_request(q).unwrap();
    }
    e.run_to_completion(Some(proposer), plan).unwrap();
    let mut f = e.take_finished();
    f.sort_by_key(|f| f.id);
    (*e.counters(), f.into_iter().map(|f| f.tokens).collect())
}

/// Acceptance rate (accepted / drafted) of `rt` on greedy rollouts of `prompts`, chains of 3, host executor.
pub fn acceptance(target: &Llama, kind: DrafterKind, rt: DraftRuntime, prompts: &[Vec<u32>], n: usize) -> f64 {
    let (c, _) = greedy_sd(target, kind, &mut EagleProposer::fixed(rt), prompts, n, &Plan::chain(3));
    c.accepted as f64 / c.drafted.max(1) as f64
}

/// A drafter of `kind` before and after `steps` offline training steps on `target`'s own greedy responses to
/// `prompts` (`n` tokens each): (untrained, trained) f32 runtimes.
pub fn untrained_and_trained(
    target: &Llama,
    kind: DrafterKind,
    prompts: &[Vec<u32>],
    n: usize,
    steps: u64,
) -> (DraftRuntime, DraftRuntime) {
    let set = samples(target, kind, prompts, n);
    let mut t = trainer(target, kind, TrainConfig { window: 48, row_len: 96, ..small_cfg(1e-2) });
    let before = t.runtime(&F32).unwrap();
    train_offline(&mut t, &set, Budget::Steps(steps), |_| {}).unwrap();
    (before, t.runtime(&F32).unwrap())
}

/// A proposer over a fixed runtime with executor `exec`.
pub fn proposer<E: DraftExecutor>(rt: DraftRuntime, exec: E) -> EagleProposer<E> {
    EagleProposer::with_executor(Arc::new(WeightsSlot::new(rt)), exec)
}
