//! [`Countdown`]: TinyZero's "make the target from these numbers" task, answered in `<answer></answer>`.

use serde::{Deserialize, Serialize};
use tlt_kernels::SplitMix64;

use super::{score_answer, Answer, Problem, RewardConfig, Score, Task};
use crate::{Error, Result};

/// Settings of [`Countdown`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CountdownConfig {
    /// Seed; problem `i` depends only on `(seed, i)`. Default 0.
    pub seed: u64,
    /// Fewest numbers per puzzle (at least 2). Default 3.
    pub min_numbers: usize,
    /// Most numbers per puzzle (at most 8). Default 4.
    pub max_numbers: usize,
    /// Numbers are drawn from `1..=max_number` (at most 10,000). Default 50.
    pub max_number: i64,
    /// Targets lie in `1..=max_target` (at most 10^9). Default 100.
    pub max_target: i64,
}

impl Default for CountdownConfig {
    fn default() -> Self {
        Self { seed: 0, min_numbers: 3, max_numbers: 4, max_number: 50, max_target: 100 }
    }
}

impl CountdownConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the offending field.
    pub fn validate(&self) -> Result<()> {
        if self.min_numbers < 2 {
            return Err(Error::config("countdown.min_numbers", "must be at least 2"));
        }
        if self.max_numbers < self.min_numbers || self.max_numbers > 8 {
            return Err(Error::config("countdown.max_numbers", format!("must be in {}..=8", self.min_numbers)));
        }
        if !(1..=10_000).contains(&self.max_number) {
            return Err(Error::config("countdown.max_number", "must be in 1..=10000"));
        }
        if !(1..=1_000_000_000).contains(&self.max_target) {
            return Err(Error::config("countdown.max_target", "must be in 1..=1000000000"));
        }
        Ok(())
    }
}

/// Attempts at a puzzle with a target in range before falling back to the sum of the numbers.
const MAX_ATTEMPTS: usize = 256;

/// TinyZero-style Countdown: "Using the numbers [44, 19, 35], create an equation that equals 98 ...". Every target is
/// reachable: it is the value of a random expression over all the numbers (integer intermediate results, exact
/// divisions), retried until it lies in `1..=max_target` (after 256 misses, the sum of the numbers is used).
///
/// The verifier takes the last `<answer>...</answer>`, allows only digits, `+ - * / ( )` and spaces, requires each
/// provided number to be used exactly once (TinyZero), and evaluates exactly (overflow or division by zero: not correct).
///
/// ```
/// use tlt_rl::task::{Countdown, CountdownConfig, Task};
///
/// let task = Countdown::new(CountdownConfig::default())?;
/// let p = task.problem(0)?;
/// let (_, _, solution) = task.puzzle(0);
/// assert!(task.score(&p, &format!("<answer>{solution}</answer>")).correct);
/// # Ok::<(), tlt_rl::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Countdown {
    cfg: CountdownConfig,
    reward: RewardConfig,
}

/// A partial expression while a puzzle is built.
struct Node {
    text: String,
    value: i128,
    compound: bool,
}

impl Node {
    fn operand(&self) -> String {
        if self.compound {
            format!("({})", self.text)
        } else {
            self.text.clone()
        }
    }
}

impl Countdown {
    /// A generator with `cfg` and the default [`RewardConfig`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an invalid `cfg`.
    pub fn new(cfg: CountdownConfig) -> Result<Self> {
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

    /// The generator settings.
    pub fn config(&self) -> &CountdownConfig {
        &self.cfg
    }

    /// The reward settings.
    pub fn reward(&self) -> &RewardConfig {
        &self.reward
    }

    /// Puzzle `index`: its numbers, its target and one solution (an expression using every number once).
    pub fn puzzle(&self, index: u64) -> (Vec<i64>, i64, String) {
        let mut rng = SplitMix64::new(self.cfg.seed).fork(index);
        let max_number = usize::try_from(self.cfg.max_number).unwrap_or(1);
        let mut numbers = Vec::new();
        for _ in 0..MAX_ATTEMPTS {
            let n = self.cfg.min_numbers + rng.below(self.cfg.max_numbers - self.cfg.min_numbers + 1);
            numbers = (0..n).map(|_| 1 + rng.below(max_number) as i64).collect();
            let root = random_expression(&numbers, &mut rng);
            if let Ok(target) = i64::try_from(root.value) {
                if (1..=self.cfg.max_target).contains(&target) {
                    return (numbers, target, root.text);
                }
            }
        }
        let text = numbers.iter().map(i64::to_string).collect::<Vec<_>>().join(" + ");
        (numbers.clone(), numbers.iter().sum(), text)
    }
}

/// A random expression tree over all `numbers`: repeatedly combines two random nodes with a random operator, keeping
/// every intermediate value a positive integer (a subtraction is ordered, an inexact division or an overflow
/// becomes an addition).
fn random_expression(numbers: &[i64], rng: &mut SplitMix64) -> Node {
    let mut pool: Vec<Node> =
        numbers.iter().map(|&n| Node { text: n.to_string(), value: i128::from(n), compound: false }).collect();
    while pool.len() > 1 {
        let mut a = pool.swap_remove(rng.below(pool.len()));
        let mut b = pool.swap_remove(rng.below(pool.len()));
        let mut op = b"+-*/"[rng.below(4)];
        if (op == b'-' && a.value < b.value) || (op == b'/' && a.value % b.value != 0 && b.value % a.value == 0) {
            std::mem::swap(&mut a, &mut b);
        }
        let value = match op {
            b'-' if a.value > b.value => Some(a.value - b.value),
            b'*' => a.value.checked_mul(b.value),
            b'/' if a.value % b.value == 0 => Some(a.value / b.value),
            _ => None,
        };
        let value = value.unwrap_or_else(|| {
            op = b'+';
            a.value + b.value
        });
        let text = format!("{} {} {}", a.operand(), char::from(op), b.operand());
        pool.push(Node { text, value, compound: true });
    }
    pool.pop().unwrap_or(Node { text: "0".into(), value: 0, compound: false })
}

impl Task for Countdown {
    fn name(&self) -> &str {
        "countdown"
    }

    fn len(&self) -> Option<u64> {
        None
    }

    fn problem(&self, index: u64) -> Result<Problem> {
        let (numbers, target, _) = self.puzzle(index);
        let prompt = format!(
            "Using the numbers {numbers:?}, create an equation that equals {target}. You can use basic arithmetic \
             operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. \
             And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
        );
        Ok(Problem { index, prompt, answer: Answer::Countdown { numbers, target } })
    }

    fn score(&self, problem: &Problem, completion: &str) -> Score {
        score_answer(&problem.answer, completion, &self.reward)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::expr::evaluate;
    use crate::task::verdict::Deadline;
    use proptest::prelude::*;

    fn task(seed: u64) -> Countdown {
        Countdown::new(CountdownConfig { seed, ..CountdownConfig::default() }).unwrap()
    }

    fn grade(numbers: &[i64], target: i64, completion: &str) -> Score {
        let bonus = RewardConfig { format_reward: 0.1, ..RewardConfig::default() };
        score_answer(&Answer::Countdown { numbers: numbers.to_vec(), target }, completion, &bonus)
    }

    #[test]
    fn task_countdown_deterministic_reachable_and_in_range() {
        let t = task(11);
        let mut targets = std::collections::HashSet::new();
        for i in 0..300 {
            let p = t.problem(i).unwrap();
            assert_eq!(p, task(11).problem(i).unwrap());
            let Answer::Countdown { numbers, target } = &p.answer else { panic!() };
            assert!((3..=4).contains(&numbers.len()) && numbers.iter().all(|n| (1..=50).contains(n)));
            assert!((1..=100).contains(target), "{target}");
            assert!(p.prompt.contains(&format!("{numbers:?}")) && p.prompt.contains(&format!("equals {target}.")));
            let (_, _, solution) = t.puzzle(i);
            let e = evaluate(&solution, &mut Deadline::none()).unwrap();
            let mut used: Vec<i64> = e.literals.iter().map(|&x| x as i64).collect();
            let mut sorted = numbers.clone();
            used.sort_unstable();
            sorted.sort_unstable();
            assert_eq!(used, sorted, "every number exactly once: {solution}");
            let s = t.score(&p, &format!("<think>hmm</think>\n<answer> {solution} </answer>"));
            assert!(s.correct && (s.reward - 1.0).abs() < 1e-12, "{solution}: {s:?}");
            targets.insert(*target);
        }
        assert!(targets.len() > 50, "{}", targets.len());
        assert_ne!(task(1).problem(0).unwrap(), task(2).problem(0).unwrap());
        assert_ne!(t.problem(0).unwrap().prompt, t.problem(1).unwrap().prompt);
    }

    #[test]
    fn task_countdown_grading() {
        let n = [44, 19, 35];
        let ok = |s: &str| grade(&n, 98, s);
        assert!(ok("<answer>44 + 19 + 35</answer>").correct);
        assert!(ok("<answer>(44 + 19) + 35</answer>").correct);
        assert!(ok("<answer>35 + 19 + 44</answer>").correct, "any order");
        assert!(ok("<answer>1</answer> then <answer>44 + 19 + 35</answer>").correct, "the last tag counts");
        assert!(!ok("<answer>44 + 19 + 35</answer> then <answer>1</answer>").correct);
        let wrong = ok("<answer>44 + 19 - 35</answer>");
        assert_eq!((wrong.correct, wrong.formatted, wrong.reward), (false, true, 0.1));
        assert!(!ok("<answer>44 + 44 + 10</answer>").correct, "44 reused");
        assert!(!ok("<answer>49 + 49</answer>").correct, "numbers not in the list");
        assert!(!ok("<answer>44 + 19 + 35 = 98</answer>").correct, "only the expression");
        assert!(!ok("<answer>44 + 19 + 35 + 0</answer>").correct, "0 is not provided");
        assert!(ok("<answer>044 + 19 + 35</answer>").correct, "leading zeros are the same number");
        let s = ok("<answer>44 + 19 + 35 + 35 / (19 - 19)</answer>");
        assert_eq!((s.correct, s.formatted), (false, true), "division by zero");
        assert!(!ok("<answer>-44 + 142</answer>").correct, "no unary minus");
        assert!(!ok("<answer>４４ + 19 + 35</answer>").correct, "unicode digits");
        assert_eq!(ok("44 + 19 + 35"), Score::ZERO);
        assert_eq!(ok("<answer>44 + 19 + 35"), Score::ZERO);
        assert_eq!(ok(""), Score::ZERO);
        assert_eq!(ok("<answer></answer>").reward, 0.1);
        // Division: exact rationals, by zero is wrong.
        assert!(grade(&[8, 4, 2], 1, "<answer>8 / 4 / 2</answer>").correct);
        assert!(grade(&[1, 2, 3], 1, "<answer>(1 + 2) / 3</answer>").correct);
        assert!(!grade(&[3, 1, 2], 5, "<answer>(3 - 1 / 2) * 2</answer>").correct, "2 reused");
        assert!(!grade(&[3, 1, 2, 2, 7], 5, "<answer>(3 - 1 / 2) * 2</answer>").correct, "7 left out");
        assert!(grade(&[3, 1, 2, 2], 5, "<answer>(3 - 1 / 2) * 2</answer>").correct);
        let zero = grade(&[5, 5, 1], 1, "<answer>1 / (5 - 5)</answer>");
        assert_eq!((zero.correct, zero.formatted), (false, true));
        // Huge literals overflow: not correct, no panic.
        let huge = format!("1{}", "0".repeat(500));
        assert!(!grade(&[1, 2], 3, &format!("<answer>{huge} - {huge} + 3</answer>")).correct);
        let big = "9".repeat(30);
        assert!(!grade(&[1], 1, &format!("<answer>{big} * {big} * {big}</answer>")).correct);
    }

    /// TinyZero requires every number exactly once: an equation that reaches the target with a number left out is
    /// formatted but wrong (it was graded correct when numbers only had to be used at most once).
    #[test]
    fn task_countdown_requires_every_number() {
        let s = grade(&[44, 19, 35, 2], 98, "<answer>44 + 19 + 35</answer>");
        assert_eq!((s.correct, s.formatted, s.reward), (false, true, 0.1), "2 left out");
        assert!(!grade(&[44, 19, 35, 2], 98, "<answer>(44 + 19 + 35) * 2 / 2</answer>").correct, "2 reused");
        assert!(grade(&[44, 19, 35, 1], 98, "<answer>(44 + 19 + 35) * 1</answer>").correct);
    }

    #[test]
    fn task_countdown_config_validation() {
        let bad = [
            CountdownConfig { min_numbers: 1, ..Default::default() },
            CountdownConfig { min_numbers: 4, max_numbers: 3, ..Default::default() },
            CountdownConfig { max_numbers: 9, ..Default::default() },
            CountdownConfig { max_number: 0, ..Default::default() },
            CountdownConfig { max_target: 0, ..Default::default() },
        ];
        for cfg in bad {
            assert!(matches!(Countdown::new(cfg.clone()), Err(Error::InvalidConfig { .. })), "{cfg:?}");
        }
        let t = Countdown::new(CountdownConfig { max_target: 1, min_numbers: 2, max_numbers: 2, ..Default::default() })
            .unwrap();
        for i in 0..20 {
            let (numbers, target, solution) = t.puzzle(i);
            assert!(grade(&numbers, target, &format!("<answer>{solution}</answer>")).correct);
        }
        assert!(task(0).with_reward(RewardConfig { correct_reward: f64::INFINITY, ..Default::default() }).is_err());
        assert_eq!(task(0).config().max_number, 50);
        assert_eq!(task(0).reward(), &RewardConfig::default());
    }

    proptest! {
        #[test]
        fn task_prop_countdown_solutions_verify(
            seed in any::<u64>(),
            index in any::<u64>(),
            lo in 2usize..5,
            extra in 0usize..4,
        ) {
            let (max_number, max_target) = (100, 1000);
            let cfg = CountdownConfig { seed, min_numbers: lo, max_numbers: lo + extra, max_number, max_target };
            let t = Countdown::new(cfg).unwrap();
            let p = t.problem(index).unwrap();
            let (_, _, solution) = t.puzzle(index);
            let completion = format!("<answer>{solution}</answer>");
            prop_assert!(t.score(&p, &completion).correct);
        }

        #[test]
        fn task_prop_countdown_never_panics(s in any::<String>(), e in "[0-9+*/() -]{0,40}") {
            for c in [s.clone(), format!("<answer>{e}</answer>"), format!("<answer>{s}</answer>")] {
                let score = grade(&[1, 2, 3, 4], 10, &c);
                prop_assert!(score.reward.is_finite() && (!score.correct || score.formatted));
            }
        }
    }
}
