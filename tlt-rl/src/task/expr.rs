//! Exact rational arithmetic on `i128` and a safe evaluator for `+ - * / ( )` expressions over non-negative integer
//! literals (the Countdown verifier and the arithmetic generator).
//!
//! The evaluator is an iterative shunting-yard (no recursion, so deep nesting cannot overflow the stack), checks a
//! [`Deadline`] per token, and reports overflow and division by zero as errors instead of panicking.

use super::verdict::{Deadline, TimedOut};

/// An exact fraction `num / den` in lowest terms with `den > 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rational {
    num: i128,
    den: i128,
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Rational {
    /// Zero.
    pub(crate) const ZERO: Self = Self { num: 0, den: 1 };

    /// The integer `n`.
    pub(crate) fn int(n: i128) -> Self {
        Self { num: n, den: 1 }
    }

    /// `num / den` reduced; `None` for a zero denominator or an overflow.
    pub(crate) fn new(num: i128, den: i128) -> Option<Self> {
        if den == 0 {
            return None;
        }
        let (num, den) = if den < 0 { (num.checked_neg()?, den.checked_neg()?) } else { (num, den) };
        let g = gcd(num.unsigned_abs(), den.unsigned_abs());
        // g divides den > 0, so 1 <= g <= den <= i128::MAX.
        let g = i128::try_from(g).ok()?;
        Some(Self { num: num / g, den: den / g })
    }

    /// The numerator (sign included).
    pub(crate) fn numer(self) -> i128 {
        self.num
    }

    /// Whether this is an integer.
    pub(crate) fn is_integer(self) -> bool {
        self.den == 1
    }

    /// `self + rhs`, `None` on overflow.
    pub(crate) fn add(self, rhs: Self) -> Option<Self> {
        let g = i128::try_from(gcd(self.den.unsigned_abs(), rhs.den.unsigned_abs())).ok()?;
        let (l, r) = (rhs.den / g, self.den / g);
        let num = self.num.checked_mul(l)?.checked_add(rhs.num.checked_mul(r)?)?;
        Self::new(num, self.den.checked_mul(l)?)
    }

    /// `self - rhs`, `None` on overflow.
    pub(crate) fn sub(self, rhs: Self) -> Option<Self> {
        self.add(Self { num: rhs.num.checked_neg()?, den: rhs.den })
    }

    /// `self * rhs`, `None` on overflow.
    pub(crate) fn mul(self, rhs: Self) -> Option<Self> {
        let g1 = i128::try_from(gcd(self.num.unsigned_abs(), rhs.den.unsigned_abs())).ok()?.max(1);
        let g2 = i128::try_from(gcd(rhs.num.unsigned_abs(), self.den.unsigned_abs())).ok()?.max(1);
        let num = (self.num / g1).checked_mul(rhs.num / g2)?;
        let den = (self.den / g2).checked_mul(rhs.den / g1)?;
        Self::new(num, den)
    }

    /// `self / rhs`, `None` on division by zero or overflow.
    pub(crate) fn div(self, rhs: Self) -> Option<Self> {
        if rhs.num == 0 {
            return None;
        }
        self.mul(Self::new(rhs.den, rhs.num)?)
    }
}

/// Why an expression has no value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExprError {
    /// A character outside `0-9 + - * / ( )` and whitespace, or a malformed expression.
    Syntax,
    /// A division by zero.
    DivisionByZero,
    /// A literal or an intermediate result does not fit.
    Overflow,
    /// The deadline passed.
    TimedOut,
}

impl From<TimedOut> for ExprError {
    fn from(_: TimedOut) -> Self {
        Self::TimedOut
    }
}

/// The value of an expression and the integer literals it used, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Evaluation {
    /// The exact value.
    pub(crate) value: Rational,
    /// The literals, left to right.
    pub(crate) literals: Vec<i128>,
}

/// Literals longer than this many digits are an overflow (`i128` holds 38).
const MAX_LITERAL_DIGITS: usize = 36;

fn precedence(op: u8) -> u8 {
    match op {
        b'*' | b'/' => 2,
        _ => 1,
    }
}

fn apply(values: &mut Vec<Rational>, op: u8) -> Result<(), ExprError> {
    let (Some(b), Some(a)) = (values.pop(), values.pop()) else {
        return Err(ExprError::Syntax);
    };
    let v = match op {
        b'+' => a.add(b).ok_or(ExprError::Overflow)?,
        b'-' => a.sub(b).ok_or(ExprError::Overflow)?,
        b'*' => a.mul(b).ok_or(ExprError::Overflow)?,
        b'/' if b == Rational::ZERO => return Err(ExprError::DivisionByZero),
        b'/' => a.div(b).ok_or(ExprError::Overflow)?,
        _ => return Err(ExprError::Syntax),
    };
    values.push(v);
    Ok(())
}

/// Evaluates `src`: non-negative integer literals, binary `+ - * /` with the usual precedence (left-associative),
/// parentheses and ASCII whitespace; no unary operators.
pub(crate) fn evaluate(src: &str, deadline: &mut Deadline) -> Result<Evaluation, ExprError> {
    let bytes = src.as_bytes();
    let mut values: Vec<Rational> = Vec::new();
    let mut ops: Vec<u8> = Vec::new();
    let mut literals = Vec::new();
    let mut expect_operand = true;
    let mut i = 0;
    while i < bytes.len() {
        deadline.tick()?;
        let c = bytes[i];
        match c {
            b' ' | b'\t' | b'\n' | b'\r' => i += 1,
            b'0'..=b'9' if expect_operand => {
                let start = i;
                while i < bytes.len() && bytes[i].is_ascii_digit() {
                    i += 1;
                }
                let digits = &src[start..i];
                if digits.len() > MAX_LITERAL_DIGITS {
                    return Err(ExprError::Overflow);
                }
                let n: i128 = digits.parse().map_err(|_| ExprError::Overflow)?;
                literals.push(n);
                values.push(Rational::int(n));
                expect_operand = false;
            }
            b'(' if expect_operand => {
                ops.push(c);
                i += 1;
            }
            b')' if !expect_operand => {
                loop {
                    deadline.tick()?;
                    match ops.pop() {
                        Some(b'(') => break,
                        Some(op) => apply(&mut values, op)?,
                        None => return Err(ExprError::Syntax),
                    }
                }
                i += 1;
            }
            b'+' | b'-' | b'*' | b'/' if !expect_operand => {
                while let Some(&top) = ops.last() {
                    if top == b'(' || precedence(top) < precedence(c) {
                        break;
                    }
                    deadline.tick()?;
                    ops.pop();
                    apply(&mut values, top)?;
                }
                ops.push(c);
                expect_operand = true;
                i += 1;
            }
            _ => return Err(ExprError::Syntax),
        }
    }
    if expect_operand {
        return Err(ExprError::Syntax);
    }
    while let Some(op) = ops.pop() {
        deadline.tick()?;
        if op == b'(' {
            return Err(ExprError::Syntax);
        }
        apply(&mut values, op)?;
    }
    match (values.pop(), values.is_empty()) {
        (Some(value), true) => Ok(Evaluation { value, literals }),
        _ => Err(ExprError::Syntax),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(s: &str) -> Result<Rational, ExprError> {
        evaluate(s, &mut Deadline::none()).map(|e| e.value)
    }

    fn r(n: i128, d: i128) -> Rational {
        Rational::new(n, d).unwrap()
    }

    #[test]
    fn task_expr_rational_arithmetic() {
        assert_eq!(r(2, 4), r(1, 2));
        assert_eq!(r(3, -6), r(-1, 2));
        assert_eq!(r(1, 2).add(r(1, 3)), Some(r(5, 6)));
        assert_eq!(r(1, 2).sub(r(1, 2)), Some(Rational::ZERO));
        assert_eq!(r(2, 3).mul(r(3, 4)), Some(r(1, 2)));
        assert_eq!(r(2, 3).div(r(4, 3)), Some(r(1, 2)));
        assert_eq!(r(1, 2).div(Rational::ZERO), None);
        assert_eq!(Rational::new(1, 0), None);
        assert_eq!(Rational::new(i128::MIN, -1), None);
        assert_eq!(Rational::int(i128::MAX).add(Rational::int(1)), None);
        assert_eq!(Rational::int(i128::MAX).mul(Rational::int(2)), None);
        assert_eq!(Rational::int(i128::MIN).sub(Rational::int(1)), None);
        assert_eq!(r(1, i128::MAX).add(r(1, i128::MAX - 1)), None);
        assert!(r(4, 2).is_integer() && !r(1, 2).is_integer());
        assert_eq!((r(-6, 4).numer(), r(-6, 4).den), (-3, 2));
    }

    #[test]
    fn task_expr_precedence_and_associativity() {
        assert_eq!(eval("7 + 5 * 3"), Ok(Rational::int(22)));
        assert_eq!(eval("2 - 3 - 4"), Ok(Rational::int(-5)));
        assert_eq!(eval("8 / 4 / 2"), Ok(Rational::int(1)));
        assert_eq!(eval("(1 + 2) / 3"), Ok(Rational::int(1)));
        assert_eq!(eval("2 * (3 + 4) - 10 / 4"), Ok(r(23, 2)));
        assert_eq!(eval(" ((((5)))) "), Ok(Rational::int(5)));
        assert_eq!(eval("007"), Ok(Rational::int(7)));
        let e = evaluate("44 + 19 * (35 - 30)", &mut Deadline::none()).unwrap();
        assert_eq!(e.literals, vec![44, 19, 35, 30]);
    }

    #[test]
    fn task_expr_rejects_bad_input() {
        for s in ["", " ", "-1", "1 +", "+ 1", "(1", "1)", "()", "1 2", "1 = 1", "1 ** 2", "x", "1,5", "½", "1 + ()"] {
            assert_eq!(eval(s), Err(ExprError::Syntax), "{s:?}");
        }
        assert_eq!(eval("1 / (2 - 2)"), Err(ExprError::DivisionByZero));
        assert_eq!(eval("1 / 0"), Err(ExprError::DivisionByZero));
        assert_eq!(eval(&format!("1{}", "0".repeat(500))), Err(ExprError::Overflow));
        let big = "9".repeat(30);
        assert_eq!(eval(&format!("{big} * {big}")), Err(ExprError::Overflow));
    }

    #[test]
    fn task_expr_deep_nesting_is_iterative() {
        let s = format!("{}1{}", "(".repeat(200_000), ")".repeat(200_000));
        assert_eq!(eval(&s), Ok(Rational::int(1)));
        let mut d = Deadline::after_ms(0);
        assert_eq!(evaluate(&s, &mut d), Err(ExprError::TimedOut));
    }
}
