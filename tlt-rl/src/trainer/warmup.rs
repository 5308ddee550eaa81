//! Drafter warm-up before RL, TLT's offline stage: the policy answers prompts of the task at the rollout's
//! sampling settings, the EAGLE drafter trains on those answers' hidden states for a budget, and the warm drafter
//! is cached under a key of everything that decides it, so a second run starts from it at once.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tlt_drafter::train::{Budget, STATE_FILE as DRAFTER_STATE};
use tlt_drafter::DrafterTrainer;
use tlt_kernels::SplitMix64;
use tlt_model::Llama;
use tlt_scheduler::AdaptiveDecoder;

use super::config::{Mode, TrainerConfig, WarmupConfig};
use super::drafter::RolloutDrafter;
use super::env::{Environment, Prompt};
use super::rollout::{spec_params, Observer, RolloutJob};
use super::Trainer;
use crate::task::Split;
use crate::{Error, Result};

/// Warm-up prompts are drawn from the training split at positions from here on: far beyond any run's steps for
/// generated tasks (unseen problems of the same kind); a finite dataset wraps around into its training problems,
/// which is what TLT warms on.
pub const WARMUP_DATA_BASE: u64 = 1 << 40;

/// What a warm-up did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WarmupReport {
    /// The cache key (hex SHA-256 of the policy's weights, the prompts' tokens and every setting that shapes the
    /// drafter).
    pub key: String,
    /// The drafter came from the cache (nothing generated or trained in this run).
    pub cached: bool,
    /// Answers generated.
    pub samples: usize,
    /// Tokens in them.
    pub tokens: usize,
    /// Seconds generating them.
    pub generate_s: f64,
    /// Drafter steps.
    pub steps: u64,
    /// Seconds training.
    pub train_s: f64,
    /// Training loss and top-1 accuracy (draft argmax = target's) of the first and last step.
    pub loss: [f64; 2],
    /// See `loss`.
    pub accuracy: [f64; 2],
    /// Seconds loading the cached drafter or computing the key.
    pub other_s: f64,
}

/// The cache key of a warm drafter for `policy` on `prompts` under `cfg`: SHA-256 over the policy's weights (name,
/// shape, f32 values), the prompts' token ids and the settings that shape the drafter (sampling, warm-up, drafter
/// training, drafter seed). The time budget is part of it, so a different budget trains anew.
///
/// # Errors
/// A weight that cannot be read back from its device.
pub fn cache_key(policy: &Llama, prompts: &[Prompt], cfg: &TrainerConfig) -> Result<String> {
    let mut h = Sha256::new();
    h.update(b"tlt-rl drafter warm-up v1\0");
    let mut tensors = policy.weights().named_tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, t) in tensors {
        h.update(name.as_bytes());
        h.update([0]);
        for d in t.dims() {
            h.update((*d as u64).to_le_bytes());
        }
        let values = t.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let mut bytes = Vec::with_capacity(4 * 65536);
        for chunk in values.chunks(65536) {
            bytes.clear();
            bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
            h.update(&bytes);
        }
    }
    for p in prompts {
        h.update((p.ids.len() as u64).to_le_bytes());
        for id in &p.ids {
            h.update(id.to_le_bytes());
        }
    }
    let settings = serde_json::json!({
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "seed": cfg.seed,
        "warmup": { "samples_per_prompt": cfg.sd.warmup.samples_per_prompt, "max_new_tokens": cfg.sd.warmup.max_new_tokens,
                    "seconds": cfg.sd.warmup.seconds, "max_steps": cfg.sd.warmup.max_steps },
        "drafter": cfg.sd.kinds(),
        "drafter_train": cfg.sd.drafter_train,
        "drafter_seed": cfg.sd.drafter_seed,
        "hot_vocab": cfg.sd.hot_vocab,
    });
    h.update(settings.to_string().as_bytes());
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

impl<E: Environment> Trainer<E> {
    /// Warms the EAGLE drafter up before the first RL step ([`WarmupConfig`]): the current policy answers
    /// `prompts` training prompts (from [`WARMUP_DATA_BASE`]) `samples_per_prompt` times each at the rollout's
    /// temperature with plain decoding, and the drafter trains on those answers' hidden states, then is published
    /// to the engine. With a cache directory a drafter cached under the same [`cache_key`] is loaded instead, and
    /// a new one is cached (atomically). Returns `None` (nothing done) in baseline mode, for model-free drafters,
    /// with warm-up off or after the first step.
    ///
    /// # Errors
    /// Generation, training or cache I/O failures.
    pub fn warm_up_drafter(&mut self, obs: &mut dyn Observer) -> Result<Option<WarmupReport>> {
        let w = self.cfg.sd.warmup.clone();
        if self.cfg.mode != Mode::Tlt || !self.cfg.sd.has_eagle() || w.prompts == 0 || self.step != 0 {
            return Ok(None);
        }
        // Data-parallel: rank 0 warms up (and fills the cache) while the others wait, then they load its cache (or,
        // without a cache, warm up the same way after it).
        let ranks = self.comm.size();
        if ranks > 1 && self.comm.rank() != 0 {
            self.comm.barrier()?;
        }
        let report = self.warm_up_here(&w, obs);
        if ranks > 1 && self.comm.rank() == 0 {
            self.comm.barrier()?;
        }
        report
    }

    /// [`Self::warm_up_drafter`] on this rank.
    fn warm_up_here(&mut self, w: &WarmupConfig, obs: &mut dyn Observer) -> Result<Option<WarmupReport>> {
        obs.on_phase(0, "drafter warm-up");
        let t0 = Instant::now();
        let prompts = (0..w.prompts as u64)
            .map(|i| self.env().prompt(Split::Train, WARMUP_DATA_BASE + i))
            .collect::<Result<Vec<_>>>()?;
        self.check_prompt_room(&prompts)?;
        let key = cache_key(&self.policy, &prompts, &self.cfg)?;
        let cached = w.cache_dir.as_ref().map(|d| d.join(&key));
        if let Some(dir) = cached.as_ref().filter(|d| d.join(DRAFTER_STATE).exists()) {
            let trainer = DrafterTrainer::resume(dir, self.rollout_model()?)?;
            let buffer = tlt_drafter::online::OnlineBuffer::new(self.cfg.sd.buffer)?;
            let mut drafter = RolloutDrafter::eagle(&self.cfg.sd, trainer, 1, buffer)?;
            if self.comm.size() > 1 {
                drafter.replicate(self.comm.clone())?;
            }
            self.drafter = Some(drafter);
            tracing::info!(dir = %dir.display(), "warm drafter loaded from the cache");
            return Ok(Some(WarmupReport {
                key,
                cached: true,
                other_s: t0.elapsed().as_secs_f64(),
                ..WarmupReport::default()
            }));
        }
        let other_s = t0.elapsed().as_secs_f64();
        let seed = SplitMix64::new(self.cfg.seed).fork(WARMUP_DATA_BASE).next_u64();
        let params = spec_params(self.cfg.temperature, self.cfg.top_p, w.max_new_tokens, seed);
        let job = RolloutJob {
            limits: self.cfg.rollout,
            prompts: &prompts,
            group_size: w.samples_per_prompt,
            params,
            rl_step: 0,
            stream_keys: None,
            record_features: true,
            on_finish: None,
            give_away: None,
        };
        let out = self.rollouts.rollout(self.rollout_model()?, job, &mut AdaptiveDecoder::plain()?, None, obs)?;
        let tokens = out.samples.iter().map(|s| s.tokens.len()).sum();
        let budget = match w.max_steps {
            Some(n) => Budget::Steps(n),
            None => Budget::Time(Duration::from_secs_f64(w.seconds)),
        };
        obs.on_phase(0, "drafter warm-up training");
        let drafter =
            self.drafter.as_ref().ok_or_else(|| Error::InvalidArgument("TLT mode without a drafter".into()))?;
        let keep = self.policy.config().eos_ids();
        let Some(trained) = drafter.warm_up(&out.features, budget, self.cfg.sd.hot_vocab, &keep)? else {
            return Ok(None);
        };
        if let Some(dir) = &cached {
            drafter.save(dir)?; // atomic
            tracing::info!(dir = %dir.display(), "warm drafter cached");
        }
        let stat = |f: fn(&tlt_drafter::train::StepStats) -> f64| {
            // `+ 0.0` turns an IEEE -0.0 into 0.0 so reports never print "-0.00".
            [trained.first.as_ref().map_or(0.0, f) + 0.0, trained.last.as_ref().map_or(0.0, f) + 0.0]
        };
        Ok(Some(WarmupReport {
            key,
            cached: false,
            samples: out.samples.len(),
            tokens,
            generate_s: out.seconds,
            steps: trained.steps,
            train_s: trained.seconds,
            loss: stat(|s| s.eval.loss),
            accuracy: stat(|s| s.eval.accuracy),
            other_s,
        }))
    }
}
