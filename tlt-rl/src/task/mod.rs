//! Tasks for RL: problem generators and datasets, rule-based rewards with a time limit, and chat templates.
//!
//! A [`Task`] hands out [`Problem`]s by data index (deterministic, so a data position is resumable) and scores a
//! completion with a rule-based verifier:
//!
//! - [`Arithmetic`]: seeded multi-step integer arithmetic, answered in `\boxed{}`;
//! - [`Countdown`]: TinyZero-style "reach the target with these numbers", answered in `<answer></answer>`;
//! - [`JsonlTask`]: GSM8K/MATH-style JSONL files (`question`, `answer`), answered in `\boxed{}` or after `####`.
//!
//! Rewards follow verl (1 for a correct answer, 0 otherwise, by default) and TinyZero (with a format bonus):
//! [`RewardConfig::correct_reward`] plus [`RewardConfig::format_reward`] (default 0) for a correct answer in the
//! required format, the format reward alone for a wrong answer in that format, nothing otherwise.
//! Verifiers are native Rust (no sympy, no child process), look at the last [`MAX_EXAMINED_BYTES`] of a completion
//! only, use exact rational arithmetic (`i128`) and check a deadline inside their loops, so a pathological completion
//! yields [`Score::timed_out`] instead of a hang. Scoring never panics.
//!
//! ```
//! use tlt_rl::task::{builtin, Task};
//!
//! let task = builtin("arithmetic", 7)?;
//! let problem = task.problem(0)?;
//! assert!(problem.prompt.contains("\\boxed{}"));
//! let score = task.score(&problem, "no idea");
//! assert_eq!((score.reward, score.correct, score.formatted), (0.0, false, false));
//! # Ok::<(), tlt_rl::Error>(())
//! ```

mod answer;
mod arithmetic;
mod chat;
mod countdown;
mod countdown_verify;
mod expr;
mod jsonl;
mod split;
mod verdict;
mod word;

use serde::{Deserialize, Serialize};

pub use answer::{answers_equal, extract_answer, numbers_equal};
pub use arithmetic::{Arithmetic, ArithmeticConfig};
pub use chat::{ChatMessage, ChatTemplate, CHATML_JINJA};
pub use countdown::{Countdown, CountdownConfig};
pub use jsonl::JsonlTask;
pub use split::{DataSplit, Split, GENERATOR_EVAL_BASE};
pub use word::{WordConfig, WordProblems};

use crate::{Error, Result};
use verdict::{Deadline, Verdict};

/// Verifiers look at this many trailing bytes of a completion (rounded to a character boundary), as verl's GSM8K
/// grader looks at the last 300 characters: the answer comes last, and the cap bounds the work per completion.
pub const MAX_EXAMINED_BYTES: usize = 4096;

/// One problem of a [`Task`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    /// Its data index.
    pub index: u64,
    /// The user message (no chat template applied).
    pub prompt: String,
    /// The ground truth the verifier checks against.
    pub answer: Answer,
}

/// The ground truth of a [`Problem`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Answer {
    /// A numeric ground truth as text (`"42"`, `"-3.5"`, `"1/3"`, `"\frac{1}{3}"`), compared with
    /// [`answers_equal`] against the completion's [`extract_answer`].
    Number(String),
    /// A numeric ground truth graded by the answer after the last `####` alone (a `\boxed{}` answer is unformatted):
    /// verl's GSM8K grader, for GSM8K files ([`RewardConfig::accept_boxed`] turns it into [`Self::Number`]).
    Hashes(String),
    /// A Countdown puzzle: an equation over `numbers` (each used exactly once, `+ - * /` and parentheses) must equal
    /// `target`.
    Countdown {
        /// The numbers the equation may use.
        numbers: Vec<i64>,
        /// The value the equation must have.
        target: i64,
    },
}

/// The verdict on one completion.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// The scalar reward.
    pub reward: f64,
    /// The answer is right.
    pub correct: bool,
    /// The answer was given in the required format (`\boxed{}`, `####`, `<answer></answer>`).
    pub formatted: bool,
    /// The verifier ran out of time ([`RewardConfig::time_limit_ms`]); the reward is then 0.
    pub timed_out: bool,
}

impl Score {
    /// The score of an unformatted completion: all zero.
    pub const ZERO: Self = Self { reward: 0.0, correct: false, formatted: false, timed_out: false };

    /// The score of a verification that ran out of time: zero reward, `timed_out` set.
    pub const TIMED_OUT: Self = Self { reward: 0.0, correct: false, formatted: false, timed_out: true };
}

/// Rule-based reward settings (the TinyZero defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardConfig {
    /// Added for a correct answer. Default 1.0.
    pub correct_reward: f64,
    /// Given when the answer is in the required format (`\boxed{}` or `####`; `<answer></answer>` for Countdown),
    /// right or wrong. Default 0, verl's (its GSM8K `format_score`): a correct answer scores 1, anything else 0;
    /// TinyZero's bonus was 0.1.
    pub format_reward: f64,
    /// Time budget of one verification in milliseconds; past it the score is [`Score::TIMED_OUT`]. Default 1000.
    pub time_limit_ms: u64,
    /// Numeric answers without the required format are still judged by the last number in the completion (verl's
    /// GSM8K `flexible` mode): correct earns `correct_reward` without the format reward. Default false (strict).
    pub flexible: bool,
    /// GSM8K files (reference answers after `####`, asked for with the default instruction) also accept an answer in
    /// `\boxed{}`, which then wins over `####`. Default false: `####` alone, as verl's GSM8K grader.
    pub accept_boxed: bool,
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self { correct_reward: 1.0, format_reward: 0.0, time_limit_ms: 1000, flexible: false, accept_boxed: false }
    }
}

impl RewardConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a non-finite reward or a zero time limit.
    pub fn validate(&self) -> Result<()> {
        if !self.correct_reward.is_finite() {
            return Err(Error::config("reward.correct_reward", "must be finite"));
        }
        if !self.format_reward.is_finite() {
            return Err(Error::config("reward.format_reward", "must be finite"));
        }
        if self.time_limit_ms == 0 {
            return Err(Error::config("reward.time_limit_ms", "must be at least 1"));
        }
        Ok(())
    }
}

/// A source of problems with a rule-based verifier.
pub trait Task: Send + Sync {
    /// A short name (`"arithmetic"`, `"countdown"`, the JSONL file's stem).
    fn name(&self) -> &str;

    /// The number of problems, `None` for an endless generator.
    fn len(&self) -> Option<u64>;

    /// `true` for a dataset without problems.
    fn is_empty(&self) -> bool {
        self.len() == Some(0)
    }

    /// The problem at data index `index`: the same for the same task (seed) and index, so a data position is
    /// resumable.
    ///
    /// # Errors
    /// An index past [`Task::len`], or a generator that cannot build the problem.
    fn problem(&self, index: u64) -> Result<Problem>;

    /// Scores `completion` (the generated text) against `problem`. Never panics, whatever the input; bounded in time
    /// by the task's [`RewardConfig::time_limit_ms`].
    fn score(&self, problem: &Problem, completion: &str) -> Score;
}

/// Scores `completion` against `answer` with the rule-based verifier of its kind (used by every built-in [`Task`]).
/// Never panics; returns [`Score::TIMED_OUT`] when `reward.time_limit_ms` runs out.
pub fn score_answer(answer: &Answer, completion: &str, reward: &RewardConfig) -> Score {
    let mut deadline = Deadline::after_ms(reward.time_limit_ms);
    let text = tail(completion, MAX_EXAMINED_BYTES);
    let verdict = match answer {
        Answer::Number(truth) => answer::verify(truth, text, &mut deadline, false),
        Answer::Hashes(truth) => answer::verify(truth, text, &mut deadline, true),
        Answer::Countdown { numbers, target } => countdown_verify::verify(numbers, *target, text, &mut deadline),
    };
    match verdict {
        Verdict::TimedOut => Score::TIMED_OUT,
        Verdict::Unformatted => match answer {
            Answer::Number(truth) | Answer::Hashes(truth)
                if reward.flexible && answer::last_number(text).is_some_and(|n| answers_equal(n, truth)) =>
            {
                Score { reward: reward.correct_reward, correct: true, formatted: false, timed_out: false }
            }
            _ => Score::ZERO,
        },
        Verdict::Wrong => Score { reward: reward.format_reward, correct: false, formatted: true, timed_out: false },
        Verdict::Correct => Score {
            reward: reward.correct_reward + reward.format_reward,
            correct: true,
            formatted: true,
            timed_out: false,
        },
    }
}

/// The built-in generator `name` (`"arithmetic"`, `"countdown"` or `"word"`) with default settings and `seed`.
///
/// # Errors
/// [`Error::InvalidConfig`] for an unknown name, listing the known ones.
pub fn builtin(name: &str, seed: u64) -> Result<Box<dyn Task>> {
    builtin_with(name, seed, &ArithmeticConfig::default(), &WordConfig::default(), RewardConfig::default())
}

/// The built-in generator `name` seeded with `seed` (which replaces the seed in `arithmetic` and `word`), with the
/// settings of its kind (Countdown keeps its defaults) and `reward`.
///
/// # Errors
/// [`Error::InvalidConfig`] for an unknown name or invalid configs.
pub fn builtin_with(
    name: &str,
    seed: u64,
    arithmetic: &ArithmeticConfig,
    word: &WordConfig,
    reward: RewardConfig,
) -> Result<Box<dyn Task>> {
    match name {
        "arithmetic" => {
            let cfg = ArithmeticConfig { seed, ..arithmetic.clone() };
            Ok(Box::new(Arithmetic::new(cfg)?.with_reward(reward)?))
        }
        "countdown" => {
            let cfg = CountdownConfig { seed, ..CountdownConfig::default() };
            Ok(Box::new(Countdown::new(cfg)?.with_reward(reward)?))
        }
        "word" => Ok(Box::new(WordProblems::new(WordConfig { seed, ..word.clone() })?.with_reward(reward)?)),
        other => {
            Err(Error::config("task.name", format!("unknown task `{other}`; known tasks: arithmetic, countdown, word")))
        }
    }
}

/// The last `max_bytes` bytes of `s`, moved forward to a character boundary.
pub(crate) fn tail(s: &str, max_bytes: usize) -> &str {
    let mut start = s.len().saturating_sub(max_bytes);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

#[cfg(test)]
mod tests {
    use super::verdict::TimedOut;
    use super::*;

    /// TinyZero's format bonus, so that the tests see every reward level.
    fn cfg() -> RewardConfig {
        RewardConfig { format_reward: 0.1, ..RewardConfig::default() }
    }

    #[test]
    fn task_builtin_names() {
        assert_eq!(builtin("arithmetic", 1).unwrap().name(), "arithmetic");
        assert_eq!(builtin("countdown", 1).unwrap().name(), "countdown");
        assert_eq!(builtin("word", 1).unwrap().name(), "word");
        let err = builtin("chess", 1).err().unwrap().to_string();
        assert!(err.contains("chess") && err.contains("arithmetic") && err.contains("countdown"), "{err}");
    }

    #[test]
    fn task_reward_config_defaults_and_validation() {
        let c: RewardConfig = serde_json::from_str("{}").unwrap();
        let verl = RewardConfig {
            correct_reward: 1.0,
            format_reward: 0.0,
            time_limit_ms: 1000,
            flexible: false,
            accept_boxed: false,
        };
        assert_eq!(c, verl);
        assert!(serde_json::from_str::<RewardConfig>(r#"{"bogus": 1}"#).is_err());
        assert!(RewardConfig { time_limit_ms: 0, ..cfg() }.validate().is_err());
        assert!(RewardConfig { correct_reward: f64::NAN, ..cfg() }.validate().is_err());
        assert!(cfg().validate().is_ok());
    }

    #[test]
    fn task_score_levels() {
        let a = Answer::Number("42".into());
        let s = score_answer(&a, "so \\boxed{42}", &cfg());
        assert!(s.correct && s.formatted && !s.timed_out);
        assert!((s.reward - 1.1).abs() < 1e-12);
        let s = score_answer(&a, "so \\boxed{41}", &cfg());
        assert_eq!((s.reward, s.correct, s.formatted), (0.1, false, true));
        assert_eq!(score_answer(&a, "42", &cfg()), Score::ZERO);
        assert_eq!(score_answer(&a, "", &cfg()), Score::ZERO);
    }

    #[test]
    fn task_time_limit_zero_times_out_on_pathological_input() {
        let reward = RewardConfig { time_limit_ms: 0, ..cfg() };
        let nested = "\\boxed{".repeat(100_000);
        assert_eq!(score_answer(&Answer::Number("1".into()), &nested, &reward), Score::TIMED_OUT);
        let expr = format!("<answer>{}1{}</answer>", "(".repeat(1900), ")".repeat(1900));
        let cd = Answer::Countdown { numbers: vec![1, 2, 3], target: 1 };
        assert_eq!(score_answer(&cd, &expr, &reward), Score::TIMED_OUT);
        // The same inputs finish well within the default limit.
        assert!(!score_answer(&Answer::Number("1".into()), &nested, &cfg()).timed_out);
        assert!(!score_answer(&cd, &expr, &cfg()).timed_out);
    }

    #[test]
    fn task_deadline_ticks() {
        let mut d = Deadline::none();
        assert!((0..1000).all(|_| d.tick().is_ok()));
        let mut d = Deadline::after_ms(0);
        assert_eq!(d.tick(), Err(TimedOut));
        assert_eq!(d.tick(), Err(TimedOut));
        let mut d = Deadline::after_ms(u64::MAX);
        assert!(d.tick().is_ok());
    }

    #[test]
    fn task_tail_respects_char_boundaries() {
        let s = "é".repeat(3000); // 6000 bytes
        let t = tail(&s, MAX_EXAMINED_BYTES);
        assert!(t.len() <= MAX_EXAMINED_BYTES && t.chars().all(|c| c == 'é'));
        assert_eq!(tail("abc", 10), "abc");
        assert_eq!(tail("", 10), "");
    }

    #[test]
    fn task_adversarial_completions_never_panic() {
        let answers = [
            Answer::Number("42".into()),
            Answer::Number("1/3".into()),
            Answer::Countdown { numbers: vec![1, 2, 3], target: 6 },
            Answer::Countdown { numbers: vec![], target: 0 },
        ];
        let huge = format!("1{}", "0".repeat(500));
        let lossy =
            String::from_utf8_lossy(&[0xff, 0xfe, b'\\', b'b', b'o', b'x', b'e', b'd', b'{', 0xc3]).into_owned();
        let megabyte = "x{\\boxed{".repeat(110_000);
        let inputs = [
            String::new(),
            huge.clone(),
            format!("\\boxed{{{huge}}}"),
            format!("<answer>{huge} * {huge}</answer>"),
            "\\boxed{\\frac{1}{\\boxed{2}}}".into(),
            "\\boxed{{{{}".into(),
            "}}}\\boxed{".into(),
            "<answer>1 / (2 - 2)</answer>".into(),
            "<answer>((((</answer>".into(),
            "<answer></answer>".into(),
            "#### ".into(),
            "日本語 \\boxed{４２} 🎉".into(),
            lossy,
            megabyte,
        ];
        for a in &answers {
            for s in &inputs {
                let score = score_answer(a, s, &cfg());
                assert!(score.reward.is_finite());
                assert!(!score.correct || score.formatted);
            }
        }
    }

    #[test]
    fn flexible_scoring_judges_the_last_number_without_format_reward() {
        let truth = Answer::Number("12".into());
        let flexible = RewardConfig { flexible: true, ..RewardConfig::default() };
        let s = score_answer(&truth, "7 + 5 = 12.", &flexible);
        assert!(s.correct && !s.formatted && s.reward == 1.0, "{s:?}");
        assert_eq!(score_answer(&truth, "7 + 5 = 13.", &flexible), Score::ZERO);
        assert_eq!(score_answer(&truth, "7 + 5 = 12.", &RewardConfig::default()), Score::ZERO);
        // The boxed answer wins over later numbers.
        let s = score_answer(&truth, "\\boxed{12} (not 13)", &flexible);
        assert!(s.correct && s.formatted, "{s:?}");
        // Thousands separators in a flexible answer are read as one number.
        for (truth, text) in [("3000", "A: 3,000"), ("6250", "A: 6,250"), ("1234567.5", "so 1,234,567.5.")] {
            let s = score_answer(&Answer::Number(truth.into()), text, &flexible);
            assert!(s.correct, "{text} should be {truth}: {s:?}");
        }
        assert!(!score_answer(&Answer::Number("3".into()), "A: 3,000", &flexible).correct);
    }
}
