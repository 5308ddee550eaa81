//! Row-major per-position hidden states of a sequence, as the engine records them.

use crate::{Error, Result};

/// The target's hidden features at consecutive positions of one sequence: row `t` is the feature at position
/// `t` (the one that predicts token `t + 1`), EAGLE's pairing of `h_t` with `x_{t+1}`. The width is whatever the
/// [`Target`](crate::Target) returns: for `tlt_model::Llama` the final-norm state, for
/// [`TappedLlama`](crate::TappedLlama) its taps side by side.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HiddenStates {
    width: usize,
    data: Vec<f32>,
}

impl HiddenStates {
    /// No rows yet, of `width` features each.
    pub fn new(width: usize) -> Self {
        Self { width, data: Vec::new() }
    }

    /// Rows from a flat row-major buffer.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] if `data.len()` is not a multiple of a non-zero `width`.
    pub fn from_flat(width: usize, data: Vec<f32>) -> Result<Self> {
        if width == 0 || !data.len().is_multiple_of(width) {
            return Err(Error::ShapeMismatch { what: "hidden-state buffer", expected: width, got: data.len() });
        }
        Ok(Self { width, data })
    }

    /// Features per row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Number of rows (positions).
    pub fn len(&self) -> usize {
        self.data.len().checked_div(self.width).unwrap_or(0)
    }

    /// Keeps the first `rows` rows.
    pub fn truncate(&mut self, rows: usize) {
        self.data.truncate(rows * self.width);
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Row `t`, if it exists.
    pub fn row(&self, t: usize) -> Option<&[f32]> {
        self.data.get(t * self.width..(t + 1) * self.width)
    }

    /// All rows, flat and row-major.
    pub fn as_flat(&self) -> &[f32] {
        &self.data
    }

    /// Takes the flat row-major buffer.
    pub fn into_flat(self) -> Vec<f32> {
        self.data
    }

    /// Appends one row.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] if `row` is not `width` long.
    pub fn push(&mut self, row: &[f32]) -> Result<()> {
        if row.len() != self.width {
            return Err(Error::ShapeMismatch { what: "hidden-state row", expected: self.width, got: row.len() });
        }
        self.data.extend_from_slice(row);
        Ok(())
    }

    /// Appends the rows of a flat buffer.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] if `rows.len()` is not a multiple of `width`.
    pub fn extend_flat(&mut self, rows: &[f32]) -> Result<()> {
        if self.width == 0 || !rows.len().is_multiple_of(self.width) {
            return Err(Error::ShapeMismatch { what: "hidden-state rows", expected: self.width, got: rows.len() });
        }
        self.data.extend_from_slice(rows);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_and_shapes_are_checked() {
        let mut h = HiddenStates::new(2);
        assert!(h.is_empty());
        h.push(&[1.0, 2.0]).unwrap();
        h.extend_flat(&[3.0, 4.0, 5.0, 6.0]).unwrap();
        assert_eq!(h.len(), 3);
        assert_eq!(h.row(1), Some(&[3.0, 4.0][..]));
        assert_eq!(h.row(3), None);
        assert!(h.push(&[1.0]).is_err());
        assert!(h.extend_flat(&[1.0]).is_err());
        assert!(HiddenStates::from_flat(0, vec![]).is_err());
        assert!(HiddenStates::from_flat(2, vec![1.0; 3]).is_err());
        assert_eq!(HiddenStates::from_flat(2, vec![0.0; 4]).unwrap().len(), 2);
    }
}
