//! [`WordProblems`]: seeded GSM-style multi-step word problems with an exact integer answer, chain of thought asked.

use serde::{Deserialize, Serialize};
use tlt_kernels::SplitMix64;

use super::{score_answer, Answer, Problem, RewardConfig, Score, Task};
use crate::{Error, Result};

/// Settings of [`WordProblems`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WordConfig {
    /// Seed; problem `i` depends only on `(seed, i)`. Default 0.
    pub seed: u64,
    /// Fewest operations after the starting quantity (at least 1). Default 2.
    pub min_steps: usize,
    /// Most operations (at most 12). Default 6.
    pub max_steps: usize,
}

impl Default for WordConfig {
    fn default() -> Self {
        Self { seed: 0, min_steps: 2, max_steps: 6 }
    }
}

impl WordConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the offending field.
    pub fn validate(&self) -> Result<()> {
        if self.min_steps == 0 {
            return Err(Error::config("word.min_steps", "must be at least 1"));
        }
        if self.max_steps < self.min_steps || self.max_steps > 12 {
            return Err(Error::config("word.max_steps", format!("must be in {}..=12", self.min_steps)));
        }
        Ok(())
    }
}

const NAMES: [(&str, &str); 12] = [
    ("Maria", "she"),
    ("Tom", "he"),
    ("Aisha", "she"),
    ("Ben", "he"),
    ("Lena", "she"),
    ("Carlos", "he"),
    ("Yuki", "she"),
    ("Omar", "he"),
    ("Nina", "she"),
    ("Sam", "he"),
    ("Priya", "she"),
    ("Jack", "he"),
];
const ITEMS: [&str; 12] = [
    "apples", "marbles", "stickers", "books", "cookies", "pencils", "shells", "coins", "cards", "eggs", "stamps",
    "beads",
];
const FRIENDS: [&str; 6] = ["a friend", "a classmate", "the teacher", "a neighbour", "the school", "a cousin"];

/// Seeded multi-step word problems in the style of GSM8K: a person starts with some items, then two to six events
/// (buying packs, giving away, doubling, sharing equally, selling at a price...) change the count, and the question
/// asks for the final count. Every intermediate value is a positive integer below 10,000 and every division is
/// exact, so the answer is an exact integer. The prompt asks for step-by-step reasoning and the answer in
/// `\boxed{}`; scoring is [`score_answer`]. An endless generator.
///
/// ```
/// use tlt_rl::task::{Task, WordConfig, WordProblems};
///
/// let task = WordProblems::new(WordConfig { seed: 1, ..WordConfig::default() })?;
/// let p = task.problem(0)?;
/// assert!(p.prompt.contains("step by step"));
/// assert_eq!(p, task.problem(0)?);
/// # Ok::<(), tlt_rl::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct WordProblems {
    cfg: WordConfig,
    reward: RewardConfig,
}

/// Capitalises the first letter.
fn cap(s: &str) -> String {
    let mut c = s.chars();
    c.next().map_or_else(String::new, |f| f.to_uppercase().chain(c).collect())
}

impl WordProblems {
    /// A generator with `cfg` and the default [`RewardConfig`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an invalid `cfg`.
    pub fn new(cfg: WordConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self { cfg, reward: RewardConfig::default() })
    }

    /// The same generator scored with `reward`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an invalid `reward`.
    pub fn with_reward(mut self, reward: RewardConfig) -> Result<Self> {
        reward.validate()?;
        self.reward = reward;
        Ok(self)
    }

    /// The story of problem `index`, its question and the answer.
    pub fn story(&self, index: u64) -> (String, i64) {
        let mut rng = SplitMix64::new(self.cfg.seed).fork(index);
        let (name, pron) = NAMES[rng.below(NAMES.len())];
        let item = ITEMS[rng.below(ITEMS.len())];
        let steps = self.cfg.min_steps + rng.below(self.cfg.max_steps - self.cfg.min_steps + 1);
        let mut n: i64 = 5 + rng.below(46) as i64;
        let mut text = format!("{name} has {n} {item}.");
        let num = |rng: &mut SplitMix64, lo: i64, hi: i64| lo + rng.below((hi - lo + 1) as usize) as i64;
        let mut done = 0;
        while done < steps {
            let kind = rng.below(7);
            let sentence = match kind {
                0 => {
                    let k = num(&mut rng, 2, 9);
                    n += k;
                    format!("{} buys {k} more {item}.", cap(pron))
                }
                1 => {
                    let (packs, each) = (num(&mut rng, 2, 6), num(&mut rng, 3, 12));
                    n += packs * each;
                    format!("Then {pron} buys {packs} packs with {each} {item} in each pack.")
                }
                2 if n > 4 => {
                    let k = num(&mut rng, 2, n / 2);
                    n -= k;
                    format!("{} gives {k} {item} to {}.", cap(pron), FRIENDS[rng.below(FRIENDS.len())])
                }
                3 if n < 2_000 => {
                    let (f, word) = if rng.below(2) == 0 { (2, "doubles") } else { (3, "triples") };
                    n *= f;
                    format!("After a week the number of {item} {name} has {word}.")
                }
                4 => {
                    let divisors: Vec<i64> = (2..=6).filter(|d| n % d == 0 && n / d >= 2).collect();
                    if divisors.is_empty() {
                        continue;
                    }
                    let d = divisors[rng.below(divisors.len())];
                    n /= d;
                    format!("{} shares all of them equally among {d} boxes and keeps only one box.", cap(pron))
                }
                5 if n > 6 => {
                    let (days, per) = (num(&mut rng, 2, 5), num(&mut rng, 1, 3));
                    if days * per >= n {
                        continue;
                    }
                    n -= days * per;
                    format!("Every day for {days} days {pron} uses {per} of the {item}.")
                }
                6 => {
                    let (friends, each) = (num(&mut rng, 2, 4), num(&mut rng, 2, 8));
                    n += friends * each;
                    format!("{friends} friends each give {name} {each} {item}.")
                }
                _ => continue,
            };
            text.push(' ');
            text.push_str(&sentence);
            done += 1;
        }
        text.push_str(&format!(" How many {item} does {name} have now?"));
        (text, n)
    }
}

impl Task for WordProblems {
    fn name(&self) -> &str {
        "word"
    }

    fn len(&self) -> Option<u64> {
        None
    }

    fn problem(&self, index: u64) -> Result<Problem> {
        let (story, answer) = self.story(index);
        Ok(Problem {
            index,
            prompt: format!("{story} Let's think step by step, then put the final answer in \\boxed{{}}."),
            answer: Answer::Number(answer.to_string()),
        })
    }

    fn score(&self, problem: &Problem, completion: &str) -> Score {
        score_answer(&problem.answer, completion, &self.reward)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// An independent solver: replays the story's sentences with their own arithmetic.
    fn solve(story: &str) -> i64 {
        let nums = |s: &str| -> Vec<i64> {
            s.split(|c: char| !c.is_ascii_digit()).filter(|w| !w.is_empty()).map(|w| w.parse().unwrap()).collect()
        };
        let mut n = 0;
        for s in story.split_inclusive(['.', '?']).map(str::trim) {
            let v = nums(s);
            n = if s.contains(" has ") && !s.contains("How many") && !s.contains("number of") {
                v[0]
            } else if s.contains("packs with") || (s.contains("friends each give")) {
                n + v[0] * v[1]
            } else if s.contains("buys") {
                n + v[0]
            } else if s.contains("gives") {
                n - v[0]
            } else if s.contains("doubles") {
                n * 2
            } else if s.contains("triples") {
                n * 3
            } else if s.contains("boxes") {
                n / v[0]
            } else if s.contains("Every day") {
                n - v[0] * v[1]
            } else {
                n
            };
        }
        n
    }

    #[test]
    fn word_problems_are_seeded_and_varied() {
        let t = WordProblems::new(WordConfig::default()).unwrap();
        assert_eq!(t.problem(4).unwrap(), t.problem(4).unwrap());
        let other = WordProblems::new(WordConfig { seed: 1, ..WordConfig::default() }).unwrap();
        assert_ne!(t.problem(4).unwrap(), other.problem(4).unwrap());
        let prompts: std::collections::HashSet<String> = (0..200).map(|i| t.problem(i).unwrap().prompt).collect();
        assert_eq!(prompts.len(), 200);
        let p = t.problem(0).unwrap();
        let Answer::Number(a) = &p.answer else { panic!("numeric answer") };
        assert!(t.score(&p, &format!("so \\boxed{{{a}}}")).correct);
        assert!(!t.score(&p, "\\boxed{-1}").correct);
        assert!(WordConfig { min_steps: 0, ..WordConfig::default() }.validate().is_err());
        assert!(WordConfig { max_steps: 13, ..WordConfig::default() }.validate().is_err());
    }

    proptest! {
        /// Every answer is the independent solver's, a positive integer below 10,000, after the asked-for steps.
        #[test]
        fn word_answers_match_an_independent_solver(seed in any::<u64>(), index in any::<u64>(), lo in 1usize..6) {
            let cfg = WordConfig { seed, min_steps: lo, max_steps: lo + 3 };
            let (story, answer) = WordProblems::new(cfg).unwrap().story(index);
            prop_assert_eq!(solve(&story), answer, "{}", story);
            prop_assert!(answer > 0 && answer < 10_000, "{}", answer);
            let sentences = story.matches(['.', '?']).count();
            prop_assert!((lo + 2..=lo + 5).contains(&sentences), "{} sentences: {}", sentences, story);
        }
    }
}
