//! The online drafter trained on the device (`CudaOnlineTrainer`) against the host's online step: from the same
//! buffer it draws the same samples at every step (the same batches), takes the same learning rates and follows the
//! host's losses within bf16 tolerance; its checkpoint is the host trainer's format, and a trainer resumed from it
//! continues with the same bits as one that never stopped (with a checkpoint one step apart as the control).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tlt_drafter::cuda::CudaOnlineTrainer;
use tlt_drafter::online::{BufferConfig, FeatureSample, OnlineBuffer};
use tlt_drafter::{DrafterKind, DrafterTrainer, TrainConfig};
use tlt_model::Llama;

use super::common::rollouts::{samples, small_cfg};
use super::common::{target, tokens};

fn buffer(target: &Llama) -> OnlineBuffer {
    let b = OnlineBuffer::new(BufferConfig::default()).unwrap();
    for s in samples(target, DrafterKind::Eagle2, &tokens(6, 5, 3), 28) {
        b.push(FeatureSample::clone(&s)).unwrap();
    }
    b
}

fn host(target: &Llama, cfg: &TrainConfig) -> DrafterTrainer {
    let dcfg = tlt_drafter::DrafterConfig::eagle2_from_target(target.config(), true);
    let d = tlt_drafter::Eagle2Drafter::random(dcfg, tlt_drafter::FrozenTarget::new(target), 13).unwrap();
    DrafterTrainer::new(d, cfg.clone()).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tlt-drafter-online-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn the_device_online_trainer_draws_as_the_host_and_follows_its_losses() {
    let dev = super::devices("the_device_online_trainer_draws_as_the_host", &[tlt_cuda_sim::Schedule::Lazy]).remove(0);
    let target = target("llama", 5).rounded_to_bf16().unwrap();
    let cfg = small_cfg(0.005);
    let buf = buffer(&target);
    let mut cpu = host(&target, &cfg);
    let mut gpu = CudaOnlineTrainer::new(dev, host(&target, &cfg)).unwrap();
    for k in 0..4 {
        let drawn: Vec<Arc<FeatureSample>> = cpu.draw_from_buffer(&buf).into_iter().map(|(_, s)| s).collect();
        let a = cpu.step(&drawn).unwrap();
        let b = gpu.step_from_buffer(&buf).unwrap().expect("the buffer has samples");
        assert_eq!((b.step, b.lr, b.eval.batch), (a.step, a.lr, a.eval.batch), "step {k}: the same draw and batch");
        let rel = (b.eval.loss - a.eval.loss).abs() / a.eval.loss;
        assert!(rel <= 0.02, "step {k}: loss {} vs the host's {}", b.eval.loss, a.eval.loss);
        println!("step {k}: loss {:.6} on the device, {:.6} on the host", b.eval.loss, a.eval.loss);
    }
    assert_eq!(gpu.steps_done(), 4);
    let empty = OnlineBuffer::new(BufferConfig::default()).unwrap();
    assert!(gpu.step_from_buffer(&empty).unwrap().is_none(), "an empty buffer trains nothing");
    assert_eq!(gpu.steps_done(), 4);
}

/// Bytes of every file of a checkpoint directory, by relative path.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for sub in ["", "drafter"] {
        let mut names: Vec<_> = std::fs::read_dir(dir.join(sub)).unwrap().map(|e| e.unwrap().path()).collect();
        names.sort();
        for p in names.into_iter().filter(|p| p.is_file()) {
            out.push((p.strip_prefix(dir).unwrap().display().to_string(), std::fs::read(&p).unwrap()));
        }
    }
    out
}

#[test]
fn a_device_online_checkpoint_resumes_with_the_same_bits() {
    let dev = super::devices("a_device_online_checkpoint_resumes", &[tlt_cuda_sim::Schedule::Seeded(5)]).remove(0);
    let target = target("llama", 5).rounded_to_bf16().unwrap();
    let cfg = small_cfg(0.005);
    let buf = buffer(&target);
    let steps = |t: &mut CudaOnlineTrainer, n: usize| {
        for _ in 0..n {
            t.step_from_buffer(&buf).unwrap().unwrap();
        }
    };
    let (whole, split, mid, early) = (scratch("whole"), scratch("split"), scratch("mid"), scratch("early"));
    let mut a = CudaOnlineTrainer::new(dev.clone(), host(&target, &cfg)).unwrap();
    steps(&mut a, 4);
    a.save_checkpoint(&early).unwrap();
    steps(&mut a, 1);
    a.save_checkpoint(&whole).unwrap();
    let mut b = CudaOnlineTrainer::new(dev.clone(), host(&target, &cfg)).unwrap();
    steps(&mut b, 3);
    b.save_checkpoint(&mid).unwrap();
    let mut c = CudaOnlineTrainer::new(dev, DrafterTrainer::resume(&mid, &target).unwrap()).unwrap();
    assert_eq!(c.steps_done(), 3);
    steps(&mut c, 2);
    c.save_checkpoint(&split).unwrap();
    let (w, s, e) = (files(&whole), files(&split), files(&early));
    assert_eq!(
        w.len(),
        4,
        "drafter config and weights, moments, state: {:?}",
        w.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    for ((name, x), (_, y)) in w.iter().zip(&s) {
        assert!(x == y, "{name}: a resumed device trainer's checkpoint differs from an uninterrupted one's");
    }
    // The control: one step fewer changes the weights and the moments.
    for (name, _) in w.iter().filter(|(n, _)| n.ends_with(".safetensors")) {
        let (x, y) = (&w.iter().find(|f| &f.0 == name).unwrap().1, &e.iter().find(|f| &f.0 == name).unwrap().1);
        assert!(x != y, "{name}: a checkpoint one step earlier has the same bytes: the comparison has no power");
    }
    for d in [whole, split, mid, early] {
        let _ = std::fs::remove_dir_all(d);
    }
}
