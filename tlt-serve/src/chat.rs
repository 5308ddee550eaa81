//! OpenAI's `POST /v1/chat/completions` in vLLM's form: the conversation is rendered by the model's chat template
//! (`tlt_rl::task::ChatTemplate`: minijinja, with the semantics of transformers' `apply_chat_template`), tokenized
//! without special tokens added (the template writes them), and sampled by the `/v1/completions` machinery
//! (validation, `n` samples of one prompt forked from one prefill, finish reasons, usage).

use std::path::Path;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::Response;
use axum::Json;
use serde::{Deserialize, Serialize};
use tlt_rl::task::{ChatMessage, ChatTemplate};

use crate::api::{check_ids, finish_kind, invalid, Limits, OpenAiOptions, Sampling, Usage};
use crate::reply::{answer, unix_seconds, usage};
use crate::state::AppState;
use crate::{Error, Result};

/// The chat template of the model at `path`: the GGUF's `tokenizer.chat_template` (`loaded.chat_template`, with the
/// BOS/EOS tokens of its config), else the `chat_template` of a `tokenizer_config.json` in the HF checkpoint
/// directory. `None` without either, or without a tokenizer to name the special tokens of a GGUF's.
///
/// # Errors
/// [`Error::Model`] when `tokenizer_config.json` cannot be read or parsed, or the template does not compile.
pub fn model_template(path: &Path, loaded: &tlt_model::LoadedModel) -> Result<Option<ChatTemplate>> {
    let config = match (&loaded.chat_template, &loaded.tokenizer) {
        (Some(t), Some(tok)) => Some(tlt_rl::trainer::tokenizer_config(loaded.model.config(), tok, Some(t))),
        (Some(_), None) => None,
        (None, _) => {
            let file = path.join("tokenizer_config.json");
            match std::fs::read_to_string(&file) {
                Ok(text) => {
                    Some(serde_json::from_str(&text).map_err(|e| Error::Model(format!("{}: {e}", file.display())))?)
                }
                Err(_) if !file.exists() => None,
                Err(e) => return Err(Error::Model(format!("{}: {e}", file.display()))),
            }
        }
    };
    let Some(config) = config else { return Ok(None) };
    ChatTemplate::from_tokenizer_config(&config).map_err(|e| Error::Model(e.to_string()))
}

/// A message's content: text, or a list of content parts (only `{"type": "text", "text": ...}` parts are served;
/// their texts are joined with newlines, as vLLM joins them).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts.
    Parts(Vec<serde_json::Value>),
}

/// One message of the conversation.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...: passed to the template as is.
    pub role: String,
    /// The text (null is refused: tool calls are not served).
    #[serde(default)]
    pub content: Option<Content>,
    /// Anything else (`name`, `tool_calls`, ...): refused by name unless null.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

/// OpenAI's `POST /v1/chat/completions` body (with vLLM's `add_generation_prompt` and sampling extensions).
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    /// The conversation.
    pub messages: Vec<Message>,
    /// New tokens at most (OpenAI's older name). Default 16.
    pub max_tokens: Option<u64>,
    /// New tokens at most; wins over `max_tokens`.
    pub max_completion_tokens: Option<u64>,
    /// Return each sampled token's log-probability.
    pub logprobs: Option<bool>,
    /// 0 only: the top alternatives are not served.
    pub top_logprobs: Option<u64>,
    /// vLLM's: end the prompt with the assistant's header. Default true.
    pub add_generation_prompt: Option<bool>,
    /// Sampling, `n`, `model`, `stream` and what is refused.
    #[serde(flatten)]
    pub options: OpenAiOptions,
}

impl ChatCompletionRequest {
    /// Validated sampling.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the field: no message, `top_logprobs` above 0, and what
    /// [`OpenAiOptions::validate`] refuses.
    pub fn validate(&self, limits: &Limits) -> Result<Sampling> {
        if self.messages.is_empty() {
            return Err(invalid("messages", "no message"));
        }
        if self.top_logprobs.unwrap_or(0) > 0 {
            return Err(invalid(
                "top_logprobs",
                "top alternatives are not served: 0 (with logprobs) gives the sampled token's",
            ));
        }
        match self.max_completion_tokens {
            Some(n) => self.options.validate("max_completion_tokens", Some(n), limits),
            None => self.options.validate("max_tokens", self.max_tokens, limits),
        }
    }

    /// The conversation as the template takes it.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the message field that is not served (`messages[1].content[0].type`).
    pub fn conversation(&self) -> Result<Vec<ChatMessage>> {
        self.messages.iter().enumerate().map(|(i, m)| m.text(&format!("messages[{i}]"))).collect()
    }
}

impl Message {
    /// The message as role and text; `at` names it in errors.
    fn text(&self, at: &str) -> Result<ChatMessage> {
        if let Some((k, _)) = self.other.iter().find(|(_, v)| !v.is_null()) {
            return Err(invalid(&format!("{at}.{k}"), "this message field is not served"));
        }
        let content = match &self.content {
            None => return Err(invalid(&format!("{at}.content"), "must be text (a string or text parts)")),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (j, part) in parts.iter().enumerate() {
                    match (part["type"].as_str(), part["text"].as_str()) {
                        (Some("text"), Some(text)) => texts.push(text),
                        (Some("text"), None) => {
                            return Err(invalid(&format!("{at}.content[{j}].text"), "must be a string"))
                        }
                        _ => return Err(invalid(&format!("{at}.content[{j}].type"), "only text parts are served")),
                    }
                }
                texts.join("\n")
            }
        };
        Ok(ChatMessage::new(self.role.clone(), content))
    }
}

/// The assistant's reply in a choice.
#[derive(Debug, Clone, Serialize)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: &'static str,
    /// The completion decoded, special tokens skipped.
    pub content: String,
}

/// An alternative token and its log-probability (none are served: `top_logprobs` is 0).
#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// Its text's UTF-8 bytes.
    pub bytes: Vec<u8>,
}

/// A sampled token's log-probability, as OpenAI's `ChatCompletionTokenLogprob`.
#[derive(Debug, Clone, Serialize)]
pub struct TokenLogprob {
    /// The token decoded alone.
    pub token: String,
    /// Its log-probability (the target's, from the pass that committed it).
    pub logprob: f32,
    /// `token`'s UTF-8 bytes (as vLLM gives them: a token that is part of a character decodes to U+FFFD).
    pub bytes: Vec<u8>,
    /// Empty (`top_logprobs` is 0).
    pub top_logprobs: Vec<TopLogprob>,
}

/// A choice's `logprobs`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatLogprobs {
    /// One entry per sampled token.
    pub content: Vec<TokenLogprob>,
}

/// One choice of a chat completion.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    /// Its place among the `n` choices.
    pub index: usize,
    /// The reply.
    pub message: AssistantMessage,
    /// With `logprobs`: the sampled tokens' log-probabilities; else null.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length` or `abort`.
    pub finish_reason: String,
}

/// OpenAI's chat completion.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletionResponse {
    /// `chatcmpl-<n>`.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The model name the request gave, else the served model's.
    pub model: String,
    /// `n` choices.
    pub choices: Vec<ChatChoice>,
    /// Token counts (the prompt once per choice, as vLLM counts it).
    pub usage: Usage,
}

/// `POST /v1/chat/completions`.
pub(crate) async fn completions(
    State(s): State<Arc<AppState>>,
    body: std::result::Result<Json<ChatCompletionRequest>, JsonRejection>,
) -> Response {
    answer(s, body, run).await
}

/// The prompt of `req`: its conversation rendered by the model's template and tokenized, checked against the model.
fn prompt(s: &AppState, req: &ChatCompletionRequest, sampling: &Sampling) -> Result<Vec<u32>> {
    if s.tokenizer.is_none() {
        return Err(invalid("messages", "this model has no tokenizer: send token ids to /v1/completions"));
    }
    let template = s.chat_template.as_ref().ok_or_else(|| {
        invalid(
            "messages",
            "this model has no usable chat template (none in its GGUF metadata or in a tokenizer_config.json beside \
             its checkpoint): render the prompt yourself and send it to /v1/completions",
        )
    })?;
    let conversation = req.conversation()?;
    let text = template
        .render(&conversation, req.add_generation_prompt.unwrap_or(true))
        .map_err(|e| invalid("messages", e.to_string()))?;
    let ids = s.tokenize("messages", &text)?;
    check_ids("messages", &ids, sampling.max_new_tokens, &s.limits)
}

async fn run(s: &AppState, req: ChatCompletionRequest) -> Result<ChatCompletionResponse> {
    let sampling = req.validate(&s.limits)?;
    let n = req.options.samples()?;
    let prompt = prompt(s, &req, &sampling)?;
    let id = s.id("chatcmpl-");
    let outs = s.submit_batch(std::slice::from_ref(&prompt), n, &sampling, &id).await?;
    let usage = usage(&outs);
    let with_logprobs = req.logprobs.unwrap_or(false);
    let choices = outs
        .into_iter()
        .enumerate()
        .map(|(index, out)| {
            let logprobs = with_logprobs.then(|| ChatLogprobs {
                content: out
                    .tokens
                    .iter()
                    .zip(&out.logprobs)
                    .map(|(&t, &logprob)| {
                        let token = s.detokenize_with(&[t], true);
                        TokenLogprob { bytes: token.as_bytes().to_vec(), token, logprob, top_logprobs: Vec::new() }
                    })
                    .collect(),
            });
            ChatChoice {
                index,
                message: AssistantMessage { role: "assistant", content: s.detokenize_with(&out.tokens, true) },
                logprobs,
                finish_reason: finish_kind(out.reason).into(),
            }
        })
        .collect();
    Ok(ChatCompletionResponse {
        id,
        object: "chat.completion",
        created: unix_seconds(),
        model: s.answer_model(req.options.model.as_deref()),
        choices,
        usage,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.
    use super::*;

    fn request(body: serde_json::Value) -> ChatCompletionRequest {
        serde_json::from_value(body).unwrap()
    }

    fn limits() -> Limits {
        Limits { vocab_size: 64, context: 64, pool_tokens: 64, eos: vec![1] }
    }

    fn field(e: Error) -> String {
        match e {
            Error::Invalid { field, .. } => field,
            other => panic!("not a field error: {other}"),
        }
    }

    #[test]
    fn conversations_render_text_and_text_parts_alike() {
        let parts = request(serde_json::json!({"messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
             "name": null}]}));
        let text = request(serde_json::json!({"messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]}));
        assert_eq!(parts.conversation().unwrap(), text.conversation().unwrap());
        let t = ChatTemplate::chatml();
        assert_eq!(
            t.render(&parts.conversation().unwrap(), true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn what_is_not_served_is_refused_by_name() {
        let cases = [
            (serde_json::json!({"messages": []}), "messages"),
            (serde_json::json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), "top_logprobs"),
            (serde_json::json!({"messages": [{"role": "user", "content": "x"}], "stream": true}), "stream"),
            (serde_json::json!({"messages": [{"role": "user", "content": "x"}], "stop": ["\n"]}), "stop"),
            (serde_json::json!({"messages": [{"role": "user", "content": "x"}], "tools": []}), "tools"),
            (
                serde_json::json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}),
                "max_completion_tokens",
            ),
            (serde_json::json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}), "max_tokens"),
            (serde_json::json!({"messages": [{"role": "user", "content": "x"}], "n": 0}), "n"),
        ];
        for (body, name) in cases {
            assert_eq!(field(request(body.clone()).validate(&limits()).unwrap_err()), name, "{body}");
        }
        let messages = [
            (serde_json::json!({"role": "assistant", "content": null, "tool_calls": []}), "messages[0].tool_calls"),
            (serde_json::json!({"role": "assistant"}), "messages[0].content"),
            (
                serde_json::json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
                "messages[0].content[0].type",
            ),
            (serde_json::json!({"role": "user", "content": [{"type": "text"}]}), "messages[0].content[0].text"),
        ];
        for (m, name) in messages {
            let req = request(serde_json::json!({"messages": [m]}));
            assert_eq!(field(req.conversation().unwrap_err()), name);
        }
        // Accepted: OpenAI's nulls and `user`, `max_completion_tokens` over `max_tokens`.
        let ok = request(serde_json::json!({"messages": [{"role": "user", "content": "x"}], "stop": null,
            "user": "u", "logprobs": true, "top_logprobs": 0, "max_tokens": 0, "max_completion_tokens": 5}));
        assert_eq!(ok.validate(&limits()).unwrap().max_new_tokens, 5);
    }
}
