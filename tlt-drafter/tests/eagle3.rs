//! EAGLE-3: the training-time-test unroll against an independent sequential drafting reference, alignment,
//! gradients, frozen shared parts, and training on real target hidden states.
#![allow(clippy::unwrap_used, clippy::needless_range_loop)] // Tests: a panic is the failure report.

mod common;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use common::reference::*;
use common::*;
use tlt_drafter::{
    DrafterConfig, Eagle3Batch, Eagle3Drafter, Eagle3LossConfig, Error, FrozenTarget, Teacher, VocabMap,
};

const DRAFT_VOCAB: usize = 12;

fn drafter(target: &tlt_model::Llama) -> Eagle3Drafter {
    let toks = tokens(3, 9, 1).into_iter().flatten();
    let vocab = VocabMap::from_tokens(toks, VOCAB, DRAFT_VOCAB, &[2]).unwrap();
    let cfg = DrafterConfig::eagle3_from_target(target.config(), DRAFT_VOCAB);
    Eagle3Drafter::random(cfg, vocab, FrozenTarget::new(target), 5).unwrap()
}

fn batch(target: &tlt_model::Llama, teacher_from_hidden: bool) -> Eagle3Batch {
    let out = run_target(target, &tokens(2, 9, 1));
    let teacher =
        if teacher_from_hidden { Teacher::FinalHidden(out.final_hidden) } else { Teacher::Logits(out.logits) };
    Eagle3Batch {
        input_ids: out.ids,
        aux_hidden: out.aux,
        teacher,
        loss_mask: mask(&[vec![0., 1., 1., 1., 1., 1., 1., 1., 1.], vec![0., 0., 1., 1., 1., 1., 1., 0., 0.]]),
        segments: None,
    }
}

fn loss_cfg(steps: usize) -> Eagle3LossConfig {
    Eagle3LossConfig { steps, ..Default::default() }
}

#[test]
fn gradients_match_finite_differences() {
    let target = target("llama", 3);
    let d = drafter(&target).to_dtype(DType::F64).unwrap();
    let b = batch(&target, false);
    let vars = d.vars().unwrap();
    let checked = check_gradients(&vars, 1, || d.loss(&b, &loss_cfg(3)).unwrap().total);
    assert!(checked >= 3 * vars.len(), "checked only {checked}");
}

#[test]
fn every_parameter_gets_a_nonzero_gradient_and_only_drafter_parameters_are_vars() {
    let target = target("qwen2", 3); // a Qwen2 target still gets a (bias-free) llama drafter
    let d = drafter(&target);
    assert_eq!(d.config().attention_bias(), tlt_model::AttentionBias::default());
    let vars = d.vars().unwrap();
    let names: Vec<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), 13);
    assert!(names.contains(&"midlayer.hidden_norm.weight") && names.contains(&"lm_head.weight"));
    assert!(!names.iter().any(|n| n.contains("embed")));
    let loss = d.loss(&batch(&target, true), &loss_cfg(2)).unwrap();
    assert_all_gradients_nonzero(&vars, &loss.total, "eagle3");
}

#[test]
fn adamw_trains_while_shared_embedding_and_head_stay_bit_identical() {
    let target = target("llama", 3);
    let d = drafter(&target);
    let (embed0, head0) = (bits(&target.weights().embed_tokens), bits(target.weights().lm_head()));
    let draft_head0 = bits(&d.weights().lm_head);
    let b = batch(&target, true);
    let vars: Vec<_> = d.vars().unwrap().into_iter().map(|(_, v)| v).collect();
    let params = ParamsAdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, weight_decay: 0.0, ..Default::default() };
    let mut opt = AdamW::new(vars, params).unwrap();
    let cfg = Eagle3LossConfig::default();
    let first = d.loss(&b, &cfg).unwrap();
    assert_eq!(first.steps.len(), 7);
    for _ in 0..8 {
        opt.backward_step(&d.loss(&b, &cfg).unwrap().total).unwrap();
    }
    let last = d.loss(&b, &cfg).unwrap();
    let (f, l) = (scalar(&first.total), scalar(&last.total));
    assert!(l < 0.9 * f, "loss {f} -> {l}");
    assert_ne!(bits(&d.weights().lm_head), draft_head0, "the draft head trains");
    assert_eq!(bits(&target.weights().embed_tokens), embed0);
    assert_eq!(bits(target.weights().lm_head()), head0);
    assert_eq!(bits(d.target().embed_tokens()), embed0);
    assert_eq!(bits(d.target().lm_head()), head0);
}

#[test]
fn draft_head_starts_from_the_target_rows_of_the_used_ids() {
    let target = target("llama", 3);
    let d = drafter(&target);
    let head = target.weights().lm_head().to_vec2::<f32>().unwrap();
    let draft = d.weights().lm_head.to_vec2::<f32>().unwrap();
    assert!(d.vocab().used().contains(&2), "EOS is kept");
    for (i, &id) in d.vocab().used().iter().enumerate() {
        assert_eq!(draft[i], head[id as usize]);
    }
}

/// Hidden-state teacher and logit teacher give the same loss; positions whose target argmax is outside the draft
/// vocabulary carry no weight.
#[test]
fn teacher_forms_agree_and_out_of_vocab_targets_are_masked() {
    let target = target("llama", 3);
    let d = drafter(&target);
    let (a, b) =
        (d.loss(&batch(&target, true), &loss_cfg(3)).unwrap(), d.loss(&batch(&target, false), &loss_cfg(3)).unwrap());
    assert!((scalar(&a.total) - scalar(&b.total)).abs() < 1e-4);
    assert_eq!(a.tokens, b.tokens);

    // Make every target argmax an unused id: nothing is trained.
    let unused = (0..VOCAB as u32).find(|&i| !d.vocab().contains(i)).unwrap();
    let mut hot = vec![0f32; 2 * 9 * VOCAB];
    for row in hot.chunks_mut(VOCAB) {
        row[unused as usize] = 50.0;
    }
    let mut bb = batch(&target, false);
    bb.teacher = Teacher::Logits(Tensor::from_vec(hot, (2, 9, VOCAB), &Device::Cpu).unwrap());
    let l = d.loss(&bb, &loss_cfg(3)).unwrap();
    assert!(l.tokens.iter().all(|&t| t == 0.0));
    assert_eq!(scalar(&l.total), 0.0);
}

/// Step 0 at position t is trained against the teacher at t + 1: a teacher built from the drafter's own step-0
/// logits (placed one row later) is matched exactly (loss = its entropy); the same teacher unshifted is not.
#[test]
fn step0_alignment_is_pinned_by_a_perfect_teacher() {
    let target = target("llama", 3);
    let d = drafter(&target).to_dtype(DType::F64).unwrap();
    let mut b = batch(&target, false);
    b.loss_mask = Tensor::ones((2, 9), DType::F64, &Device::Cpu).unwrap();
    let step0 = d.forward_train(&b, 1).unwrap().remove(0); // [2, 9, N]
    let place = |shift: usize| -> Tensor {
        // Full-vocab logits: draft logits on used ids, -1e4 elsewhere, draft row r at teacher row r + shift.
        let s = step0.to_vec3::<f64>().unwrap();
        let mut out = vec![-1e4f64; 2 * 9 * VOCAB];
        for r in 0..2 {
            for t in 0..9usize {
                let src = t.checked_sub(shift).map(|x| &s[r][x]);
                for (i, &id) in d.vocab().used().iter().enumerate() {
                    out[(r * 9 + t) * VOCAB + id as usize] = src.map_or(0.0, |row| row[i]);
                }
            }
        }
        Tensor::from_vec(out, (2, 9, VOCAB), &Device::Cpu).unwrap()
    };
    let logp = candle_nn::ops::log_softmax(&step0.narrow(1, 0, 8).unwrap(), D::Minus1).unwrap();
    let entropy = scalar(&(logp.exp().unwrap() * &logp).unwrap().sum_all().unwrap().neg().unwrap()) / 16.0;
    b.teacher = Teacher::Logits(place(1));
    let aligned = d.loss(&b, &loss_cfg(1)).unwrap();
    assert_eq!(aligned.tokens[0], 16.0);
    assert!((scalar(&aligned.total) - entropy).abs() < 1e-9, "{} vs entropy {entropy}", scalar(&aligned.total));
    assert_eq!(aligned.accuracy[0], 1.0);
    b.teacher = Teacher::Logits(place(0));
    assert!(scalar(&d.loss(&b, &loss_cfg(1)).unwrap().total) > entropy + 1e-3);
}

// ---- An independent reference: EAGLE-3 drafting a chain at one position, one step at a time (f64, loops). ----

struct Ref {
    fc: Mat,
    q: Mat,
    k: Mat,
    v: Mat,
    o: Mat,
    gate: Mat,
    up: Mat,
    down: Mat,
    in_norm: Vec<f64>,
    hid_norm: Vec<f64>,
    post: Vec<f64>,
    norm: Vec<f64>,
    head: Mat,
    embed: Mat,
    inv: Vec<f64>,
    eps: f64,
    nh: usize,
    nkv: usize,
    hd: usize,
}

impl Ref {
    fn new(d: &Eagle3Drafter) -> Self {
        let w = d.weights();
        let l = &w.layer;
        let c = &d.config().llama;
        Self {
            fc: mat(&w.fc.weight),
            q: mat(&l.proj.q_proj.weight),
            k: mat(&l.proj.k_proj.weight),
            v: mat(&l.proj.v_proj.weight),
            o: mat(&l.proj.o_proj.weight),
            gate: mat(&l.proj.gate_proj.weight),
            up: mat(&l.proj.up_proj.weight),
            down: mat(&l.proj.down_proj.weight),
            in_norm: vec1(l.input_layernorm.as_ref().unwrap()),
            hid_norm: vec1(l.hidden_norm.as_ref().unwrap()),
            post: vec1(&l.post_attention_layernorm),
            norm: vec1(&w.norm),
            head: mat(&w.lm_head),
            embed: mat(d.target().embed_tokens()),
            inv: c.rope_inv_freq(),
            eps: c.rms_norm_eps,
            nh: c.num_attention_heads,
            nkv: c.kv_heads(),
            hd: c.head_dim(),
        }
    }

    /// Query, key and value of (token, feature) at `pos`.
    fn qkv(&self, token: u32, feature: &[f64], pos: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let mut x = rms(&self.embed[token as usize], &self.in_norm, self.eps);
        x.extend(rms(feature, &self.hid_norm, self.eps));
        let (mut q, mut k) = (matvec(&self.q, &x), matvec(&self.k, &x));
        rope(&mut q, self.hd, pos, &self.inv);
        rope(&mut k, self.hd, pos, &self.inv);
        (q, k, matvec(&self.v, &x))
    }

    /// Attention of `q` over `keys`/`values`, then the rest of the layer; returns (pre-norm output, logits).
    fn finish(&self, q: &[f64], keys: &[Vec<f64>], values: &[Vec<f64>], feature: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let attn = attend(q, keys, values, self.nh, self.nkv, self.hd);
        let x = add(feature, &matvec(&self.o, &attn));
        let out = mlp_residual(&x, &self.post, &self.gate, &self.up, &self.down, self.eps);
        let logits = matvec(&self.head, &rms(&out, &self.norm, self.eps));
        (out, logits)
    }
}

/// The TTT unroll equals drafting a chain at position `t` one step at a time with a KV cache: the prefix holds the
/// step-0 keys of positions `0..=t` (from the target's features), each chain step `k` reads the ground-truth token
/// `x_{t+1+k}` and the previous step's output at RoPE position `t + k`, and sees its own earlier chain keys.
#[test]
fn ttt_unroll_matches_sequential_chain_drafting() {
    let target = target("llama", 3);
    let d = drafter(&target).to_dtype(DType::F64).unwrap();
    let b = batch(&target, false);
    let steps = 4;
    let unrolled: Vec<Vec<Vec<Vec<f64>>>> =
        d.forward_train(&b, steps).unwrap().iter().map(|l| l.to_vec3::<f64>().unwrap()).collect();
    let r = Ref::new(&d);
    let ids = b.input_ids.to_vec2::<u32>().unwrap();
    let aux = b.aux_hidden.to_dtype(DType::F64).unwrap().to_vec3::<f64>().unwrap();
    let mut compared = 0;
    for row in 0..2 {
        let g0: Vec<Vec<f64>> = aux[row].iter().map(|a| matvec(&r.fc, a)).collect();
        for t in 0..9 {
            // Step-0 keys of the prefix.
            let (mut keys, mut values) = (vec![], vec![]);
            for j in 0..=t {
                let (_, k, v) = r.qkv(ids[row].get(j + 1).copied().unwrap_or(0), &g0[j], j);
                keys.push(k);
                values.push(v);
            }
            let mut feature = g0[t].clone();
            for k in 0..steps {
                if t + 1 + k >= 9 {
                    break;
                }
                let (q, key, value) = r.qkv(ids[row][t + 1 + k], &feature, t + k);
                if k > 0 {
                    keys.push(key);
                    values.push(value);
                }
                let (out, logits) = r.finish(&q, &keys, &values, &feature);
                let got = &unrolled[k][row][t];
                let diff = logits.iter().zip(got).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                assert!(diff < 1e-9, "row {row} position {t} step {k}: max diff {diff}");
                compared += 1;
                feature = out;
            }
        }
    }
    assert!(compared >= 40, "compared {compared}");
}

#[test]
fn packed_rows_match_padded_rows_and_bad_batches_are_errors() {
    let target = target("llama", 3);
    let d = drafter(&target);
    let a = run_target(&target, &tokens(1, 6, 2));
    let c = run_target(&target, &tokens(1, 6, 5));
    let cat = |x: &Tensor, y: &Tensor, dim| Tensor::cat(&[x, y], dim).unwrap();
    let m = vec![0f32, 1., 1., 1., 1., 1.];
    let packed = Eagle3Batch {
        input_ids: cat(&a.ids, &c.ids, 1),
        aux_hidden: cat(&a.aux, &c.aux, 1),
        teacher: Teacher::Logits(cat(&a.logits, &c.logits, 1)),
        loss_mask: mask(&[[m.clone(), m.clone()].concat()]),
        segments: Some(Tensor::new(&[[3u32, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4]], &Device::Cpu).unwrap()),
    };
    let rows = Eagle3Batch {
        input_ids: cat(&a.ids, &c.ids, 0),
        aux_hidden: cat(&a.aux, &c.aux, 0),
        teacher: Teacher::Logits(cat(&a.logits, &c.logits, 0)),
        loss_mask: mask(&[m.clone(), m]),
        segments: None,
    };
    let (p, q) = (d.loss(&packed, &loss_cfg(3)).unwrap(), d.loss(&rows, &loss_cfg(3)).unwrap());
    assert_eq!(p.tokens, q.tokens);
    assert!((scalar(&p.total) - scalar(&q.total)).abs() < 1e-5, "{} vs {}", scalar(&p.total), scalar(&q.total));

    let mut bad = rows.clone();
    bad.aux_hidden = bad.aux_hidden.narrow(2, 0, HIDDEN).unwrap();
    assert!(matches!(d.loss(&bad, &loss_cfg(1)), Err(Error::InvalidBatch { field: "aux_hidden", .. })));
    let mut bad = rows.clone();
    bad.teacher = Teacher::Logits(a.logits.clone());
    assert!(matches!(d.loss(&bad, &loss_cfg(1)), Err(Error::InvalidBatch { field: "teacher", .. })));
    assert!(matches!(d.loss(&rows, &loss_cfg(0)), Err(Error::InvalidConfig { .. })));
}
