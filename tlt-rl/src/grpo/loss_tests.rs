//! Tests of [`super::policy_loss`]: hand-computed clipping, aggregation, micro-batch additivity and gradients.

use candle_core::{DType, Device, Tensor, Var};
use proptest::prelude::*;

use super::*;
use crate::Error;

const AGGS: [LossAgg; 4] =
    [LossAgg::TokenMean, LossAgg::SeqMeanTokenMean, LossAgg::SeqMeanTokenSum, LossAgg::SeqMeanTokenSumNorm];

fn t2(v: &[f64], b: usize, t: usize) -> Tensor {
    Tensor::from_vec(v.to_vec(), (b, t), &Device::Cpu).unwrap()
}

fn t1(v: &[f64]) -> Tensor {
    Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu).unwrap()
}

/// The default GRPO loss with DAPO's clip-higher (0.28, not the default 0.2), so that the hand-computed cases tell the
/// two clip bounds apart.
fn plain() -> GrpoConfig {
    GrpoConfig { tis_cap: None, clip_high: 0.28, ..GrpoConfig::default() }
}

/// Loss, d loss / d logp and stats of a single token with advantage `a` and ratio `ratio`.
fn one_token(a: f64, ratio: f64, cfg: &GrpoConfig) -> (f64, f64, LossStats) {
    let var = Var::from_tensor(&t2(&[ratio.ln()], 1, 1)).unwrap();
    let (old, mask, adv) = (t2(&[0.0], 1, 1), t2(&[1.0], 1, 1), t1(&[a]));
    let inp = LossInputs {
        logp: var.as_tensor(),
        old_logp: &old,
        rollout_logp: None,
        ref_logp: None,
        entropy: None,
        advantages: &adv,
        mask: &mask,
    };
    let norm = LossNorm { total_tokens: 1, total_seqs: 1, max_response_len: 1 };
    let (loss, stats) = policy_loss(&inp, &norm, cfg).unwrap();
    let grad = loss.backward().unwrap().get(var.as_tensor()).unwrap().to_vec2::<f64>().unwrap()[0][0];
    (loss.to_scalar::<f64>().unwrap(), grad, stats)
}

#[test]
fn grpo_clipping_hand_computed() {
    // (advantage, ratio, dual clip, loss, gradient, clipped low, clipped high)
    let cases = [
        (1.0, 1.1, None, -1.1, -1.1, 0.0, 0.0),
        (1.0, 1.5, None, -1.28, 0.0, 0.0, 1.0),
        (1.0, 0.5, None, -0.5, -0.5, 0.0, 0.0),
        (-1.0, 0.5, None, 0.8, 0.0, 1.0, 0.0),
        (-1.0, 1.5, None, 1.5, 1.5, 0.0, 0.0),
        (-2.0, 0.9, None, 1.8, 1.8, 0.0, 0.0),
        (-1.0, 5.0, Some(3.0), 3.0, 0.0, 0.0, 0.0),
        (-1.0, 2.0, Some(3.0), 2.0, 2.0, 0.0, 0.0),
        (1.0, 5.0, Some(3.0), -1.28, 0.0, 0.0, 1.0),
        (0.5, 1.2, None, -0.6, -0.6, 0.0, 0.0),
    ];
    for (a, ratio, dual, want, want_grad, low, high) in cases {
        let cfg = GrpoConfig { dual_clip: dual, ..plain() };
        let (loss, grad, s) = one_token(a, ratio, &cfg);
        let ctx = format!("A={a} ratio={ratio} dual={dual:?}");
        // The dual clip acts exactly where it caps the loss (A < 0 and -A r > -A c): zero gradient there.
        let capped = dual.is_some_and(|c| a < 0.0 && -a * ratio > -a * c);
        assert_eq!(s.dual_clip_frac, f64::from(u8::from(capped)), "{ctx}");
        // ppo_kl = old_logp - logp = -ln(ratio).
        assert!((s.ppo_kl + ratio.ln()).abs() < 1e-12, "{ctx}: ppo_kl {}", s.ppo_kl);
        assert!((loss - want).abs() < 1e-12, "{ctx}: loss {loss} vs {want}");
        assert!((grad - want_grad).abs() < 1e-12, "{ctx}: grad {grad} vs {want_grad}");
        assert_eq!((s.clip_frac_low, s.clip_frac_high), (low, high), "{ctx}");
        assert!((s.ratio_mean - ratio).abs() < 1e-12);
        assert_eq!((s.tokens, s.tis_weight_mean, s.loss), (1, 1.0, loss));
    }
}

/// The loss of one trained token with advantage 1, log-probabilities `logp`/`old` (`[1, 1]`), rollout log-probability
/// `rollout` and TIS cap `cap`.
fn tis_token(logp: &Tensor, old: &Tensor, rollout: f64, cap: Option<f64>) -> (Tensor, LossStats) {
    let (r, mask, adv) = (t2(&[rollout], 1, 1), t2(&[1.0], 1, 1), t1(&[1.0]));
    let norm = LossNorm { total_tokens: 1, total_seqs: 1, max_response_len: 1 };
    let inp = LossInputs {
        logp,
        old_logp: old,
        rollout_logp: Some(&r),
        ref_logp: None,
        entropy: None,
        advantages: &adv,
        mask: &mask,
    };
    policy_loss(&inp, &norm, &GrpoConfig { tis_cap: cap, ..GrpoConfig::default() }).unwrap()
}

#[test]
fn grpo_tis_weight_is_capped_and_detached() {
    let (logp, old) = (t2(&[1.1f64.ln()], 1, 1), t2(&[0.0], 1, 1));
    for (rollout, cap, want_w) in
        [(-1.5f64.ln(), Some(2.0), 1.5), (-3.0f64.ln(), Some(2.0), 2.0), (-3.0f64.ln(), None, 1.0)]
    {
        let (loss, s) = tis_token(&logp, &old, rollout, cap);
        assert!((loss.to_scalar::<f64>().unwrap() + 1.1 * want_w).abs() < 1e-12);
        assert!((s.tis_weight_mean - want_w).abs() < 1e-12);
        assert!((s.pg_loss + 1.1 * want_w).abs() < 1e-12);
    }
}

/// TIS at T = 0.7: the trainer's log-probability of the sampled token (candle, logits / T) against the rollout's
/// (computed here by hand at the same temperature) gives the hand-computed weight `exp(old - rollout)`; comparing
/// against a temperature-1 rollout log-probability (what the engine recorded before) gives a wrong weight.
#[test]
fn grpo_tis_at_temperature_0_7_hand_computed() {
    let t = 0.7f64;
    let policy = [2.0f64, 1.0, 0.0];
    let rollout_logits = [2.2f64, 1.0, 0.0]; // the rollout engine's policy copy differs a little
    let lp = |z: &[f64], temp: f64| {
        let s: Vec<f64> = z.iter().map(|x| x / temp).collect();
        s[0] - s.iter().map(|x| x.exp()).sum::<f64>().ln()
    };
    let (old_hand, rollout_hand) = (lp(&policy, t), lp(&rollout_logits, t));
    // Hand: 2/0.7 - ln(e^{2/0.7} + e^{1/0.7} + 1) = -0.26012, and -0.20151 for the rollout: weight 0.94308.
    assert!((old_hand + 0.260_12).abs() < 1e-5 && (rollout_hand + 0.201_51).abs() < 1e-5, "{old_hand} {rollout_hand}");
    let want_w = (old_hand - rollout_hand).exp();
    assert!((want_w - 0.943_08).abs() < 1e-5);
    let logits = Tensor::from_vec(policy.to_vec(), (1, 1, 3), &Device::Cpu).unwrap();
    let target = Tensor::from_vec(vec![0u32], (1, 1), &Device::Cpu).unwrap();
    let (old, _) = logprobs_and_entropy(&logits, &target, t, false).unwrap();
    assert!((old.to_vec2::<f64>().unwrap()[0][0] - old_hand).abs() < 1e-12);
    let weight = |rollout: f64| tis_token(&old, &old, rollout, Some(2.0)).1.tis_weight_mean;
    assert!((weight(rollout_hand) - want_w).abs() < 1e-12, "{} vs {want_w}", weight(rollout_hand));
    // Negative control: a temperature-1 rollout log-probability misses by far more than rounding.
    assert!((weight(lp(&rollout_logits, 1.0)) - want_w).abs() > 0.05);
}

#[test]
fn grpo_kl_term_and_errors() {
    let (logp, mask, adv, reference) = (t2(&[-1.0], 1, 1), t2(&[1.0], 1, 1), t1(&[0.0]), t2(&[-1.5], 1, 1));
    let norm = LossNorm { total_tokens: 1, total_seqs: 1, max_response_len: 1 };
    let mut inp = LossInputs {
        logp: &logp,
        old_logp: &logp,
        rollout_logp: None,
        ref_logp: Some(&reference),
        entropy: None,
        advantages: &adv,
        mask: &mask,
    };
    let cfg = GrpoConfig { kl: Some(KlConfig { coef: 0.1, estimator: KlEstimator::K3 }), ..plain() };
    let (loss, s) = policy_loss(&inp, &norm, &cfg).unwrap();
    let k3 = (-0.5f64).exp() + 0.5 - 1.0;
    assert!((loss.to_scalar::<f64>().unwrap() - 0.1 * k3).abs() < 1e-12);
    assert!((s.kl - k3).abs() < 1e-12);

    inp.ref_logp = None;
    assert!(matches!(policy_loss(&inp, &norm, &cfg), Err(Error::InvalidArgument(_))));
    let ent = GrpoConfig { entropy_coef: 0.01, ..plain() };
    assert!(policy_loss(&inp, &norm, &ent).is_err());
    let small = LossNorm { total_tokens: 0, ..norm };
    assert!(policy_loss(&inp, &small, &plain()).is_err());
    let seqs = LossNorm { total_seqs: 0, ..norm };
    assert!(policy_loss(&inp, &seqs, &GrpoConfig { loss_agg: LossAgg::SeqMeanTokenSum, ..plain() }).is_err());
    let len = LossNorm { max_response_len: 0, ..norm };
    assert!(policy_loss(&inp, &len, &GrpoConfig { loss_agg: LossAgg::SeqMeanTokenSumNorm, ..plain() }).is_err());
    let wide = t2(&[0.0, 0.0], 1, 2);
    inp.old_logp = &wide;
    assert!(policy_loss(&inp, &norm, &plain()).is_err());
    let two = t1(&[0.0, 1.0]);
    inp.old_logp = &logp;
    inp.advantages = &two;
    assert!(policy_loss(&inp, &norm, &plain()).is_err());
}

#[test]
fn grpo_aggregation_modes_hand_computed() {
    // Ratio 1 everywhere, so token loss = -A - entropy (entropy_coef 1).
    let logp = t2(&[-1.0; 6], 2, 3);
    let ent = t2(&[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 2, 3);
    let mask = t2(&[1.0, 1.0, 0.0, 1.0, 0.0, 0.0], 2, 3);
    let adv = t1(&[1.0, -2.0]);
    let inp = LossInputs {
        logp: &logp,
        old_logp: &logp,
        rollout_logp: None,
        ref_logp: None,
        entropy: Some(&ent),
        advantages: &adv,
        mask: &mask,
    };
    // Sequence sums: -1.1 - 1.2 = -2.3 over 2 tokens, 1.6 over 1 token.
    let cases = [
        (LossAgg::TokenMean, 3, -0.7 / 3.0),
        (LossAgg::TokenMean, 6, -0.7 / 6.0),
        (LossAgg::SeqMeanTokenMean, 3, (-1.15 + 1.6) / 2.0),
        (LossAgg::SeqMeanTokenSum, 3, -0.7 / 2.0),
        (LossAgg::SeqMeanTokenSumNorm, 3, -0.7 / (2.0 * 4.0)),
    ];
    for (agg, total_tokens, want) in cases {
        let cfg = GrpoConfig { loss_agg: agg, entropy_coef: 1.0, ..plain() };
        let norm = LossNorm { total_tokens, total_seqs: 2, max_response_len: 4 };
        let (loss, s) = policy_loss(&inp, &norm, &cfg).unwrap();
        let got = loss.to_scalar::<f64>().unwrap();
        assert!((got - want).abs() < 1e-12, "{agg:?}: {got} vs {want}");
        assert!((s.entropy - 0.7 / 3.0).abs() < 1e-12);
        assert!((s.pg_loss - (-1.0 - 1.0 + 2.0) / 3.0).abs() < 1e-12);
        assert_eq!(s.tokens, 3);
    }
    assert_eq!(
        LossNorm::from_mask(&mask, 4).unwrap(),
        LossNorm { total_tokens: 3, total_seqs: 2, max_response_len: 4 }
    );
}

#[test]
fn grpo_loss_stats_merge_is_token_weighted() {
    let mut a = LossStats { loss: 1.0, pg_loss: 2.0, ratio_mean: 1.0, tokens: 1, ..Default::default() };
    let b = LossStats { loss: 0.5, pg_loss: 5.0, ratio_mean: 3.0, tokens: 3, ..Default::default() };
    a.merge(&b);
    assert_eq!((a.loss, a.pg_loss, a.ratio_mean, a.tokens), (1.5, 4.25, 2.5, 4));
    let mut empty = LossStats::default();
    empty.merge(&LossStats::default());
    assert_eq!(empty, LossStats::default());
}

/// One random mini-batch: per-token values, a mask, advantages and a split of its rows into micro-batches.
#[derive(Debug, Clone)]
struct Batch {
    b: usize,
    t: usize,
    logp: Vec<f64>,
    old: Vec<f64>,
    rollout: Vec<f64>,
    reference: Vec<f64>,
    entropy: Vec<f64>,
    mask: Vec<f64>,
    adv: Vec<f64>,
    part: Vec<usize>,
}

fn batches() -> impl Strategy<Value = Batch> {
    (1usize..7, 1usize..6).prop_flat_map(|(b, t)| {
        let n = b * t;
        let toks = || prop::collection::vec(-1.0f64..1.0, n);
        (toks(), prop::collection::vec(-3.0f64..0.0, n), toks(), toks(), prop::collection::vec(0.0f64..2.0, n))
            .prop_flat_map(move |(lr, old, roll, rf, ent)| {
                (
                    Just((lr, old, roll, rf, ent)),
                    prop::collection::vec(prop::bool::weighted(0.7), n),
                    prop::collection::vec(-2.0f64..2.0, b),
                    prop::collection::vec(0usize..3, b),
                )
            })
            .prop_map(move |((lr, old, roll, rf, ent), mask, adv, part)| Batch {
                b,
                t,
                logp: lr.iter().zip(&old).map(|(d, o)| o + d).collect(),
                rollout: roll.iter().zip(&old).map(|(d, o)| o + d).collect(),
                reference: rf.iter().zip(&old).map(|(d, o)| o + d).collect(),
                old,
                entropy: ent,
                mask: mask.into_iter().map(|m| m as u8 as f64).collect(),
                adv,
                part,
            })
    })
}

/// Evaluates the loss of the rows `rows` of `x` under `norm`.
fn loss_of(x: &Batch, rows: &[usize], logp: &Tensor, norm: &LossNorm, cfg: &GrpoConfig) -> (Tensor, LossStats) {
    let idx = Tensor::from_vec(rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), rows.len(), &Device::Cpu).unwrap();
    let pick = |v: &[f64]| t2(v, x.b, x.t).index_select(&idx, 0).unwrap();
    let (old, roll, rf, ent, mask) =
        (pick(&x.old), pick(&x.rollout), pick(&x.reference), pick(&x.entropy), pick(&x.mask));
    let adv = t1(&x.adv).index_select(&idx, 0).unwrap();
    let logp = logp.index_select(&idx, 0).unwrap();
    let inp = LossInputs {
        logp: &logp,
        old_logp: &old,
        rollout_logp: Some(&roll),
        ref_logp: Some(&rf),
        entropy: Some(&ent),
        advantages: &adv,
        mask: &mask,
    };
    policy_loss(&inp, norm, cfg).unwrap()
}

fn full_cfg(agg: LossAgg, dual: bool) -> GrpoConfig {
    GrpoConfig {
        loss_agg: agg,
        dual_clip: dual.then_some(3.0),
        kl: Some(KlConfig { coef: 0.05, estimator: KlEstimator::K3 }),
        entropy_coef: 0.01,
        ..GrpoConfig::default()
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

proptest! {
    #[test]
    fn grpo_micro_batches_sum_to_full_batch_loss(x in batches(), agg in 0usize..4, dual in any::<bool>()) {
        let cfg = full_cfg(AGGS[agg], dual);
        let norm = LossNorm::from_mask(&t2(&x.mask, x.b, x.t), x.t + 1).unwrap();
        let logp = t2(&x.logp, x.b, x.t);
        let all: Vec<usize> = (0..x.b).collect();
        let (full, full_stats) = loss_of(&x, &all, &logp, &norm, &cfg);
        let full = full.to_scalar::<f64>().unwrap();
        let mut sum = 0.0;
        let mut merged = LossStats::default();
        for p in 0..3 {
            let rows: Vec<usize> = (0..x.b).filter(|&i| x.part[i] == p).collect();
            if rows.is_empty() {
                continue;
            }
            let (l, s) = loss_of(&x, &rows, &logp, &norm, &cfg);
            sum += l.to_scalar::<f64>().unwrap();
            merged.merge(&s);
        }
        prop_assert!(close(full, sum), "full {} vs sum {}", full, sum);
        prop_assert!(close(full_stats.loss, merged.loss));
        prop_assert_eq!(full_stats.tokens, merged.tokens);
        for (a, b) in [
            (full_stats.pg_loss, merged.pg_loss),
            (full_stats.kl, merged.kl),
            (full_stats.entropy, merged.entropy),
            (full_stats.clip_frac_low, merged.clip_frac_low),
            (full_stats.clip_frac_high, merged.clip_frac_high),
            (full_stats.ratio_mean, merged.ratio_mean),
            (full_stats.tis_weight_mean, merged.tis_weight_mean),
        ] {
            prop_assert!(close(a, b), "{} vs {}", a, b);
        }
    }
}

#[test]
fn grpo_loss_gradient_matches_finite_differences() {
    // Log-ratios away from the clip boundaries 1 - 0.2, 1 + 0.28 and the dual clip 3.
    let lr = [-0.5, -0.1, 0.05, 0.2, 0.6, 1.5, -0.4, 0.1, 1.2, -0.05, 0.15, 0.3];
    let (b, t) = (3, 4);
    let old: Vec<f64> = (0..b * t).map(|i| -0.3 - 0.17 * i as f64).collect();
    let x = Batch {
        b,
        t,
        logp: old.iter().zip(lr).map(|(o, d)| o + d).collect(),
        rollout: old.iter().enumerate().map(|(i, o)| o + [0.3, -0.2, -1.0][i % 3]).collect(),
        reference: old.iter().enumerate().map(|(i, o)| o + 0.1 * (i % 5) as f64 - 0.2).collect(),
        old,
        entropy: (0..b * t).map(|i| 0.1 * i as f64).collect(),
        mask: vec![1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0],
        adv: vec![1.3, -0.7, -1.6],
        part: vec![0; b],
    };
    let rows: Vec<usize> = (0..b).collect();
    let norm = LossNorm { total_tokens: 8, total_seqs: 3, max_response_len: 5 };
    for agg in AGGS {
        for dual in [false, true] {
            let cfg = full_cfg(agg, dual);
            let var = Var::from_tensor(&t2(&x.logp, b, t)).unwrap();
            let (loss, _) = loss_of(&x, &rows, var.as_tensor(), &norm, &cfg);
            let grads = loss.backward().unwrap();
            let g = grads.get(var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            let h = 1e-6;
            for i in 0..b * t {
                let eval = |d: f64| {
                    let mut v = x.logp.clone();
                    v[i] += d;
                    loss_of(&x, &rows, &t2(&v, b, t), &norm, &cfg).0.to_scalar::<f64>().unwrap()
                };
                let fd = (eval(h) - eval(-h)) / (2.0 * h);
                assert!((g[i] - fd).abs() < 1e-7, "{agg:?} dual={dual} token {i}: grad {} vs fd {fd}", g[i]);
                if x.mask[i] == 0.0 {
                    assert_eq!(g[i], 0.0, "masked token {i} has a gradient");
                }
            }
            assert!(g.iter().any(|&v| v.abs() > 1e-3), "{agg:?}: gradient vanished");
        }
    }
}

#[test]
fn grpo_loss_accepts_f32_inputs() {
    let logp = Tensor::new(&[[-1.0f32, -2.0]], &Device::Cpu).unwrap();
    let old = Tensor::new(&[[-1.1f32, -2.0]], &Device::Cpu).unwrap();
    let mask = Tensor::ones((1, 2), DType::F32, &Device::Cpu).unwrap();
    let adv = Tensor::new(&[0.5f32], &Device::Cpu).unwrap();
    let inp = LossInputs {
        logp: &logp,
        old_logp: &old,
        rollout_logp: Some(&old),
        ref_logp: None,
        entropy: None,
        advantages: &adv,
        mask: &mask,
    };
    let norm = LossNorm { total_tokens: 2, total_seqs: 1, max_response_len: 2 };
    let (loss, s) = policy_loss(&inp, &norm, &GrpoConfig::default()).unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    let want = -0.5 * (0.1f64.exp() + 1.0) / 2.0;
    assert!((s.loss - want).abs() < 1e-6);
    assert!((s.tis_weight_mean - 1.0).abs() < 1e-7);
}
