//! The trainer's view of a task: token prompts in, token completions scored.

use tlt_model::encode;
use tokenizers::Tokenizer;

use crate::task::{ChatTemplate, DataSplit, Problem, Score, Split, Task};
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
///
/// `Sync + 'static`: the trainer scores answers on worker threads while the rollout decodes (`[trainer.scoring]`),
/// each holding the environment.
pub trait Environment: Send + Sync + 'static {
    /// The prompt at position `pos` of `split` (deterministic; training and evaluation prompts never overlap).
    ///
    /// # Errors
    /// When the task cannot produce it, or `pos` is past the split.
    fn prompt(&self, split: Split, pos: u64) -> Result<Prompt>;

    /// Scores `completion` (generated tokens, a stop token last if it stopped) for `prompt`.
    ///
    /// # Errors
    /// When the completion cannot be decoded.
    fn score(&self, prompt: &Prompt, completion: &[u32]) -> Result<Score>;

    /// The tokenizer behind the prompts, written next to an exported policy (`None`: a token-level environment).
    fn hf_tokenizer(&self) -> Option<&Tokenizer> {
        None
    }

    /// The chat template prompts are rendered with, as Hugging Face Jinja source, written to an exported policy's
    /// `tokenizer_config.json`.
    fn hf_chat_template(&self) -> Option<&str> {
        None
    }
}

/// A text [`Task`] made token-level: chat-templated prompts, decoded completions.
pub struct TextEnv {
    task: Box<dyn Task>,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    system: Option<String>,
    split: DataSplit,
}

impl std::fmt::Debug for TextEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextEnv").field("task", &self.task.name()).field("system", &self.system).finish()
    }
}

impl TextEnv {
    /// Wraps `task`; `system` is an optional system message. Nothing is held out and training data comes in a
    /// shuffle of seed 0 until [`TextEnv::with_split`].
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] for an empty task.
    pub fn new(
        task: Box<dyn Task>,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        system: Option<String>,
    ) -> Result<Self> {
        let split = DataSplit::new(task.len(), 0, 0)?;
        Ok(Self { task, tokenizer, template, system, split })
    }

    /// The same environment holding out `held_out` problems of a finite task for evaluation (ignored by
    /// generators, whose evaluation prompts come from their own index range), training data shuffled by `seed`.
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] when nothing would be left to train on.
    pub fn with_split(mut self, held_out: u64, seed: u64) -> Result<Self> {
        self.split = DataSplit::new(self.task.len(), held_out, seed)?;
        Ok(self)
    }

    /// How training and evaluation prompts are drawn from the task.
    pub fn split(&self) -> &DataSplit {
        &self.split
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
    fn prompt(&self, split: Split, pos: u64) -> Result<Prompt> {
        let index = self.split.index(split, pos)?;
        let problem = self.task.problem(index)?;
        let text = self.template.prompt(self.system.as_deref(), &problem.prompt)?;
        let ids = encode(&self.tokenizer, &text)?;
        Ok(Prompt { index, ids, problem: Some(problem) })
    }

    /// Decodes `completion` **without special tokens** (verl: `skip_special_tokens=True`) and lets the task grade the
    /// text: the stop token that ends every completion that stops (`<|im_end|>`) never reaches the verifier.
    fn score(&self, prompt: &Prompt, completion: &[u32]) -> Result<Score> {
        let text = self.tokenizer.decode(completion, true).map_err(|e| tlt_model::Error::Tokenizer(e.to_string()))?;
        match &prompt.problem {
            Some(p) => Ok(self.task.score(p, &text)),
            None => Err(crate::Error::InvalidArgument("a TextEnv prompt without its problem".into())),
        }
    }

    fn hf_tokenizer(&self) -> Option<&Tokenizer> {
        Some(&self.tokenizer)
    }

    fn hf_chat_template(&self) -> Option<&str> {
        Some(self.template.jinja_source())
    }
}
