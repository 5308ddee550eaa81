//! Every way of running the same tokens through the model gives the same logits: one token at a time,
//! prefill (whole or chunked), batched ragged decode and tree verification + commit give the same bits (the
//! inference forward is position- and batch-invariant); the (independent) training forward agrees to `TOL`.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use candle_core::{Device, Tensor};
use proptest::prelude::*;
use tlt_model::{KvCache, Llama, LlamaConfig, LogitsFor, SeqId, SeqInput, Tap};

const TOL: f32 = 1e-4;

fn tiny() -> Llama {
    let mut cfg = LlamaConfig::tiny(48, 64, 3);
    cfg.intermediate_size = 96;
    Llama::random(cfg, 7).expect("tiny model")
}

fn qwen_tiny() -> Llama {
    let mut cfg = LlamaConfig::tiny(40, 32, 2);
    cfg.model_type = "qwen2".into();
    cfg.tie_word_embeddings = true;
    Llama::random(cfg, 11).expect("tiny qwen model")
}

/// Qwen3: q/k head norms, a head_dim decoupled from the width (4 heads of 16 in 32), tied head.
fn qwen3_tiny() -> Llama {
    let mut cfg = LlamaConfig::tiny(48, 32, 2);
    cfg.model_type = "qwen3".into();
    cfg.head_dim = Some(16);
    cfg.tie_word_embeddings = true;
    Llama::random(cfg, 13).expect("tiny qwen3 model")
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_vec2::<f32>().expect("2-D logits")
}

/// Whether two logit rows are the same bits.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Logits after each token, feeding one token per forward.
fn one_at_a_time(model: &Llama, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let seq = cache.add_sequence();
    tokens.iter().map(|&t| rows(&model.decode(&mut cache, &[(seq, t)]).unwrap()).remove(0)).collect()
}

fn all_logits(model: &Llama, cache: &mut KvCache, seq: SeqId, tokens: &[u32]) -> Vec<Vec<f32>> {
    let input = SeqInput { seq, tokens, tree: None, logits: LogitsFor::All };
    rows(&model.forward(cache, &[input], &[]).unwrap().logits)
}

fn check_paths_agree(model: &Llama) {
    // 70 tokens: the chunks and decode steps start inside, at and across the attention's key tiles.
    let tokens: Vec<u32> = (0..70).map(|i| (i * 7 + 3) % model.config().vocab_size as u32).collect();
    let reference = one_at_a_time(model, &tokens);

    // Prefill in one forward (all logits) and in two chunks.
    let mut cache = model.new_cache();
    let seq = cache.add_sequence();
    let full = all_logits(model, &mut cache, seq, &tokens);
    let mut cache2 = model.new_cache();
    let seq2 = cache2.add_sequence();
    let mut chunked = all_logits(model, &mut cache2, seq2, &tokens[..5]);
    chunked.extend(all_logits(model, &mut cache2, seq2, &tokens[5..33]));
    chunked.extend(all_logits(model, &mut cache2, seq2, &tokens[33..]));
    for i in 0..tokens.len() {
        assert!(same_bits(&reference[i], &full[i]), "prefill position {i}");
        assert!(same_bits(&reference[i], &chunked[i]), "chunked prefill position {i}");
    }

    // Training forward: an independent implementation on candle ops.
    let ids = Tensor::from_slice(&tokens, (1, tokens.len()), &Device::Cpu).unwrap();
    let train = model.forward_train(&ids).unwrap().squeeze(0).unwrap();
    for (i, row) in rows(&train).iter().enumerate() {
        assert!(max_diff(&reference[i], row) <= TOL, "training forward position {i}");
    }
}

#[test]
fn llama_paths_agree() {
    check_paths_agree(&tiny());
}

#[test]
fn qwen2_with_bias_and_tied_head_paths_agree() {
    check_paths_agree(&qwen_tiny());
}

#[test]
fn qwen3_with_qk_norm_and_decoupled_head_dim_paths_agree() {
    check_paths_agree(&qwen3_tiny());
}

#[test]
fn batched_ragged_decode_matches_single_sequences() {
    let model = tiny();
    let prompts: [&[u32]; 3] = [&[1, 2, 3, 4, 5, 6, 7], &[9], &[10, 11, 12, 13]];
    let continuation: [[u32; 4]; 3] = [[20, 21, 22, 23], [30, 31, 32, 33], [40, 41, 42, 43]];
    let mut cache = model.new_cache();
    let seqs: Vec<SeqId> = prompts.iter().map(|_| cache.add_sequence()).collect();
    let prefill: Vec<SeqInput> = seqs
        .iter()
        .zip(prompts)
        .map(|(&seq, tokens)| SeqInput { seq, tokens, tree: None, logits: LogitsFor::Last })
        .collect();
    let out = model.forward(&mut cache, &prefill, &[]).unwrap();
    let first = rows(&out.logits);
    let mut batched: Vec<Vec<Vec<f32>>> = first.into_iter().map(|r| vec![r]).collect();
    for step in 0..4 {
        let batch: Vec<(SeqId, u32)> = seqs.iter().zip(&continuation).map(|(&s, c)| (s, c[step])).collect();
        for (k, r) in rows(&model.decode(&mut cache, &batch).unwrap()).into_iter().enumerate() {
            batched[k].push(r);
        }
    }
    for k in 0..3 {
        let all: Vec<u32> = prompts[k].iter().chain(&continuation[k]).copied().collect();
        let reference = one_at_a_time(&model, &all);
        for (j, got) in batched[k].iter().enumerate() {
            let pos = prompts[k].len() - 1 + j;
            assert!(same_bits(&reference[pos], got), "sequence {k} position {pos}");
        }
    }
}

/// Batch invariance: a sequence decoded beside 129 others (past the 64 rows where linears once switched to candle's
/// GEMM) gets the same logit bits as decoded alone; so does its prefill beside other prompts.
#[test]
fn a_sequences_logits_are_the_same_bits_in_any_batch() {
    let model = tiny();
    let prompt: &[u32] = &[3, 1, 4, 1, 5, 9, 2, 6];
    let next = [7u32, 11, 13];
    let bits =
        |t: &Tensor| -> Vec<Vec<u32>> { rows(t).iter().map(|r| r.iter().map(|v| v.to_bits()).collect()).collect() };
    // Alone.
    let mut cache = model.new_cache();
    let seq = cache.add_sequence();
    let mut alone = vec![bits(&model.prefill(&mut cache, seq, prompt).unwrap().unsqueeze(0).unwrap())[0].clone()];
    for &t in &next {
        alone.push(bits(&model.decode(&mut cache, &[(seq, t)]).unwrap())[0].clone());
    }
    // Beside 129 other sequences with prompts of their own, prefilled in the same forward.
    let others: Vec<Vec<u32>> = (0..129u32).map(|i| (0..1 + i % 9).map(|j| (i * 7 + j * 3) % 48).collect()).collect();
    let mut cache = model.new_cache();
    let seqs: Vec<SeqId> = (0..130).map(|_| cache.add_sequence()).collect();
    let inputs: Vec<SeqInput> = std::iter::once(prompt)
        .chain(others.iter().map(Vec::as_slice))
        .zip(&seqs)
        .map(|(tokens, &seq)| SeqInput { seq, tokens, tree: None, logits: LogitsFor::Last })
        .collect();
    let mut batched = vec![bits(&model.forward(&mut cache, &inputs, &[]).unwrap().logits)[0].clone()];
    for &t in &next {
        let batch: Vec<(SeqId, u32)> = seqs.iter().enumerate().map(|(i, &s)| (s, if i == 0 { t } else { 5 })).collect();
        batched.push(bits(&model.decode(&mut cache, &batch).unwrap())[0].clone());
    }
    for (step, (a, b)) in alone.iter().zip(&batched).enumerate() {
        assert!(a == b, "step {step}: the logits depend on the batch");
    }
}

#[test]
fn taps_expose_layer_inputs_and_final_norm() {
    let model = tiny();
    let mut cache = model.new_cache();
    let seq = cache.add_sequence();
    let taps = [Tap::LayerInput(0), Tap::LayerInput(3), Tap::FinalNorm];
    let input = SeqInput { seq, tokens: &[5, 6, 7], tree: None, logits: LogitsFor::All };
    let out = model.forward(&mut cache, &[input], &taps).unwrap();
    assert_eq!(out.taps.len(), 3);
    // Layer 0's input is the embedding.
    let emb = model.weights().embed_tokens.get(6).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(rows(&out.taps[0])[1], emb);
    // The LM head applied to the final-norm tap reproduces the logits.
    let head = model.weights().lm_head().t().unwrap();
    let relogits = out.taps[2].matmul(&head).unwrap();
    assert!(max_diff(&rows(&relogits).concat(), &rows(&out.logits).concat()) <= TOL);
    assert_eq!(Tap::eagle3(30), [Tap::LayerInput(2), Tap::LayerInput(15), Tap::LayerInput(27), Tap::FinalNorm]);
    assert!(model
        .forward(
            &mut cache,
            &[SeqInput { seq, tokens: &[1], tree: None, logits: LogitsFor::Last }],
            &[Tap::LayerInput(4)]
        )
        .is_err());
}

#[test]
fn bad_inputs_are_errors_and_leave_the_cache_untouched() {
    let model = tiny();
    let mut cache = model.new_cache();
    let seq = cache.add_sequence();
    model.prefill(&mut cache, seq, &[1, 2]).unwrap();
    let bad_token = SeqInput { seq, tokens: &[1, 1000], tree: None, logits: LogitsFor::Last };
    assert!(model.forward(&mut cache, &[bad_token], &[]).is_err());
    let bad_tree = SeqInput { seq, tokens: &[1, 2], tree: Some(&[Some(1), None]), logits: LogitsFor::All };
    assert!(model.forward(&mut cache, &[bad_tree], &[]).is_err());
    let empty = SeqInput { seq, tokens: &[], tree: None, logits: LogitsFor::Last };
    assert!(model.forward(&mut cache, &[empty], &[]).is_err());
    let twice = SeqInput { seq, tokens: &[3], tree: None, logits: LogitsFor::Last };
    assert!(model.forward(&mut cache, &[twice, twice], &[]).is_err());
    assert!(model.decode(&mut cache, &[(SeqId(9), 1)]).is_err());
    assert_eq!(cache.len(seq).unwrap(), 2);
    model.verify_tree(&mut cache, seq, &[3, 4], &[None, Some(0)]).unwrap();
    assert!(matches!(model.decode(&mut cache, &[(seq, 1)]), Err(tlt_model::Error::PendingTree(_))));
    cache.commit(seq, &[]).unwrap();
    assert_eq!(cache.len(seq).unwrap(), 2);
}

/// A random tree: node `i`'s parent is a random earlier node or `None` (attached to the prefix).
fn tree_strategy(max_nodes: usize) -> impl Strategy<Value = Vec<Option<usize>>> {
    prop::collection::vec(any::<prop::sample::Index>(), 1..=max_nodes).prop_map(|picks| {
        picks.iter().enumerate().map(|(i, pick)| if i == 0 { None } else { pick.index(i + 1).checked_sub(1) }).collect()
    })
}

fn path_to(parents: &[Option<usize>], node: usize) -> Vec<usize> {
    let mut path = vec![node];
    while let Some(p) = parents[*path.last().expect("non-empty")] {
        path.push(p);
    }
    path.reverse();
    path
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Verify a random tree, commit a random root-to-node path, then decode on: every logit is the bits of plain
    /// sequential decoding of prefix + path (+ next token), with prefixes that end before, at and across the
    /// attention's key tiles. Llama or Qwen3 (q/k head norms).
    #[test]
    fn tree_verify_and_commit_match_sequential(
        qwen3 in any::<bool>(),
        parents in tree_strategy(10),
        tokens in prop::collection::vec(0u32..48, 10),
        prefix_len in 1usize..70,
        pick in any::<prop::sample::Index>(),
        next in 0u32..48,
    ) {
        let model = if qwen3 { qwen3_tiny() } else { tiny() };
        let prefix: Vec<u32> = (0..prefix_len as u32).map(|i| (i * 5 + 1) % 48).collect();
        let n = parents.len();
        let tree_tokens = &tokens[..n];
        let mut cache = model.new_cache();
        let seq = cache.add_sequence();
        model.prefill(&mut cache, seq, &prefix).unwrap();
        let logits = rows(&model.verify_tree(&mut cache, seq, tree_tokens, &parents).unwrap());

        // Every node's logits equal sequential decoding of prefix + its root path.
        for (node, node_logits) in logits.iter().enumerate().take(n) {
            let path = path_to(&parents, node);
            let seqtoks: Vec<u32> = prefix.iter().copied().chain(path.iter().map(|&j| tree_tokens[j])).collect();
            let reference = one_at_a_time(&model, &seqtoks);
            prop_assert!(same_bits(reference.last().unwrap(), node_logits), "node {}", node);
        }

        let path = path_to(&parents, pick.index(n));
        cache.commit(seq, &path).unwrap();
        prop_assert_eq!(cache.len(seq).unwrap(), prefix_len + path.len());
        let after = rows(&model.decode(&mut cache, &[(seq, next)]).unwrap()).remove(0);
        let seqtoks: Vec<u32> = prefix.iter().copied().chain(path.iter().map(|&j| tree_tokens[j])).chain([next]).collect();
        let reference = one_at_a_time(&model, &seqtoks);
        prop_assert!(same_bits(reference.last().unwrap(), &after));

        // Rolling back to the prefix and decoding again matches too.
        cache.truncate(seq, prefix_len).unwrap();
        let again = rows(&model.decode(&mut cache, &[(seq, next)]).unwrap()).remove(0);
        let seqtoks: Vec<u32> = prefix.iter().copied().chain([next]).collect();
        prop_assert!(same_bits(one_at_a_time(&model, &seqtoks).last().unwrap(), &again));
    }
}

#[test]
fn packed_inference_weights_track_f32() {
    // Q8_0 needs k % 32 == 0: hidden 64, ffn 96.
    let reference = tiny();
    let tokens = [3u32, 9, 27, 1, 40, 5, 8, 13, 21, 34, 2, 44];
    let want = one_at_a_time(&reference, &tokens);
    let scale = want.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    // Tolerance relative to the largest logit: half precision, 8-bit and 4-bit weights (random 4-bit weights
    // compound through the layers; a layout bug would still give errors of the order of the logits).
    for (dtype, rel) in
        [(tlt_model::WeightDType::F16, 2e-3), (tlt_model::WeightDType::Q8_0, 2e-2), (tlt_model::WeightDType::Q4_0, 0.5)]
    {
        let tol = rel * scale;
        let mut model = reference.clone();
        model.pack_for_inference(dtype).unwrap();
        assert_eq!(model.inference_dtype(), dtype);
        assert!(model.weight_bytes_per_token() < reference.weight_bytes_per_token());
        let got = one_at_a_time(&model, &tokens);
        for (a, b) in want.iter().zip(&got) {
            assert!(max_diff(a, b) <= tol, "{dtype:?}: {} > {tol}", max_diff(a, b));
        }
        // Every path is the same bits as another under packed weights too (a prefill's many rows convert the
        // weights into f32 panels, a decode step's one row converts them in registers).
        let mut cache = model.new_cache();
        let seq = cache.add_sequence();
        let full = all_logits(&model, &mut cache, seq, &tokens);
        for (a, b) in got.iter().zip(&full) {
            assert!(same_bits(a, b), "{dtype:?} prefill vs decode");
        }
    }
    let mut model = reference.clone();
    model.pack_for_inference(tlt_model::WeightDType::Q8_0).unwrap();
    model.make_trainable().unwrap();
    assert_eq!(model.inference_dtype(), tlt_model::WeightDType::F32, "training drops stale packs");
}
