//! [`Arithmetic`]: seeded multi-step integer arithmetic ("Compute 7 + 5 * 3."), answered in `\boxed{}`.

use serde::{Deserialize, Serialize};
use tlt_kernels::SplitMix64;

use super::expr::evaluate;
use super::{score_answer, Answer, Deadline, Problem, RewardConfig, Score, Task};
use crate::{Error, Result};

/// Settings of [`Arithmetic`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArithmeticConfig {
    /// Seed; problem `i` depends only on `(seed, i)`. Default 0.
    pub seed: u64,
    /// Fewest operators per expression (at least 1). Default 1.
    pub min_ops: usize,
    /// Most operators per expression (at most 32). Default 2.
    pub max_ops: usize,
    /// Operands are drawn from `1..=max_operand`; `max_operand^(max_ops + 1)` must stay within `10^30` so every
    /// answer is exact. Default 20.
    pub max_operand: i64,
    /// The operators to draw from, a string over `+-*/` (a repeated operator is drawn more often). Divisions are
    /// built to be exact, so every answer is an integer. Default `"+-*"`.
    pub ops: String,
}

impl Default for ArithmeticConfig {
    fn default() -> Self {
        Self { seed: 0, min_ops: 1, max_ops: 2, max_operand: 20, ops: "+-*".into() }
    }
}

impl ArithmeticConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the offending field.
    pub fn validate(&self) -> Result<()> {
        if self.min_ops == 0 {
            return Err(Error::config("arithmetic.min_ops", "must be at least 1"));
        }
        if self.max_ops < self.min_ops || self.max_ops > 32 {
            return Err(Error::config("arithmetic.max_ops", format!("must be in {}..=32", self.min_ops)));
        }
        if !(1..=1_000_000).contains(&self.max_operand) {
            return Err(Error::config("arithmetic.max_operand", "must be in 1..=1000000"));
        }
        let bound = u32::try_from(self.max_ops + 1).ok().and_then(|e| i128::from(self.max_operand).checked_pow(e));
        if bound.is_none_or(|b| b > 10i128.pow(30)) {
            return Err(Error::config(
                "arithmetic.max_operand",
                format!("max_operand^(max_ops + 1) = {}^{} exceeds 10^30", self.max_operand, self.max_ops + 1),
            ));
        }
        if self.ops.is_empty() || !self.ops.chars().all(|c| "+-*/".contains(c)) {
            return Err(Error::config(
                "arithmetic.ops",
                format!("`{}` must be a non-empty string over +-*/", self.ops),
            ));
        }
        Ok(())
    }
}

/// Seeded multi-step integer arithmetic with the usual precedence, e.g. "Compute 7 + 5 * 3. Put the final answer in
/// \boxed{}." (answer 22). An endless generator; divisions are exact by construction.
///
/// ```
/// use tlt_rl::task::{Arithmetic, ArithmeticConfig, Task};
///
/// let task = Arithmetic::new(ArithmeticConfig { seed: 3, ..ArithmeticConfig::default() })?;
/// let p = task.problem(5)?;
/// assert_eq!(p, task.problem(5)?);
/// # Ok::<(), tlt_rl::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Arithmetic {
    cfg: ArithmeticConfig,
    ops: Vec<u8>,
    reward: RewardConfig,
}

impl Arithmetic {
    /// A generator with `cfg` and the default [`RewardConfig`].
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an invalid `cfg`.
    pub fn new(cfg: ArithmeticConfig) -> Result<Self> {
        cfg.validate()?;
        let ops = cfg.ops.bytes().collect();
        Ok(Self { cfg, ops, reward: RewardConfig::default() })
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
    pub fn config(&self) -> &ArithmeticConfig {
        &self.cfg
    }

    /// The reward settings.
    pub fn reward(&self) -> &RewardConfig {
        &self.reward
    }

    /// The expression of problem `index` and its value.
    ///
    /// # Errors
    /// Only on an internal inconsistency (the expression does not evaluate to an integer).
    pub fn expression(&self, index: u64) -> Result<(String, i128)> {
        let mut rng = SplitMix64::new(self.cfg.seed).fork(index);
        let n_ops = self.cfg.min_ops + rng.below(self.cfg.max_ops - self.cfg.min_ops + 1);
        let max = u64::try_from(self.cfg.max_operand).unwrap_or(1);
        let operand = |rng: &mut SplitMix64| 1 + i128::from(rng.next_u64() % max);
        let mut term = operand(&mut rng); // the value of the current `*`/`/` chain, always a positive integer
        let mut expr = term.to_string();
        for _ in 0..n_ops {
            let op = self.ops[rng.below(self.ops.len())];
            let x = match op {
                b'/' => {
                    let divisors: Vec<i128> =
                        (2..=term.min(i128::from(self.cfg.max_operand))).filter(|d| term % d == 0).collect();
                    if divisors.is_empty() {
                        1
                    } else {
                        divisors[rng.below(divisors.len())]
                    }
                }
                _ => operand(&mut rng),
            };
            term = match op {
                b'*' => term * x,
                b'/' => term / x,
                _ => x,
            };
            expr.push(' ');
            expr.push(char::from(op));
            expr.push(' ');
            expr.push_str(&x.to_string());
        }
        match evaluate(&expr, &mut Deadline::none()) {
            Ok(e) if e.value.is_integer() => Ok((expr, e.value.numer())),
            other => Err(Error::InvalidArgument(format!("arithmetic: `{expr}` has no integer value ({other:?})"))),
        }
    }
}

impl Task for Arithmetic {
    fn name(&self) -> &str {
        "arithmetic"
    }

    fn len(&self) -> Option<u64> {
        None
    }

    fn problem(&self, index: u64) -> Result<Problem> {
        let (expr, value) = self.expression(index)?;
        Ok(Problem {
            index,
            prompt: format!("Compute {expr}. Put the final answer in \\boxed{{}}."),
            answer: Answer::Number(value.to_string()),
        })
    }

    fn score(&self, problem: &Problem, completion: &str) -> Score {
        score_answer(&problem.answer, completion, &self.reward)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn task(seed: u64) -> Arithmetic {
        Arithmetic::new(ArithmeticConfig { seed, ..ArithmeticConfig::default() }).unwrap()
    }

    fn truth(p: &Problem) -> String {
        match &p.answer {
            Answer::Number(n) => n.clone(),
            other => panic!("{other:?}"),
        }
    }

    /// Independent evaluation of `a op b op c ...` with `+ - *` only: sum of products.
    fn naive(expr: &str) -> i128 {
        let toks: Vec<&str> = expr.split(' ').collect();
        let (mut sum, mut term, mut sign) = (0i128, toks[0].parse::<i128>().unwrap(), 1i128);
        for pair in toks[1..].chunks(2) {
            let x: i128 = pair[1].parse().unwrap();
            match pair[0] {
                "*" => term *= x,
                op => {
                    sum += sign * term;
                    sign = if op == "+" { 1 } else { -1 };
                    term = x;
                }
            }
        }
        sum + sign * term
    }

    #[test]
    fn task_arithmetic_deterministic_and_varied() {
        let (a, b) = (task(1), task(1));
        for i in 0..50 {
            assert_eq!(a.problem(i).unwrap(), b.problem(i).unwrap());
        }
        let prompts: std::collections::HashSet<String> = (0..50).map(|i| a.problem(i).unwrap().prompt).collect();
        assert!(prompts.len() >= 40, "{}", prompts.len());
        assert_ne!(task(1).problem(0).unwrap(), task(2).problem(0).unwrap());
        let p = a.problem(3).unwrap();
        assert_eq!(p.index, 3);
        assert!(p.prompt.starts_with("Compute ") && p.prompt.ends_with("Put the final answer in \\boxed{}."));
        assert_eq!(a.len(), None);
        assert!(!a.is_empty());
    }

    #[test]
    fn task_arithmetic_precedence_matches_naive() {
        let t = Arithmetic::new(ArithmeticConfig { seed: 9, min_ops: 1, max_ops: 6, ..ArithmeticConfig::default() })
            .unwrap();
        for i in 0..200 {
            let (expr, value) = t.expression(i).unwrap();
            let n_ops = expr.split(' ').count() / 2;
            assert!((1..=6).contains(&n_ops), "{expr}");
            assert_eq!(value, naive(&expr), "{expr}");
        }
    }

    #[test]
    fn task_arithmetic_exact_division() {
        let t = Arithmetic::new(ArithmeticConfig {
            seed: 4,
            min_ops: 3,
            max_ops: 3,
            ops: "/*/".into(),
            ..Default::default()
        })
        .unwrap();
        let mut saw_real_division = false;
        for i in 0..100 {
            let (expr, _) = t.expression(i).unwrap();
            saw_real_division |= expr.split(" / ").skip(1).any(|d| !d.starts_with("1 ") && d != "1");
        }
        assert!(saw_real_division);
    }

    #[test]
    fn task_arithmetic_scores_its_own_answers() {
        let t = task(5).with_reward(RewardConfig { format_reward: 0.1, ..Default::default() }).unwrap();
        for i in 0..30 {
            let p = t.problem(i).unwrap();
            let ans = truth(&p);
            let right = t.score(&p, &format!("Let me think. The answer is \\boxed{{{ans}}}."));
            assert!(right.correct && (right.reward - 1.1).abs() < 1e-12, "{right:?}");
            let right = t.score(&p, &format!("work\n#### {ans}"));
            assert!(right.correct);
            let wrong: i128 = ans.parse::<i128>().unwrap() + 1;
            let s = t.score(&p, &format!("\\boxed{{{wrong}}}"));
            assert_eq!((s.correct, s.formatted, s.reward), (false, true, 0.1));
            assert_eq!(t.score(&p, &ans), Score::ZERO);
        }
    }

    #[test]
    fn task_arithmetic_config_validation() {
        let bad = [
            ArithmeticConfig { min_ops: 0, ..Default::default() },
            ArithmeticConfig { min_ops: 3, max_ops: 2, ..Default::default() },
            ArithmeticConfig { max_ops: 33, ..Default::default() },
            ArithmeticConfig { max_operand: 0, ..Default::default() },
            ArithmeticConfig { max_operand: 1_000_000, max_ops: 5, ..Default::default() },
            ArithmeticConfig { ops: String::new(), ..Default::default() },
            ArithmeticConfig { ops: "+^".into(), ..Default::default() },
        ];
        for cfg in bad {
            assert!(matches!(Arithmetic::new(cfg.clone()), Err(Error::InvalidConfig { .. })), "{cfg:?}");
        }
        let cfg: ArithmeticConfig = serde_json::from_str(r#"{"seed": 2, "ops": "*"}"#).unwrap();
        assert_eq!(cfg, ArithmeticConfig { seed: 2, ops: "*".into(), ..Default::default() });
        assert!(serde_json::from_str::<ArithmeticConfig>(r#"{"sed": 2}"#).is_err());
        assert!(task(0).with_reward(RewardConfig { time_limit_ms: 0, ..Default::default() }).is_err());
        let t = task(0).with_reward(RewardConfig { format_reward: 0.0, ..Default::default() }).unwrap();
        assert_eq!(t.reward().format_reward, 0.0);
        assert_eq!(t.config().seed, 0);
    }

    proptest! {
        #[test]
        fn task_prop_arithmetic_answers_verify(seed in any::<u64>(), index in any::<u64>(), ops in "[-+*/]{1,4}") {
            let t = Arithmetic::new(ArithmeticConfig { seed, ops, max_ops: 4, ..Default::default() }).unwrap();
            let p = t.problem(index).unwrap();
            prop_assert_eq!(&p, &t.problem(index).unwrap());
            let ans = truth(&p);
            let completion = format!("\\boxed{{{ans}}}");
            prop_assert!(t.score(&p, &completion).correct);
        }

        #[test]
        fn task_prop_arithmetic_score_never_panics(s in any::<String>(), index in 0u64..100) {
            let t = task(0);
            let p = t.problem(index).unwrap();
            let score = t.score(&p, &s);
            prop_assert!(score.reward.is_finite() && (!score.correct || score.formatted));
        }
    }
}
