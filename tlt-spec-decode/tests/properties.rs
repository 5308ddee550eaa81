//! Property tests of tree construction and verification.

mod common;

use std::collections::HashMap;
use std::sync::Mutex;

use common::mix;
use proptest::prelude::*;
use tlt_spec_decode::{
    verify_greedy, verify_sampling, DraftTree, NgramDrafter, Plan, Proposal, SamplingParams, SeededRng,
};

/// Structural invariants every tree must satisfy: parents precede children, depths follow parents, the kept
/// set is ancestor-closed (every parent is in the tree), sibling tokens are distinct, and the tree fits `plan`.
fn check_structure(t: &DraftTree, plan: &Plan, max_children: usize) {
    let parents = t.parents();
    let depths = t.depths();
    assert!(!t.is_empty() && t.len() <= plan.verify_tokens);
    assert_eq!(parents[0], None);
    assert_eq!(depths[0], 0);
    for i in 1..t.len() {
        let p = parents[i].expect("non-root nodes have a parent");
        assert!(p < i, "parent {p} of {i} does not precede it");
        assert_eq!(depths[i], depths[p] + 1);
        assert!(depths[i] <= plan.steps);
        assert!(t.children(p).expect("in range").contains(&i));
        assert!(t.is_ancestor(p, i).expect("in range") && t.is_ancestor(0, i).expect("in range"));
        let path = t.path_to(i).expect("in range");
        assert!(t.is_root_path(&path));
        assert_eq!(path.len(), depths[i] + 1);
    }
    for i in 0..t.len() {
        let kids = t.children(i).expect("in range");
        assert!(kids.len() <= max_children);
        let mut toks: Vec<u32> = kids.iter().map(|&c| t.nodes()[c].token).collect();
        toks.sort_unstable();
        toks.dedup();
        assert_eq!(toks.len(), kids.len(), "duplicate sibling tokens under {i}");
    }
}

/// A random drafter callback: 0..6 candidates over tokens 0..12 (duplicates possible), log-probs in [-6, 0).
fn random_candidates(seed: u64, path: &[u32]) -> Vec<(u32, f32)> {
    let mut key: Vec<u64> = vec![seed];
    key.extend(path.iter().map(|&t| t as u64));
    let h = mix(&key);
    let n = (h % 6) as usize;
    (0..n as u64)
        .map(|j| {
            let g = mix(&[h, j]);
            ((g % 12) as u32, -6.0 * ((g >> 32) as f32 / (1u64 << 32) as f32) - 1e-3)
        })
        .collect()
}

fn plan_strategy() -> impl Strategy<Value = Plan> {
    (1usize..6, 1usize..5).prop_flat_map(|(steps, top_k)| {
        let max = Plan { steps, top_k, verify_tokens: 1 }.max_tree_nodes();
        (1..=max).prop_map(move |verify_tokens| Plan { steps, top_k, verify_tokens })
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// EAGLE-2 trees: structure, frontier selection and reranking checked against the callback's own record.
    #[test]
    fn eagle2_trees_are_well_formed(plan in plan_strategy(), seed in any::<u64>(), root in 0u32..12) {
        let calls: Mutex<Vec<Vec<u32>>> = Mutex::new(Vec::new());
        let t = DraftTree::eagle2(root, &plan, |path: &[u32]| {
            calls.lock().expect("unpoisoned").push(path.to_vec());
            random_candidates(seed, path)
        }).expect("valid");
        check_structure(&t, &plan, plan.top_k);
        prop_assert!(t.max_depth() <= plan.steps);

        // Reconstruct every scored node (path -> score) from the calls, as EAGLE-2 defines them.
        let calls = calls.into_inner().expect("unpoisoned");
        let mut score: HashMap<Vec<u32>, f32> = HashMap::new();
        score.insert(vec![root], 0.0);
        for path in &calls {
            let base = score[path];
            let mut c = random_candidates(seed, path);
            c.sort_by(|a, b| b.1.total_cmp(&a.1));
            let mut seen = Vec::new();
            for (tok, lp) in c {
                if seen.len() == plan.top_k { break; }
                if seen.contains(&tok) { continue; }
                seen.push(tok);
                let mut p = path.clone();
                p.push(tok);
                score.insert(p, base + lp);
            }
        }
        // The beams expanded at each depth are the best top_k scored nodes of that depth.
        for d in 1..plan.steps {
            let mut level: Vec<f32> = score.iter().filter(|(p, _)| p.len() == d + 1).map(|(_, &s)| s).collect();
            level.sort_by(|a, b| b.total_cmp(a));
            let expanded: Vec<f32> = calls.iter().filter(|p| p.len() == d + 1).map(|p| score[p]).collect();
            prop_assert_eq!(expanded.len(), level.len().min(plan.top_k));
            if let Some(worst) = expanded.iter().copied().reduce(f32::min) {
                prop_assert!(level.get(plan.top_k).is_none_or(|&s| s <= worst));
            }
        }
        // The kept nodes are scored nodes with their recorded scores, and the best ones.
        let mut kept: Vec<Vec<u32>> = Vec::new();
        for i in 0..t.len() {
            let toks: Vec<u32> = t.path_to(i).expect("in range").iter().map(|&n| t.nodes()[n].token).collect();
            let s = *score.get(&toks).expect("kept node was scored");
            prop_assert!((s - t.nodes()[i].score).abs() < 1e-4);
            kept.push(toks);
        }
        prop_assert_eq!(t.len(), plan.verify_tokens.min(score.len()));
        let min_kept = kept[1..].iter().map(|p| score[p]).fold(f32::INFINITY, f32::min);
        let max_dropped = score.iter().filter(|(p, _)| !kept.contains(p)).map(|(_, &s)| s).fold(f32::NEG_INFINITY, f32::max);
        prop_assert!(max_dropped <= min_kept, "dropped {} > kept {}", max_dropped, min_kept);
        // Siblings in proposal order: non-increasing score.
        for i in 0..t.len() {
            let s: Vec<f32> = t.children(i).expect("in range").iter().map(|&c| t.nodes()[c].score).collect();
            prop_assert!(s.windows(2).all(|w| w[0] >= w[1]));
        }
    }

    /// Greedy verification returns a maximal root path of argmax matches.
    #[test]
    fn greedy_path_is_valid(plan in plan_strategy(), seed in any::<u64>()) {
        let t = DraftTree::eagle2(0, &plan, |path: &[u32]| random_candidates(seed, path)).expect("valid");
        let rows: Vec<Vec<f32>> = (0..t.len())
            .map(|i| (0..12u64).map(|v| (mix(&[seed, i as u64, v]) % 7) as f32).collect())
            .collect();
        let a = verify_greedy(&t, &rows).expect("valid");
        prop_assert!(t.is_root_path(&a.path));
        prop_assert!(a.path.len() <= plan.steps + 1);
        let argmax = |r: &[f32]| tlt_kernels::argmax(r).expect("valid") as u32;
        for w in a.path.windows(2) {
            prop_assert_eq!(t.nodes()[w[1]].token, argmax(&rows[w[0]]));
        }
        let last = *a.path.last().expect("non-empty");
        prop_assert_eq!(a.next_token, argmax(&rows[last]));
        let kids = t.children(last).expect("in range");
        prop_assert!(kids.iter().all(|&c| t.nodes()[c].token != a.next_token));
        prop_assert_eq!(a.committed_tokens(&t).expect("valid").len(), a.path.len());
    }

    /// Sampling verification always returns a root path and an in-vocabulary token, for every proposal kind.
    #[test]
    fn sampling_path_is_valid(plan in plan_strategy(), seed in any::<u64>(), temp in 0.0f32..2.0) {
        let t = DraftTree::eagle2(0, &plan, |path: &[u32]| random_candidates(seed, path)).expect("valid");
        let rows: Vec<Vec<f32>> = (0..t.len())
            .map(|i| (0..12u64).map(|v| (mix(&[seed, i as u64, v]) % 7) as f32 * 0.5).collect())
            .collect();
        let q: Vec<Vec<f32>> = vec![vec![1.0; 12]; t.len()];
        let params = SamplingParams { temperature: temp, top_p: Some(0.8), ..Default::default() };
        let mut rng = SeededRng::new(seed);
        for prop in [Proposal::PointMass, Proposal::Iid(&q), Proposal::WithoutReplacement(&q)] {
            let a = verify_sampling(&t, &rows, prop, &params, &mut rng).expect("valid");
            prop_assert!(t.is_root_path(&a.path));
            prop_assert!(a.path.len() <= plan.steps + 1);
            prop_assert!(a.next_token < 12);
        }
    }

    /// Chains: shape and full greedy acceptance when the target agrees.
    #[test]
    fn chains(draft in proptest::collection::vec(0u32..10, 0..8), root in 0u32..10) {
        let t = DraftTree::chain(root, &draft);
        let plan = Plan::chain(draft.len().max(1));
        check_structure(&t, &plan, 1);
        prop_assert_eq!(t.len(), draft.len() + 1);
        let rows: Vec<Vec<f32>> = (0..t.len())
            .map(|i| {
                let want = draft.get(i).copied().unwrap_or(0) as usize;
                (0..10).map(|v| if v == want { 1.0 } else { 0.0 }).collect()
            })
            .collect();
        let a = verify_greedy(&t, &rows).expect("valid");
        prop_assert_eq!(a.path, (0..t.len()).collect::<Vec<_>>());
    }

    /// N-gram trees: well-formed, within the plan, and every root path is a continuation seen in the history.
    #[test]
    fn ngram_trees(
        history in proptest::collection::vec(0u32..4, 1..60),
        plan in plan_strategy(),
        min_n in 1usize..3,
        extra in 0usize..3,
    ) {
        let d = NgramDrafter { min_ngram: min_n, max_ngram: min_n + extra };
        let t = d.propose(&history, &plan).expect("valid");
        check_structure(&t, &plan, plan.top_k);
        prop_assert_eq!(t.root_token(), *history.last().expect("non-empty"));
        for i in 1..t.len() {
            let toks: Vec<u32> = t.path_to(i).expect("in range").iter().map(|&n| t.nodes()[n].token).collect();
            // root + continuation occurs contiguously, starting before the last position.
            let found = (0..history.len() - 1).any(|s| history[s..].starts_with(&toks));
            prop_assert!(found, "path {:?} not in history", toks);
        }
    }
}
