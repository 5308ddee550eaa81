//! The generation part of a step: rollouts whose answers are scored as they finish, DAPO's dynamic sampling, and
//! the step's metrics line.

use std::sync::Arc;
use std::time::Instant;

use tlt_kernels::SplitMix64;

use super::reward::Collected;
use super::rollout::{spec_params, GiveAway, Observer, RolloutJob, RolloutOutput};
use super::{inference_copy, step_seed, Environment, Mode, Prompt, RolloutDrafter, Trainer, UpdateStats};
use crate::metrics::{mean_std, percentile, StepMetrics};
use crate::task::{Score, Split};
use crate::Result;

/// Everything a step generated.
pub(super) struct Generation {
    /// Every rollout of the step, merged: samples group-major, groups numbered across rollouts.
    pub out: RolloutOutput,
    /// One score per sample.
    pub scores: Vec<Score>,
    /// The shaped reward of each sample (the score's reward plus any overlong penalty).
    pub rewards: Vec<f64>,
    /// The groups trained on, ascending: all of them, or with dynamic sampling the informative ones (at most
    /// `prompts_per_step`).
    pub kept: Vec<usize>,
    /// The data position after the prompts this step drew.
    pub data_pos: u64,
    /// Rollouts run.
    pub gen_batches: usize,
    /// Scoring time, all rollouts together.
    pub scoring: Collected,
    /// Each data-parallel rank's rollout seconds (empty for one rank).
    pub rank_rollout_s: Vec<f64>,
    /// Groups a data-parallel rank decoded for another (work stealing).
    pub stolen_groups: usize,
    /// Drafter versions data-parallel ranks installed mid-rollout (trained by the trainer rank while they decoded).
    pub drafter_swaps: u64,
}

impl Generation {
    /// Per generated group: all its rewards are equal (as [`crate::grpo::group_advantages`] decides it; a group of
    /// one answer never is).
    pub(super) fn zero_variance_groups(&self, group_size: usize) -> Vec<bool> {
        self.rewards.chunks(group_size).map(|r| r.len() > 1 && crate::grpo::all_equal(r)).collect()
    }
}

impl<E: Environment> Trainer<E> {
    /// The step's rollouts and rewards: one rollout of `prompts_per_step` prompts, or with dynamic sampling more
    /// until the informative groups fill the batch or `max_gen_batches` rollouts ran.
    pub(super) fn generate(&mut self, step: u64, obs: &mut dyn Observer) -> Result<Generation> {
        let (p, g) = (self.cfg.prompts_per_step, self.cfg.group_size);
        let dynamic = self.cfg.dynamic_sampling.clone();
        let max_batches = dynamic.as_ref().map_or(1, |d| d.max_gen_batches);
        let mut data_pos = self.data_pos;
        let mut gen: Option<Generation> = None;
        for k in 0..max_batches {
            let prompts = (0..p as u64)
                .map(|i| self.env().prompt(Split::Train, data_pos + i))
                .collect::<Result<Vec<Prompt>>>()?;
            self.check_prompt_room(&prompts)?;
            data_pos += p as u64;
            let seed = match k {
                0 => step_seed(self.cfg.seed, step),
                _ => SplitMix64::new(step_seed(self.cfg.seed, step)).fork(k as u64).next_u64(),
            };
            let (out, scoring, rank_rollout_s, stolen_groups, drafter_swaps) =
                self.rollout_and_score(step, &prompts, seed, obs)?;
            let rewards: Vec<f64> = out
                .samples
                .iter()
                .zip(&scoring.scores)
                .map(|(s, sc)| self.cfg.grpo.shaped_reward(sc.reward, s.tokens.len(), self.cfg.max_new_tokens))
                .collect();
            let offset = k * p;
            let gen = match gen.as_mut() {
                None => gen.insert(Generation {
                    out,
                    scores: scoring.scores.clone(),
                    rewards,
                    kept: Vec::new(),
                    data_pos,
                    gen_batches: 1,
                    scoring,
                    rank_rollout_s,
                    stolen_groups,
                    drafter_swaps,
                }),
                Some(acc) => {
                    acc.out.append(out, offset);
                    acc.scores.extend(scoring.scores.iter().copied());
                    acc.rewards.extend(rewards);
                    acc.data_pos = data_pos;
                    acc.gen_batches += 1;
                    acc.scoring.merge(scoring);
                    acc
                }
            };
            let zero = gen.zero_variance_groups(g);
            gen.kept = match dynamic {
                None => (0..zero.len()).collect(),
                Some(_) => (0..zero.len()).filter(|&i| !zero[i]).take(p).collect(),
            };
            if gen.kept.len() >= p {
                break;
            }
        }
        let gen = gen.ok_or_else(|| crate::Error::InvalidArgument("no rollout ran".into()))?;
        if dynamic.is_some() && gen.kept.len() < p {
            tracing::warn!(
                step,
                informative = gen.kept.len(),
                wanted = p,
                rollouts = gen.gen_batches,
                "dynamic sampling reached max_gen_batches: training on fewer informative groups"
            );
        }
        Ok(gen)
    }

    /// One rollout of `prompts` with sampling seed `seed`, each answer handed to the scoring workers as it
    /// finishes; then the scores (waiting for the last ones). In a data-parallel job this rank decodes and scores
    /// its [`shard`](super::shard) of the groups and the samples and scores of all ranks come back (with each
    /// rank's rollout seconds; `seconds` is then the slowest rank's).
    fn rollout_and_score(
        &mut self,
        step: u64,
        prompts: &[Prompt],
        seed: u64,
        obs: &mut dyn Observer,
    ) -> Result<(RolloutOutput, Collected, Vec<f64>, usize, u64)> {
        let ranks = self.comm.size();
        if ranks == 1 {
            let (out, collected) = self.rollout_and_score_shard(step, prompts, None, seed, None, obs)?;
            return Ok((out, collected, Vec::new(), 0, 0));
        }
        let comm = self.comm.clone();
        let mine = super::parallel::shard(prompts.len(), ranks, comm.rank());
        let steal = self.cfg.steal_queued_groups;
        let g = self.cfg.group_size as u64;
        let keys = |groups: &[usize]| -> Vec<u64> { groups.iter().map(|&i| i as u64 * g).collect() };
        let own: Vec<usize> = mine.clone().collect();
        let to_step = |local: usize| mine.start + local;
        let mut give = |waiting: &[usize]| super::parallel::answer_steals(comm.as_ref(), waiting, &to_step, steal);
        let (mut out, mut collected) =
            self.rollout_and_score_shard(step, &prompts[mine.clone()], Some(&keys(&own)), seed, Some(&mut give), obs)?;
        for s in &mut out.samples {
            s.group += mine.start;
        }
        // Out of work: steal groups other ranks have not started, until none is left, then wait for every rank.
        let mut stolen = 0;
        let mut done = vec![false; ranks];
        let ask = |done: &mut [bool]| match steal {
            true => super::parallel::ask_for_work(comm.as_ref(), done),
            false => Ok(Vec::new()),
        };
        let mut granted = ask(&mut done)?;
        while !granted.is_empty() {
            tracing::debug!(step, groups = ?granted, "decoding groups stolen from busier ranks");
            stolen += granted.len();
            let taken: Vec<Prompt> = granted.iter().map(|&i| prompts[i].clone()).collect();
            let to_step = |local: usize| granted[local];
            let mut refuse =
                |waiting: &[usize]| super::parallel::answer_steals(comm.as_ref(), waiting, &to_step, false);
            let (mut more, c) =
                self.rollout_and_score_shard(step, &taken, Some(&keys(&granted)), seed, Some(&mut refuse), obs)?;
            for s in &mut more.samples {
                s.group = granted[s.group];
            }
            out.append(more, 0);
            collected.merge(c);
            granted = ask(&mut done)?;
        }
        // This rank's rollout time (`out.seconds`) is its decoding, its own share and what it stole: not its waits
        // for grants or for the others.
        // Then wait for every rank, the trainer rank training the drafter meanwhile, and agree on its version.
        let mut drafter = if self.cfg.mode == Mode::Tlt { self.drafter.as_mut() } else { None };
        let mut idle = |busy: &[bool]| drafter.as_deref_mut().map_or(Ok(false), |d| d.idle_step(busy));
        super::parallel::finish_rollout(comm.as_ref(), &mut done, &mut idle)?;
        let min_steps = match self.cfg.sd.schedule {
            super::DrafterSchedule::Fixed { steps } => steps,
            super::DrafterSchedule::Tail | super::DrafterSchedule::Off => 0,
        };
        let (swaps, drafter_s) = match drafter {
            Some(d) => d.sync_replicas(min_steps)?,
            None => (0, 0.0),
        };
        // This rank's drafter training: the trainer rank's while the others decoded, and every rank's joint steps at
        // the step's end.
        out.drafter_s += drafter_s;
        out.drafter_after_s += drafter_s;
        let local = std::mem::take(&mut out.samples);
        let scores = std::mem::take(&mut collected.scores);
        let all = super::parallel::gather_rollout(comm.as_ref(), local, scores, out.seconds, stolen, swaps)?;
        out.samples = all.samples;
        collected.scores = all.scores;
        out.seconds = all.rollout_s.iter().copied().fold(0.0, f64::max);
        Ok((out, collected, all.rollout_s, all.stolen, all.swaps))
    }

    /// One rollout of `prompts` (coin streams keyed by `stream_keys` when given), scored as answers finish.
    fn rollout_and_score_shard(
        &mut self,
        step: u64,
        prompts: &[Prompt],
        stream_keys: Option<&[u64]>,
        seed: u64,
        give_away: Option<&mut GiveAway>,
        obs: &mut dyn Observer,
    ) -> Result<(RolloutOutput, Collected)> {
        obs.on_phase(step, "rollout");
        let params = spec_params(self.cfg.temperature, self.cfg.top_p, self.cfg.max_new_tokens, seed);
        let shared: Vec<Arc<Prompt>> = prompts.iter().cloned().map(Arc::new).collect();
        self.scoring.begin();
        let scoring = &mut self.scoring;
        let mut submit = |i: usize, group: usize, tokens: &[u32]| scoring.submit(i, &shared[group], tokens);
        let job = RolloutJob {
            limits: self.cfg.rollout,
            prompts,
            group_size: self.cfg.group_size,
            params,
            rl_step: step,
            stream_keys,
            record_features: false,
            on_finish: Some(&mut submit),
            // Re-borrowed for the job's (shorter) lifetime: `Option` does not coerce its contents.
            give_away: match give_away {
                Some(g) => Some(g),
                None => None,
            },
        };
        let drafter = if self.cfg.mode == Mode::Tlt { self.drafter.as_mut() } else { None };
        let model = inference_copy(&self.rollout_model)?;
        let t0 = Instant::now();
        let out = self.rollouts.rollout(model, job, &mut self.decoder, drafter, obs)?;
        let t_end = Instant::now();
        obs.on_phase(step, "reward");
        let collected = self.scoring.collect(out.samples.len(), (t0, t_end))?;
        Ok((out, collected))
    }

    /// The metrics line of a step (wall times of the update and publication are filled in by the caller).
    pub(super) fn metrics(
        &self,
        step: u64,
        gen: &Generation,
        zero_var: &[bool],
        update: &UpdateStats,
        lr: f64,
    ) -> StepMetrics {
        let out = &gen.out;
        let n = gen.scores.len().max(1) as f64;
        let (reward_mean, reward_std) = mean_std(&gen.rewards);
        let lens: Vec<usize> = out.samples.iter().map(|s| s.tokens.len()).collect();
        let lens_f: Vec<f64> = lens.iter().map(|&l| l as f64).collect();
        let total = out.samples.len().max(1) as f64;
        let active = &out.trace.active;
        let idle_fraction = if active.is_empty() {
            0.0
        } else {
            1.0 - active.iter().sum::<usize>() as f64 / (active.len() as f64 * total)
        };
        let informative = gen.kept.iter().filter(|&&k| !zero_var.get(k).copied().unwrap_or(true)).count();
        StepMetrics {
            step,
            mode: match self.cfg.mode {
                Mode::Tlt => "tlt".into(),
                Mode::Baseline => "baseline".into(),
            },
            reward_mean,
            reward_std,
            accuracy: gen.scores.iter().filter(|s| s.correct).count() as f64 / n,
            format_rate: gen.scores.iter().filter(|s| s.formatted).count() as f64 / n,
            response_len_p50: percentile(&lens_f, 0.5),
            response_len_p90: percentile(&lens_f, 0.9),
            response_len_max: lens.iter().copied().max().unwrap_or(0),
            response_len_mean: lens_f.iter().sum::<f64>() / n,
            truncation_rate: out.samples.iter().filter(|s| s.truncated).count() as f64 / n,
            samples: out.samples.len(),
            rollout_tokens: lens.iter().sum(),
            rollout_s: out.seconds,
            reward_s: gen.scoring.busy_s,
            reward_hidden_s: gen.scoring.hidden_s,
            reward_wait_s: gen.scoring.wait_s,
            reward_timeouts: gen.scoring.timeouts,
            gen_batches: gen.gen_batches,
            informative_groups: informative,
            drafter_s: out.drafter_s,
            drafter_after_s: out.drafter_after_s,
            idle_fraction,
            sd_on_fraction: out.trace.sd_fraction(),
            accept_len: out.trace.mean_accept_len(),
            arms: out.trace.arms.clone(),
            drafter_version: self.drafter.as_ref().map_or(0, RolloutDrafter::version),
            drafter_steps: self.drafter.as_ref().map_or(0, RolloutDrafter::steps),
            loss: update.loss.loss,
            pg_loss: update.loss.pg_loss,
            kl: update.loss.kl,
            entropy: update.loss.entropy,
            clip_frac: update.loss.clip_frac_low + update.loss.clip_frac_high,
            ratio_mean: update.loss.ratio_mean,
            tis_weight: update.loss.tis_weight_mean,
            optimizer_steps: update.optimizer_steps,
            skipped_optimizer_steps: update.skipped_steps,
            dual_clip_frac: update.loss.dual_clip_frac,
            ppo_kl: update.loss.ppo_kl,
            grad_norm: update.grad_norm,
            lr,
            zero_variance_groups: zero_var.iter().filter(|&&z| z).count(),
            tail_share: out.trace.tail_share(self.cfg.sd.gate.threshold),
            active_requests: active.clone(),
            round_seconds: out.trace.round_seconds.clone(),
            round_tokens: out.trace.round_tokens.clone(),
            round_end_s: out.round_end_s.clone(),
            round_sd: out.round_sd.clone(),
            plain_arm_steps: out.trace.plain_arm_steps,
            drafter_prepare_s: out.trace.prepare_seconds,
            sd_ceiling: out.sd_ceiling,
            response_lengths: lens,
            tokens_digest: crate::metrics::tokens_digest(out.samples.iter().map(|s| s.tokens.as_slice())),
            accept_lens: out.trace.accept_lens.clone(),
            ranks: self.comm.size(),
            rank_idle_s: {
                let slowest = gen.rank_rollout_s.iter().copied().fold(0.0, f64::max);
                gen.rank_rollout_s.iter().map(|s| slowest - s).collect()
            },
            rank_rollout_s: gen.rank_rollout_s.clone(),
            stolen_groups: gen.stolen_groups,
            drafter_swaps: gen.drafter_swaps,
            grad_sync_s: update.grad_sync_s,
            grad_wait_s: update.grad_wait_s,
            ..StepMetrics::default()
        }
    }
}
