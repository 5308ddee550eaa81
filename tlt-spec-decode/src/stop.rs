//! Stop strings: the engine works on token ids, so it asks a [`TokenDecoder`] for the text of the latest tokens.

use crate::Result;

/// Turns token ids into text, for stop strings. Implemented for `tokenizers::Tokenizer` (feature `tokenizers`).
pub trait TokenDecoder: std::fmt::Debug {
    /// The text of `tokens` (special tokens skipped).
    ///
    /// # Errors
    /// If the ids cannot be decoded.
    fn decode(&self, tokens: &[u32]) -> Result<String>;
}

#[cfg(feature = "tokenizers")]
impl TokenDecoder for tokenizers::Tokenizer {
    fn decode(&self, tokens: &[u32]) -> Result<String> {
        std::ops::Deref::deref(self)
            .decode(tokens, true)
            .map_err(|e| crate::Error::InvalidArgument(format!("decode: {e}")))
    }
}

/// Finds the first completed stop string in generated text, looking only at a window of the latest tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StopStrings {
    strings: Vec<String>,
    /// Tokens to decode per check: every token decodes to at least one byte, so a stop string of `n` bytes
    /// spans at most `n` tokens; two more absorb a multi-byte character split across tokens.
    window: usize,
}

impl StopStrings {
    /// A matcher for `strings` (non-empty, as [`SpecParams::validate`](crate::SpecParams::validate) checks).
    pub(crate) fn new(strings: &[String]) -> Self {
        let window = strings.iter().map(String::len).max().unwrap_or(0) + 2;
        Self { strings: strings.to_vec(), window }
    }

    /// Whether there are no stop strings.
    pub(crate) fn is_empty(&self) -> bool {
        self.strings.is_empty()
    }

    /// Index of a stop string that occurs in the text of the window of `generated` ending at its last token.
    /// Called after every new token, this finds each stop string at the token that completes it.
    pub(crate) fn find(&self, decoder: &dyn TokenDecoder, generated: &[u32]) -> Result<Option<usize>> {
        if self.strings.is_empty() || generated.is_empty() {
            return Ok(None);
        }
        let text = decoder.decode(&generated[generated.len().saturating_sub(self.window)..])?;
        Ok(self.strings.iter().position(|s| text.contains(s.as_str())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token `t` decodes to the letter `'a' + t`.
    #[derive(Debug)]
    struct Letters;
    impl TokenDecoder for Letters {
        fn decode(&self, tokens: &[u32]) -> Result<String> {
            Ok(tokens.iter().map(|&t| char::from(b'a' + t as u8)).collect())
        }
    }

    #[test]
    fn finds_stop_strings_at_the_completing_token() {
        let s = StopStrings::new(&["cd".into(), "zz".into()]);
        let gen = [0, 1, 2, 3, 4];
        let first = (1..=gen.len()).find(|&n| s.find(&Letters, &gen[..n]).unwrap().is_some());
        assert_eq!(first, Some(4));
        assert_eq!(s.find(&Letters, &gen[..4]).unwrap(), Some(0));
        assert!(StopStrings::new(&[]).is_empty());
    }
}
