//! Chat templates: Hugging Face Jinja templates (as stored in `tokenizer_config.json` or a GGUF's
//! `tokenizer.chat_template`) rendered with minijinja, and a built-in ChatML.

use minijinja::value::{from_args, Value, ValueKind};
use minijinja::{context, Environment, ErrorKind, State};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"` or `"assistant"`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }

    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// An assistant message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

const TEMPLATE_NAME: &str = "chat_template";

/// [`ChatTemplate::chatml`] as a Hugging Face Jinja template (what [`ChatTemplate::jinja_source`] returns for it).
pub const CHATML_JINJA: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + \
    message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}\
    {% endif %}";

#[derive(Clone)]
enum Kind {
    ChatMl,
    Jinja { env: Box<Environment<'static>>, bos: String, eos: String, source: String },
}

/// Turns a conversation into the prompt text a chat model expects.
///
/// [`ChatTemplate::from_jinja`] follows `transformers`' `apply_chat_template`: the template sees `messages` (a list
/// of `{role, content}`), `add_generation_prompt`, `bos_token` and `eos_token`, blocks are trimmed as with
/// `trim_blocks`/`lstrip_blocks`, `raise_exception(msg)` fails the rendering with `msg`, and the common Python string
/// and dict methods (`strip`, `lstrip`, `rstrip`, `startswith`, `endswith`, `split`, `replace`, `upper`, `lower`,
/// `items`, `keys`, `values`, `get`) are available.
///
/// ```
/// use tlt_rl::task::ChatTemplate;
///
/// let t = ChatTemplate::chatml();
/// assert_eq!(t.prompt(None, "Hi")?, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
/// # Ok::<(), tlt_rl::Error>(())
/// ```
#[derive(Clone)]
pub struct ChatTemplate {
    kind: Kind,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::ChatMl => f.write_str("ChatTemplate::ChatMl"),
            Kind::Jinja { bos, eos, .. } => {
                f.debug_struct("ChatTemplate::Jinja").field("bos_token", bos).field("eos_token", eos).finish()
            }
        }
    }
}

impl ChatTemplate {
    /// ChatML as used by SmolLM2 and Qwen: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then
    /// `<|im_start|>assistant\n` for the generation prompt. No default system message is added.
    pub fn chatml() -> Self {
        Self { kind: Kind::ChatMl }
    }

    /// Compiles a Hugging Face Jinja chat template; `bos_token` and `eos_token` are exposed to it.
    ///
    /// # Errors
    /// [`Error::Parse`] when the template does not compile.
    pub fn from_jinja(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.set_unknown_method_callback(python_method);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| Error::parse("chat template", e.to_string()))?;
        let kind =
            Kind::Jinja { env: Box::new(env), bos: bos_token.into(), eos: eos_token.into(), source: source.into() };
        Ok(Self { kind })
    }

    /// The chat template of a `tokenizer_config.json` (as transformers reads it): `chat_template` as a string, or
    /// the entry named `default` of a list of `{name, template}`; `bos_token` and `eos_token` as strings or as
    /// `{content}` objects (absent or null: empty). `None` when the config has no template.
    ///
    /// ```
    /// use tlt_rl::task::{ChatTemplate, CHATML_JINJA};
    ///
    /// let config = serde_json::json!({"chat_template": CHATML_JINJA, "eos_token": {"content": "<|im_end|>"}});
    /// let t = ChatTemplate::from_tokenizer_config(&config)?.expect("a template");
    /// assert_eq!(t.prompt(None, "Hi")?, ChatTemplate::chatml().prompt(None, "Hi")?);
    /// # Ok::<(), tlt_rl::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Parse`] when the template does not compile.
    pub fn from_tokenizer_config(config: &serde_json::Value) -> Result<Option<Self>> {
        let source = match &config["chat_template"] {
            serde_json::Value::String(s) => Some(s.as_str()),
            serde_json::Value::Array(named) => {
                named.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str())
            }
            _ => None,
        };
        let token = |key: &str| {
            let v = &config[key];
            v.as_str().or_else(|| v["content"].as_str()).unwrap_or_default()
        };
        source.map(|s| Self::from_jinja(s, token("bos_token"), token("eos_token"))).transpose()
    }

    /// The template as Hugging Face Jinja source (for `tokenizer_config.json`'s `chat_template`): the source given
    /// to [`Self::from_jinja`], or [`CHATML_JINJA`].
    pub fn jinja_source(&self) -> &str {
        match &self.kind {
            Kind::ChatMl => CHATML_JINJA,
            Kind::Jinja { source, .. } => source,
        }
    }

    /// Renders `messages`, followed by the assistant header when `add_generation_prompt`.
    ///
    /// # Errors
    /// [`Error::Parse`] when the template fails (including a `raise_exception`).
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        match &self.kind {
            Kind::ChatMl => {
                let mut out = String::new();
                for m in messages {
                    out.push_str("<|im_start|>");
                    out.push_str(&m.role);
                    out.push('\n');
                    out.push_str(&m.content);
                    out.push_str("<|im_end|>\n");
                }
                if add_generation_prompt {
                    out.push_str("<|im_start|>assistant\n");
                }
                Ok(out)
            }
            Kind::Jinja { env, bos, eos, .. } => {
                let fail = |e: minijinja::Error| Error::parse("chat template", e.to_string());
                let template = env.get_template(TEMPLATE_NAME).map_err(fail)?;
                template
                    .render(context! {
                        messages => messages,
                        add_generation_prompt => add_generation_prompt,
                        bos_token => bos,
                        eos_token => eos,
                    })
                    .map_err(fail)
            }
        }
    }

    /// The generation prompt for one user message, after an optional system message.
    ///
    /// # Errors
    /// As [`ChatTemplate::render`].
    pub fn prompt(&self, system: Option<&str>, user: &str) -> Result<String> {
        let mut messages = Vec::with_capacity(2);
        if let Some(system) = system {
            messages.push(ChatMessage::system(system));
        }
        messages.push(ChatMessage::user(user));
        self.render(&messages, true)
    }
}

/// The Python `str` and `dict` methods HF templates call (a subset of minijinja-contrib's `pycompat`).
fn python_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, minijinja::Error> {
    if let Some(s) = value.as_str() {
        return match method {
            "strip" | "lstrip" | "rstrip" => {
                let (chars,): (Option<&str>,) = from_args(args)?;
                let pat = |c: char| chars.map_or(c.is_whitespace(), |cs| cs.contains(c));
                Ok(Value::from(match method {
                    "strip" => s.trim_matches(pat),
                    "lstrip" => s.trim_start_matches(pat),
                    _ => s.trim_end_matches(pat),
                }))
            }
            "startswith" | "endswith" => {
                let (affix,): (&str,) = from_args(args)?;
                Ok(Value::from(if method == "startswith" { s.starts_with(affix) } else { s.ends_with(affix) }))
            }
            "upper" | "lower" => {
                let () = from_args(args)?;
                Ok(Value::from(if method == "upper" { s.to_uppercase() } else { s.to_lowercase() }))
            }
            "replace" => {
                let (from, to): (&str, &str) = from_args(args)?;
                Ok(Value::from(s.replace(from, to)))
            }
            "split" => {
                let (sep, maxsplit): (Option<&str>, Option<i64>) = from_args(args)?;
                let limit = maxsplit.and_then(|m| usize::try_from(m).ok()).map_or(usize::MAX, |m| m.saturating_add(1));
                let parts: Vec<Value> = match sep {
                    Some("") => return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "empty separator")),
                    Some(sep) => s.splitn(limit, sep).map(Value::from).collect(),
                    None => s.split_whitespace().map(Value::from).collect(),
                };
                Ok(Value::from(parts))
            }
            _ => Err(ErrorKind::UnknownMethod.into()),
        };
    }
    if value.kind() == ValueKind::Map {
        match method {
            "items" => {
                let () = from_args(args)?;
                return state.apply_filter("items", std::slice::from_ref(value));
            }
            "keys" | "values" => {
                let () = from_args(args)?;
                let keys: Vec<Value> = value.try_iter()?.collect();
                if method == "keys" {
                    return Ok(Value::from(keys));
                }
                let values = keys.iter().map(|k| value.get_item(k)).collect::<std::result::Result<Vec<_>, _>>()?;
                return Ok(Value::from(values));
            }
            "get" => {
                let (key, default): (Value, Option<Value>) = from_args(args)?;
                let v = value.get_item(&key)?;
                return Ok(if v.is_undefined() { default.unwrap_or(Value::from(())) } else { v });
            }
            _ => {}
        }
    }
    Err(ErrorKind::UnknownMethod.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2's `tokenizer.chat_template` (as in its GGUF and `tokenizer_config.json`).
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn smollm2() -> ChatTemplate {
        ChatTemplate::from_jinja(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap()
    }

    #[test]
    fn chatml_jinja_source_renders_as_the_builtin_chatml() {
        let jinja = ChatTemplate::from_jinja(ChatTemplate::chatml().jinja_source(), "", "").unwrap();
        let messages = [ChatMessage::system("S"), ChatMessage::user("Hi"), ChatMessage::assistant("Yo")];
        for gen in [false, true] {
            assert_eq!(jinja.render(&messages, gen).unwrap(), ChatTemplate::chatml().render(&messages, gen).unwrap());
        }
        assert_eq!(smollm2().jinja_source(), SMOLLM2);
    }

    #[test]
    fn task_chat_smollm2_template() {
        let t = smollm2();
        assert_eq!(
            t.prompt(None, "Hi").unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.prompt(Some("Be brief."), "Hi").unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(format!("{t:?}").contains("Jinja"));
    }

    #[test]
    fn task_chat_chatml_matches_smollm2_with_a_system_message() {
        let convo = [
            ChatMessage::system("sys"),
            ChatMessage::user("What is 2 + 2?\nThink."),
            ChatMessage::assistant("<think>easy</think> 4"),
            ChatMessage::user("{{ not a template }} {% raw %}"),
        ];
        for gen in [false, true] {
            assert_eq!(ChatTemplate::chatml().render(&convo, gen).unwrap(), smollm2().render(&convo, gen).unwrap());
        }
        assert_eq!(
            ChatTemplate::chatml().prompt(None, "Hi").unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(ChatTemplate::chatml().render(&[], false).unwrap(), "");
        assert_eq!(format!("{:?}", ChatTemplate::chatml()), "ChatTemplate::ChatMl");
    }

    #[test]
    fn task_chat_hf_semantics() {
        // trim_blocks + lstrip_blocks: the newline after a block tag and the indentation before it disappear.
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.role }}: {{ m.content }}\n\
                   \x20   {% endif %}\n{% endfor %}";
        let t = ChatTemplate::from_jinja(src, "", "").unwrap();
        assert_eq!(t.render(&[ChatMessage::user("Hi"), ChatMessage::system("x")], false).unwrap(), "user: Hi\n");
        // Whitespace-controlled multi-line templates (the Qwen2.5 style) give ChatML.
        let qwen = "{%- for message in messages %}\n    {{- '<|im_start|>' + message.role + '\\n' + message.content + \
                    '<|im_end|>' + '\\n' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    \
                    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";
        let t = ChatTemplate::from_jinja(qwen, "", "").unwrap();
        assert_eq!(t.prompt(Some("s"), "u").unwrap(), ChatTemplate::chatml().prompt(Some("s"), "u").unwrap());
        // bos/eos tokens.
        let t = ChatTemplate::from_jinja(
            "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        assert_eq!(t.render(&[ChatMessage::user("a"), ChatMessage::assistant("b")], false).unwrap(), "<s>a</s>b</s>");
    }

    #[test]
    fn task_chat_from_tokenizer_config() {
        let named = serde_json::json!({"chat_template": [{"name": "tool_use", "template": "T"},
            {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}],
            "bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": false}});
        let t = ChatTemplate::from_tokenizer_config(&named).unwrap().unwrap();
        assert_eq!(t.render(&[ChatMessage::user("a")], false).unwrap(), "<s>a</s>");
        let plain = serde_json::json!({"chat_template": SMOLLM2, "bos_token": null});
        assert_eq!(ChatTemplate::from_tokenizer_config(&plain).unwrap().unwrap().jinja_source(), SMOLLM2);
        for none in [serde_json::json!({}), serde_json::json!({"chat_template": [{"name": "rag", "template": "x"}]})] {
            assert!(ChatTemplate::from_tokenizer_config(&none).unwrap().is_none());
        }
        let bad = serde_json::json!({"chat_template": "{% for %}"});
        assert!(matches!(ChatTemplate::from_tokenizer_config(&bad), Err(Error::Parse { .. })));
    }

    #[test]
    fn task_chat_raise_exception_and_errors() {
        let src = "{% if messages[0]['role'] == 'assistant' %}\
                   {{ raise_exception('Conversation roles must alternate') }}{% endif %}ok";
        let t = ChatTemplate::from_jinja(src, "", "").unwrap();
        assert_eq!(t.prompt(None, "Hi").unwrap(), "ok");
        let err = t.render(&[ChatMessage::assistant("x")], false).unwrap_err();
        assert!(
            matches!(&err, Error::Parse { .. }) && err.to_string().contains("Conversation roles must alternate"),
            "{err}"
        );
        assert!(matches!(ChatTemplate::from_jinja("{% for %}", "", ""), Err(Error::Parse { .. })));
        assert!(matches!(ChatTemplate::from_jinja("{{ x", "", ""), Err(Error::Parse { .. })));
        let t = ChatTemplate::from_jinja("{{ messages[0].content.frobnicate() }}", "", "").unwrap();
        assert!(t.prompt(None, "Hi").is_err());
    }

    #[test]
    fn task_chat_python_methods() {
        let src =
            "{% set c = messages[0].content %}{{ c.strip() }}|{{ c.lstrip() }}|{{ c.rstrip() }}|{{ c.strip(' x') }}|\
                   {{ c.startswith('  x') }}|{{ c.endswith('y') }}|{{ c.upper() }}|{{ c.replace('x', 'z') }}|\
                   {{ c.split() | join('+') }}|{{ 'a,b,c'.split(',', 1) | join('+') }}|\
                   {% set d = {'k': 1} %}{% for k, v in d.items() %}{{ k }}={{ v }}{% endfor %}|{{ d.keys() | join }}|\
                   {{ d.values() | join }}|{{ d.get('k') }}|{{ d.get('q', 7) }}|{{ d.get('q') is none }}";
        let t = ChatTemplate::from_jinja(src, "", "").unwrap();
        assert_eq!(
            t.prompt(None, "  x y ").unwrap(),
            "x y|x y |  x y|y|True|False|  X Y |  z y |x+y|a+b,c|k=1|k|1|1|7|True"
        );
    }
}
