//! The engine on the device target (`CudaTarget`, the host code a GPU runs), on the device the environment gives:
//! in CI the simulated device (`tlt-cuda-sim`'s `SimGpu`, whose stream runs work late, eagerly or at seeded random
//! points), on a GPU machine the CUDA device (`TLT_REQUIRE_GPU=1` makes a missing one an error):
//! - greedy speculative decoding on the device commits exactly the tokens of plain decoding on the device, under
//!   every schedule; host verification of the device's logits commits the same;
//! - sampled: verification on the device equals verification of the same logits on the host;
//! - the device sampler passes a chi-square test, and a biased coin stream fails it;
//! - sampled speculative decoding with device tree acceptance gives the joint law of two tokens that the device
//!   target's own logits define (chi-square), and a biased variant (coins reused across positions) fails it;
//! - negative control (simulated device only): with the host's waits faulted (the first GPU run's fault: a wait on
//!   an event never recorded) the engine reads poison from pinned memory and fails, or commits other tokens.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod common;

use std::sync::Arc;

use common::{chi_square, chi_square_p_value};
use tlt_cuda_sim::{Fault, Schedule, SimGpu};
use tlt_kernels::cuda::plan;
use tlt_kernels::cuda::{DeviceBuf, Gpu, SharedGpu};
use tlt_model::{Llama, LlamaConfig};
use tlt_spec_decode::cuda::{CudaState, CudaTarget};
use tlt_spec_decode::{
    Coins, DraftContext, DraftTree, Drafter, Engine, Finished, NgramDrafter, Plan, Result, SamplingParams, SeqHandle,
    SpecParams, Target, TargetInput, TargetOutput, Verified, VerifySpec,
};

fn tiny(vocab: usize) -> Llama {
    let mut cfg = LlamaConfig::tiny(vocab, 64, 2);
    cfg.intermediate_size = 128;
    Llama::random(cfg, 9).unwrap()
}

/// `m` with its LM head scaled by 0.1: near-uniform next-token distributions.
fn flat(m: Llama) -> Llama {
    let mut w = m.weights().clone();
    w.lm_head = w.lm_head.as_ref().map(|h| (h * 0.1).unwrap());
    w.head_packed = None;
    Llama::new(m.config().clone(), w).unwrap()
}

/// The devices of a test: the CUDA device on a GPU machine, else the simulated device under `schedules`.
fn devices(test: &str, schedules: &[Schedule]) -> Vec<SharedGpu> {
    tlt_cuda_sim::test_devices(test, schedules).unwrap()
}

fn prompts() -> Vec<Vec<u32>> {
    (0..8u32).map(|i| (0..12).map(|j| (i * 7 + j * (j % 3 + 1)) % 20).chain([i % 5, 1, 2, 1, 2]).collect()).collect()
}

fn try_run(
    target: &CudaTarget,
    params: SpecParams,
    drafter: Option<&mut dyn Drafter>,
    on_device: bool,
) -> Result<Vec<Finished>> {
    let mut engine = Engine::new(target, params)?;
    engine.verify_on_target(on_device);
    for p in prompts() {
        engine.add_request(&p)?;
    }
    engine.run_to_completion(drafter, &Plan { steps: 4, top_k: 2, verify_tokens: 12 })?;
    let mut f = engine.take_finished();
    f.sort_by_key(|f| f.id);
    Ok(f)
}

fn run(target: &CudaTarget, params: SpecParams, drafter: Option<&mut dyn Drafter>, on_device: bool) -> Vec<Finished> {
    try_run(target, params, drafter, on_device).unwrap()
}

#[test]
fn greedy_sd_on_the_device_equals_plain_decoding_on_the_device() {
    for dev in devices("greedy_sd_on_the_device_equals_plain_decoding_on_the_device", &SimGpu::schedules()) {
        greedy_sd(dev);
    }
}

fn greedy_sd(dev: SharedGpu) {
    let target = CudaTarget::new(&tiny(96), dev, 8, 512, 1 << 30).unwrap();
    let params = SpecParams::greedy(48);
    let plain = run(&target, params.clone(), None, true);
    let mut ngram = NgramDrafter::default();
    let engine_sd = run(&target, params.clone(), Some(&mut ngram), true);
    for (a, b) in plain.iter().zip(&engine_sd) {
        let first = a.tokens.iter().zip(&b.tokens).position(|(x, y)| x != y);
        assert_eq!(a.tokens, b.tokens, "request {:?}: first difference at {first:?}", a.id);
    }
    // Host verification of the device's logits commits the same tokens.
    let mut ngram = NgramDrafter::default();
    let host = run(&target, params, Some(&mut ngram), false);
    assert_eq!(
        host.iter().map(|f| &f.tokens).collect::<Vec<_>>(),
        engine_sd.iter().map(|f| &f.tokens).collect::<Vec<_>>()
    );
    for (h, d) in host.iter().zip(&engine_sd) {
        let lp = h.logprobs.iter().zip(&d.logprobs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(lp < 1e-3, "request {:?}: log-probs differ by {lp}", h.id);
    }
}

/// The first GPU run's fault re-created on the simulated device: the host's waits wait for nothing (cudarc's
/// `PinnedHostSlice` waited on an event a context without event tracking never records). With the results' wait gone
/// (`Fault::NoSynchronize`), device acceptance is read from pinned memory before its copy lands: the engine fails
/// ("device acceptance returned ... nodes", the GPU's message; poison reads -1 where the GPU read 0) or commits
/// other tokens, and the race is recorded. With the staging buffers' wait gone (`Fault::NoEventWaits`), the host
/// rewrites a staging buffer a queued copy still reads (the prefills of two prompts back to back): an error.
#[test]
fn the_first_gpu_runs_fault_is_caught_on_the_simulated_device() {
    let reference = {
        let target = CudaTarget::new(&tiny(96), Arc::new(SimGpu::new(Schedule::Lazy)), 8, 512, 0).unwrap();
        run(&target, SpecParams::greedy(24), Some(&mut NgramDrafter::default()), true)
    };
    for (fault, schedule) in [
        (Fault::NoSynchronize, Schedule::Lazy),
        (Fault::NoSynchronize, Schedule::Eager),
        (Fault::NoSynchronize, Schedule::Seeded(4)),
        (Fault::NoEventWaits, Schedule::Lazy),
        (Fault::NoEventWaits, Schedule::Seeded(4)),
    ] {
        let sim = SimGpu::new(schedule).with_fault(fault);
        let target = CudaTarget::new(&tiny(96), Arc::new(sim.clone()), 8, 512, 0).unwrap();
        let faulted = try_run(&target, SpecParams::greedy(24), Some(&mut NgramDrafter::default()), true);
        let outcome = match &faulted {
            Err(e) => format!("error: {e}"),
            Ok(f) if f.iter().map(|x| &x.tokens).ne(reference.iter().map(|x| &x.tokens)) => "other tokens".into(),
            Ok(_) => "the reference tokens (missed)".into(),
        };
        let races = sim.races();
        println!("{fault:?}, {schedule:?}: {outcome}; {} racy reads recorded", races.len());
        assert!(!outcome.contains("missed"), "{fault:?} {schedule:?}: the fault went unnoticed");
        match fault {
            Fault::NoSynchronize => {
                assert!(!races.is_empty(), "{schedule:?}: the read before the copy landed went unrecorded");
                assert!(outcome.contains("device acceptance returned") || outcome == "other tokens", "{outcome}");
            }
            Fault::NoEventWaits => assert!(outcome.contains("still uses"), "{outcome}"),
        }
    }
}

#[test]
fn device_verification_equals_host_verification_when_sampling() {
    for dev in devices("device_verification_equals_host_verification_when_sampling", &[Schedule::Seeded(9)]) {
        sampled_verification(dev);
    }
}

fn sampled_verification(dev: SharedGpu) {
    let target = CudaTarget::new(&tiny(96), dev, 8, 512, 1 << 30).unwrap();
    let params = SpecParams { sampling: SamplingParams::default(), seed: 3, ..SpecParams::greedy(64) };
    let (mut a, mut b) = (NgramDrafter::default(), NgramDrafter::default());
    let dev = run(&target, params.clone(), Some(&mut a), true);
    let host = run(&target, params, Some(&mut b), false);
    // A coin within float noise of a CDF step may pick a neighbour (the device sums in another order); that may
    // happen once in a while, never often.
    let same = dev.iter().zip(&host).filter(|(d, h)| d.tokens == h.tokens).count();
    assert!(same + 1 >= dev.len(), "only {same} of {} requests equal", dev.len());
}

/// Same tokens, row after row: the device sampler's histogram on one logits row against softmax, with uniform
/// coins (passes) and squared coins (the negative control, fails).
#[test]
fn device_sampler_chi_square_with_a_biased_control() {
    for dev in devices("device_sampler_chi_square_with_a_biased_control", &[Schedule::Lazy]) {
        sampler_chi_square(dev.as_ref());
    }
}

fn sampler_chi_square(g: &dyn Gpu) {
    // Fewer rows on the simulated device (each row is a block of threads there); still ~250 draws per token.
    let (vocab, rows) = (16usize, if g.info().simulated { 4_000usize } else { 20_000 });
    let row: Vec<f32> = (0..vocab).map(|i| ((i * 7) % 11) as f32 * 0.3).collect();
    let logits: Vec<f32> = (0..rows).flat_map(|_| row.iter().copied()).collect();
    let params = SamplingParams { temperature: 0.8, ..SamplingParams::default() };
    let p: Vec<f64> = tlt_kernels::probs(&row, &params).unwrap().into_iter().map(f64::from).collect();
    let mut rng = tlt_kernels::SplitMix64::new(5);
    for (biased, name) in [(false, "uniform coins"), (true, "squared coins")] {
        let coins: Vec<f64> = (0..rows)
            .map(|_| {
                let u = rng.next_f64();
                if biased {
                    u * u
                } else {
                    u
                }
            })
            .collect();
        let (l, c) = (DeviceBuf::from_host(g, &logits).unwrap(), DeviceBuf::from_host(g, &coins).unwrap());
        let (tok, lp, pm) = (
            DeviceBuf::<i32>::zeros(g, rows).unwrap(),
            DeviceBuf::<f32>::zeros(g, rows).unwrap(),
            DeviceBuf::<f32>::zeros(g, rows).unwrap(),
        );
        let launch = plan::sample_rows(rows, vocab, 0.8, l.buf(), Some(c.buf()), tok.buf(), lp.buf(), pm.buf());
        g.launch(&launch.unwrap()).unwrap();
        let mut counts = vec![0u64; vocab];
        for t in tok.to_host(g).unwrap() {
            counts[t as usize] += 1;
        }
        let (stat, df) = chi_square(&counts, &p);
        let pv = chi_square_p_value(stat, df);
        eprintln!("device sampler, {name}: chi2 {stat:.1} df {df} p {pv:.3e}");
        if biased {
            assert!(pv < 1e-6, "{name}: the biased control passed (p = {pv})");
        } else {
            assert!(pv > 0.001, "{name}: chi2 {stat:.1} on {df} df, p = {pv:.2e}");
        }
    }
}

/// A fixed tree, a function of the context only (so point-mass verification stays lossless): the root gets children
/// 0, 1 and 2, node 1 gets child 1, node 0 gets child 3.
#[derive(Debug)]
struct FixedTree;

impl Drafter for FixedTree {
    fn propose(&mut self, ctx: &DraftContext<'_>, _plan: &Plan) -> Result<DraftTree> {
        let mut t = DraftTree::new(*ctx.history.last().unwrap());
        let a = t.push_child(0, 0, 0.0)?;
        let b = t.push_child(0, 1, 0.0)?;
        t.push_child(0, 2, 0.0)?;
        t.push_child(b, 1, 0.0)?;
        t.push_child(a, 3, 0.0)?;
        Ok(t)
    }
}

/// The biased control: the wrapped target verifies every request's round with the first request's coins (a seeding
/// bug: one coin stream shared by a batch), so the requests of a batch draw the same tokens and the empirical law
/// clumps, whatever the rounds and however the tree is accepted. (The earlier control reused position 0's coins,
/// which changed nothing while the first round accepted both tokens: no power.)
struct ReusedCoins<'a>(&'a CudaTarget);

impl Target for ReusedCoins<'_> {
    type State = CudaState;
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn eos_ids(&self) -> Vec<u32> {
        Vec::new()
    }
    fn new_state(&self) -> CudaState {
        self.0.new_state()
    }
    fn new_sequence(&self, state: &mut CudaState) -> SeqHandle {
        self.0.new_sequence(state)
    }
    fn remove(&self, state: &mut CudaState, seq: SeqHandle) -> Result<()> {
        self.0.remove(state, seq)
    }
    fn truncate(&self, state: &mut CudaState, seq: SeqHandle, len: usize) -> Result<()> {
        self.0.truncate(state, seq, len)
    }
    fn forward(&self, state: &mut CudaState, inputs: &[TargetInput<'_>], hidden: bool) -> Result<TargetOutput> {
        self.0.forward(state, inputs, hidden)
    }
    fn forward_verify(
        &self,
        state: &mut CudaState,
        inputs: &[TargetInput<'_>],
        hidden: bool,
        spec: VerifySpec<'_>,
    ) -> Result<Option<Vec<Verified>>> {
        let first = spec.coins.first().map(|c| c.stream().clone());
        let stuck: Vec<Coins> = spec
            .coins
            .iter()
            .map(|c| Coins::new(first.clone().unwrap_or_else(|| c.stream().clone()), c.position()))
            .collect();
        self.0.forward_verify(state, inputs, hidden, VerifySpec { params: spec.params, coins: &stuck })
    }
    fn commit(&self, state: &mut CudaState, seq: SeqHandle, path: &[usize]) -> Result<()> {
        self.0.commit(state, seq, path)
    }
}

/// The joint law of the first two generated tokens under the device target's own logits (host softmax of the rows
/// a tree forward returns): `p[t1 * vocab + t2]`.
fn exact_two(target: &CudaTarget, prompt: &[u32], params: &SamplingParams) -> Vec<f64> {
    let vocab = target.vocab_size();
    let mut st = target.new_state();
    let s = target.new_sequence(&mut st);
    target
        .forward(
            &mut st,
            &[TargetInput { seq: s, tokens: &prompt[..prompt.len() - 1], tree: None, logits: false }],
            false,
        )
        .unwrap();
    // One tree: the root, then every token as its child: row 0 is p(t1), row 1 + t1 is p(t2 | t1).
    let tokens: Vec<u32> = std::iter::once(*prompt.last().unwrap()).chain(0..vocab as u32).collect();
    let parents: Vec<Option<usize>> = std::iter::once(None).chain((0..vocab).map(|_| Some(0))).collect();
    let out = target
        .forward(&mut st, &[TargetInput { seq: s, tokens: &tokens, tree: Some(&parents), logits: true }], false)
        .unwrap();
    let p1 = tlt_kernels::probs(out.logits_row(0, 0).unwrap(), params).unwrap();
    let mut joint = vec![0f64; vocab * vocab];
    for t1 in 0..vocab {
        let p2 = tlt_kernels::probs(out.logits_row(0, 1 + t1).unwrap(), params).unwrap();
        for t2 in 0..vocab {
            joint[t1 * vocab + t2] = f64::from(p1[t1]) * f64::from(p2[t2]);
        }
    }
    joint
}

fn sample_two<T: Target>(target: T, prompt: &[u32], params: &SamplingParams, n: usize, seed: u64) -> Vec<u64> {
    let vocab = target.vocab_size();
    let sp = SpecParams { sampling: *params, seed, stop_token_ids: Some(Vec::new()), ..SpecParams::greedy(2) };
    let mut engine = Engine::new(target, sp).unwrap();
    let mut counts = vec![0u64; vocab * vocab];
    let mut drafter = FixedTree;
    let mut left = n;
    while left > 0 {
        let batch = left.min(32);
        for _ in 0..batch {
            engine.add_request(prompt).unwrap();
        }
        engine.run_to_completion(Some(&mut drafter), &Plan { steps: 2, top_k: 3, verify_tokens: 6 }).unwrap();
        for f in engine.take_finished() {
            counts[f.tokens[0] as usize * vocab + f.tokens[1] as usize] += 1;
        }
        left -= batch;
    }
    counts
}

#[test]
fn device_tree_acceptance_is_lossless_and_a_biased_variant_is_caught() {
    for dev in devices("device_tree_acceptance_is_lossless_and_a_biased_variant_is_caught", &[Schedule::Seeded(3)]) {
        tree_acceptance(dev);
    }
}

fn tree_acceptance(dev: SharedGpu) {
    // Vocabulary 6, so the 36 cells are well populated by 6,000 samples; a flat target (the LM head scaled by 0.1:
    // every token between about 1/12 and 1/3), so both positions are real draws and the biased control clumps.
    let target = CudaTarget::new(&flat(tiny(6)), dev, 32, 128, 1 << 28).unwrap();
    let prompt = [1u32, 4, 2, 5];
    let params = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
    let exact = exact_two(&target, &prompt, &params);
    // Fewer on the simulated device: the biased control's clumps of 32 still give a chi-square far in the tail.
    let n = if target.with_model(|m| m.gpu().info().simulated).unwrap() { 960 } else { 6_000 };
    let (stat, df) = chi_square(&sample_two(&target, &prompt, &params, n, 11), &exact);
    let p = chi_square_p_value(stat, df);
    eprintln!("device tree acceptance: chi2 {stat:.1} df {df} p {p:.4}");
    assert!(p > 0.001, "chi2 {stat:.1} on {df} df, p = {p:.2e}");
    let (stat, df) = chi_square(&sample_two(ReusedCoins(&target), &prompt, &params, n, 11), &exact);
    let p = chi_square_p_value(stat, df);
    eprintln!("reused coins (biased control): chi2 {stat:.1} df {df} p {p:.2e}");
    assert!(p < 1e-6, "the biased control passed: chi2 {stat:.1} on {df} df, p = {p:.2e}");
}

/// Hidden features through device verification (accepted rows picked from the taps, or packed on the device for the
/// final norm alone) against host verification of the same logits: the rows an EAGLE drafter reads.
#[test]
fn recorded_hidden_rows_match_host_verification() {
    for dev in devices("recorded_hidden_rows_match_host_verification", &[Schedule::Seeded(8)]) {
        hidden_rows(dev);
    }
}

fn hidden_rows(dev: SharedGpu) {
    let model = tiny(96);
    let target = CudaTarget::new(&model, dev, 8, 512, 1 << 30).unwrap();
    for taps in [vec![tlt_model::Tap::FinalNorm], tlt_model::Tap::eagle3(2).to_vec()] {
        target.set_taps(&taps).unwrap();
        let run = |on_device: bool| {
            let mut engine = Engine::new(&target, SpecParams::greedy(24)).unwrap();
            engine.verify_on_target(on_device);
            engine.record_hidden(true);
            for p in prompts().iter().take(3) {
                engine.add_request(p).unwrap();
            }
            engine
                .run_to_completion(Some(&mut NgramDrafter::default()), &Plan { steps: 3, top_k: 2, verify_tokens: 8 })
                .unwrap();
            let mut f = engine.take_finished();
            f.sort_by_key(|f| f.id);
            f
        };
        let (dev, host) = (run(true), run(false));
        for (d, h) in dev.iter().zip(&host) {
            assert_eq!(d.tokens, h.tokens);
            let (dh, hh) = (d.hidden.as_ref().unwrap(), h.hidden.as_ref().unwrap());
            assert_eq!(dh.width(), 64 * taps.len(), "taps {taps:?}");
            assert_eq!(dh.len(), hh.len());
            for i in 0..dh.len() {
                let (a, b) = (dh.row(i).unwrap(), hh.row(i).unwrap());
                let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                assert!(diff < 1e-2, "taps {taps:?}, row {i}: {diff}");
            }
        }
    }
}
