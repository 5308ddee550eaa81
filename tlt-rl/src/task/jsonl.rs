//! [`JsonlTask`]: GSM8K/MATH-style JSONL datasets.

use std::path::Path;

use serde_json::{Map, Value};

use super::{extract_answer, score_answer, Answer, Problem, RewardConfig, Score, Task};
use crate::{Error, Result};

/// The instruction appended to GSM8K-style questions (answers after `####`), as in verl's preprocessing.
const HASH_INSTRUCTION: &str = "Let's think step by step and output the final answer after \"####\".";
/// The instruction appended to MATH-style questions (answers in `\boxed{}`), as in verl's preprocessing.
const BOXED_INSTRUCTION: &str = "Let's think step by step and output the final answer within \\boxed{}.";

#[derive(Debug, Clone, PartialEq)]
struct Item {
    question: String,
    answer: String,
    hashes: bool,
}

/// A fixed dataset of math word problems, one JSON object per line:
///
/// - the question in `question` (or `problem`);
/// - the answer in `answer` (or else `solution`): a GSM8K solution ending in `#### 72`, a MATH solution with a
///   `\boxed{...}`, or a bare answer (a string or a JSON number).
///
/// Other fields are ignored and blank lines are skipped. The prompt is the question followed by verl's instruction
/// (answer after `####` for GSM8K-style lines, within `\boxed{}` otherwise). Completions of GSM8K-style lines are
/// graded by the answer after `####` alone, as verl's GSM8K grader ([`RewardConfig::accept_boxed`], or a custom
/// instruction, accepts `\boxed{}` too); others by [`extract_answer`] (`\boxed{}`, else `####`); then
/// [`super::answers_equal`].
///
/// ```
/// use tlt_rl::task::{JsonlTask, Task};
///
/// let task = JsonlTask::from_str("toy", r#"{"question": "2 + 2?", "answer": "2 + 2 = 4\n#### 4"}"#)?;
/// let p = task.problem(0)?;
/// assert!(task.score(&p, "#### 4").correct);
/// # Ok::<(), tlt_rl::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct JsonlTask {
    name: String,
    items: Vec<Item>,
    reward: RewardConfig,
    instruction: Option<String>,
}

impl JsonlTask {
    /// Loads the JSONL file at `path`; the task is named after the file stem.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read, [`Error::Parse`] naming `path:line` for a malformed line, and
    /// [`Error::Parse`] for a file without problems.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let items = parse_lines(&path.display().to_string(), &text)?;
        let name = path.file_stem().map_or_else(|| "jsonl".to_string(), |s| s.to_string_lossy().into_owned());
        Ok(Self { name, items, reward: RewardConfig::default(), instruction: None })
    }

    /// Parses JSONL `text` as a dataset called `name` (used in errors as `name:line`).
    ///
    /// # Errors
    /// [`Error::Parse`] for a malformed line or a text without problems.
    pub fn from_str(name: &str, text: &str) -> Result<Self> {
        let items = parse_lines(name, text)?;
        Ok(Self { name: name.to_string(), items, reward: RewardConfig::default(), instruction: None })
    }

    /// The same dataset scored with `reward`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an invalid `reward`.
    pub fn with_reward(mut self, reward: RewardConfig) -> Result<Self> {
        reward.validate()?;
        self.reward = reward;
        Ok(self)
    }

    /// The same dataset with `instruction` appended to every question in place of the default ones (an empty
    /// string: the bare question).
    #[must_use]
    pub fn with_instruction(mut self, instruction: impl Into<String>) -> Self {
        self.instruction = Some(instruction.into());
        self
    }

    /// The reward settings.
    pub fn reward(&self) -> &RewardConfig {
        &self.reward
    }
}

fn parse_lines(name: &str, text: &str) -> Result<Vec<Item>> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut items = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let item = parse_line(line).map_err(|reason| Error::parse(format!("{name}:{}", i + 1), reason))?;
        items.push(item);
    }
    if items.is_empty() {
        return Err(Error::parse(name, "no problems (every line is blank)"));
    }
    Ok(items)
}

fn field<'a>(obj: &'a Map<String, Value>, names: &[&str]) -> std::result::Result<&'a Value, String> {
    names.iter().find_map(|n| obj.get(*n)).ok_or_else(|| format!("missing field `{}`", names.join("` or `")))
}

fn parse_line(line: &str) -> std::result::Result<Item, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let Value::Object(obj) = value else {
        return Err("expected a JSON object".into());
    };
    let question = match field(&obj, &["question", "problem"])? {
        Value::String(s) if !s.trim().is_empty() => s.trim().to_string(),
        Value::String(_) => return Err("empty question".into()),
        other => return Err(format!("`question` must be a string, got {other}")),
    };
    let (answer, hashes) = match field(&obj, &["answer", "solution"])? {
        Value::String(s) => {
            let hashes = s.contains("####");
            let answer = match extract_answer(s) {
                Some(a) => a,
                None if hashes || s.contains("\\boxed") || s.contains("\\fbox") => {
                    return Err("no final answer after `####` or inside `\\boxed{}`".into())
                }
                None => s.trim().to_string(),
            };
            (answer, hashes)
        }
        Value::Number(n) => (n.to_string(), false),
        other => return Err(format!("`answer` must be a string or a number, got {other}")),
    };
    if answer.is_empty() {
        return Err("empty answer".into());
    }
    Ok(Item { question, answer, hashes })
}

impl Task for JsonlTask {
    fn name(&self) -> &str {
        &self.name
    }

    fn len(&self) -> Option<u64> {
        Some(self.items.len() as u64)
    }

    fn problem(&self, index: u64) -> Result<Problem> {
        let item = usize::try_from(index).ok().and_then(|i| self.items.get(i)).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "problem {index} is out of range: `{}` has {} problems",
                self.name,
                self.items.len()
            ))
        })?;
        let instruction = match &self.instruction {
            Some(s) => s.as_str(),
            None if item.hashes => HASH_INSTRUCTION,
            None => BOXED_INSTRUCTION,
        };
        let prompt =
            if instruction.is_empty() { item.question.clone() } else { format!("{} {instruction}", item.question) };
        // GSM8K lines asked for `####` are graded by it alone (verl's grader) unless boxed answers are accepted.
        let answer = if item.hashes && self.instruction.is_none() && !self.reward.accept_boxed {
            Answer::Hashes(item.answer.clone())
        } else {
            Answer::Number(item.answer.clone())
        };
        Ok(Problem { index, prompt, answer })
    }

    fn score(&self, problem: &Problem, completion: &str) -> Score {
        score_answer(&problem.answer, completion, &self.reward)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DATA: &str = r#"{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?", "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"}

{"problem": "What is $\\frac{1}{2} + \\frac{1}{3}$?", "solution": "We get $\\boxed{\\frac{5}{6}}$.", "level": "Level 1"}
{"question": "How many?", "answer": 1234}
{"question": "Price?", "answer": "$1,234.50"}
{"question": "Simplify.", "answer": "\\frac{\\sqrt{3}}{2}"}
"#;

    fn answer(t: &JsonlTask, i: u64) -> String {
        match t.problem(i).unwrap().answer {
            Answer::Number(s) | Answer::Hashes(s) => s,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn task_jsonl_parses_gsm8k_math_and_bare() {
        let t = JsonlTask::from_str("mix", DATA).unwrap();
        assert_eq!((t.name(), t.len()), ("mix", Some(5)));
        assert_eq!(answer(&t, 0), "72");
        assert_eq!(answer(&t, 1), "\\frac{5}{6}");
        assert_eq!(answer(&t, 2), "1234");
        assert_eq!(answer(&t, 3), "$1,234.50");
        let p0 = t.problem(0).unwrap();
        assert!(p0.prompt.starts_with("Natalia sold") && p0.prompt.ends_with("after \"####\"."));
        assert!(t.problem(1).unwrap().prompt.ends_with("within \\boxed{}."));
        assert_eq!(t.problem(1).unwrap().index, 1);
        let err = t.problem(5).unwrap_err().to_string();
        assert!(err.contains("out of range") && err.contains("5 problems"), "{err}");
        let bare = t.clone().with_instruction("");
        assert_eq!(bare.problem(2).unwrap().prompt, "How many?");
        let custom = t.with_instruction("Answer in \\boxed{}.");
        assert_eq!(custom.problem(0).unwrap().prompt.matches("\\boxed{}").count(), 1);
    }

    #[test]
    fn task_jsonl_scores() {
        let t = JsonlTask::from_str("mix", DATA).unwrap();
        let cases = [
            (0, "24 + 48 = 72\n#### 72", true),
            (0, "#### 71", false),
            (1, "\\boxed{\\dfrac{10}{12}}", true),
            (1, "\\boxed{0.8333}", false),
            (2, "\\boxed{1,234}", true),
            (3, "#### $1234.5", true),
            (4, "\\boxed{\\dfrac{\\sqrt{3}}{2}}", true),
            (4, "\\boxed{\\frac{\\sqrt{2}}{2}}", false),
        ];
        for (i, completion, correct) in cases {
            let s = t.score(&t.problem(i).unwrap(), completion);
            assert_eq!((s.correct, s.formatted), (correct, true), "{i}: {completion}");
        }
        assert_eq!(t.score(&t.problem(0).unwrap(), "72"), Score::ZERO);
        // GSM8K lines are graded by `####` alone (verl's grader): a boxed answer is unformatted, and with both the
        // `####` one decides; `accept_boxed` (or a custom instruction) accepts a box, which then wins.
        let (boxed, both) = ("So the total is \\boxed{72}.", "\\boxed{71}\n#### 72");
        assert_eq!(t.score(&t.problem(0).unwrap(), boxed), Score::ZERO);
        assert!(t.score(&t.problem(0).unwrap(), both).correct);
        let accepting = t.clone().with_reward(RewardConfig { accept_boxed: true, ..RewardConfig::default() }).unwrap();
        assert!(accepting.score(&accepting.problem(0).unwrap(), boxed).correct);
        assert!(!accepting.score(&accepting.problem(0).unwrap(), both).correct);
        let custom = t.clone().with_instruction("Answer in \\boxed{}.");
        assert!(custom.score(&custom.problem(0).unwrap(), boxed).correct);
        let t =
            t.with_reward(RewardConfig { correct_reward: 2.0, time_limit_ms: 50, ..RewardConfig::default() }).unwrap();
        assert_eq!(t.score(&t.problem(0).unwrap(), "#### 72").reward, 2.0);
        assert_eq!(t.reward().time_limit_ms, 50);
    }

    #[test]
    fn task_jsonl_errors_name_the_line() {
        let cases = [
            ("{\"question\": \"a\", \"answer\": \"1\"}\n\nnot json\n", "bad:3"),
            ("{\"question\": \"a\"}", "bad:1"),
            ("{\"answer\": \"1\"}", "bad:1"),
            ("{\"question\": \"a\", \"answer\": \"1\"}\n[1, 2]", "bad:2"),
            ("{\"question\": \"\", \"answer\": \"1\"}", "bad:1"),
            ("{\"question\": \"a\", \"answer\": \"  \"}", "bad:1"),
            ("{\"question\": \"a\", \"answer\": null}", "bad:1"),
            ("{\"question\": 3, \"answer\": \"1\"}", "bad:1"),
            ("{\"question\": \"a\", \"answer\": \"\\\\boxed{}\"}", "bad:1"),
        ];
        for (text, what) in cases {
            match JsonlTask::from_str("bad", text) {
                Err(Error::Parse { what: w, reason }) => assert_eq!(w, what, "{text}: {reason}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        assert!(matches!(JsonlTask::from_str("empty", "\n  \n"), Err(Error::Parse { .. })));
        assert!(matches!(JsonlTask::from_str("empty", ""), Err(Error::Parse { .. })));
    }

    #[test]
    fn task_jsonl_open_file() {
        let dir = std::env::temp_dir().join(format!("tlt-rl-task-jsonl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("gsm8k_tiny.jsonl");
        std::fs::write(&path, format!("\u{feff}{DATA}")).unwrap();
        let t = JsonlTask::open(&path).unwrap();
        assert_eq!((t.name(), t.len()), ("gsm8k_tiny", Some(5)));
        std::fs::write(&path, "{\"question\": \"a\", \"answer\": \"1\"}\n{oops}\n").unwrap();
        let err = JsonlTask::open(&path).unwrap_err().to_string();
        assert!(err.contains(&format!("{}:2", path.display())), "{err}");
        assert!(matches!(JsonlTask::open(dir.join("missing.jsonl")), Err(Error::Io { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
