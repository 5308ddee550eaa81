//! Markdown rendering of `decode.json`.

use crate::bench_decode::Report;

/// The markdown summary table.
pub(crate) fn markdown(r: &Report) -> String {
    let mut s = format!(
        "# decode: tlt-model vs candle-transformers (SmolLM2-135M, f32, greedy)\n\n\
         {} prompt tokens, {} new tokens; {} ({} threads); read bandwidth {:.2} GB/s (probe on the model's thread count); \
         weights read per step {:.1} MB; commit {}; {}\n\n\
         | batch | runs | steps | ours tok/s | ours ms/step | ours prefill ms | ours GB/s | ours bw_fraction \
         | candle tok/s | candle ms/step | candle prefill ms | ratio vs candle |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        r.workload.prompt_tokens,
        r.workload.new_tokens,
        r.header.machine.cpu_model,
        r.header.machine.candle_threads,
        r.read_bandwidth_gbs,
        r.results.first().map_or(0.0, |b| b.weight_bytes_per_step as f64 / 1e6),
        r.header.git_commit,
        r.header.timestamp,
    );
    for b in &r.results {
        let (o, c) = (&b.ours, &b.candle_transformers);
        s.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.0} | {:.2} | {:.3} | {:.1} | {:.1} | {:.0} | {:.2} |\n",
            b.batch,
            b.repeats,
            b.new_tokens,
            o.tokens_per_s,
            o.ms_per_step,
            o.prefill_ms,
            o.achieved_gbs,
            o.bw_fraction,
            c.tokens_per_s,
            c.ms_per_step,
            c.prefill_ms,
            b.ratio_vs_candle_transformers
        ));
    }
    let agree = if r.sanity.tokens_match {
        format!("greedy tokens agree with candle-transformers for {} tokens at batch 1", r.sanity.tokens_compared)
    } else {
        format!("greedy tokens DISAGREE with candle-transformers at token {:?}", r.sanity.first_mismatch)
    };
    s.push_str(&format!("\nSanity: {agree}.\n"));
    if let Some(q) = &r.q8_0 {
        let o = &q.ours;
        s.push_str(
            "\n## batch 1, Q8_0 weights (tlt-model packed vs candle-transformers quantized_llama)\n\n\
             | weights | weights read per step MB | ours tok/s | ours ms/step | ours bw_fraction | candle tok/s \
             | candle ms/step | ratio vs candle |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        if let Some(f) = &r.f32_batch1 {
            let b1 = r.results.iter().find(|b| b.batch == 1);
            s.push_str(&format!(
                "| f32 | {:.1} | {:.1} | {:.1} | {:.3} | {:.1} | {:.1} | {:.2} |\n",
                f.weight_bytes_per_step as f64 / 1e6,
                f.ours_tokens_per_s,
                b1.map_or(f64::NAN, |b| b.ours.ms_per_step),
                b1.map_or(f64::NAN, |b| b.ours.bw_fraction),
                f.candle_tokens_per_s,
                b1.map_or(f64::NAN, |b| b.candle_transformers.ms_per_step),
                f.ratio_vs_candle_transformers
            ));
        }
        s.push_str(&format!(
            "| q8_0 | {:.1} | {:.1} | {:.1} | {:.3} | {:.1} | {:.1} | {:.2} |\n",
            q.pair.weight_bytes_per_step as f64 / 1e6,
            q.pair.ours_tokens_per_s,
            o.ms_per_step,
            o.bw_fraction,
            q.pair.candle_tokens_per_s,
            q.candle_transformers.ms_per_step,
            q.pair.ratio_vs_candle_transformers
        ));
        let g = &q.greedy_agreement;
        s.push_str(&format!(
            "\nQ8_0 greedy agreement over the first {} tokens: {} (informative only; the two quantize separately).\n",
            g.tokens_compared,
            match g.first_mismatch {
                None => "all agree".to_string(),
                Some(i) => format!("first difference at token {i}"),
            }
        ));
    }
    let v = &r.verify;
    s.push_str(&format!(
        "\n## verifying {} draft tokens vs one decode step (batch 1, f32, context {}, median of {})\n\n\
         | draft | ms | ÷ decode step |\n|---|---:|---:|\n| decode 1 token | {:.2} | 1.00 |\n\
         | chain of {} | {:.2} | {:.2} |\n| branching tree {:?} | {:.2} | {:.2} |\n",
        v.nodes,
        v.context,
        v.repeats,
        v.decode1_ms,
        v.nodes,
        v.chain.verify_ms,
        v.chain.verify8_over_decode1,
        v.tree.parents.iter().map(|p| p.map_or(-1, |p| p as i64)).collect::<Vec<_>>(),
        v.tree.verify_ms,
        v.tree.verify8_over_decode1,
    ));
    s
}
