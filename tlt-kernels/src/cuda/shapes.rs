//! Host-side shapes of the CUDA kernels: the limits the kernels are written for, buffer lengths, and the ancestor
//! masks of a draft tree. Pure functions, tested without a GPU.

use crate::attention::AttnShape;
use crate::error::{Error, Result};

/// The largest query group (`n_heads / n_kv_heads`) `tree_attention_bf16` handles (`ATT_MAX_GROUP`).
pub const MAX_GROUP: usize = 8;
/// The largest head dimension `tree_attention_bf16` handles (`ATT_MAX_HD`).
pub const MAX_HEAD_DIM: usize = 128;
/// The most nodes of a masked draft tree (one `u64` of ancestor bits per node).
pub const MAX_TREE_NODES: usize = 64;
/// The largest `k` of `top_k_rows_f32` (`TOPK_MAX`).
pub const MAX_TOP_K: usize = 16;

/// Checks attention heads against the CUDA kernels' limits (beyond [`AttnShape::validate`]).
///
/// # Errors
/// [`Error::InvalidArgument`] when the shape is invalid, the query group exceeds [`MAX_GROUP`], or `head_dim` is odd
/// or exceeds [`MAX_HEAD_DIM`].
pub fn check_device_attn(shape: &AttnShape) -> Result<()> {
    shape.validate()?;
    if shape.n_heads / shape.n_kv_heads > MAX_GROUP {
        return Err(Error::InvalidArgument(format!(
            "the CUDA attention handles query groups of at most {MAX_GROUP}: {shape:?}"
        )));
    }
    if !shape.head_dim.is_multiple_of(2) || shape.head_dim > MAX_HEAD_DIM {
        return Err(Error::InvalidArgument(format!(
            "the CUDA attention needs an even head_dim of at most {MAX_HEAD_DIM}: {shape:?}"
        )));
    }
    Ok(())
}

/// A KV cache laid out `[layers, slots, max_len, n_kv_heads, head_dim]` (bf16), one per K and V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheDims {
    /// Decoder layers.
    pub layers: usize,
    /// Sequences the cache holds at once.
    pub slots: usize,
    /// Positions per sequence.
    pub max_len: usize,
    /// The heads.
    pub attn: AttnShape,
}

impl CacheDims {
    /// Elements of one cached position (`n_kv_heads * head_dim`).
    #[must_use]
    pub fn row(&self) -> usize {
        self.attn.n_kv_heads * self.attn.head_dim
    }

    /// Elements of one layer.
    #[must_use]
    pub fn layer_len(&self) -> usize {
        self.slots * self.max_len * self.row()
    }

    /// Elements of the whole cache.
    #[must_use]
    pub fn len(&self) -> usize {
        self.layers * self.layer_len()
    }

    /// Whether the cache holds nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks the heads and that the sizes fit the kernels' 32-bit indices where they use them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for bad heads, a zero size, or positions/slots beyond `i32`.
    pub fn check(&self) -> Result<()> {
        check_device_attn(&self.attn)?;
        if self.layers == 0 || self.slots == 0 || self.max_len == 0 {
            return Err(Error::InvalidArgument(format!("cache dims must be positive: {self:?}")));
        }
        if self.max_len > i32::MAX as usize || self.slots > i32::MAX as usize || self.row() > i32::MAX as usize {
            return Err(Error::InvalidArgument(format!("cache dims beyond i32: {self:?}")));
        }
        Ok(())
    }
}

/// The query block of one attention call: `batch` sequences with up to `n_max` new tokens (tree nodes) each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeDims {
    /// Sequences.
    pub batch: usize,
    /// Nodes per sequence (padded).
    pub n_max: usize,
}

impl TreeDims {
    /// Checks the sizes; a masked (tree) call allows at most [`MAX_TREE_NODES`] nodes.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero size, too many nodes, or a grid beyond CUDA's 65,535 y/z blocks.
    pub fn check(&self, masked: bool) -> Result<()> {
        if self.batch == 0 || self.n_max == 0 {
            return Err(Error::InvalidArgument(format!("tree dims must be positive: {self:?}")));
        }
        if masked && self.n_max > MAX_TREE_NODES {
            return Err(Error::InvalidArgument(format!(
                "a draft tree has at most {MAX_TREE_NODES} nodes on the device, got n_max {}",
                self.n_max
            )));
        }
        if self.batch > 65_535 || self.n_max > 65_535 {
            return Err(Error::InvalidArgument(format!("tree dims beyond the launch grid: {self:?}")));
        }
        Ok(())
    }

    /// `batch * n_max`.
    #[must_use]
    pub fn nodes(&self) -> usize {
        self.batch * self.n_max
    }
}

/// The ancestor masks `tree_attention_bf16` reads: bit `j` of entry `i` is set when node `j` is node `i` or one of
/// its ancestors. `parents[0]` is the root's (negative); every other node's parent precedes it.
///
/// # Errors
/// [`Error::InvalidArgument`] for an empty tree, more than [`MAX_TREE_NODES`] nodes, a root with a parent, or a
/// parent that does not precede its child.
pub fn ancestor_masks(parents: &[i32]) -> Result<Vec<u64>> {
    if parents.is_empty() || parents.len() > MAX_TREE_NODES {
        return Err(Error::InvalidArgument(format!(
            "a device draft tree has 1..={MAX_TREE_NODES} nodes, got {}",
            parents.len()
        )));
    }
    if parents[0] >= 0 {
        return Err(Error::InvalidArgument(format!("node 0 is the root, but has parent {}", parents[0])));
    }
    let mut masks = Vec::with_capacity(parents.len());
    masks.push(1u64);
    for (i, &p) in parents.iter().enumerate().skip(1) {
        let p = usize::try_from(p).ok().filter(|&p| p < i).ok_or_else(|| {
            Error::InvalidArgument(format!("node {i}: parent {p} must be an earlier node (topological order)"))
        })?;
        masks.push(masks[p] | (1u64 << i));
    }
    Ok(masks)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `#define` of `name` in a source.
    fn define(text: &str, name: &str) -> usize {
        let line = text.lines().find(|l| l.starts_with(&format!("#define {name} "))).expect(name);
        line.split_whitespace().nth(2).unwrap().parse().unwrap()
    }

    #[test]
    fn limits_match_the_kernel_source() {
        let att = super::super::SOURCES.iter().find(|s| s.file == "attention.cu").unwrap().text;
        assert_eq!(define(att, "ATT_MAX_GROUP"), MAX_GROUP);
        assert_eq!(define(att, "ATT_MAX_HD"), MAX_HEAD_DIM);
        let draft = super::super::SOURCES.iter().find(|s| s.file == "draft.cu").unwrap().text;
        assert_eq!(define(draft, "TOPK_MAX"), MAX_TOP_K);
    }

    #[test]
    fn real_architectures_pass_and_bad_heads_fail() {
        // SmolLM2-135M, Qwen2.5-1.5B, Qwen2.5-7B, Llama-3-8B, Qwen3-0.6B (head_dim 128 in a width of 1024).
        for (h, kv, d) in [(9, 3, 64), (12, 2, 128), (28, 4, 128), (32, 8, 128), (16, 8, 128)] {
            check_device_attn(&AttnShape::new(h, kv, d)).unwrap();
        }
        for (h, kv, d) in [(9, 2, 64), (32, 2, 128), (8, 8, 256), (8, 8, 63), (0, 1, 64)] {
            assert!(check_device_attn(&AttnShape::new(h, kv, d)).is_err(), "{h} {kv} {d}");
        }
        assert!(TreeDims { batch: 2, n_max: 65 }.check(true).is_err());
        TreeDims { batch: 2, n_max: 65 }.check(false).unwrap();
        let c = CacheDims { layers: 30, slots: 4, max_len: 1024, attn: AttnShape::new(9, 3, 64) };
        c.check().unwrap();
        assert_eq!(c.len(), 30 * 4 * 1024 * 192);
    }

    #[test]
    fn ancestor_masks_of_a_small_tree() {
        // 0 -> 1 -> 3, 0 -> 2 -> 4 -> 5
        let m = ancestor_masks(&[-1, 0, 0, 1, 2, 4]).unwrap();
        assert_eq!(m, vec![0b1, 0b11, 0b101, 0b1011, 0b10101, 0b110101]);
        assert!(ancestor_masks(&[-1, 2, 0]).is_err(), "a parent after its child");
        assert!(ancestor_masks(&[0]).is_err(), "a root with a parent");
        assert!(ancestor_masks(&vec![-1; 65]).is_err());
        assert!(ancestor_masks(&[]).is_err());
    }
}
