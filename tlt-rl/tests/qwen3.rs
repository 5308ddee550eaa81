//! A Qwen3 policy through the GRPO trainer on the CPU: a tiny random Qwen3 (q/k head norms, head_dim 32 with a width
//! of 64 and 4 heads, i.e. decoupled) trained two steps at T = 0.7 with TLT rollouts (an EAGLE-2 drafter, alone
//! and in the suffix + EAGLE hybrid, speculating from the first round) and with plain rollouts, from the same weights
//! and seeds: the same tokens, weights that moved (the q/k norms included) and are bit-identical between the modes;
//! the policy and its drafter (a llama layer of the policy's head shape) export and reload.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::collections::BTreeMap;

use tlt_drafter::checkpoint::load_eagle2;
use tlt_drafter::SaveDType;
use tlt_model::{EosTokens, Llama, LlamaConfig};
use tlt_rl::trainer::{
    DrafterChoice, ExportConfig, Mode, Quiet, Trainer, TrainerConfig, EXPORT_DRAFTER_DIR, EXPORT_POLICY_DIR,
};

mod common;

use common::{base_config, weights, Count, EOS, VOCAB};

fn tiny_qwen3(seed: u64) -> Llama {
    let mut cfg = LlamaConfig::tiny(VOCAB as usize, 64, 2);
    cfg.model_type = "qwen3".into();
    cfg.head_dim = Some(32);
    cfg.eos_token_id = Some(EosTokens::One(EOS));
    Llama::random(cfg, seed).unwrap()
}

/// The trainer tests' small run at T = 0.7 with `drafter` (SD from the first round, the drafter trained 2 steps
/// after each rollout), the default GRPO settings.
fn config(mode: Mode, drafter: DrafterChoice) -> TrainerConfig {
    let mut cfg = base_config(mode);
    cfg.temperature = 0.7;
    cfg.sd.drafter = drafter;
    cfg
}

/// Two GRPO steps of one mode.
struct Run {
    /// The completions of each step.
    outs: Vec<Vec<Vec<u32>>>,
    /// The trainer after them.
    trainer: Trainer<Count>,
    /// Each step's share of rounds with SD on and its drafter training steps.
    sd: Vec<(f64, u64)>,
}

fn run(mode: Mode, drafter: DrafterChoice) -> Run {
    let mut trainer = Trainer::new(tiny_qwen3(6), Count, config(mode, drafter)).unwrap();
    let (mut outs, mut sd) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let r = trainer.step(&mut Quiet).unwrap();
        assert!(r.metrics.grad_norm > 0.0, "{mode:?}: no update happened");
        sd.push((r.metrics.sd_on_fraction, r.metrics.drafter_steps));
        outs.push(r.samples.into_iter().map(|(s, _, _)| s.tokens).collect());
    }
    Run { outs, trainer, sd }
}

#[test]
fn qwen3_grpo_tlt_commits_the_baselines_tokens_and_weights() {
    let initial = {
        let m = tiny_qwen3(6);
        m.weights()
            .named_tensors()
            .into_iter()
            .map(|(n, w)| (n, w.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
            .collect::<BTreeMap<_, _>>()
    };
    let base = run(Mode::Baseline, DrafterChoice::Eagle2);
    let base_w = weights(&base.trainer);
    let qk: Vec<&String> =
        base_w.keys().filter(|n| n.ends_with("q_norm.weight") || n.ends_with("k_norm.weight")).collect();
    assert_eq!(qk.len(), 4, "q and k head norms of both layers are trained parameters: {qk:?}");
    for name in &qk {
        assert_eq!(base_w[*name].len(), 32, "{name}: one weight per head dimension");
    }
    // Every parameter moved, the head norms included (they got gradients).
    for (name, w) in &base_w {
        assert!(w != &initial[name], "`{name}` did not change in two steps");
    }

    for drafter in [DrafterChoice::Eagle2, DrafterChoice::Hybrid] {
        let Run { outs, trainer: t, sd } = run(Mode::Tlt, drafter);
        assert!(sd.iter().all(|&(f, _)| f > 0.5), "{drafter:?}: SD was not on: {sd:?}");
        assert!(sd[1].1 > 0, "{drafter:?}: the online drafter never trained");
        assert_eq!(outs, base.outs, "{drafter:?}: completions differ");
        let w = weights(&t);
        for (name, a) in &base_w {
            assert!(w[name] == *a, "{drafter:?}: weight `{name}` differs after 2 steps");
        }
        if drafter == DrafterChoice::Eagle2 {
            check_export(&t);
        }
    }
}

/// The trained Qwen3 policy exports as an HF Qwen3 directory that reloads bit for bit, and its drafter as a llama
/// EAGLE layer with the policy's head_dim.
fn check_export(t: &Trainer<Count>) {
    let dir = std::env::temp_dir().join(format!("tlt-qwen3-export-{}", std::process::id()));
    let export = ExportConfig { drafter_dtype: SaveDType::F32, ..ExportConfig::default() };
    let out = t.export(&dir, &export).unwrap();
    let policy = tlt_model::load_hf_dir(&dir.join(EXPORT_POLICY_DIR)).unwrap().model;
    assert_eq!(policy.config().architecture().unwrap(), tlt_model::Architecture::Qwen3);
    assert_eq!(policy.config().head_dim(), 32);
    let reloaded: BTreeMap<String, Vec<f32>> = policy
        .weights()
        .named_tensors()
        .into_iter()
        .map(|(n, w)| (n, w.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    assert!(reloaded == weights(t), "the exported policy differs from the trained one");
    let drafter = out.drafter_dir().expect("a TLT run with an EAGLE drafter exports it");
    assert_eq!(drafter, dir.join(EXPORT_DRAFTER_DIR));
    let ck = load_eagle2(&drafter, t.policy().config()).unwrap();
    assert_eq!(ck.config.llama.architecture().unwrap(), tlt_model::Architecture::Llama);
    assert_eq!((ck.config.llama.head_dim(), ck.config.llama.q_dim()), (32, 128));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Qwen3 policy with the update on a device is refused when the trainer is built, naming what is missing (the
/// q/k head norms' backward), not after its first rollout; the same config with the update on the CPU, and a Llama
/// policy with the update on the device, are accepted (the check refuses only what it should).
#[test]
fn a_device_update_of_qwen3_is_refused_at_construction() {
    let cuda = |update_on_device: bool| TrainerConfig {
        device: tlt_model::Device::Cuda(0),
        update_on_device,
        ..config(Mode::Baseline, DrafterChoice::default())
    };
    let Err(err) = Trainer::new(tiny_qwen3(6), Count, cuda(true)) else { panic!("a Qwen3 device update was accepted") };
    let msg = err.to_string();
    assert!(msg.contains("update_on_device") && msg.contains("q/k head norms"), "{msg}");
    // Without tlt-rl's `cuda` feature a CUDA config is refused for that (`device`), never for the architecture.
    let accepted = |r: tlt_rl::Result<Trainer<Count>>, what: &str| match r {
        Ok(_) => {}
        Err(e) => assert!(cfg!(not(feature = "cuda")) && !e.to_string().contains("update_on_device"), "{what}: {e}"),
    };
    accepted(Trainer::new(tiny_qwen3(6), Count, cuda(false)), "Qwen3 with the update on the CPU");
    let mut llama = tiny_qwen3(6).config().clone();
    llama.model_type = "llama".into();
    llama.head_dim = None;
    accepted(Trainer::new(Llama::random(llama, 6).unwrap(), Count, cuda(true)), "Llama with the update on the device");
}
