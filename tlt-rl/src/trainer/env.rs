//! The trainer's view of a task: token prompts in, token completions scored.

use tlt_model::{decode, encode};
use tokenizers::Tokenizer;

use crate::task::{ChatTemplate, Problem, Score, Task};
use crate::Result;

/// A prompt of one RL group.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    /// Its data index (the resumable data position).
    pub index: u64,
    /// The tokenized prompt, chat template applied.
    pub ids: Vec<u32>,
    /// The task problem behind it (`None` for token-level environments).
    pub problem: Option<Problem>,
}

/// Prompts and rewards at the token level. Implemented by [`TextEnv`] (a [`Task`] behind a tokenizer and a chat
/// template); tests implement it directly on token ids.
pub trait Environment: Send {
    /// The prompt at data index `index` (deterministic).
    ///
    /// # Errors
    /// When the task cannot produce it.
    fn prompt(&self, index: u64) -> Result<Prompt>;

    /// Scores `completion` (generated tokens, a stop token last if it stopped) for `prompt`.
    ///
    /// # Errors
    /// When the completion cannot be decoded.
    fn score(&self, prompt: &Prompt, completion: &[u32]) -> Result<Score>;
}

/// A text [`Task`] made token-level: chat-templated prompts, decoded completions.
pub struct TextEnv {
    task: Box<dyn Task>,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    system: Option<String>,
}

impl std::fmt::Debug for TextEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextEnv").field("task", &self.task.name()).field("system", &self.system).finish()
    }
}

impl TextEnv {
    /// Wraps `task`; `system` is an optional system message.
    pub fn new(task: Box<dyn Task>, tokenizer: Tokenizer, template: ChatTemplate, system: Option<String>) -> Self {
        Self { task, tokenizer, template, system }
    }

    /// The task.
    pub fn task(&self) -> &dyn Task {
        self.task.as_ref()
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }
}

impl Environment for TextEnv {
    fn prompt(&self, index: u64) -> Result<Prompt> {
        let index = match self.task.len() {
            Some(0) => return Err(crate::Error::InvalidArgument(format!("task `{}` is empty", self.task.name()))),
            Some(n) => index % n,
            None => index,
        };
        let problem = self.task.problem(index)?;
        let text = self.template.prompt(self.system.as_deref(), &problem.prompt)?;
        let ids = encode(&self.tokenizer, &text)?;
        Ok(Prompt { index, ids, problem: Some(problem) })
    }

    fn score(&self, prompt: &Prompt, completion: &[u32]) -> Result<Score> {
        let text = decode(&self.tokenizer, completion)?;
        match &prompt.problem {
            Some(p) => Ok(self.task.score(p, &text)),
            None => Err(crate::Error::InvalidArgument("a TextEnv prompt without its problem".into())),
        }
    }
}
