//! Device verification ([`DeviceVerifier`], what `CudaTarget` runs: packed trees and coins sent from pinned memory,
//! `sample_rows`, `tree_accept`, `gather_path_rows`, packed results fetched into pinned memory) on the simulated
//! device (`tlt-cuda-sim`'s `SimGpu`, its stream late or seeded) against the engine's host verification
//! ([`Verified::on_host`] with [`ExactVerifier`]) of the same logits and coins: greedy and sampled, branching trees
//! and chains, a padded sequence, hidden rows packed on the device. A negative control (coins of the wrong request)
//! must change what is committed.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::sync::Arc;

use half::bf16;
use tlt_cuda_sim::{Schedule, SimGpu};
use tlt_kernels::cuda::{DeviceBuf, SharedGpu};
use tlt_spec_decode::device_verify::{DeviceHidden, DeviceVerifier, HiddenRows, VerifyProgram};
use tlt_spec_decode::{
    Coins, DraftTree, ExactVerifier, SamplingParams, SeededRng, SeqHandle, TargetInput, TargetOutput, Verified,
    VerifySpec,
};

/// A simulated device whose stream runs work as `schedule` says.
fn sim(schedule: Schedule) -> SharedGpu {
    Arc::new(SimGpu::new(schedule))
}

const VOCAB: usize = 37;
const HIDDEN: usize = 8;
const N_MAX: usize = 6;
/// Two trees in a verification of three: the third sequence is padding.
const BATCH: usize = 3;

/// A logits row peaked at `hot` (12 above noise in [-1, 1]: the token is drawn with probability ~1 at T <= 1), or
/// flat noise in [-1.5, 1.5] when `hot` is `None` (the draw depends on the coin).
fn row(rng: &mut SeededRng, hot: Option<u32>) -> Vec<f32> {
    let spread = if hot.is_some() { 1.0 } else { 1.5 };
    let mut v = rng.uniform_vec(VOCAB, -spread, spread);
    if let Some(h) = hot {
        v[h as usize] = 12.0;
    }
    v
}

/// The trees and the target's view of them: input 0 branches (node 1 accepted, then node 3 of the siblings 2 and
/// 3, a leaf: the bonus token is drawn from a flat row); input 1 is a chain whose third draft is rejected (the
/// correction comes from a peaked row), then a flat row nobody reaches.
fn trees(rng: &mut SeededRng) -> (Vec<DraftTree>, Vec<Vec<Vec<f32>>>) {
    let mut t0 = DraftTree::new(3);
    let a = t0.push_child(0, 10, -0.1).unwrap();
    t0.push_child(a, 11, -0.5).unwrap();
    let c = t0.push_child(a, 12, -0.7).unwrap();
    t0.push_child(c - 1, 13, -0.9).unwrap();
    let rows0 = vec![row(rng, Some(10)), row(rng, Some(12)), row(rng, Some(5)), row(rng, None), row(rng, Some(7))];
    let t1 = DraftTree::chain(4, &[20, 21, 22, 23, 24]);
    let rows1 = vec![
        row(rng, Some(20)),
        row(rng, Some(21)),
        row(rng, Some(30)),
        row(rng, None),
        row(rng, Some(24)),
        row(rng, None),
    ];
    (vec![t0, t1], vec![rows0, rows1])
}

/// What one run of the device program returns for `trees` with `coins` at `temperature`.
fn on_sim(
    dev: &SharedGpu,
    trees: &[DraftTree],
    rows: &[Vec<Vec<f32>>],
    hidden: &[f32],
    coins: &[Coins],
    temperature: f32,
) -> tlt_spec_decode::Result<Vec<Verified>> {
    let (parents, tokens): (Vec<Vec<Option<usize>>>, Vec<Vec<u32>>) =
        trees.iter().map(|t| (t.parents(), t.tokens())).unzip();
    let inputs: Vec<TargetInput<'_>> = (0..trees.len())
        .map(|b| TargetInput { seq: SeqHandle(b), tokens: &tokens[b], tree: Some(&parents[b]), logits: true })
        .collect();
    // Logits padded to [batch * n_max, vocab]; padding rows are never read past n_nodes (NaN would show).
    let mut logits = vec![f32::NAN; BATCH * N_MAX * VOCAB];
    for (b, r) in rows.iter().enumerate() {
        for (j, x) in r.iter().enumerate() {
            logits[(b * N_MAX + j) * VOCAB..(b * N_MAX + j + 1) * VOCAB].copy_from_slice(x);
        }
    }
    let hidden_bf: Vec<bf16> = hidden.iter().map(|&x| bf16::from_f32(x)).collect();
    let g = dev.as_ref();
    let (lg, hs) = (DeviceBuf::from_host(g, &logits).unwrap(), DeviceBuf::from_host(g, &hidden_bf).unwrap());
    let params = SamplingParams { temperature, ..SamplingParams::default() };
    let spec = VerifySpec { params: &params, coins };
    let mut verifier = DeviceVerifier::new(dev.clone(), HIDDEN);
    verifier.verify(BATCH, N_MAX, VOCAB, lg.buf(), DeviceHidden::Packed(hs.buf()), &inputs, spec)
}

/// The engine's host verification of the same trees, rows and coins.
fn on_host(trees: &[DraftTree], rows: &[Vec<Vec<f32>>], hidden: &[f32], coins: &[Coins], t: f32) -> Vec<Verified> {
    let mut out = TargetOutput { vocab: VOCAB, hidden_size: HIDDEN, ..TargetOutput::default() };
    let (mut at, mut h) = (0, Vec::new());
    for (b, r) in rows.iter().enumerate() {
        for x in r {
            out.logits.extend_from_slice(x);
        }
        out.logit_rows.push(at..at + r.len());
        out.hidden_rows.push(at..at + r.len());
        at += r.len();
        // The rows the device holds (rounded to bf16), as the host would receive them.
        let src = &hidden[b * N_MAX * HIDDEN..(b * N_MAX + r.len()) * HIDDEN];
        h.extend(src.iter().map(|&x| bf16::from_f32(x).to_f32()));
    }
    out.hidden = Some(h);
    let params = SamplingParams { temperature: t, ..SamplingParams::default() };
    (0..trees.len())
        .map(|b| Verified::on_host(&ExactVerifier, &trees[b], &out, b, &params, &coins[b]).unwrap())
        .collect()
}

fn coins(seed: u64) -> Vec<Coins> {
    (0..2).map(|b| Coins::new(SeededRng::new(seed).fork(b), 5 + 3 * b)).collect()
}

#[test]
fn device_verification_on_the_simulated_device_matches_host_verification() {
    for schedule in SimGpu::schedules() {
        let dev = sim(schedule);
        let mut rng = SeededRng::new(7);
        let (trees, rows) = trees(&mut rng);
        let hidden = rng.uniform_vec(BATCH * N_MAX * HIDDEN, -2.0, 2.0);
        let mut bonus_tokens = std::collections::HashSet::new();
        for t in [0.0f32, 0.7, 1.0] {
            for seed in 0..6u64 {
                let c = coins(seed);
                let dev_v = on_sim(&dev, &trees, &rows, &hidden, &c, t).unwrap();
                let host_v = on_host(&trees, &rows, &hidden, &c, t);
                for (b, (d, h)) in dev_v.iter().zip(&host_v).enumerate() {
                    let what = format!("T = {t}, coins {seed}, tree {b}");
                    assert_eq!(d.accepted, h.accepted, "{what}");
                    assert_eq!(d.hidden, h.hidden, "{what}: packed hidden rows");
                    assert_eq!(d.hidden_size, HIDDEN);
                    for (x, y) in d.logprobs.iter().zip(&h.logprobs).chain(d.p_max.iter().zip(&h.p_max)) {
                        assert!(
                            (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                            "{what}: {:?} vs {:?}",
                            d.logprobs,
                            h.logprobs
                        );
                    }
                }
                // The shapes the trees were built for: 1 + 1 drafts accepted in the branching tree, 2 in the chain.
                assert_eq!(dev_v[0].accepted.path, [0, 1, 3], "T = {t}");
                assert_eq!((dev_v[1].accepted.path.as_slice(), dev_v[1].accepted.next_token), (&[0, 1, 2][..], 30));
                bonus_tokens.insert(dev_v[0].accepted.next_token);
            }
        }
        // The bonus token of the branching tree is drawn from a flat row: the coins matter.
        assert!(bonus_tokens.len() >= 4, "the flat row's draws: {bonus_tokens:?}");
    }
}

#[test]
fn coins_of_the_wrong_request_are_caught() {
    let dev = sim(Schedule::Seeded(5));
    let mut rng = SeededRng::new(7);
    let (trees, rows) = trees(&mut rng);
    let hidden = rng.uniform_vec(BATCH * N_MAX * HIDDEN, -2.0, 2.0);
    let mut differ = 0;
    for seed in 0..6u64 {
        let c = coins(seed);
        let swapped: Vec<Coins> = c.iter().rev().cloned().collect();
        let dev_v = on_sim(&dev, &trees, &rows, &hidden, &swapped, 1.0).unwrap();
        let host_v = on_host(&trees, &rows, &hidden, &c, 1.0);
        differ += usize::from(dev_v.iter().zip(&host_v).any(|(d, h)| d.accepted != h.accepted));
    }
    assert!(differ >= 4, "swapped coins went unnoticed in {} of 6 rounds", 6 - differ);
}

#[test]
fn bad_rows_and_shapes_are_errors() {
    let dev = sim(Schedule::Lazy);
    let mut rng = SeededRng::new(3);
    let (trees, mut rows) = trees(&mut rng);
    let hidden = vec![0.0; BATCH * N_MAX * HIDDEN];
    // A NaN in the row of the chain's correction: the sampler marks it and the host read says why.
    rows[1][2][4] = f32::NAN;
    let e = on_sim(&dev, &trees, &rows, &hidden, &coins(0), 0.0).unwrap_err();
    assert!(e.to_string().contains("NaN"), "{e}");
    let program = VerifyProgram::new(1, N_MAX, HIDDEN);
    let (p, t) = (trees[0].parents(), trees[0].tokens());
    let inp = TargetInput { seq: SeqHandle(0), tokens: &t, tree: Some(&p), logits: true };
    let mut host = vec![0u8; program.input_bytes()];
    assert!(program.write_inputs(&[inp, inp], &coins(0), &mut host).is_err(), "more trees than the batch");
    assert!(program.write_inputs(&[inp], &[], &mut host).is_err(), "no coins");
    assert!(program.write_inputs(&[inp], &coins(0), &mut host[..4]).is_err(), "host bytes too short");
    let causal = TargetInput { tree: None, ..inp };
    assert!(program.write_inputs(&[causal], &coins(0), &mut host).is_err(), "no tree");
    assert!(program.read(&[0u8; 4], 1, HiddenRows::None).is_err(), "result bytes too short");
}
