//! Greedy speculative decoding end to end against a toy target: it must reproduce plain greedy decoding, accept
//! everything when the drafter is the target, and commit exactly one token per round when the drafter is
//! always wrong.

mod common;

use common::{target_logits, VOCAB};
use tlt_kernels::argmax;
use tlt_spec_decode::{verify_greedy, DraftTree, NgramDrafter, Plan};

const PROMPT: [u32; 3] = [1, 4, 2];
const NEW_TOKENS: usize = 40;

fn greedy_next(ctx: &[u32]) -> u32 {
    argmax(&target_logits(ctx)).expect("valid") as u32
}

/// Plain greedy decoding of `NEW_TOKENS` tokens.
fn plain_greedy() -> Vec<u32> {
    let mut ctx = PROMPT.to_vec();
    while ctx.len() < PROMPT.len() + NEW_TOKENS {
        ctx.push(greedy_next(&ctx));
    }
    ctx
}

/// Speculative greedy decoding with trees from `draft`; returns the sequence and the tokens committed per round.
fn speculative(mut draft: impl FnMut(&[u32]) -> DraftTree) -> (Vec<u32>, Vec<usize>) {
    let mut ctx = PROMPT.to_vec();
    let mut per_round = Vec::new();
    while ctx.len() < PROMPT.len() + NEW_TOKENS {
        let tree = draft(&ctx);
        let rows = common::target_rows(&ctx, &tree);
        let acc = verify_greedy(&tree, &rows).expect("valid");
        let committed = acc.committed_tokens(&tree).expect("valid");
        per_round.push(committed.len());
        ctx.extend(committed);
    }
    ctx.truncate(PROMPT.len() + NEW_TOKENS);
    (ctx, per_round)
}

#[test]
fn drafter_equal_to_target_is_fully_accepted() {
    let steps = 4;
    let (seq, per_round) = speculative(|ctx| {
        let mut c = ctx.to_vec();
        let mut d = Vec::new();
        for _ in 0..steps {
            let t = greedy_next(&c);
            d.push(t);
            c.push(t);
        }
        DraftTree::chain(*ctx.last().expect("non-empty"), &d)
    });
    assert_eq!(seq, plain_greedy());
    assert!(per_round.iter().all(|&n| n == steps + 1), "{per_round:?}");
}

#[test]
fn eagle2_tree_from_the_target_itself_always_accepts() {
    // With the target as drafter (log-softmax as draft log-probs), the root's argmax child has the best score
    // of the whole tree (deeper nodes score at most their level-1 ancestor), so it is always kept and accepted.
    let plan = Plan { steps: 3, top_k: 2, verify_tokens: 6 };
    let (seq, per_round) = speculative(|ctx| {
        DraftTree::eagle2(*ctx.last().expect("non-empty"), &plan, |path: &[u32]| {
            let mut c = ctx.to_vec();
            c.extend_from_slice(&path[1..]);
            let lp = tlt_kernels::log_softmax(&target_logits(&c)).expect("valid");
            lp.into_iter().enumerate().map(|(t, l)| (t as u32, l)).collect()
        })
        .expect("valid")
    });
    assert_eq!(seq, plain_greedy());
    assert!(per_round.iter().all(|&n| n >= 2), "{per_round:?}");
    // Deeper greedy nodes are usually kept too.
    let mean = per_round.iter().sum::<usize>() as f64 / per_round.len() as f64;
    assert!(mean > 2.5, "{per_round:?}");
}

#[test]
fn always_wrong_drafter_commits_one_token_per_round() {
    let (seq, per_round) = speculative(|ctx| {
        // Every node proposes all tokens except the target's argmax (a chain of wrong guesses plus siblings).
        let mut t = DraftTree::new(*ctx.last().expect("non-empty"));
        let right = greedy_next(ctx);
        for tok in (0..VOCAB as u32).filter(|&x| x != right) {
            let c = t.push_child(0, tok, -1.0).expect("valid");
            t.push_child(c, 0, -1.0).expect("valid");
        }
        t
    });
    assert_eq!(seq, plain_greedy());
    assert_eq!(per_round, vec![1; NEW_TOKENS]);
}

#[test]
fn ngram_drafting_reproduces_greedy() {
    let drafter = NgramDrafter::default();
    let plan = Plan { steps: 4, top_k: 2, verify_tokens: 8 };
    let (seq, per_round) = speculative(|ctx| drafter.propose(ctx, &plan).expect("valid"));
    assert_eq!(seq, plain_greedy());
    // The toy target's greedy output is periodic (a function of the last two tokens over 8 symbols), so prompt
    // lookup must eventually accept drafts.
    assert!(per_round.len() < NEW_TOKENS, "{per_round:?}");
}
