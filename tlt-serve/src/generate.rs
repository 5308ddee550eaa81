//! SGLang's `/generate` (not streamed; [`crate::stream`] streams it) and OpenAI's `/v1/completions`: a request
//! checked into prompts and sampling, queued, and its outputs shaped as each client reads them.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::Response;
use axum::Json;

use crate::api::{
    check_ids, finish_kind, Choice, ChoiceLogprobs, CompletionRequest, CompletionResponse, FinishReason,
    GenerateRequest, GenerateResponse, MetaInfo, Prompt, Sampling,
};
use crate::reply::{answer, unix_seconds, usage};
use crate::state::AppState;
use crate::stats::Stats;
use crate::worker::Output;
use crate::Error;

/// One prompt of a `/generate` request, checked: its request id, token ids and sampling.
pub(crate) type Prepared = (String, Vec<u32>, Sampling);

/// A `/generate` request checked: each prompt's id, ids and sampling (with a fresh coin stream when unseeded), and
/// whether it was a batch.
pub(crate) fn prepare_generate(s: &AppState, req: &GenerateRequest) -> crate::Result<(Vec<Prepared>, bool)> {
    req.check_unserved()?;
    let sampling = req.sampling_params.validate(&s.limits)?;
    if !sampling.stop_strings.is_empty() && s.tokenizer.is_none() {
        let reason = "this model has no tokenizer to match stop strings with: use stop_token_ids";
        return Err(Error::Invalid { field: "sampling_params.stop".into(), reason: reason.into() });
    }
    let (field, prompts, batched) = match (&req.input_ids, &req.text) {
        (Some(ids), None) => {
            let (items, batched) = ids.items();
            ("input_ids", items.into_iter().cloned().collect::<Vec<_>>(), batched)
        }
        (None, Some(text)) => {
            let (items, batched) = text.items();
            let ids = items.iter().map(|t| s.tokenize("text", t)).collect::<crate::Result<Vec<_>>>()?;
            ("text", ids, batched)
        }
        _ => {
            return Err(Error::Invalid {
                field: "input_ids".into(),
                reason: "give exactly one of text and input_ids".into(),
            })
        }
    };
    if prompts.is_empty() {
        return Err(Error::Invalid { field: field.into(), reason: "an empty batch".into() });
    }
    s.check_batch(field, prompts.len())?;
    let rids: Vec<Option<String>> = match &req.rid {
        None => vec![None; prompts.len()],
        Some(r) => {
            let (items, many) = r.items();
            if many != batched || items.len() != prompts.len() {
                let reason = format!("{} ids for {} prompts", items.len(), prompts.len());
                return Err(Error::Invalid { field: "rid".into(), reason });
            }
            items.into_iter().cloned().map(Some).collect()
        }
    };
    let mut out = Vec::with_capacity(prompts.len());
    for (i, (ids, rid)) in prompts.iter().zip(rids).enumerate() {
        let name = if batched { format!("{field}[{i}]") } else { field.to_owned() };
        let prompt = check_ids(&name, ids, sampling.max_new_tokens, &s.limits)?;
        let mut sampling = sampling.clone();
        if sampling.seed.is_none() {
            sampling.stream = s.fresh_streams(1);
        }
        out.push((rid.unwrap_or_else(|| s.id("")), prompt, sampling));
    }
    Ok((out, batched))
}

/// SGLang's answer for `out`; `finished` false: a streamed partial answer (finish reason null).
pub(crate) fn generate_response(
    s: &AppState,
    req: &GenerateRequest,
    rid: &str,
    out: &Output,
    finished: bool,
) -> GenerateResponse {
    let text = |t: u32| req.return_text_in_logprobs.then(|| s.detokenize_with(&[t], false));
    let logprobs =
        req.return_logprob.then(|| out.logprobs.iter().zip(&out.tokens).map(|(&l, &t)| (l, t, text(t))).collect());
    let stop = req.sampling_params.stop_strings().unwrap_or_default();
    let mut text = s.detokenize_with(&out.tokens, req.sampling_params.skip_special_tokens.unwrap_or(true));
    // SGLang's trim: the text ends before the first occurrence of the stop string that ended it.
    if let (true, tlt_spec_decode::FinishReason::StopString { index }) = (finished, out.reason) {
        let at = stop.get(index).and_then(|m| text.find(m.as_str()));
        if let (Some(at), false) = (at, req.sampling_params.no_stop_trim.unwrap_or(false)) {
            text.truncate(at);
        }
    }
    GenerateResponse {
        text,
        meta_info: MetaInfo {
            id: rid.to_owned(),
            finish_reason: finished.then(|| FinishReason::of(out.reason, out.tokens.last().copied(), &stop)),
            prompt_tokens: out.prompt_tokens,
            completion_tokens: out.tokens.len(),
            cached_tokens: 0,
            weight_version: out.weight_version.to_string(),
            output_token_logprobs: logprobs,
            spec_verify_ct: out.spec_rounds,
            spec_accept_token_num: out.spec_accepted,
            spec_draft_token_num: out.spec_drafted,
        },
        output_ids: out.tokens.clone(),
    }
}

/// `/generate`'s answer: one, or a list for a batch.
#[derive(serde::Serialize)]
#[serde(untagged)]
pub(crate) enum GenerateAnswer {
    One(Box<GenerateResponse>),
    Many(Vec<GenerateResponse>),
}

pub(crate) async fn run_generate(s: &AppState, req: GenerateRequest) -> crate::Result<GenerateAnswer> {
    let (items, batched) = prepare_generate(s, &req)?;
    // Every prompt of a batch is queued before any is awaited (the engine batches them), or none is.
    s.reserve(items.len())?;
    let mut pending = Vec::with_capacity(items.len());
    let total = items.len();
    for (k, (rid, prompt, sampling)) in items.into_iter().enumerate() {
        match s.send_reserved(Some(rid.clone()), prompt, sampling, None) {
            Ok(rx) => pending.push((rx, rid)),
            Err(e) => {
                Stats::sub(&s.stats.waiting, (total - k - 1) as u64);
                return Err(e);
            }
        }
    }
    let mut answers = Vec::with_capacity(pending.len());
    for (rx, rid) in pending {
        let out = rx.await.map_err(|_| Error::Stopped)??;
        answers.push(generate_response(s, &req, &rid, &out, true));
    }
    match answers.pop() {
        Some(one) if !batched => Ok(GenerateAnswer::One(Box::new(one))),
        last => Ok(GenerateAnswer::Many(answers.into_iter().chain(last).collect())),
    }
}

pub(crate) async fn completions(
    State(s): State<Arc<AppState>>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Response {
    answer(s, body, run_completion).await
}

async fn run_completion(s: &AppState, req: CompletionRequest) -> crate::Result<CompletionResponse> {
    let sampling = req.validate(&s.limits)?;
    let n = req.options.samples()?;
    let batched = matches!(req.prompt, crate::api::Prompts::Many(_));
    let mut prompts = Vec::new();
    for (i, p) in req.prompts().into_iter().enumerate() {
        let field = if batched { format!("prompt[{i}]") } else { "prompt".into() };
        let ids = match p {
            Prompt::Ids(ids) => ids.clone(),
            Prompt::Text(text) => s.tokenize(&field, text)?,
        };
        prompts.push(check_ids(&field, &ids, sampling.max_new_tokens, &s.limits)?);
    }
    let id = s.id("cmpl-");
    let outs = s.submit_batch(&prompts, n, &sampling, &id).await?;
    let usage = usage(&outs);
    let token = |t: u32| if req.return_tokens_as_token_ids { format!("token_id:{t}") } else { s.detokenize(&[t]) };
    let mut choices = Vec::with_capacity(outs.len());
    for (index, out) in outs.into_iter().enumerate() {
        let logprobs = req.logprobs.map(|k| {
            let tokens: Vec<String> = out.tokens.iter().map(|&t| token(t)).collect();
            let top = (k == 0).then(|| {
                tokens.iter().zip(&out.logprobs).map(|(t, &l)| std::iter::once((t.clone(), l)).collect()).collect()
            });
            ChoiceLogprobs { tokens, token_logprobs: out.logprobs.clone(), top_logprobs: top }
        });
        choices.push(Choice {
            index,
            text: s.detokenize(&out.tokens),
            finish_reason: finish_kind(out.reason).into(),
            logprobs,
            prompt_token_ids: req.return_token_ids.then(|| prompts[index / n].clone()),
            token_ids: req.return_token_ids.then_some(out.tokens),
        });
    }
    Ok(CompletionResponse {
        id,
        object: "text_completion".into(),
        created: unix_seconds(),
        model: s.answer_model(req.options.model.as_deref()),
        choices,
        usage,
    })
}
