//! Final-answer extraction (`\boxed{}`, `\fbox{}`, `####`) and exact numeric equivalence, as in verl's GSM8K and
//! MATH graders but without floats or regexes.

use super::expr::Rational;
use super::verdict::{Deadline, TimedOut, Verdict};

/// The final answer of `completion`: the content of the last complete `\boxed{...}` or `\fbox{...}` (braces balanced,
/// the outermost box when boxes nest), else what follows the last `####` (GSM8K): the number that leads its line
/// (verl's `#### (\-?[0-9\.\,]+)`: `#### 72.`, `#### $1,234 dollars` and `#### 72<|im_end|>` give `72`, `1,234`
/// and `72`), or the whole line when no number leads it or the number goes on as an expression (`#### 1/2`,
/// `#### \frac{1}{2}`), else `None`. The result is trimmed; an empty box or line counts as no answer.
///
/// ```
/// use tlt_rl::task::extract_answer;
///
/// assert_eq!(extract_answer("so \\boxed{\\frac{1}{2}}."), Some("\\frac{1}{2}".to_string()));
/// assert_eq!(extract_answer("48 / 2 = 24\n#### 24"), Some("24".to_string()));
/// assert_eq!(extract_answer("24"), None);
/// ```
pub fn extract_answer(completion: &str) -> Option<String> {
    extract_within(completion, &mut Deadline::none()).ok().flatten().map(str::to_string)
}

/// [`extract_answer`] under a deadline.
pub(crate) fn extract_within<'a>(text: &'a str, deadline: &mut Deadline) -> Result<Option<&'a str>, TimedOut> {
    if let Some(boxed) = last_boxed(text, deadline)? {
        let boxed = boxed.trim();
        if !boxed.is_empty() {
            return Ok(Some(boxed));
        }
    }
    Ok(hashes_answer(text))
}

/// What follows the last `####` (as [`extract_answer`] reads it), ignoring `\boxed{}`: verl's GSM8K grader.
pub(crate) fn hashes_answer(text: &str) -> Option<&str> {
    text.rfind("####").and_then(|p| {
        let rest = text[p..].trim_start_matches('#').trim_start();
        let line = rest.lines().next().unwrap_or("").trim();
        (!line.is_empty()).then(|| leading_number(line).unwrap_or(line))
    })
}

/// The number that leads `line` (after an optional `$` or `\$`): `-?` then digits, `.` and `,`, without trailing
/// `.` or `,`; `None` when no digit leads or the number goes on as an expression (`/`, `^`, `{`, `\`).
fn leading_number(line: &str) -> Option<&str> {
    let s = line.strip_prefix("\\$").or_else(|| line.strip_prefix('$')).unwrap_or(line).trim_start();
    let b = s.as_bytes();
    let sign = usize::from(b.first() == Some(&b'-'));
    if !b.get(sign).is_some_and(u8::is_ascii_digit) {
        return None;
    }
    let end =
        b[sign..].iter().position(|c| !(c.is_ascii_digit() || *c == b'.' || *c == b',')).map_or(b.len(), |i| i + sign);
    if matches!(b.get(end), Some(b'/' | b'^' | b'{' | b'\\')) {
        return None;
    }
    Some(s[..end].trim_end_matches(['.', ',']))
}

/// If `\boxed` or `\fbox` (then optional spaces, then `{`) starts at `i` (a backslash), the index after the `{`.
fn box_open(b: &[u8], i: usize) -> Option<usize> {
    let rest = &b[i + 1..];
    let name = [&b"boxed"[..], &b"fbox"[..]].into_iter().find(|n| rest.starts_with(n))?;
    let mut j = i + 1 + name.len();
    if b.get(j).is_some_and(u8::is_ascii_alphabetic) {
        return None; // another macro, e.g. `\boxedx`
    }
    while b.get(j) == Some(&b' ') {
        j += 1;
    }
    (b.get(j) == Some(&b'{')).then_some(j + 1)
}

/// The content of the complete box that closes last (hence the outermost of nested ones), one linear pass.
fn last_boxed<'a>(text: &'a str, deadline: &mut Deadline) -> Result<Option<&'a str>, TimedOut> {
    let b = text.as_bytes();
    // One entry per open brace: `Some(content start)` for a box, `None` for a plain brace.
    let mut stack: Vec<Option<usize>> = Vec::new();
    let mut best = None;
    let mut i = 0;
    while i < b.len() {
        deadline.tick()?;
        match b[i] {
            b'\\' => {
                if let Some(j) = box_open(b, i) {
                    stack.push(Some(j));
                    i = j;
                    continue;
                }
                if matches!(b.get(i + 1), Some(b'{' | b'}' | b'\\')) {
                    i += 1; // an escaped brace or backslash
                }
            }
            b'{' => stack.push(None),
            b'}' => {
                if let Some(Some(start)) = stack.pop() {
                    best = Some((start, i));
                }
            }
            _ => {}
        }
        i += 1;
    }
    // Both ends sit next to ASCII braces, so they are character boundaries.
    Ok(best.and_then(|(s, e)| text.get(s..e)))
}

/// Grades `text` against the ground truth `truth` (an [`super::Answer::Number`]).
pub(crate) fn verify(truth: &str, text: &str, deadline: &mut Deadline, hashes_only: bool) -> Verdict {
    if deadline.tick().is_err() {
        return Verdict::TimedOut;
    }
    let pred = if hashes_only { Ok(hashes_answer(text)) } else { extract_within(text, deadline) };
    match pred {
        Err(TimedOut) => Verdict::TimedOut,
        Ok(None) => Verdict::Unformatted,
        Ok(Some(pred)) if answers_equal(pred, truth) => Verdict::Correct,
        Ok(Some(_)) => Verdict::Wrong,
    }
}

/// The last number in `text`, for flexible scoring: digits with an optional leading `-`, thousands separators
/// (`3,000`, `1,234,567.5`: groups of three digits after the first, before any decimal point) and one decimal point.
/// A comma that does not separate thousands ends the number (`1,2` gives `2`).
pub(crate) fn last_number(text: &str) -> Option<&str> {
    let b = text.as_bytes();
    let end = b.iter().rposition(u8::is_ascii_digit)? + 1;
    let digit_before = |i: usize| i >= 2 && b[i - 2].is_ascii_digit();
    let mut start = end;
    // Digits since the last separator, whether a decimal point or a thousands comma was taken, and where the
    // number began before its first comma (the fallback when the leading group turns out longer than three).
    let (mut run, mut dot, mut comma, mut after_comma) = (0usize, false, false, end);
    while start > 0 {
        let c = b[start - 1];
        if c.is_ascii_digit() {
            run += 1;
        } else if c == b'.' && !dot && !comma && digit_before(start) {
            dot = true;
            run = 0;
        } else if c == b',' && run == 3 && digit_before(start) {
            comma = true;
            after_comma = start;
            run = 0;
        } else {
            break;
        }
        start -= 1;
    }
    if comma && run > 3 {
        start = after_comma;
    }
    if start > 0 && b[start - 1] == b'-' {
        start -= 1;
    }
    text.get(start..end)
}

/// Whether a predicted answer matches a ground truth: [`numbers_equal`] of the two, or of their numeric cores (the number left after units, `\\text{}`, `x =` and the like are stripped)
/// (`\boxed{12 apples}`, `\boxed{\text{12}}`, `12\%`, `x = 12` all state 12), or else the same text after removing
/// whitespace, `$`, `\left`/`\right`, LaTeX spacing and a trailing `.` (for non-numeric MATH answers such as
/// `\frac{\sqrt{3}}{2}`). Symmetric; empty answers never match.
///
/// ```
/// use tlt_rl::task::answers_equal;
///
/// for pred in ["12 apples", "\\text{12}", "12\\%", "x = 12", "12\\text{ cm}", "\\$12.00"] {
///     assert!(answers_equal(pred, "12"), "{pred}");
/// }
/// assert!(!answers_equal("12 or 13", "12"));
/// assert!(!answers_equal("2 pi", "2"));
/// ```
pub fn answers_equal(pred: &str, truth: &str) -> bool {
    if numbers_equal(pred, truth) {
        return true;
    }
    if let (Some(p), Some(t)) = (numeric_core(pred), numeric_core(truth)) {
        if numbers_equal(&p, &t) {
            return true;
        }
    }
    let (p, t) = (normalize(pred), normalize(truth));
    !p.is_empty() && p == t
}

/// Text macros whose argument is unwrapped by [`numeric_core`].
const TEXT_MACROS: [&str; 5] = ["\\text{", "\\textbf{", "\\textrm{", "\\mbox{", "\\mathrm{"];
/// Words after a number that are mathematics, not units: never cut by [`numeric_core`].
const MATH_WORDS: [&str; 3] = ["pi", "i", "e"];

/// What a short final answer states, with what carries no value removed (in the spirit of the MATH grader's
/// `strip_string`): text macros unwrapped (`\text{12}`, `12\text{ cm}`), `\%`, `%`, `^\circ` and `$` removed, a
/// left side of at most two characters before a single `=` dropped (`x = 12`), and trailing words of letters only cut
/// off (units and nouns: `12 apples`, `5 square feet`; never `pi`, `i` or `e`). `None` when nothing is left.
fn numeric_core(s: &str) -> Option<String> {
    let mut t = s.to_string();
    for m in TEXT_MACROS {
        while let Some(start) = t.find(m) {
            let open = start + m.len();
            let close = matching_brace(&t[open..])? + open;
            t = format!("{} {} {}", &t[..start], &t[open..close], &t[close + 1..]);
        }
    }
    for unit in ["^{\\circ}", "^\\circ", "\\%", "%", "\\$", "$"] {
        if t.contains(unit) {
            t = t.replace(unit, " ");
        }
    }
    let mut rest = t.trim();
    if let Some((lhs, rhs)) = rest.split_once('=') {
        let lhs = lhs.trim();
        if !rhs.contains('=') && !lhs.is_empty() && lhs.chars().count() <= 2 {
            rest = rhs.trim();
        }
    }
    loop {
        let (head, word) = rest.rsplit_once(char::is_whitespace).unwrap_or(("", rest));
        let word = word.trim_end_matches(['.', ',']);
        let cut = !head.trim().is_empty()
            && !word.is_empty()
            && word.bytes().all(|c| c.is_ascii_alphabetic())
            && !MATH_WORDS.contains(&word);
        if !cut {
            break;
        }
        rest = head.trim_end();
    }
    (!rest.is_empty()).then(|| rest.to_string())
}

/// The index of the `}` closing a brace opened just before `s`, or `None` if it never closes.
fn matching_brace(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s.bytes().enumerate() {
        match c {
            b'{' => depth += 1,
            b'}' if depth == 0 => return Some(i),
            b'}' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// A parsed number: exact when it fits `i128`, else a normalized decimal string (sign, digits without leading
/// zeros, `.` and fraction digits without trailing zeros).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Num {
    Exact(Rational),
    Decimal(String),
}

/// Whether `a` and `b` are the same number: integers, decimals, `a/b` and `\frac{a}{b}` (`\dfrac`, `\tfrac`),
/// with `$`, spaces, LaTeX spacing, thousands separators (`1,234`, `1{,}234`) and a trailing `.` ignored, compared
/// exactly as rationals. Decimals too long for `i128` compare as normalized digit strings (so such a number never
/// equals a fraction); anything unparsable is unequal. Never panics.
///
/// ```
/// use tlt_rl::task::numbers_equal;
///
/// assert!(numbers_equal("$1,234.50", "1234.5"));
/// assert!(numbers_equal("\\frac{2}{6}", "1/3"));
/// assert!(!numbers_equal("0.333", "1/3"));
/// ```
pub fn numbers_equal(a: &str, b: &str) -> bool {
    match (parse_number(a), parse_number(b)) {
        (Some(x), Some(y)) => x == y,
        _ => false,
    }
}

/// Removes what carries no value: `$`, whitespace, LaTeX spacing and sizing, a trailing `.`, outer braces.
fn normalize(s: &str) -> String {
    let mut t: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    for (from, to) in [
        ("\\$", ""),
        ("$", ""),
        ("\\left", ""),
        ("\\right", ""),
        ("\\,", ""),
        ("\\!", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("{,}", ","),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\u{2212}", "-"),
    ] {
        if t.contains(from) {
            t = t.replace(from, to);
        }
    }
    let mut t = t.trim_end_matches('.').to_string();
    while t.len() >= 2 && t.starts_with('{') && t.ends_with('}') && braces_balanced(&t[1..t.len() - 1]) {
        t = t[1..t.len() - 1].to_string();
    }
    t
}

fn braces_balanced(s: &str) -> bool {
    let mut depth = 0usize;
    for c in s.bytes() {
        match c {
            b'{' => depth += 1,
            b'}' => match depth.checked_sub(1) {
                Some(d) => depth = d,
                None => return false,
            },
            _ => {}
        }
    }
    depth == 0
}

fn parse_number(s: &str) -> Option<Num> {
    let t = normalize(s);
    if let Some((neg, rest)) = strip_sign(&t).and_then(|(neg, r)| r.strip_prefix("\\frac{").map(|r| (neg, r))) {
        let (num, rest) = rest.split_once('}')?;
        let den = rest.strip_prefix('{')?.strip_suffix('}')?;
        let q = fraction(num, den)?;
        return if neg { Some(Num::Exact(Rational::ZERO.sub(q)?)) } else { Some(Num::Exact(q)) };
    }
    match t.split_once('/') {
        Some((num, den)) => fraction(num, den).map(Num::Exact),
        None => decimal(&t),
    }
}

/// `num / den` for two exact decimals.
fn fraction(num: &str, den: &str) -> Option<Rational> {
    match (decimal(num)?, decimal(den)?) {
        (Num::Exact(n), Num::Exact(d)) => n.div(d),
        _ => None,
    }
}

/// An optional leading `+` or `-`: `(negative, rest)`.
fn strip_sign(s: &str) -> Option<(bool, &str)> {
    Some(match s.as_bytes().first()? {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    })
}

/// `[+-]digits[.digits]`, with `,` accepted only as a thousands separator in the integer part.
fn decimal(s: &str) -> Option<Num> {
    let (neg, body) = strip_sign(s)?;
    let (int, frac) = body.split_once('.').unwrap_or((body, ""));
    let int = strip_thousands(int)?;
    if (int.is_empty() && frac.is_empty()) || !frac.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let int = int.trim_start_matches('0');
    let frac = frac.trim_end_matches('0');
    let neg = neg && !(int.is_empty() && frac.is_empty());
    let digits = int.len() + frac.len();
    if digits <= 36 {
        let mantissa: i128 = if digits == 0 { 0 } else { format!("{int}{frac}").parse().ok()? };
        let scale = 10i128.checked_pow(u32::try_from(frac.len()).ok()?)?;
        let q = Rational::new(if neg { -mantissa } else { mantissa }, scale)?;
        return Some(Num::Exact(q));
    }
    let sign = if neg { "-" } else { "" };
    let int = if int.is_empty() { "0" } else { int };
    Some(Num::Decimal(if frac.is_empty() { format!("{sign}{int}") } else { format!("{sign}{int}.{frac}") }))
}

/// The digits of `s` with thousands separators removed: plain digits, or groups `d{1,3}(,ddd)*`.
fn strip_thousands(s: &str) -> Option<String> {
    if !s.bytes().all(|c| c.is_ascii_digit() || c == b',') {
        return None;
    }
    if !s.contains(',') {
        return Some(s.to_string());
    }
    let mut groups = s.split(',');
    let first = groups.next()?;
    if first.is_empty() || first.len() > 3 {
        return None;
    }
    let mut out = first.to_string();
    for g in groups {
        if g.len() != 3 {
            return None;
        }
        out.push_str(g);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ex(s: &str) -> Option<String> {
        extract_answer(s)
    }

    #[test]
    fn task_extract_boxed_and_hashes() {
        assert_eq!(ex("\\boxed{42}").as_deref(), Some("42"));
        assert_eq!(ex("first \\boxed{1} then \\boxed{ 2 }").as_deref(), Some("2"));
        assert_eq!(ex("\\fbox{7}").as_deref(), Some("7"));
        assert_eq!(ex("\\boxed {7}").as_deref(), Some("7"));
        assert_eq!(ex("$\\boxed{\\frac{1}{2}}$").as_deref(), Some("\\frac{1}{2}"));
        assert_eq!(ex("\\boxed{\\{1, 2\\}}").as_deref(), Some("\\{1, 2\\}"));
        assert_eq!(ex("x\n#### 1,234\nmore").as_deref(), Some("1,234"));
        assert_eq!(ex("#### 3\n#### 4").as_deref(), Some("4"));
        assert_eq!(ex("\\boxed{5}\n#### 4").as_deref(), Some("5"), "boxed wins over ####");
        assert_eq!(ex("\\boxed{}\n#### 4").as_deref(), Some("4"));
        assert_eq!(ex("\\boxedx{5}"), None);
        assert_eq!(ex("42"), None);
        assert_eq!(ex(""), None);
        assert_eq!(ex("####   "), None);
    }

    /// GSM8K: only the number that leads the line after `####` (verl's regex), so text after it (a stop token kept
    /// by the decoder, a unit, a full stop) no longer makes a correct answer unparsable.
    #[test]
    fn task_extract_takes_the_number_after_hashes() {
        for (text, want) in [
            ("#### 72<|im_end|>", "72"),
            ("#### 72.<|im_end|>", "72"),
            ("#### 72.", "72"),
            ("#### $18 per day", "18"),
            ("####\\$1,234.50.", "1,234.50"),
            ("#### -3 degrees", "-3"),
            ("#### 1/2", "1/2"),
            ("#### \\frac{1}{2}", "\\frac{1}{2}"),
            ("#### 72\\%", "72\\%"),
            ("#### x = 5", "x = 5"),
        ] {
            assert_eq!(ex(text).as_deref(), Some(want), "{text}");
        }
        for (text, truth) in [("#### 72<|im_end|>", "72"), ("#### 72\\%", "72"), ("#### 1,234.50.", "1234.5")] {
            let pred = ex(text).unwrap();
            assert!(answers_equal(&pred, truth), "{text}: {pred} vs {truth}");
        }
    }

    /// The answer normalizer accepts what a word problem invites in a box: `\text{}`, units and words after the
    /// number, `\%`, a leading `x =`; and still rejects a different number or an answer that hedges.
    #[test]
    fn task_answers_equal_strips_units_text_and_variables() {
        let same = [
            "12 apples",
            "\\text{12}",
            "\\text{12 apples}",
            "12\\text{ apples}",
            "\\textbf{12}",
            "12\\%",
            "12%",
            "x = 12",
            "x=12",
            "n = 12 cookies.",
            "12 square feet",
            "$12$",
            "12^\\circ",
        ];
        for pred in same {
            assert!(answers_equal(pred, "12"), "{pred} should state 12");
            assert!(answers_equal("12", pred), "symmetric: {pred}");
        }
        for pred in ["\\boxed{12 apples}", "\\boxed{\\text{12}}", "\\boxed{12\\%}", "\\boxed{x = 12}"] {
            assert!(matches!(verify("12", pred, &mut Deadline::none(), false), Verdict::Correct), "{pred}");
        }
        let different = [
            "13 apples",
            "12 or 13",
            "2 pi",
            "apples",
            "x = 13",
            "abc = 12",
            "x = y = 12",
            "\\text{12",
            "12 apples and 3 pears",
        ];
        for pred in different {
            let want = if pred == "2 pi" { "2" } else { "12" };
            assert!(!answers_equal(pred, want), "{pred} must not equal {want}");
        }
        assert_eq!(numeric_core("   "), None);
        assert_eq!(numeric_core("\\frac{1}{2} cup").as_deref(), Some("\\frac{1}{2}"));
    }

    #[test]
    fn task_extract_nested_and_unbalanced() {
        // The outermost complete box wins; its content is not a number.
        assert_eq!(ex("\\boxed{\\frac{1}{\\boxed{2}}}").as_deref(), Some("\\frac{1}{\\boxed{2}}"));
        assert!(!numbers_equal("\\frac{1}{\\boxed{2}}", "0.5"));
        // An unclosed box is skipped; a complete box inside it still counts.
        assert_eq!(ex("\\boxed{ \\boxed{3}").as_deref(), Some("3"));
        assert_eq!(ex("\\boxed{3").as_deref(), None);
        assert_eq!(ex("\\boxed{3}}}}").as_deref(), Some("3"));
        assert_eq!(ex("}}}{{{\\boxed{4}").as_deref(), Some("4"));
        assert_eq!(ex("\\boxed{{{{}").as_deref(), None);
        assert_eq!(ex("\\boxed{a{b}c}").as_deref(), Some("a{b}c"));
    }

    #[test]
    fn task_extract_unicode_and_lossy() {
        assert_eq!(ex("答案是 \\boxed{42} 🎉").as_deref(), Some("42"));
        let lossy = String::from_utf8_lossy(&[0xff, 0xfe, b'\\', b'f', b'b', b'o', b'x', b'{', b'9', b'}', 0xc3]);
        assert_eq!(ex(&lossy).as_deref(), Some("9"));
        assert_eq!(ex("\\boxed{é}").as_deref(), Some("é"));
        assert!(!numbers_equal("４２", "42"), "full-width digits are not ASCII digits");
    }

    #[test]
    fn task_numbers_equal_forms() {
        let same = [
            ("42", "42"),
            ("42", "42.0"),
            ("42.", "42"),
            ("$42$", "42"),
            ("\\$42", "42"),
            ("1,234", "1234"),
            ("1{,}234", "1234"),
            ("12,345,678.90", "12345678.9"),
            (" - 3.5 ", "-3.5"),
            ("-3.50", "-7/2"),
            ("+5", "5"),
            ("-0", "0"),
            ("0.0", "-0.000"),
            (".5", "1/2"),
            ("1/3", "2/6"),
            ("\\frac{1}{3}", "1/3"),
            ("\\dfrac{2}{4}", "0.5"),
            ("-\\frac{3}{4}", "-0.75"),
            ("\\frac{-3}{4}", "-0.75"),
            ("{7}", "7"),
            ("\u{2212}2", "-2"),
            ("1/-2", "-0.5"),
            ("\\left(5\\right)", "\\left(5\\right)"),
        ];
        for (a, b) in same {
            assert!(numbers_equal(a, b) || answers_equal(a, b), "{a} == {b}");
            assert!(answers_equal(b, a), "{b} == {a}");
        }
        let different = [
            ("42", "43"),
            ("0.333", "1/3"),
            ("1,23", "123"),
            ("1,2345", "12345"),
            (",123", "123"),
            ("1/0", "1/0"),
            ("", ""),
            ("-", "-"),
            (".", "0"),
            ("1.2.3", "1.2.3"),
            ("abc", "42"),
            ("1e3", "1000"),
            ("\\frac{1}{\\boxed{2}}", "0.5"),
        ];
        for (a, b) in different {
            assert!(!numbers_equal(a, b), "{a} != {b}");
        }
        assert!(answers_equal("\\frac{\\sqrt{3}}{2}", "\\dfrac{\\sqrt{3}}{2}"));
        assert!(!answers_equal("", ""));
    }

    #[test]
    fn task_numbers_equal_huge() {
        let huge = format!("1{}", "0".repeat(500));
        assert!(numbers_equal(&huge, &huge));
        assert!(numbers_equal(&huge, &format!("{huge}.000")));
        assert!(numbers_equal(&format!("000{huge}"), &huge));
        assert!(!numbers_equal(&huge, &format!("1{}", "0".repeat(499))));
        assert!(!numbers_equal(&huge, &format!("{huge}/1")), "overflowing fractions are rejected");
        let tiny = format!("0.{}1", "0".repeat(300));
        assert!(numbers_equal(&tiny, &format!("{tiny}000")));
        assert!(!numbers_equal(&tiny, "0"));
        assert!(!numbers_equal(&format!("-{huge}"), &huge));
        let max = i128::MAX.to_string();
        assert!(numbers_equal(&max, &max));
    }

    proptest! {
        #[test]
        fn task_prop_answer_fns_never_panic(s in any::<String>(), t in "[-+0-9.,/{}\\\\fracboxed$ ]{0,40}") {
            let _ = extract_answer(&s);
            let _ = extract_answer(&t);
            let _ = numbers_equal(&s, &t);
            prop_assert_eq!(numbers_equal(&t, &t), parse_number(&t).is_some());
            prop_assert_eq!(answers_equal(&s, &t), answers_equal(&t, &s));
        }

        #[test]
        fn task_prop_integers_and_fractions(
            a in any::<i64>(),
            n in -10_000i64..10_000,
            d in 1i64..10_000,
            k in 1i64..1000,
        ) {
            let (int, dec, braced) = (a.to_string(), format!("{a}.000"), format!("{{{a}}}"));
            prop_assert!(numbers_equal(&int, &dec));
            prop_assert!(numbers_equal(&braced, &int));
            let (scaled, frac) = (format!("{}/{}", n * k, d * k), format!("\\frac{{{n}}}{{{d}}}"));
            prop_assert!(numbers_equal(&scaled, &frac));
            let (q, q1) = (format!("{n}/{d}"), format!("{}/{}", n + 1, d));
            prop_assert!(!numbers_equal(&q, &q1));
        }
    }

    #[test]
    fn last_number_takes_the_final_one() {
        assert_eq!(last_number("7 + 5 = 12."), Some("12"));
        assert_eq!(last_number("so -3.5 it is"), Some("-3.5"));
        assert_eq!(last_number("x 1.2.3"), Some("2.3"));
        assert_eq!(last_number("no digits"), None);
        assert_eq!(last_number("\u{ff11} 4"), Some("4"));
        // Thousands separators (the GSM8K grading disagreements "A: 3,000" and "A: 6,250").
        assert_eq!(last_number("A: 3,000"), Some("3,000"));
        assert_eq!(last_number("A: 6,250."), Some("6,250"));
        assert_eq!(last_number("total -1,234,567.25 dollars"), Some("-1,234,567.25"));
        assert_eq!(last_number("pick 1,2"), Some("2"));
        assert_eq!(last_number("5, 600"), Some("600"));
        assert_eq!(last_number("12345,678"), Some("678"));
        assert_eq!(last_number("1.234,567"), Some("234,567"));
        assert_eq!(last_number("x,000"), Some("000"));
    }
}
