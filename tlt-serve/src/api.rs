//! The wire types: SGLang's native `/generate` and OpenAI's `/v1/completions`, as their clients send and read them,
//! and their validation into a [`Job`](crate::worker::Job)'s [`Sampling`]. Every field a client may get wrong is
//! checked here, and an error names it (`sampling_params.temperature`, `input_ids[3]`).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// SGLang's `sampling_params` (the fields this server honours; others are refused rather than ignored).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingParams {
    /// Softmax temperature; 0 is greedy. Default 1.
    pub temperature: Option<f64>,
    /// Nucleus mass in `(0, 1]`. Default 1.
    pub top_p: Option<f64>,
    /// Most probable tokens kept; `-1` (SGLang's "off") or absent: all.
    pub top_k: Option<i64>,
    /// New tokens at most. Default 128 (SGLang's).
    pub max_new_tokens: Option<u64>,
    /// Tokens that end a request (kept in its output), besides the model's end of sequence unless `ignore_eos`.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Do not stop at the model's end-of-sequence token.
    pub ignore_eos: Option<bool>,
    /// Seed of the request's sampling stream (absent: a fresh stream per request).
    pub sampling_seed: Option<u64>,
    /// Stop strings: a string or a list of them (absent, null or empty: none). The answer ends at the token whose
    /// text completes one (kept in `output_ids` and its log-probs); finish reason `{"type": "stop", "matched":
    /// <the string>}`; `text` is cut before the string's first occurrence unless `no_stop_trim`. Needs a
    /// tokenizer; at most [`MAX_STOP_STRINGS`] strings of at most [`MAX_STOP_BYTES`] bytes.
    pub stop: Option<serde_json::Value>,
    /// Decode `text` without special tokens. Default true (SGLang's).
    pub skip_special_tokens: Option<bool>,
    /// Keep a matched stop string in `text` (default false: `text` ends before it). Stop tokens are kept either
    /// way: `output_ids` end with the stop token that ended them.
    pub no_stop_trim: Option<bool>,
    /// SGLang's detokenization switch: accepted either way (`text` is the tokenizer's own decoding).
    pub spaces_between_special_tokens: Option<bool>,
    /// Samples per request: 1 only (send a request per sample; same-prompt requests share their prefill).
    pub n: Option<u64>,
    /// 0 only (not implemented otherwise).
    pub min_new_tokens: Option<u64>,
    /// 0 only (not implemented otherwise).
    pub frequency_penalty: Option<f64>,
    /// 0 only (not implemented otherwise).
    pub presence_penalty: Option<f64>,
    /// 1 only (not implemented otherwise).
    pub repetition_penalty: Option<f64>,
    /// 0 only (not implemented otherwise).
    pub min_p: Option<f64>,
    /// Constrained decoding: null only (not served).
    pub json_schema: Option<serde_json::Value>,
    /// Constrained decoding: null only (not served).
    pub regex: Option<serde_json::Value>,
    /// Constrained decoding: null only (not served).
    pub ebnf: Option<serde_json::Value>,
    /// A custom logit processor's parameters: null only (no custom logit processors).
    pub custom_params: Option<serde_json::Value>,
}

/// A prompt: text, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Token ids.
    Ids(Vec<i64>),
    /// Text, tokenised by the server.
    Text(String),
}

/// One value, or one per prompt of a batch (SGLang's batched `/generate`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    /// A single request.
    One(T),
    /// A batch: the answer is a list, in order.
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    /// The values, and whether it was a batch.
    pub fn items(&self) -> (Vec<&T>, bool) {
        match self {
            Self::One(t) => (vec![t], false),
            Self::Many(ts) => (ts.iter().collect(), true),
        }
    }
}

/// SGLang's `POST /generate` body: one prompt, or a batch of them (one `sampling_params` for all; then the answer is
/// a list). Besides the fields served, SGLang's options that this server does not serve are accepted at the values
/// that change nothing (what sglang-router adds to every request it forwards) and refused by name otherwise.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateRequest {
    /// The prompt as text (or a batch of texts).
    pub text: Option<OneOrMany<String>>,
    /// The prompt as token ids (or a batch of them).
    pub input_ids: Option<OneOrMany<Vec<i64>>>,
    /// Sampling.
    #[serde(default)]
    pub sampling_params: SamplingParams,
    /// Return the log-probability of every output token.
    #[serde(default)]
    pub return_logprob: bool,
    /// The client's request id (echoed in `meta_info.id`; a batch takes one per prompt).
    pub rid: Option<OneOrMany<String>>,
    /// Stream the answer as server-sent events: a cumulative partial answer after every round that added tokens,
    /// the final answer, then `[DONE]`.
    #[serde(default)]
    pub stream: bool,
    /// `output_token_logprobs` carry each token's decoded text as their third element (null otherwise).
    #[serde(default)]
    pub return_text_in_logprobs: bool,
    // SGLang's `/generate` options this server does not serve, as sglang-router 0.3.2 re-serialises every request
    // it forwards (its request struct: `model` null, `return_text_in_logprobs`, `stream`, `return_hidden_states`,
    // `background`, `return_bytes` and `return_entropy` false, `log_metrics` true, `no_logs` false, and the others
    // when the client sent them). Each is accepted at its neutral value (absent, null, or the value named) and
    // refused by name otherwise ([`GenerateRequest::check_unserved`]); any other field is refused as unknown.
    /// The model to route to: any name (this server serves one model).
    pub model: Option<String>,
    /// SGLang's metrics switch: either value (this server's metrics count every request).
    pub log_metrics: Option<bool>,
    /// SGLang's request-log switch: either value (requests are not logged by content).
    pub no_logs: Option<bool>,
    /// SGLang's prefix-cache namespace: any value (nothing is cached across requests).
    pub extra_key: Option<String>,
    /// The data-parallel rank to run on: 0 or null (one rank).
    pub data_parallel_rank: Option<i64>,
    /// Where input log-probs start: -1 or null (input log-probs are not served).
    pub logprob_start_len: Option<i64>,
    /// Top alternatives per token: 0 or null (not served).
    pub top_logprobs_num: Option<i64>,
    /// false or null (hidden states are not returned).
    pub return_hidden_states: Option<bool>,
    /// false or null.
    pub return_entropy: Option<bool>,
    /// false or null.
    pub return_bytes: Option<bool>,
    /// false or null.
    pub return_routed_experts: Option<bool>,
    /// false or null (no background requests).
    pub background: Option<bool>,
    /// null (requests are served first come, first served).
    pub priority: Option<serde_json::Value>,
    /// null.
    pub token_ids_logprob: Option<serde_json::Value>,
    /// null.
    pub input_embeds: Option<serde_json::Value>,
    /// null (text only).
    pub image_data: Option<serde_json::Value>,
    /// null (text only).
    pub video_data: Option<serde_json::Value>,
    /// null (text only).
    pub audio_data: Option<serde_json::Value>,
    /// null.
    pub session_params: Option<serde_json::Value>,
    /// null (no LoRA adapters).
    pub lora_path: Option<serde_json::Value>,
    /// null (no LoRA adapters).
    pub lora_id: Option<serde_json::Value>,
    /// null.
    pub custom_logit_processor: Option<serde_json::Value>,
    /// null (no prefill/decode disaggregation).
    pub bootstrap_host: Option<serde_json::Value>,
    /// null (no prefill/decode disaggregation).
    pub bootstrap_port: Option<serde_json::Value>,
    /// null (no prefill/decode disaggregation).
    pub bootstrap_room: Option<serde_json::Value>,
}

impl GenerateRequest {
    /// Refuses, by name, an option this server does not serve at a value that would change the answer (the
    /// gateway's neutral values pass).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the first such field.
    pub fn check_unserved(&self) -> Result<()> {
        let is_false = |b: Option<bool>| !b.unwrap_or(false);
        let flags = [
            ("data_parallel_rank", self.data_parallel_rank.is_none_or(|r| r == 0), "this server has one rank, 0"),
            ("logprob_start_len", self.logprob_start_len.is_none_or(|l| l == -1), "input log-probs are not served: -1"),
            ("top_logprobs_num", self.top_logprobs_num.is_none_or(|n| n == 0), "top alternatives are not served: 0"),
            ("return_hidden_states", is_false(self.return_hidden_states), "hidden states are not served"),
            ("return_entropy", is_false(self.return_entropy), "entropies are not served"),
            ("return_bytes", is_false(self.return_bytes), "token bytes are not served"),
            ("return_routed_experts", is_false(self.return_routed_experts), "this model has no experts"),
            ("background", is_false(self.background), "background requests are not served"),
        ];
        if let Some((name, _, reason)) = flags.iter().find(|(_, ok, _)| !ok) {
            return Err(invalid(name, *reason));
        }
        let nulls = [
            ("priority", &self.priority, "priority scheduling is not served"),
            ("token_ids_logprob", &self.token_ids_logprob, "log-probs of chosen tokens are not served"),
            ("input_embeds", &self.input_embeds, "send input_ids or text"),
            ("image_data", &self.image_data, "images are not served"),
            ("video_data", &self.video_data, "videos are not served"),
            ("audio_data", &self.audio_data, "audio is not served"),
            ("session_params", &self.session_params, "sessions are not served"),
            ("lora_path", &self.lora_path, "LoRA adapters are not served"),
            ("lora_id", &self.lora_id, "LoRA adapters are not served"),
            ("custom_logit_processor", &self.custom_logit_processor, "custom logit processors are not served"),
            ("bootstrap_host", &self.bootstrap_host, "prefill/decode disaggregation is not served"),
            ("bootstrap_port", &self.bootstrap_port, "prefill/decode disaggregation is not served"),
            ("bootstrap_room", &self.bootstrap_room, "prefill/decode disaggregation is not served"),
        ];
        match nulls.iter().find(|(_, v, _)| v.as_ref().is_some_and(|v| !v.is_null())) {
            Some((name, _, reason)) => Err(invalid(name, *reason)),
            None => Ok(()),
        }
    }
}

/// Why a request ended, as SGLang says it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FinishReason {
    /// `stop` (a stop token), `length` (`max_new_tokens` or the context) or `abort`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The stop token or stop string that ended it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub matched: Option<Matched>,
    /// Why it was aborted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// What stopped a request, as SGLang's `matched` gives it: a token id or a stop string.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(untagged)]
pub enum Matched {
    /// A stop token.
    Token(u32),
    /// A stop string.
    Text(String),
}

impl FinishReason {
    /// SGLang's reason for an output that ended for `reason` with `last` its last token, `stop` the request's stop
    /// strings.
    pub fn of(reason: tlt_spec_decode::FinishReason, last: Option<u32>, stop: &[String]) -> Self {
        let kind = finish_kind(reason).to_owned();
        match reason {
            tlt_spec_decode::FinishReason::Stop => Self { kind, matched: last.map(Matched::Token), message: None },
            tlt_spec_decode::FinishReason::StopString { index } => {
                Self { kind, matched: stop.get(index).cloned().map(Matched::Text), message: None }
            }
            tlt_spec_decode::FinishReason::Abort => {
                Self { kind, matched: None, message: Some("aborted before it finished".into()) }
            }
            _ => Self { kind, matched: None, message: None },
        }
    }
}

/// The coin stream of sample `index` of a request seeded with `seed`: a 64-bit mix of both with the top bit set,
/// so that it never meets an unseeded request's stream (counted from 1, far below 2^63).
pub fn seeded_stream(seed: u64, index: u64) -> u64 {
    let mix = |x: u64| tlt_kernels::SplitMix64::new(x).next_u64();
    mix(mix(seed) ^ index) | (1 << 63)
}

/// The word SGLang, OpenAI and TRL clients read for `reason`: `stop`, `length` or `abort`.
pub fn finish_kind(reason: tlt_spec_decode::FinishReason) -> &'static str {
    match reason {
        tlt_spec_decode::FinishReason::Stop | tlt_spec_decode::FinishReason::StopString { .. } => "stop",
        tlt_spec_decode::FinishReason::Length => "length",
        tlt_spec_decode::FinishReason::Abort => "abort",
    }
}

/// SGLang's `POST /abort_request` body.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct AbortRequest {
    /// The request id to end.
    #[serde(default)]
    pub rid: Option<String>,
    /// End every request.
    #[serde(default)]
    pub abort_all: bool,
}

/// SGLang's `POST /pause_generation` body (may be empty).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct PauseRequest {
    /// `abort` (default: end the running requests, which answer with what they have) or `in_place` (keep them;
    /// they go on after `/continue_generation`). `retract` is refused: re-prefilling after an update would mix two
    /// weight versions in one response.
    #[serde(default)]
    pub mode: Option<String>,
}

/// SGLang's `POST /update_weights_from_disk` body.
#[derive(Debug, Clone, Deserialize)]
pub struct UpdateWeightsRequest {
    /// An HF checkpoint directory (config.json + safetensors) or a `.gguf` file of the served architecture.
    pub model_path: String,
    /// `auto` or absent (the format is read off the path).
    #[serde(default)]
    pub load_format: Option<String>,
    /// Accepted (nothing is cached across requests).
    #[serde(default)]
    pub flush_cache: Option<bool>,
    /// End the running requests now instead of letting them finish on the old weights.
    #[serde(default)]
    pub abort_all_requests: bool,
    /// The new weights' version; absent: the version stays.
    #[serde(default)]
    pub weight_version: Option<String>,
}

/// SGLang's `meta_info`.
#[derive(Debug, Clone, Serialize)]
pub struct MetaInfo {
    /// The request id (the client's `rid`, else one made here).
    pub id: String,
    /// Why it ended (null in a streamed partial answer).
    pub finish_reason: Option<FinishReason>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from a cache (none: every prompt is prefilled).
    pub cached_tokens: usize,
    /// The weights' version.
    pub weight_version: String,
    /// `[logprob, token_id, text]` per output token, with `return_logprob` (text: the token decoded, with
    /// `return_text_in_logprobs`; else null).
    pub output_token_logprobs: Option<Vec<(f32, u32, Option<String>)>>,
    /// Speculative rounds of this request.
    pub spec_verify_ct: usize,
    /// Drafted tokens accepted in them.
    pub spec_accept_token_num: usize,
    /// Drafted tokens verified in them (slime's acceptance rate is `spec_accept_token_num / spec_draft_token_num`).
    pub spec_draft_token_num: usize,
}

/// SGLang's `/generate` answer.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateResponse {
    /// The output decoded (empty without a tokenizer).
    pub text: String,
    /// The output token ids.
    pub output_ids: Vec<u32>,
    /// Everything else.
    pub meta_info: MetaInfo,
}

/// A completions prompt: one (text or token ids) or a batch of them (vLLM's form, as TRL sends it).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompts {
    /// One prompt.
    One(Prompt),
    /// A batch; the choices come prompt-major (the `n` of the first prompt first).
    Many(Vec<Prompt>),
}

/// The options OpenAI's `/v1/completions` and `/v1/chat/completions` share, with vLLM's extensions (`top_k`,
/// `min_p`, `repetition_penalty`); flattened into both requests.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct OpenAiOptions {
    /// Any name (this server serves one model).
    #[serde(default)]
    pub model: Option<String>,
    /// Default 1.
    pub temperature: Option<f64>,
    /// Default 1.
    pub top_p: Option<f64>,
    /// vLLM's: `0` or `-1` (default): off.
    pub top_k: Option<i64>,
    /// vLLM's: must be 0 (not implemented otherwise).
    pub min_p: Option<f64>,
    /// vLLM's: must be 1 (not implemented otherwise).
    pub repetition_penalty: Option<f64>,
    /// Completions (choices) per prompt. Default 1.
    pub n: Option<u64>,
    /// Seed: choice `k` of the request samples on stream `seeded_stream(seed, k)`.
    pub seed: Option<u64>,
    /// Streaming (not served yet: refused).
    #[serde(default)]
    pub stream: bool,
    /// Anything else: refused by name unless null (or `user`), rather than ignored.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

impl OpenAiOptions {
    /// Completions per prompt.
    ///
    /// # Errors
    /// [`Error::Invalid`] for 0 or more than 1,024.
    pub fn samples(&self) -> Result<usize> {
        match self.n.unwrap_or(1) {
            0 => Err(invalid("n", "must be at least 1")),
            n if n > 1024 => Err(invalid("n", "at most 1024 completions per prompt")),
            n => Ok(n as usize),
        }
    }

    /// Validated sampling (OpenAI's defaults: 16 tokens, temperature 1), at most `max_tokens` new tokens, the field
    /// named `max_tokens_field` in errors.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the field; streaming, `min_p > 0`, `repetition_penalty != 1` and any field this
    /// server does not know are refused.
    pub fn validate(&self, max_tokens_field: &str, max_tokens: Option<u64>, limits: &Limits) -> Result<Sampling> {
        self.samples()?;
        if self.stream {
            return Err(invalid("stream", "streaming is not served yet"));
        }
        if self.min_p.is_some_and(|p| p != 0.0) {
            return Err(invalid("min_p", "only 0.0 is served"));
        }
        if self.repetition_penalty.is_some_and(|p| p != 1.0) {
            return Err(invalid("repetition_penalty", "only 1.0 is served"));
        }
        if let Some((k, _)) = self.other.iter().find(|(k, v)| !v.is_null() && k.as_str() != "user") {
            return Err(invalid(k, "this option is not served"));
        }
        let top_k = self.top_k.map(|k| if k == 0 { -1 } else { k });
        let (temperature, top_p, top_k) = sampling_values("", self.temperature, self.top_p, top_k)?;
        let mut stop = limits.eos.clone();
        stop.sort_unstable();
        Ok(Sampling {
            temperature,
            top_p,
            top_k,
            max_new_tokens: new_tokens(max_tokens_field, max_tokens, 16)?,
            stop_token_ids: Some(stop),
            stop_strings: Vec::new(),
            seed: self.seed,
            stream: self.seed.map_or(0, |s| seeded_stream(s, 0)),
        })
    }
}

/// OpenAI's `POST /v1/completions` body, with vLLM's extensions that TRL's client sends (`VLLMClient.generate`):
/// batched prompts, `top_k`, `min_p`, `repetition_penalty`, `return_token_ids`, `return_tokens_as_token_ids`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Text or token ids, one prompt or a batch.
    pub prompt: Prompts,
    /// New tokens at most. Default 16 (OpenAI's).
    pub max_tokens: Option<u64>,
    /// `0`: each sampled token's log-probability, with `top_logprobs` holding just it (vLLM's answer to 0); `1`:
    /// the log-probabilities without `top_logprobs` (the top alternatives are not served); more is refused.
    pub logprobs: Option<u64>,
    /// vLLM's: add `prompt_token_ids` and `token_ids` to every choice.
    #[serde(default)]
    pub return_token_ids: bool,
    /// vLLM's: name tokens `token_id:<id>` in `logprobs` instead of their text.
    #[serde(default)]
    pub return_tokens_as_token_ids: bool,
    /// Sampling, `n`, `model` and what is refused.
    #[serde(flatten)]
    pub options: OpenAiOptions,
}

/// What the worker needs of a request's sampling: validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Temperature (0: greedy).
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Top-k.
    pub top_k: Option<usize>,
    /// New tokens at most.
    pub max_new_tokens: usize,
    /// Stop tokens (`None`: the model's end of sequence).
    pub stop_token_ids: Option<Vec<u32>>,
    /// Stop strings (matched in the decoded output).
    pub stop_strings: Vec<String>,
    /// The client's sampling seed.
    pub seed: Option<u64>,
    /// The request's coin stream (every engine of the server has the same seed, so requests with different seeds
    /// share one): its tokens depend on (stream, prompt, sampling) alone, never on what ran beside it. A request with
    /// a seed takes [`seeded_stream`]`(seed, 0)` (the same seed, the same sample); one without takes a stream of its
    /// own from the server's counter (`AppState::fresh_streams`), so that the samples of a GRPO
    /// group sent as separate unseeded requests differ, as on SGLang.
    pub stream: u64,
}

/// What the server knows of its model, to check requests against.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Token ids are below this.
    pub vocab_size: usize,
    /// Prompt plus output fit in this.
    pub context: usize,
    /// Prompt plus output fit in the KV pool's tokens too ([`crate::pool::Pool::tokens`]).
    pub pool_tokens: usize,
    /// The model's end-of-sequence tokens.
    pub eos: Vec<u32>,
}

/// A 400 naming `field`.
pub(crate) fn invalid(field: &str, reason: impl Into<String>) -> Error {
    Error::Invalid { field: field.into(), reason: reason.into() }
}

/// `ids` checked against the vocabulary and the context (`max_new_tokens` more must fit).
///
/// # Errors
/// [`Error::Invalid`] naming the field and, for a bad id, its index.
pub fn check_ids(field: &str, ids: &[i64], max_new_tokens: usize, limits: &Limits) -> Result<Vec<u32>> {
    if ids.is_empty() {
        return Err(invalid(field, "the prompt is empty"));
    }
    let mut out = Vec::with_capacity(ids.len());
    for (i, &id) in ids.iter().enumerate() {
        match u32::try_from(id) {
            Ok(t) if (t as usize) < limits.vocab_size => out.push(t),
            _ => {
                return Err(invalid(
                    &format!("{field}[{i}]"),
                    format!("{id} is not a token id (0..{})", limits.vocab_size),
                ))
            }
        }
    }
    if out.len() + max_new_tokens > limits.context {
        return Err(invalid(
            field,
            format!(
                "{} prompt tokens + {max_new_tokens} new tokens exceed the model's context of {}",
                out.len(),
                limits.context
            ),
        ));
    }
    if out.len() + max_new_tokens > limits.pool_tokens {
        return Err(invalid(
            field,
            format!(
                "{} prompt tokens + {max_new_tokens} new tokens exceed the KV pool's {} tokens (raise \
                 --max-total-tokens or --mem-fraction-static)",
                out.len(),
                limits.pool_tokens
            ),
        ));
    }
    Ok(out)
}

/// The temperature, top-p and top-k as the sampler takes them.
fn sampling_values(
    prefix: &str,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
) -> Result<(f32, Option<f32>, Option<usize>)> {
    let temperature = temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && (0.0..=100.0).contains(&temperature)) {
        return Err(invalid(&format!("{prefix}temperature"), format!("{temperature} is not in [0, 100]")));
    }
    let top_p = match top_p {
        None => None,
        Some(p) if p.is_finite() && p > 0.0 && p <= 1.0 => (p < 1.0).then_some(p as f32),
        Some(p) => return Err(invalid(&format!("{prefix}top_p"), format!("{p} is not in (0, 1]"))),
    };
    let top_k = match top_k {
        None | Some(-1) => None,
        Some(k) if k >= 1 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(k) => return Err(invalid(&format!("{prefix}top_k"), format!("{k} is neither -1 nor >= 1"))),
    };
    Ok((temperature as f32, top_p, top_k))
}

/// Most new tokens a request may ask for.
pub const MAX_NEW_TOKENS: u64 = 1 << 20;

fn new_tokens(field: &str, n: Option<u64>, default: u64) -> Result<usize> {
    match n.unwrap_or(default) {
        0 => Err(invalid(field, "must be at least 1")),
        n if n > MAX_NEW_TOKENS => Err(invalid(field, format!("{n} exceeds {MAX_NEW_TOKENS}"))),
        n => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
    }
}

/// Most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 32;
/// Longest stop string, in bytes (every new token decodes a window of as many tokens).
pub const MAX_STOP_BYTES: usize = 256;

impl SamplingParams {
    /// The stop strings: `stop` as a string or a list of strings (none when absent, null, `""` or `[]`).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming `sampling_params.stop` (or the element) for another type, an empty string in a
    /// list, or more or longer strings than the limits.
    pub fn stop_strings(&self) -> Result<Vec<String>> {
        const FIELD: &str = "sampling_params.stop";
        let strings = match &self.stop {
            None | Some(serde_json::Value::Null) => return Ok(Vec::new()),
            Some(serde_json::Value::String(s)) if s.is_empty() => return Ok(Vec::new()),
            Some(serde_json::Value::String(s)) => vec![s.clone()],
            Some(serde_json::Value::Array(items)) => {
                let mut out = Vec::with_capacity(items.len());
                for (i, v) in items.iter().enumerate() {
                    match v.as_str() {
                        Some(s) if !s.is_empty() => out.push(s.to_owned()),
                        _ => return Err(invalid(&format!("{FIELD}[{i}]"), "a stop string must be a non-empty string")),
                    }
                }
                out
            }
            Some(_) => return Err(invalid(FIELD, "a string or a list of strings")),
        };
        if strings.len() > MAX_STOP_STRINGS {
            return Err(invalid(FIELD, format!("{} stop strings; at most {MAX_STOP_STRINGS}", strings.len())));
        }
        if let Some(i) = strings.iter().position(|s| s.len() > MAX_STOP_BYTES) {
            return Err(invalid(&format!("{FIELD}[{i}]"), format!("longer than {MAX_STOP_BYTES} bytes")));
        }
        Ok(strings)
    }

    /// Validated, with the model's end-of-sequence tokens added to the stop tokens unless `ignore_eos`.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the field.
    pub fn validate(&self, limits: &Limits) -> Result<Sampling> {
        let field = |name: &str| format!("sampling_params.{name}");
        let stop_strings = self.stop_strings()?;
        let neutral = [
            ("n", self.n.is_none_or(|n| n == 1), "only 1 is served (send a request per sample)"),
            ("min_new_tokens", self.min_new_tokens.is_none_or(|n| n == 0), "only 0 is served"),
            ("frequency_penalty", self.frequency_penalty.is_none_or(|p| p == 0.0), "only 0 is served"),
            ("presence_penalty", self.presence_penalty.is_none_or(|p| p == 0.0), "only 0 is served"),
            ("repetition_penalty", self.repetition_penalty.is_none_or(|p| p == 1.0), "only 1 is served"),
            ("min_p", self.min_p.is_none_or(|p| p == 0.0), "only 0 is served"),
        ];
        if let Some((name, _, reason)) = neutral.iter().find(|(_, ok, _)| !ok) {
            return Err(invalid(&field(name), *reason));
        }
        let unserved = [
            ("json_schema", &self.json_schema, "constrained decoding is not served"),
            ("regex", &self.regex, "constrained decoding is not served"),
            ("ebnf", &self.ebnf, "constrained decoding is not served"),
            ("custom_params", &self.custom_params, "custom logit processors are not served"),
        ];
        if let Some((name, _, reason)) = unserved.iter().find(|(_, v, _)| v.as_ref().is_some_and(|v| !v.is_null())) {
            return Err(invalid(&field(name), *reason));
        }
        let (temperature, top_p, top_k) =
            sampling_values("sampling_params.", self.temperature, self.top_p, self.top_k)?;
        let max_new_tokens = new_tokens("sampling_params.max_new_tokens", self.max_new_tokens, 128)?;
        let mut stop: Vec<u32> = if self.ignore_eos.unwrap_or(false) { Vec::new() } else { limits.eos.clone() };
        for (i, &t) in self.stop_token_ids.iter().flatten().enumerate() {
            if t as usize >= limits.vocab_size {
                return Err(invalid(&format!("sampling_params.stop_token_ids[{i}]"), format!("{t} is not a token id")));
            }
            if !stop.contains(&t) {
                stop.push(t);
            }
        }
        stop.sort_unstable();
        Ok(Sampling {
            temperature,
            top_p,
            top_k,
            max_new_tokens,
            stop_token_ids: Some(stop),
            stop_strings,
            seed: self.sampling_seed,
            stream: self.sampling_seed.map_or(0, |s| seeded_stream(s, 0)),
        })
    }
}

impl CompletionRequest {
    /// The prompts, one or many.
    pub fn prompts(&self) -> Vec<&Prompt> {
        match &self.prompt {
            Prompts::One(p) => vec![p],
            Prompts::Many(ps) => ps.iter().collect(),
        }
    }

    /// Validated sampling (OpenAI's defaults: 16 tokens, temperature 1).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the field; `logprobs > 1`, no prompt and what [`OpenAiOptions::validate`] refuses.
    pub fn validate(&self, limits: &Limits) -> Result<Sampling> {
        if self.logprobs.unwrap_or(0) > 1 {
            return Err(invalid("logprobs", "top alternatives are not served: 0 (or 1) gives the sampled token's"));
        }
        if self.prompts().is_empty() {
            return Err(invalid("prompt", "no prompt"));
        }
        self.options.validate("max_tokens", self.max_tokens, limits)
    }
}

/// OpenAI's completion choice.
#[derive(Debug, Clone, Serialize)]
pub struct Choice {
    /// Its place among the choices (prompt-major).
    pub index: usize,
    /// The completion.
    pub text: String,
    /// `stop`, `length` or `abort`.
    pub finish_reason: String,
    /// With `logprobs`: the sampled tokens' log-probabilities.
    pub logprobs: Option<ChoiceLogprobs>,
    /// With `return_token_ids` (vLLM's): the prompt's token ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// With `return_token_ids` (vLLM's): the completion's token ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// OpenAI's `logprobs` of a choice (the sampled tokens only).
#[derive(Debug, Clone, Serialize)]
pub struct ChoiceLogprobs {
    /// Each token's text (`token_id:<id>` with `return_tokens_as_token_ids`).
    pub tokens: Vec<String>,
    /// Each token's log-probability.
    pub token_logprobs: Vec<f32>,
    /// With `logprobs = 0`: per token, a map holding the sampled token alone (vLLM's answer; the top alternatives
    /// are not served).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<std::collections::BTreeMap<String, f32>>>,
}

/// OpenAI's token counts.
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Both.
    pub total_tokens: usize,
}

/// OpenAI's `/v1/completions` answer.
#[derive(Debug, Clone, Serialize)]
pub struct CompletionResponse {
    /// `cmpl-<n>`.
    pub id: String,
    /// `text_completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// `n` choices per prompt, prompt-major.
    pub choices: Vec<Choice>,
    /// Token counts.
    pub usage: Usage,
}
