//! Shared test helpers: a tiny exact "target" and an imperfect "drafter" over a small vocabulary, a chi-square
//! goodness-of-fit test, and a deliberately lossy verifier that the statistical tests must catch.
#![allow(dead_code)]

use tlt_kernels::{categorical, probs};
use tlt_spec_decode::{Accepted, Coins, DraftTree, Proposal, Result, SamplingParams, SeededRng, Verifier};

/// Vocabulary size of the toy models.
pub const VOCAB: usize = 8;

/// A well-mixed 64-bit hash of a few small integers (SplitMix64 finaliser).
pub fn mix(parts: &[u64]) -> u64 {
    let mut h = 0x9E37_79B9_7F4A_7C15u64;
    for &p in parts {
        h ^= p.wrapping_add(0x9E37_79B9_7F4A_7C15).wrapping_add(h << 6).wrapping_add(h >> 2);
        h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        h ^= h >> 31;
    }
    h
}

/// A pseudo-random value in `[-1, 1)` from a hash.
fn unit(h: u64) -> f32 {
    ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// The two tokens a toy model conditions on (the last two of `ctx`, padded with a sentinel).
fn last_two(ctx: &[u32]) -> (u64, u64) {
    let n = ctx.len();
    let a = if n >= 2 { ctx[n - 2] as u64 } else { 99 };
    let b = if n >= 1 { ctx[n - 1] as u64 } else { 99 };
    (a, b)
}

/// The target's next-token logits: a fixed pseudo-random function of the last two tokens.
pub fn target_logits(ctx: &[u32]) -> Vec<f32> {
    let (a, b) = last_two(ctx);
    (0..VOCAB as u64).map(|t| 2.5 * unit(mix(&[1, a, b, t]))).collect()
}

/// The drafter's next-token distribution: correlated with the target but different (softened target logits
/// plus independent noise), normalised.
pub fn draft_probs(ctx: &[u32]) -> Vec<f32> {
    let (a, b) = last_two(ctx);
    let t = target_logits(ctx);
    let l: Vec<f32> = (0..VOCAB as u64).map(|v| 0.6 * t[v as usize] + 1.5 * unit(mix(&[2, a, b, v]))).collect();
    let mx = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = l.iter().map(|x| (x - mx).exp()).collect();
    let z: f32 = e.iter().sum();
    e.iter().map(|x| x / z).collect()
}

/// How the test drafter builds its trees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// Two levels, two children per node, drawn i.i.d. from the drafter.
    Iid,
    /// Two levels, two children per node, drawn without replacement.
    WithoutReplacement,
    /// A deterministic EAGLE-2 tree (2 steps, top-k 2, 5 nodes) from the drafter's log-probs.
    Eagle2,
}

/// Draws `k` children from `q` (i.i.d. or without replacement).
fn draw(q: &[f32], k: usize, replace: bool, rng: &mut SeededRng) -> Vec<u32> {
    let mut q = q.to_vec();
    let mut out = Vec::new();
    for _ in 0..k {
        let Ok(t) = categorical(&q, rng.uniform()) else { break };
        out.push(t as u32);
        if !replace {
            q[t] = 0.0;
        }
    }
    out
}

/// Builds a draft tree after `ctx` and the draft rows the verifier needs (row j = q at node j).
pub fn build_tree(ctx: &[u32], scheme: Scheme, rng: &mut SeededRng) -> (DraftTree, Vec<Vec<f32>>) {
    let root = *ctx.last().expect("non-empty context");
    if scheme == Scheme::Eagle2 {
        let plan = tlt_spec_decode::Plan { steps: 2, top_k: 2, verify_tokens: 5 };
        let tree = DraftTree::eagle2(root, &plan, |path: &[u32]| {
            let mut full = ctx.to_vec();
            full.extend_from_slice(&path[1..]);
            draft_probs(&full).iter().enumerate().map(|(t, &p)| (t as u32, p.ln())).collect()
        })
        .expect("valid eagle2 tree");
        return (tree, Vec::new());
    }
    let replace = scheme == Scheme::Iid;
    let mut tree = DraftTree::new(root);
    let mut rows = vec![draft_probs(ctx)];
    for t in draw(&rows[0], 2, replace, rng) {
        tree.push_child(0, t, 0.0).expect("valid");
        let mut full = ctx.to_vec();
        full.push(t);
        rows.push(draft_probs(&full));
    }
    let level1 = rows[1..].to_vec();
    for (i, q) in level1.iter().enumerate() {
        for t in draw(q, 2, replace, rng) {
            tree.push_child(i + 1, t, 0.0).expect("valid");
        }
    }
    rows.resize(tree.len(), Vec::new());
    (tree, rows)
}

/// The target rows of every node of `tree` drafted after `ctx`.
pub fn target_rows(ctx: &[u32], tree: &DraftTree) -> Vec<Vec<f32>> {
    (0..tree.len())
        .map(|i| {
            let mut full = ctx.to_vec();
            for &n in &tree.path_to(i).expect("in range")[1..] {
                full.push(tree.nodes()[n].token);
            }
            target_logits(&full)
        })
        .collect()
}

/// The signature shared by the real verifier and the biased ones.
pub type VerifyFn = dyn Fn(&DraftTree, &[Vec<f32>], Proposal<'_>, &SamplingParams, &mut SeededRng) -> Result<Accepted>;

/// The prompt every statistical run starts from.
pub const PROMPT: [u32; 2] = [3, 5];

/// Generates the first 3 tokens after [`PROMPT`] by speculative rounds; returns them as a cell index
/// `a * V^2 + b * V + c`, and the number of rounds used.
pub fn generate3(verify: &VerifyFn, scheme: Scheme, params: &SamplingParams, rng: &mut SeededRng) -> (usize, usize) {
    let mut ctx = PROMPT.to_vec();
    let mut rounds = 0;
    while ctx.len() < PROMPT.len() + 3 {
        let (tree, q) = build_tree(&ctx, scheme, rng);
        let rows = target_rows(&ctx, &tree);
        let proposal = match scheme {
            Scheme::Iid => Proposal::Iid(&q),
            Scheme::WithoutReplacement => Proposal::WithoutReplacement(&q),
            Scheme::Eagle2 => Proposal::PointMass,
        };
        let acc = verify(&tree, &rows, proposal, params, rng).expect("verification succeeds");
        assert!(tree.is_root_path(&acc.path));
        ctx.extend(acc.committed_tokens(&tree).expect("valid path"));
        rounds += 1;
    }
    let g = &ctx[PROMPT.len()..PROMPT.len() + 3];
    ((g[0] as usize * VOCAB + g[1] as usize) * VOCAB + g[2] as usize, rounds)
}

/// The exact distribution of the first 3 tokens under the target with `params`, indexed like [`generate3`].
pub fn exact3(params: &SamplingParams) -> Vec<f64> {
    let p = |ctx: &[u32]| -> Vec<f64> {
        probs(&target_logits(ctx), params).expect("valid").into_iter().map(f64::from).collect()
    };
    let mut out = vec![0.0; VOCAB * VOCAB * VOCAB];
    let p0 = p(&PROMPT);
    for a in 0..VOCAB {
        let p1 = p(&[PROMPT[1], a as u32]);
        for b in 0..VOCAB {
            let p2 = p(&[a as u32, b as u32]);
            for c in 0..VOCAB {
                out[(a * VOCAB + b) * VOCAB + c] = p0[a] * p1[b] * p2[c];
            }
        }
    }
    let z: f64 = out.iter().sum();
    out.iter().map(|x| x / z).collect()
}

/// Pearson's chi-square statistic of `counts` against the probabilities `expected_p`, after merging every cell
/// with an expected count below 5 into one pooled cell (and the pool into the smallest other cell if it is still
/// below 5). Cells with probability 0 must have count 0 (asserted: a sample there is an outright error).
/// Returns `(statistic, degrees of freedom)`.
pub fn chi_square(counts: &[u64], expected_p: &[f64]) -> (f64, usize) {
    let n: u64 = counts.iter().sum();
    let mut cells: Vec<(f64, f64)> = Vec::new(); // (expected, observed)
    let (mut pool_e, mut pool_o) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(expected_p) {
        if p == 0.0 {
            assert_eq!(c, 0, "a sample landed in a zero-probability cell");
            continue;
        }
        let e = p * n as f64;
        if e < 5.0 {
            pool_e += e;
            pool_o += c as f64;
        } else {
            cells.push((e, c as f64));
        }
    }
    if pool_e > 0.0 {
        if pool_e >= 5.0 || cells.is_empty() {
            cells.push((pool_e, pool_o));
        } else {
            let (i, _) = cells.iter().enumerate().min_by(|a, b| a.1 .0.total_cmp(&b.1 .0)).expect("non-empty");
            cells[i].0 += pool_e;
            cells[i].1 += pool_o;
        }
    }
    let stat = cells.iter().map(|&(e, o)| (o - e) * (o - e) / e).sum();
    (stat, cells.len().saturating_sub(1))
}

/// `ln Γ(x)` for `x > 0` (Lanczos approximation, g = 7, 9 terms; relative error ~1e-15).
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection.
        return (std::f64::consts::PI / (std::f64::consts::PI * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = C[0];
    let t = x + 7.5;
    for (i, &c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// The regularized upper incomplete gamma function `Q(s, x) = Γ(s, x) / Γ(s)`: the series for `P` when
/// `x < s + 1`, Lentz's continued fraction for `Q` otherwise (Numerical Recipes §6.2).
pub fn gamma_q(s: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    let log_prefactor = -x + s * x.ln() - ln_gamma(s);
    if x < s + 1.0 {
        let (mut sum, mut term, mut ap) = (1.0 / s, 1.0 / s, s);
        for _ in 0..10_000 {
            ap += 1.0;
            term *= x / ap;
            sum += term;
            if term.abs() < sum.abs() * 1e-16 {
                break;
            }
        }
        1.0 - sum * log_prefactor.exp()
    } else {
        let tiny = 1e-300;
        let mut b = x + 1.0 - s;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - s);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let delta = d * c;
            h *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        h * log_prefactor.exp()
    }
}

/// Upper-tail p-value of a chi-square statistic with `df` degrees of freedom: `Q(df / 2, stat / 2)`.
pub fn chi_square_p_value(stat: f64, df: usize) -> f64 {
    gamma_q(df as f64 / 2.0, stat / 2.0)
}

/// Deliberately lossy verifiers, to show that the statistical tests can fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BiasedVerifier {
    /// Accepts the first drafted child whose target probability is positive; samples the next token from the
    /// untouched target distribution at the last accepted node.
    AcceptIfPossible,
    /// The correct acceptance test, but the correction after rejections is drawn from the untouched target
    /// distribution instead of the residual (the classic bug: rejected tokens come back).
    NoResidual,
}

impl BiasedVerifier {
    /// Verifies like [`tlt_spec_decode::verify_sampling`]'s signature, but wrongly.
    pub fn verify<R: AsRef<[f32]>>(
        self,
        tree: &DraftTree,
        rows: &[R],
        proposal: Proposal<'_>,
        params: &SamplingParams,
        rng: &mut SeededRng,
    ) -> Result<Accepted> {
        let mut path = vec![0];
        let mut cur = 0;
        'descend: loop {
            let p = probs(rows[cur].as_ref(), params)?;
            for &child in tree.children(cur)? {
                let t = tree.nodes()[child].token as usize;
                let accept = match self {
                    BiasedVerifier::AcceptIfPossible => p[t] > 0.0,
                    BiasedVerifier::NoResidual => {
                        let q = match proposal {
                            Proposal::PointMass => 1.0,
                            Proposal::Iid(q) | Proposal::WithoutReplacement(q) => q[cur][t] as f64,
                        };
                        rng.uniform() * q < p[t] as f64
                    }
                };
                if accept {
                    path.push(child);
                    cur = child;
                    continue 'descend;
                }
            }
            let next = categorical(&p, rng.uniform())? as u32;
            return Ok(Accepted { path, next_token: next });
        }
    }
}

/// In the [`Engine`](tlt_spec_decode::Engine), biased verifiers see deterministic drafts.
impl Verifier for BiasedVerifier {
    fn verify(&self, tree: &DraftTree, rows: &[&[f32]], params: &SamplingParams, coins: &Coins) -> Result<Accepted> {
        BiasedVerifier::verify(*self, tree, rows, Proposal::PointMass, params, &mut coins.sequential())
    }
}
