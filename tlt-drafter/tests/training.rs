//! Drafter training from engine rollouts: batch building, AdamW and clipping, loss reduction with the target
//! frozen, bit-exact resume, online training next to concurrent rollouts, and higher acceptance after training.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var};
use common::rollouts::*;
use common::*;
use parking_lot::Mutex;
use tlt_drafter::online::{BackgroundTrainer, BufferConfig, FeatureSample, OnlineBuffer, WeightsSlot};
use tlt_drafter::train::{
    build_eagle2_batch, build_eagle3_batch, feature_slices, online_step_fn, train_offline, Budget, LossParts,
    OnlineStepConfig,
};
use tlt_drafter::{
    DrafterKind, DrafterTrainer, Eagle2Drafter, Eagle3Drafter, EagleProposer, Error, TrainConfig, TrainableDrafter,
    UniformNoise,
};
use tlt_model::optim::{clip_grad_norm, AdamW, AdamWParams, LrSchedule, ScheduleKind};
use tlt_model::Llama;
use tlt_spec_decode::HiddenStates;

/// A cosine schedule: peak `lr`, `warmup` steps, the floor `ratio * lr` at `total`.
fn cosine(lr: f64, warmup: u64, total: u64, ratio: f64) -> LrSchedule {
    LrSchedule { lr, warmup_steps: warmup, total_steps: total, min_lr_ratio: ratio, kind: ScheduleKind::Cosine }
}

fn weight_bits(t: &DrafterTrainer) -> Vec<(String, Vec<u64>)> {
    t.drafter()
        .named_tensors()
        .into_iter()
        .map(|(n, x)| (n, x.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()))
        .map(|(n, v)| (n, v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

/// A hand-made sample of `h`-wide rows: row `j` is `[100 j + c for c in 0..width]`.
fn fake(tokens: &[u32], response_start: usize, width: usize) -> Arc<FeatureSample> {
    let rows = tokens.len() - 1;
    let data = (0..rows).flat_map(|j| (0..width).map(move |c| (100 * j + c) as f32)).collect();
    Arc::new(FeatureSample {
        tokens: tokens.to_vec(),
        hidden: HiddenStates::from_flat(width, data).unwrap(),
        response_start,
        rl_step: 0,
    })
}

fn vec2<T: candle_core::WithDType>(t: &Tensor) -> Vec<Vec<T>> {
    t.to_vec2::<T>().unwrap()
}

#[test]
fn batches_have_the_right_windows_masks_segments_and_feature_slices() {
    let h = 2;
    let a = fake(&[10, 11, 12, 13, 14], 3, h); // targets: rows 2, 3 (row 4 does not exist)
    let none = fake(&[1, 2, 3], 3, h); // no response token: skipped
    let b = fake(&[20, 21, 22], 1, h); // target: row 1 (row 0 has no predecessor)
    let set = [a.clone(), none, b.clone()];
    let cfg = TrainConfig { window: 8, row_len: 8, tokens_per_step: 8, ..TrainConfig::default() };

    // One row: A's window starts one position before its first target (index 1), B's at 0.
    let (batch, info) = build_eagle2_batch(&set, h, &cfg).unwrap();
    assert_eq!((info.samples, info.tokens, info.rows, info.row_len), (2, 7, 1, 7));
    assert_eq!(vec2::<u32>(&batch.input_ids), vec![vec![11, 12, 13, 14, 20, 21, 22]]);
    assert_eq!(vec2::<u32>(batch.segments.as_ref().unwrap()), vec![vec![0, 0, 0, 0, 1, 1, 1]]);
    assert_eq!(vec2::<f32>(&batch.loss_mask), vec![vec![0., 1., 1., 0., 0., 1., 0.]]);
    let hid = batch.hidden.squeeze(0).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(hid[0], vec![100., 101.]); // A row 1
    assert_eq!(hid[2], vec![300., 301.]); // A row 3
    assert_eq!(hid[3], vec![0., 0.]); // A's last token: no row
    assert_eq!(hid[4], vec![0., 1.]); // B row 0

    // Rows of 5: B goes to a second, right-padded row whose padding is its own segment with mask 0.
    let cfg5 = TrainConfig { row_len: 5, ..cfg.clone() };
    let (batch, info) = build_eagle2_batch(&set, h, &cfg5).unwrap();
    assert_eq!((info.rows, info.row_len), (2, 4));
    assert_eq!(vec2::<u32>(&batch.input_ids), vec![vec![11, 12, 13, 14], vec![20, 21, 22, 0]]);
    assert_eq!(vec2::<u32>(batch.segments.as_ref().unwrap()), vec![vec![0; 4], vec![0, 0, 0, 1]]);
    assert_eq!(vec2::<f32>(&batch.loss_mask), vec![vec![0., 1., 1., 0.], vec![0., 1., 0., 0.]]);

    // A budget of 6 tokens crops B's window to 2 tokens; one of 5 leaves no room for it.
    let (batch, _) = build_eagle2_batch(&set, h, &TrainConfig { tokens_per_step: 6, ..cfg.clone() }).unwrap();
    assert_eq!(vec2::<u32>(&batch.input_ids), vec![vec![11, 12, 13, 14, 20, 21]]);
    let (_, info) = build_eagle2_batch(&set, h, &TrainConfig { tokens_per_step: 5, ..cfg.clone() }).unwrap();
    assert_eq!(info.samples, 1);
    // A window of 3 keeps A's first three tokens.
    let (batch, _) =
        build_eagle2_batch(std::slice::from_ref(&a), h, &TrainConfig { window: 3, ..cfg.clone() }).unwrap();
    assert_eq!(vec2::<f32>(&batch.loss_mask), vec![vec![0., 1., 1.]]);

    // 4H-wide rows: EAGLE-2 reads the last H (final norm); EAGLE-3 the first 3H (aux) and the last H (teacher).
    let wide = fake(&[10, 11, 12, 13, 14], 3, 4 * h);
    let (e2, _) = build_eagle2_batch(std::slice::from_ref(&wide), h, &cfg).unwrap();
    assert_eq!(e2.hidden.squeeze(0).unwrap().to_vec2::<f32>().unwrap()[0], vec![106., 107.]);
    let (e3, _) = build_eagle3_batch(std::slice::from_ref(&wide), h, &cfg).unwrap();
    assert_eq!(
        e3.aux_hidden.squeeze(0).unwrap().to_vec2::<f32>().unwrap()[0],
        vec![100., 101., 102., 103., 104., 105.]
    );
    let tlt_drafter::Teacher::FinalHidden(teacher) = &e3.teacher else { panic!("teacher from hidden states") };
    assert_eq!(teacher.squeeze(0).unwrap().to_vec2::<f32>().unwrap()[1], vec![206., 207.]);
    assert_eq!(vec2::<f32>(&e3.loss_mask), vec2::<f32>(&e2.loss_mask));

    // Wrong widths are errors, not garbage.
    assert!(matches!(build_eagle3_batch(std::slice::from_ref(&a), h, &cfg), Err(Error::InvalidBatch { .. })));
    assert!(matches!(build_eagle3_batch(&[fake(&[1, 2, 3, 4], 2, 3 * h)], h, &cfg), Err(Error::InvalidBatch { .. })));
    assert!(matches!(build_eagle2_batch(&[fake(&[1, 2, 3, 4], 2, 3 * h)], h, &cfg), Err(Error::InvalidBatch { .. })));
    assert!(feature_slices(DrafterKind::Eagle2, h, 5).is_err());
    assert_eq!(feature_slices(DrafterKind::Eagle3, h, 8).unwrap().teacher, Some(6..8));
    // Nothing to train on is an error too.
    assert!(matches!(build_eagle2_batch(&[fake(&[1, 2, 3], 3, h)], h, &cfg), Err(Error::InvalidArgument(_))));
}

#[test]
fn config_validation_and_schedule() {
    assert!(TrainConfig::default().validate().is_ok());
    let bad = [
        TrainConfig { window: 1, ..TrainConfig::default() },
        TrainConfig { row_len: 100, ..TrainConfig::default() },
        TrainConfig { tokens_per_step: 10, ..TrainConfig::default() },
        TrainConfig { betas: [0.9, 1.0], ..TrainConfig::default() },
        TrainConfig { grad_clip: Some(0.0), ..TrainConfig::default() },
        TrainConfig { schedule: cosine(5e-5, 0, 10, 2.0), ..TrainConfig::default() },
    ];
    for c in bad {
        assert!(matches!(c.validate(), Err(Error::InvalidConfig { .. })), "{c:?}");
    }
    let c = TrainConfig { schedule: cosine(1.0, 4, 14, 0.1), ..TrainConfig::default() };
    // Warm-up from 0, as verl and transformers' schedulers: s / W at step s.
    assert_eq!(c.lr_at(0), 0.0);
    assert_eq!(c.lr_at(1), 0.25);
    assert_eq!(c.lr_at(3), 0.75);
    assert_eq!(c.lr_at(4), 1.0);
    assert!((c.lr_at(9) - 0.55).abs() < 1e-12);
    assert!((c.lr_at(14) - 0.1).abs() < 1e-12 && (c.lr_at(100) - 0.1).abs() < 1e-12);
    let text = serde_json::to_string(&c).unwrap();
    assert_eq!(serde_json::from_str::<TrainConfig>(&text).unwrap(), c);
}

#[test]
fn adamw_matches_a_direct_reimplementation_and_clipping_bounds_the_norm() {
    let (b1, b2, eps, wd, lr) = (0.9, 0.95, 1e-8, 0.1, 0.01);
    let w0 = [0.5f64, -1.0, 2.0];
    let c = [0.3f64, -2.0, 0.0];
    let var = Var::from_tensor(&Tensor::new(&[0.5f32, -1.0, 2.0], &Device::Cpu).unwrap()).unwrap();
    let hp = AdamWParams { beta1: b1, beta2: b2, eps, weight_decay: wd };
    let mut opt = AdamW::new(vec![("w".into(), var.clone())], hp).unwrap();
    // loss = sum(c * w^2) / 2: gradient c * w.
    let (mut w, mut m, mut v) = (w0, [0f64; 3], [0f64; 3]);
    let ct = Tensor::new(&[0.3f32, -2.0, 0.0], &Device::Cpu).unwrap();
    for t in 1..=5 {
        let loss = ((var.as_tensor().sqr().unwrap() * &ct).unwrap().sum_all().unwrap() * 0.5).unwrap();
        let norm = opt.step(&loss.backward().unwrap(), lr, None).unwrap();
        let g: Vec<f64> = (0..3).map(|k| c[k] * w[k]).collect();
        let want_norm = g.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!((norm.before - want_norm).abs() < 1e-5 * want_norm.max(1.0));
        for k in 0..3 {
            m[k] = b1 * m[k] + (1.0 - b1) * g[k];
            v[k] = b2 * v[k] + (1.0 - b2) * g[k] * g[k];
            let mh = m[k] / (1.0 - b1.powi(t));
            let vh = v[k] / (1.0 - b2.powi(t));
            w[k] = w[k] * (1.0 - lr * wd) - lr * mh / (vh.sqrt() + eps);
        }
        let got = var.as_tensor().to_vec1::<f32>().unwrap();
        for k in 0..3 {
            assert!((f64::from(got[k]) - w[k]).abs() < 1e-6, "step {t} [{k}]: {} vs {}", got[k], w[k]);
        }
    }
    assert_eq!(opt.state()[0].steps, 5);

    // Clipping: the global norm after is max_norm; under the limit nothing changes.
    let mut g = vec![vec![3.0, 0.0], vec![4.0]];
    let n = clip_grad_norm(&mut g, Some(0.5));
    assert_eq!(n.before, 5.0);
    assert!(n.after <= 0.5 && n.after > 0.5 - 1e-6, "{n:?}");
    assert!((g[0][0] / g[1][0] - 0.75).abs() < 1e-12, "direction kept");
    let mut g = vec![vec![0.1, 0.2]];
    assert_eq!(clip_grad_norm(&mut g, Some(0.5)).after, clip_grad_norm(&mut g.clone(), None).before);
    assert_eq!(g, vec![vec![0.1, 0.2]]);

    // A big gradient through the optimizer: clipped to the limit, and the first Adam update stays within lr.
    let var = Var::from_tensor(&Tensor::new(&[1.0f32, -1.0], &Device::Cpu).unwrap()).unwrap();
    let mut opt = AdamW::new(vec![("w".into(), var.clone())], AdamWParams::default()).unwrap();
    let loss = (var.as_tensor().sqr().unwrap().sum_all().unwrap() * 1e4).unwrap();
    let norm = opt.step(&loss.backward().unwrap(), 0.01, Some(0.5)).unwrap();
    assert!(norm.before > 1e4 && norm.after <= 0.5, "{norm:?}");
    let after = var.as_tensor().to_vec1::<f32>().unwrap();
    assert!((after[0] - 0.99).abs() < 1e-6 && (after[1] + 0.99).abs() < 1e-6, "{after:?}");
}

#[test]
fn training_reduces_the_loss_and_leaves_the_target_untouched() {
    let target = target("llama", 21);
    let embed = bits(&target.weights().embed_tokens);
    let head = bits(target.weights().lm_head());
    let prompts = tokens(6, 5, 7);
    for kind in [DrafterKind::Eagle2, DrafterKind::Eagle3] {
        let set = samples(&target, kind, &prompts, 24);
        let cfg = TrainConfig { tokens_per_step: 256, ..small_cfg(5e-3) };
        let mut t = trainer(&target, kind, cfg);
        let before = t.evaluate(&set).unwrap();
        assert_eq!(before.batch.samples, set.len(), "evaluation covers every sample");
        let start = Instant::now();
        let report = train_offline(&mut t, &set, Budget::Steps(40), |s| {
            assert!(s.eval.loss.is_finite());
            assert!(s.grad_norm.after <= 1.0 + 1e-9, "clipped: {:?}", s.grad_norm);
        })
        .unwrap();
        let after = t.evaluate(&set).unwrap();
        eprintln!(
            "{kind:?}: loss {:.4} -> {:.4}, accuracy {:.3} -> {:.3}, 40 steps in {:.2}s ({:.0} tokens/s)",
            before.loss,
            after.loss,
            before.accuracy,
            after.accuracy,
            start.elapsed().as_secs_f64(),
            report.tokens_per_s
        );
        assert_eq!(report.steps, 40);
        assert!(after.loss < 0.7 * before.loss, "{kind:?}: {} -> {}", before.loss, after.loss);
        match (&before.parts, &after.parts) {
            (LossParts::Eagle2 { vloss: v0, .. }, LossParts::Eagle2 { vloss: v1, .. }) => assert!(v1 < v0),
            (LossParts::Eagle3 { steps: s0, .. }, LossParts::Eagle3 { steps: s1, .. }) => assert!(s1[0] < s0[0]),
            other => panic!("{kind:?}: parts {other:?}"),
        }
        assert_eq!(t.steps_done(), 40);
        assert_eq!(bits(&target.weights().embed_tokens), embed, "{kind:?}: target embedding unchanged");
        assert_eq!(bits(target.weights().lm_head()), head, "{kind:?}: target LM head unchanged");
        assert_eq!(bits(t.drafter().target().embed_tokens()), embed);
    }
}

/// `n` steps of offline training; returns the losses.
fn run(t: &mut DrafterTrainer, set: &[Arc<FeatureSample>], n: u64) -> Vec<f64> {
    let mut losses = Vec::new();
    train_offline(t, set, Budget::Steps(n), |s| losses.push(s.eval.loss)).unwrap();
    losses
}

#[test]
fn a_run_split_in_two_with_a_new_schedule_matches_one_run() {
    let target = target("llama", 23);
    let set = samples(&target, DrafterKind::Eagle2, &tokens(4, 4, 9), 16);
    let cfg = small_cfg(3e-3);
    let cfg = TrainConfig { schedule: LrSchedule { warmup_steps: 2, ..cfg.schedule.clone() }, ..cfg };
    let cosine = cosine(3e-3, 2, 6, 1e-4 / 3e-3);

    let mut straight = trainer(&target, DrafterKind::Eagle2, TrainConfig { schedule: cosine.clone(), ..cfg.clone() });
    let mut lrs = Vec::new();
    let whole = train_offline(&mut straight, &set, Budget::Steps(6), |s| lrs.push(s.lr)).unwrap();

    let mut split = trainer(&target, DrafterKind::Eagle2, cfg);
    let mut split_lrs = Vec::new();
    let first = train_offline(&mut split, &set, Budget::Steps(2), |s| split_lrs.push(s.lr)).unwrap();
    split.set_lr_schedule(cosine.clone()).unwrap();
    let rest = train_offline(&mut split, &set, Budget::Steps(4), |s| split_lrs.push(s.lr)).unwrap();
    let merged = first.clone().merge(rest.clone());

    assert_eq!(split_lrs, lrs, "the swapped-in schedule continues from the step count");
    assert_eq!(merged.steps, 6);
    assert_eq!(merged.tokens, whole.tokens);
    assert_eq!(merged.first.map(|s| s.step), first.first.map(|s| s.step));
    assert_eq!(merged.last.map(|s| s.eval.loss), whole.last.map(|s| s.eval.loss), "same trajectory");
    let bad = LrSchedule { min_lr_ratio: f64::NAN, ..cosine };
    assert!(split.set_lr_schedule(bad).is_err(), "an invalid schedule is refused");
}

#[test]
fn resume_continues_bit_for_bit() {
    let target = target("llama", 22);
    let prompts = tokens(5, 4, 9);
    for kind in [DrafterKind::Eagle2, DrafterKind::Eagle3] {
        let set = samples(&target, kind, &prompts, 20);
        let mut cfg = TrainConfig {
            schedule: cosine(3e-3, 2, 8, 1e-4 / 3e-3),
            weight_decay: 0.01,
            samples_per_step: 2,
            ..small_cfg(3e-3)
        };
        let noise = Some(UniformNoise { std: 0.2, seed: 5 });
        cfg.eagle2_loss.noise = noise;
        cfg.eagle3_loss.noise = noise;
        cfg.eagle3_loss.steps = 3;

        let mut straight = trainer(&target, kind, cfg.clone());
        let all = run(&mut straight, &set, 6);

        let dir = temp_dir("resume");
        let ck = dir.join("ck");
        let mut first = trainer(&target, kind, cfg.clone());
        let mut losses = run(&mut first, &set, 3);
        first.save_checkpoint(&ck).unwrap();
        let moments = first.optimizer().state().to_vec();
        drop(first);
        let mut resumed = DrafterTrainer::resume(&ck, &target).unwrap();
        assert_eq!(resumed.steps_done(), 3);
        assert_eq!(resumed.optimizer().state(), &moments[..], "{kind:?}: moments restored exactly");
        losses.extend(run(&mut resumed, &set, 3));
        assert_eq!(losses, all, "{kind:?}: identical loss sequence");
        assert_eq!(weight_bits(&resumed), weight_bits(&straight), "{kind:?}: identical weights");
        assert_eq!(resumed.totals(), straight.totals());

        // The serving copy inside the checkpoint loads as a plain drafter.
        match kind {
            DrafterKind::Eagle2 => drop(Eagle2Drafter::load(&ck.join("drafter"), &target).unwrap()),
            DrafterKind::Eagle3 => drop(Eagle3Drafter::load(&ck.join("drafter"), &target).unwrap()),
        }
        // Saving again over it replaces it and leaves no temporary directories behind.
        resumed.save_checkpoint(&ck).unwrap();
        assert_eq!(DrafterTrainer::read_state(&ck).unwrap().step, 6);
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("ck")]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn broken_checkpoints_give_clear_errors() {
    let target = target("llama", 23);
    let set = samples(&target, DrafterKind::Eagle2, &tokens(3, 4, 1), 12);
    let mut t = trainer(&target, DrafterKind::Eagle2, small_cfg(1e-3));
    run(&mut t, &set, 2);
    let dir = temp_dir("broken");
    let fresh = |name: &str| {
        let ck = dir.join(name);
        t.save_checkpoint(&ck).unwrap();
        ck
    };
    let err = |ck: &std::path::Path| DrafterTrainer::resume(ck, &target).unwrap_err();

    let ck = fresh("no-state");
    std::fs::remove_file(ck.join("trainer_state.json")).unwrap();
    let e = err(&ck);
    assert!(matches!(&e, Error::Io { path, .. } if path.ends_with("trainer_state.json")), "{e}");

    let ck = fresh("no-moments");
    std::fs::remove_file(ck.join("optimizer.safetensors")).unwrap();
    assert!(matches!(err(&ck), Error::Io { path, .. } if path.ends_with("optimizer.safetensors")));

    let ck = fresh("truncated-moments");
    let p = ck.join("optimizer.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = err(&ck);
    assert!(matches!(&e, Error::Malformed { .. }), "{e}");

    let ck = fresh("truncated-state");
    let p = ck.join("trainer_state.json");
    let text = std::fs::read_to_string(&p).unwrap();
    std::fs::write(&p, &text[..text.len() / 2]).unwrap();
    assert!(matches!(err(&ck), Error::Malformed { .. }));

    let ck = fresh("no-weights");
    std::fs::remove_file(ck.join("drafter").join("model.safetensors")).unwrap();
    assert!(matches!(err(&ck), Error::Io { path, .. } if path.ends_with("model.safetensors")));

    // Moments of another drafter: a missing tensor is named.
    let ck = fresh("wrong-moments");
    let empty: Vec<(String, safetensors::tensor::TensorView<'_>)> = Vec::new();
    safetensors::serialize_to_file(empty, None, &ck.join("optimizer.safetensors")).unwrap();
    let e = err(&ck);
    assert!(matches!(&e, Error::MissingTensor { name, .. } if name.starts_with("exp_avg.")), "{e}");

    // Another target shape.
    let ck = fresh("ok");
    let mut cfg = target.config().clone();
    cfg.hidden_size = 32;
    let other = Llama::random(cfg, 1).unwrap();
    assert!(DrafterTrainer::resume(&ck, &other).is_err());
    assert!(DrafterTrainer::resume(&ck, &target).is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn online_training_next_to_rollouts_loses_nothing_and_pauses_within_a_step() {
    let target = target("llama", 24);
    let cfg = TrainConfig { samples_per_step: 2, ..small_cfg(2e-3) };
    let t = trainer(&target, DrafterKind::Eagle2, cfg);
    let slot = Arc::new(WeightsSlot::new(t.runtime(&F32).unwrap()));
    let trainer = Arc::new(Mutex::new(t));
    let buffer = Arc::new(
        OnlineBuffer::new(BufferConfig { max_samples: 12, keep_steps: 2, ..BufferConfig::default() }).unwrap(),
    );
    let step = online_step_fn(
        trainer.clone(),
        buffer.clone(),
        slot.clone(),
        OnlineStepConfig { publish_every: 2, runtime: F32 },
    )
    .unwrap();
    let bg = BackgroundTrainer::spawn(step, Duration::from_millis(2));
    let mut proposer = EagleProposer::new(slot.clone());

    let mut pushed = 0u64;
    let mut versions = vec![slot.version()];
    let mut max_step_s: f64 = 0.0;
    let mut latencies = Vec::new();
    for rl_step in 0..4u64 {
        buffer.set_step(rl_step);
        bg.resume();
        let steps_before = trainer.lock().steps_done();
        // Rollouts run while the trainer trains; their samples feed the buffer as they finish.
        let prompts = tokens(4, 5, rl_step as u32);
        for f in rollout(&target, &prompts, 16, Some(&mut proposer)) {
            buffer.push(FeatureSample::from_finished(&f, rl_step).unwrap()).unwrap();
            pushed += 1;
        }
        // Let it train a few steps on this step's data.
        let deadline = Instant::now() + Duration::from_secs(20);
        while trainer.lock().steps_done() < steps_before + 4 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        latencies.push(bg.pause());
        let n = trainer.lock().steps_done();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(trainer.lock().steps_done(), n, "no step after pause returned");
        if let Some(s) = trainer.lock().last_stats() {
            max_step_s = max_step_s.max(s.seconds);
        }
        versions.push(slot.version());
    }
    let stats = bg.shutdown().unwrap();
    let t = trainer.lock();
    eprintln!(
        "online: {} steps, versions {versions:?}, pause latencies {latencies:?}, max step {max_step_s:.4}s",
        stats.steps
    );
    assert_eq!(stats.steps, t.steps_done());
    assert!(t.steps_done() >= 16, "{}", t.steps_done());
    let b = buffer.stats();
    assert_eq!(b.pushed, pushed, "every push counted");
    assert_eq!(b.pushed, b.held as u64 + b.evicted, "nothing lost or duplicated");
    let ids = buffer.ids();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids unique and ordered: {ids:?}");
    assert!(versions.windows(2).all(|w| w[0] <= w[1]) && *versions.last().unwrap() >= 8, "{versions:?}");
    assert_eq!(slot.version(), t.steps_done() / 2, "one version every 2 steps");
    let by_version = proposer.rounds_by_version();
    assert!(by_version.windows(2).all(|w| w[0].0 < w[1].0), "{by_version:?}");
    for l in &latencies {
        assert!(l.as_secs_f64() <= 3.0 * max_step_s + 0.05, "pause took {l:?}, steps take up to {max_step_s}s");
    }
}

#[test]
fn offline_training_raises_acceptance_on_the_engines_own_outputs() {
    let target = target("llama", 25);
    let prompts = tokens(4, 6, 3);
    let n = 32;
    for kind in [DrafterKind::Eagle2, DrafterKind::Eagle3] {
        let set = samples(&target, kind, &prompts, n);
        let mut t = trainer(&target, kind, TrainConfig { window: 48, row_len: 96, ..small_cfg(1e-2) });
        let before = acceptance(&target, kind, t.runtime(&F32).unwrap(), &prompts, n);
        let start = Instant::now();
        let report = train_offline(&mut t, &set, Budget::Steps(150), |_| {}).unwrap();
        let after = acceptance(&target, kind, t.runtime(&F32).unwrap(), &prompts, n);
        eprintln!(
            "{kind:?}: acceptance {before:.3} -> {after:.3} after {} steps in {:.2}s ({:.0} tokens/s), loss {:.4} -> {:.4}",
            report.steps,
            start.elapsed().as_secs_f64(),
            report.tokens_per_s,
            report.first.as_ref().unwrap().eval.loss,
            report.last.as_ref().unwrap().eval.loss,
        );
        assert!(after > before + 0.1, "{kind:?}: acceptance {before} -> {after}");
    }
}

#[test]
fn hot_vocabulary_is_saved_resumed_and_drafted_over() {
    let target = target("llama", 24);
    let prompts = tokens(4, 4, 9);
    let set = samples(&target, DrafterKind::Eagle2, &prompts, 16);
    let hot: Vec<u32> = (0..VOCAB as u32).filter(|i| i % 3 != 1).collect();
    let mut t = trainer(&target, DrafterKind::Eagle2, small_cfg(3e-3));
    t.set_hot_vocab(Some(&hot)).unwrap();
    run(&mut t, &set, 2);
    // Bad ids, and a hot vocabulary for EAGLE-3, are refused.
    assert!(t.set_hot_vocab(Some(&[VOCAB as u32])).is_err());
    assert!(t.set_hot_vocab(Some(&[])).is_err());
    assert!(trainer(&target, DrafterKind::Eagle3, small_cfg(3e-3)).set_hot_vocab(Some(&hot)).is_err());

    let dir = temp_dir("hot-vocab");
    t.save_checkpoint(&dir).unwrap();
    assert_eq!(DrafterTrainer::read_state(&dir).unwrap().hot_vocab.as_deref(), Some(&hot[..]));
    let mut resumed = DrafterTrainer::resume(&dir, &target).unwrap();
    let TrainableDrafter::Eagle2(d) = resumed.drafter() else { panic!("an EAGLE-2 drafter") };
    assert_eq!(d.loss_vocab().unwrap().as_deref(), Some(&hot[..]));
    // The runtime drafts over the hot ids only (negative control: the whole vocabulary without one).
    let rt = resumed.runtime(&F32).unwrap();
    assert_eq!(rt.draft_vocab(), hot.len());
    assert!((0..rt.draft_vocab()).all(|i| hot.contains(&rt.target_id(i))));
    let mut proposer = EagleProposer::fixed(rt);
    let fin = rollout(&target, &prompts, 12, Some(&mut proposer));
    assert!(fin.iter().all(|f| f.tokens.len() == 12));
    resumed.set_hot_vocab(None).unwrap();
    assert_eq!(resumed.runtime(&F32).unwrap().draft_vocab(), VOCAB);
    let _ = std::fs::remove_dir_all(&dir);
}

/// An all-reduce (elementwise sum) between two threads, for data-parallel trainers in one process.
struct TwoWay {
    acc: std::sync::Mutex<Vec<f32>>,
    barrier: std::sync::Barrier,
}

impl TwoWay {
    fn new() -> Self {
        Self { acc: std::sync::Mutex::new(Vec::new()), barrier: std::sync::Barrier::new(2) }
    }

    fn reduce(&self, buf: &mut [f32]) -> Result<(), String> {
        {
            let mut acc = self.acc.lock().unwrap();
            acc.resize(buf.len(), 0.0);
            acc.iter_mut().zip(buf.iter()).for_each(|(a, b)| *a += b);
        }
        self.barrier.wait();
        buf.copy_from_slice(&self.acc.lock().unwrap());
        if self.barrier.wait().is_leader() {
            self.acc.lock().unwrap().clear();
        }
        self.barrier.wait();
        Ok(())
    }
}

/// One data-parallel step of `a` and `b` on their shares, their gradients summed by [`TwoWay`].
fn step_pair(
    a: &mut DrafterTrainer,
    b: &mut DrafterTrainer,
    share_a: &[Arc<FeatureSample>],
    share_b: &[Arc<FeatureSample>],
) -> [tlt_drafter::Result<Option<tlt_drafter::train::StepStats>>; 2] {
    let sum = TwoWay::new();
    std::thread::scope(|s| {
        let ha = s.spawn(|| a.step_with(share_a, |buf| sum.reduce(buf)));
        let hb = s.spawn(|| b.step_with(share_b, |buf| sum.reduce(buf)));
        [ha.join().unwrap(), hb.join().unwrap()]
    })
}

/// Two data-parallel trainers (`step_with`: each half of the batch, gradients weighted by their positions and
/// summed) end with the same weights bit for bit, and follow one trainer on the whole batch up to float summation
/// order; an empty share still takes part; a share whose loss fails fails both and neither updates; a trainer that
/// joined another's state (`join` plus its weights) then steps in lockstep with it.
#[test]
fn data_parallel_steps_follow_one_trainer() {
    let target = target("llama", 24);
    let set = samples(&target, DrafterKind::Eagle2, &tokens(8, 4, 5), 16);
    let cfg = TrainConfig { tokens_per_step: 512, ..small_cfg(3e-3) };
    let mut one = trainer(&target, DrafterKind::Eagle2, cfg.clone());
    let (mut a, mut b) =
        (trainer(&target, DrafterKind::Eagle2, cfg.clone()), trainer(&target, DrafterKind::Eagle2, cfg));
    let gap = |x: &DrafterTrainer, y: &DrafterTrainer| {
        let (p, q) = (weight_bits(x), weight_bits(y));
        p.iter()
            .zip(&q)
            .flat_map(|((_, u), (_, v))| u.iter().zip(v).map(|(s, t)| (f64::from_bits(*s) - f64::from_bits(*t)).abs()))
            .fold(0.0, f64::max)
    };
    for step in 0..4 {
        let batch: Vec<_> = (0..4).map(|k| set[(4 * step + k) % set.len()].clone()).collect();
        let whole = one.step(&batch).unwrap();
        // The last step gives `a` the whole batch and `b` nothing.
        let split = if step == 3 { 4 } else { 2 };
        let [ra, rb] = step_pair(&mut a, &mut b, &batch[..split], &batch[split..]);
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        assert_eq!(ra.as_ref().unwrap().grad_norm, rb.as_ref().map_or(ra.as_ref().unwrap().grad_norm, |s| s.grad_norm));
        assert!((ra.unwrap().grad_norm.before - whole.grad_norm.before).abs() < 1e-6 * whole.grad_norm.before);
        assert_eq!(rb.is_none(), step == 3, "an empty share reports no loss");
        assert_eq!(weight_bits(&a), weight_bits(&b), "step {step}: the trainers' weights differ");
        let d = gap(&a, &one);
        eprintln!("step {step}: largest |weight - one trainer's| {d:e}");
        assert!(d < 1e-6, "step {step}: {d:e} from one trainer's weights");
    }
    assert_eq!((a.steps_done(), b.steps_done()), (4, 4));

    // A share without a training position fails both trainers; nothing moves.
    let before = weight_bits(&a);
    let none = fake(&[1, 2, 3, 4], 4, set[0].hidden.width());
    let [ra, rb] = step_pair(&mut a, &mut b, &set[..2], &[none]);
    assert!(ra.unwrap_err().to_string().contains("other trainer"), "the healthy trainer hears of the failure");
    assert!(rb.is_err());
    assert_eq!(weight_bits(&a), before);
    assert_eq!((a.steps_done(), b.steps_done()), (4, 4));

    // A fresh trainer joins `a` (moments, step, totals, weights) and then steps in lockstep with it.
    let mut c = trainer(&target, DrafterKind::Eagle2, small_cfg(3e-3));
    c.join(a.steps_done(), a.totals(), a.optimizer().state().to_vec()).unwrap();
    for ((_, from), (_, to)) in a.drafter().vars().unwrap().iter().zip(c.drafter().vars().unwrap()) {
        to.set(from.as_tensor()).unwrap();
    }
    let [ra, rc] = step_pair(&mut a, &mut c, &set[4..6], &set[6..8]);
    assert!(ra.is_ok() && rc.is_ok());
    assert_eq!(weight_bits(&a), weight_bits(&c), "a joined trainer steps as the one it joined");
    assert!(c.join(0, a.totals(), vec![]).is_err(), "moments of the wrong count are refused");
}
