//! A policy update that fails half-way (an injected error before its second optimizer step) stops the trainer with
//! a reason that says the weights moved; a failure before any step says nothing moved.

use tlt_model::{EosTokens, Llama, LlamaConfig};

use super::update::FAIL_BEFORE_STEP;
use super::*;
use crate::task::Score;

struct Env;

impl Environment for Env {
    fn prompt(&self, _: Split, pos: u64) -> Result<Prompt> {
        Ok(Prompt { index: pos, ids: vec![2 + (pos % 20) as u32, 3, 4], problem: None })
    }

    fn score(&self, _: &Prompt, completion: &[u32]) -> Result<Score> {
        let reward = completion.iter().filter(|&&t| t == 7).count() as f64;
        Ok(Score { reward, correct: reward > 0.0, formatted: true, timed_out: false })
    }
}

fn trainer() -> Trainer<Env> {
    let mut model = LlamaConfig::tiny(32, 32, 1);
    model.eos_token_id = Some(EosTokens::One(1));
    let cfg = TrainerConfig {
        mode: Mode::Baseline,
        prompts_per_step: 4,
        group_size: 4,
        max_new_tokens: 8,
        ppo_mini_batch_size: Some(1),
        optim: OptimConfig { schedule: tlt_model::optim::LrSchedule::constant(1e-2), ..OptimConfig::default() },
        ..TrainerConfig::default()
    };
    let policy = Llama::random(model, 1).unwrap_or_else(|e| panic!("{e}"));
    Trainer::new(policy, Env, cfg).unwrap_or_else(|e| panic!("{e}"))
}

fn weights(t: &Trainer<Env>) -> Vec<Vec<f32>> {
    t.policy()
        .weights()
        .named_tensors()
        .into_iter()
        .map(|(_, w)| w.flatten_all().and_then(|w| w.to_vec1::<f32>()).unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

#[test]
fn an_update_failing_half_way_stops_the_trainer_and_says_the_weights_moved() {
    let mut t = trainer();
    let before = weights(&t);
    FAIL_BEFORE_STEP.with(|f| f.set(Some(1)));
    let e = t.step(&mut Quiet).map(|_| ()).unwrap_err();
    FAIL_BEFORE_STEP.with(|f| f.set(None));
    assert!(e.to_string().contains("injected update failure"), "{e}");
    assert!(weights(&t) != before, "the first optimizer step should have applied");
    assert_eq!(t.steps_done(), 0);
    let again = t.step(&mut Quiet).map(|_| ()).unwrap_err();
    let msg = again.to_string();
    assert!(matches!(again, Error::Stopped(_)), "{msg}");
    assert!(msg.contains("step 0 failed after 1 of its optimizer steps had moved the weights"), "{msg}");
    assert!(msg.contains("resume the run from its last checkpoint"), "{msg}");
    let dir = std::env::temp_dir().join(format!("tlt-rl-stopped-{}", std::process::id()));
    assert!(matches!(t.save_checkpoint(&dir), Err(Error::Stopped(_))));
    assert!(!dir.exists());

    // A failure before the first optimizer step: stopped all the same (the rollout fed the bandit), weights as
    // they were, and the reason does not claim they moved.
    let mut t = trainer();
    let before = weights(&t);
    FAIL_BEFORE_STEP.with(|f| f.set(Some(0)));
    assert!(t.step(&mut Quiet).is_err());
    FAIL_BEFORE_STEP.with(|f| f.set(None));
    assert!(weights(&t) == before, "nothing should have moved");
    let msg = t.step(&mut Quiet).map(|_| ()).unwrap_err().to_string();
    assert!(msg.contains("step 0 failed (") && !msg.contains("moved"), "{msg}");
}
