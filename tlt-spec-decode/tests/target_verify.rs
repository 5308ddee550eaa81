//! Verification where the logits live ([`Target::forward_verify`]) against the engine's host verification: the same
//! committed tokens, log-probs, largest probabilities and hidden rows, greedy and sampled, for drafted trees and plain
//! rounds, and the host path taken when the target declines (top-k).
//!
//! [`ToyTarget::verifying_on_target`] walks the trees from contexts, independently of the engine's row-based
//! verifier, the way a GPU target runs the walk on the device.

use tlt_spec_decode::{Engine, Finished, NgramDrafter, Plan, SamplingParams, SpecParams, ToyTarget};

fn run(target: ToyTarget, sampling: SamplingParams, on_target: bool) -> (Vec<Finished>, u64) {
    let params = SpecParams { sampling, max_new_tokens: 40, seed: 7, ..SpecParams::greedy(40) };
    let mut engine = Engine::new(target, params).expect("params");
    engine.verify_on_target(on_target);
    engine.record_hidden(true);
    // Repetitive prompts so the n-gram drafter finds matches and drafts trees.
    for p in [vec![1u32, 2, 3, 1, 2, 3, 1, 2], vec![5, 6, 5, 6, 5], vec![9], vec![4, 4, 4, 4, 4, 4]] {
        engine.add_request(&p).expect("request");
    }
    let mut drafter = NgramDrafter::default();
    let plan = Plan { steps: 3, top_k: 2, verify_tokens: 6 };
    let mut round = 0;
    while !engine.is_idle() {
        // Alternate plain and speculative rounds.
        if round % 3 == 2 {
            engine.step(None, &plan).expect("plain round");
        } else {
            engine.step(Some(&mut drafter), &plan).expect("round");
        }
        round += 1;
    }
    let accepted = engine.counters().accepted;
    let mut f = engine.take_finished();
    f.sort_by_key(|f| f.id);
    (f, accepted)
}

#[test]
fn target_side_verification_equals_host_verification() {
    let toy = ToyTarget::new(24, 3);
    for temperature in [0.0f32, 0.7, 1.0] {
        let sampling = SamplingParams { temperature, ..SamplingParams::default() };
        let (host, acc_host) = run(toy.clone(), sampling, false);
        let (dev, acc_dev) = run(toy.clone().verifying_on_target(), sampling, true);
        assert_eq!(host, dev, "temperature {temperature}");
        assert_eq!(acc_host, acc_dev);
        assert!(acc_dev > 0, "temperature {temperature}: no draft was accepted, the trees went untested");
        assert!(dev.iter().all(|f| f.hidden.as_ref().is_some_and(|h| h.len() == f.prompt.len() + f.tokens.len() - 1)));
    }
}

#[test]
fn a_declining_target_falls_back_to_the_host() {
    let toy = ToyTarget::new(24, 5);
    let sampling = SamplingParams { temperature: 0.8, top_k: Some(5), top_p: None };
    let (host, _) = run(toy.clone(), sampling, false);
    let (dev, _) = run(toy.verifying_on_target(), sampling, true);
    assert_eq!(host, dev);
}

/// The negative control: a different coin stream changes the sampled tokens, so equality above is not vacuous.
#[test]
fn different_coins_differ() {
    let toy = ToyTarget::new(24, 3);
    let sampling = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
    let (a, _) = run(toy.clone(), sampling, false);
    let params = SpecParams { sampling, max_new_tokens: 40, seed: 8, ..SpecParams::greedy(40) };
    let mut engine = Engine::new(toy.verifying_on_target(), params).expect("params");
    engine.add_request(&[1, 2, 3, 1, 2, 3, 1, 2]).expect("request");
    engine.run_to_completion(None, &Plan::chain(1)).expect("run");
    assert_ne!(engine.finished()[0].tokens, a[0].tokens);
}
