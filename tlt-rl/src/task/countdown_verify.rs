//! The Countdown verifier: an equation in `<answer>` tags that reaches the target using every given number exactly
//! once. Apart from the Countdown task (which scores through `score_answer` in `task/mod.rs`, which calls this), so
//! that neither file imports the other.

use super::expr::{evaluate, ExprError, Rational};
use super::verdict::{Deadline, Verdict};

/// The trimmed content of the last `<answer>...</answer>`.
fn answer_tag(text: &str) -> Option<&str> {
    let end = text.rfind("</answer>")?;
    let start = text[..end].rfind("<answer>")? + "<answer>".len();
    Some(text[start..end].trim())
}

/// Whether the multiset `used` equals the multiset `available`: every provided number used exactly once, as
/// TinyZero's `validate_equation` requires (an equation that leaves a number out is wrong).
fn uses_each_exactly_once(used: &[i128], available: &[i64]) -> bool {
    let mut avail: Vec<i128> = available.iter().map(|&x| i128::from(x)).collect();
    let mut used = used.to_vec();
    avail.sort_unstable();
    used.sort_unstable();
    used == avail
}

/// Grades `text` against a Countdown puzzle.
pub(crate) fn verify(numbers: &[i64], target: i64, text: &str, deadline: &mut Deadline) -> Verdict {
    if deadline.tick().is_err() {
        return Verdict::TimedOut;
    }
    let Some(equation) = answer_tag(text) else {
        return Verdict::Unformatted;
    };
    match evaluate(equation, deadline) {
        Err(ExprError::TimedOut) => Verdict::TimedOut,
        Err(_) => Verdict::Wrong,
        Ok(e) if uses_each_exactly_once(&e.literals, numbers) && e.value == Rational::int(i128::from(target)) => {
            Verdict::Correct
        }
        Ok(_) => Verdict::Wrong,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_countdown_multiset() {
        assert!(uses_each_exactly_once(&[], &[]));
        assert!(uses_each_exactly_once(&[2, 3, 2], &[2, 2, 3]));
        assert!(!uses_each_exactly_once(&[], &[1]), "a number left out");
        assert!(!uses_each_exactly_once(&[2, 2], &[2, 3, 2]), "a number left out");
        assert!(!uses_each_exactly_once(&[2, 2], &[2, 3]));
        assert!(!uses_each_exactly_once(&[4], &[2, 3]));
        assert!(!uses_each_exactly_once(&[1], &[]));
    }
}
