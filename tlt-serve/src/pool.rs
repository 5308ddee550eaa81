//! The KV pool: how many tokens and sequences the engines' caches may hold, sized as SGLang sizes its token pool
//! (`--mem-fraction-static`: the share of the device's memory for the weights and the KV cache together), or given
//! (`--max-total-tokens`). The engine thread admits a request only when the pool has room for all of it (its prompt
//! and `max_new_tokens`, reserved at admission as TGI's block allocator does, so a running request never runs out
//! of cache); a request that does not fit now waits in the queue, one that can never fit is refused.

use serde::Serialize;

use crate::{Error, Result};

/// SGLang's `--mem-fraction-static` for large GPUs, the default here on every device.
pub const DEFAULT_MEM_FRACTION: f64 = 0.88;

/// How the pool is sized.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PoolSpec {
    /// Share of the device's memory for the weights and the KV cache (SGLang's meaning); `None`:
    /// [`DEFAULT_MEM_FRACTION`].
    pub mem_fraction_static: Option<f64>,
    /// The pool's tokens, given (SGLang's `--max-total-tokens`); overrides the memory fraction.
    pub max_total_tokens: Option<usize>,
}

/// A device's memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    /// Free now.
    pub free: usize,
    /// In all.
    pub total: usize,
    /// Still to be allocated besides the pool (the weights and graphs of a model not yet uploaded).
    pub reserved: u64,
}

/// Device memory other parts take beside the target's weights and KV cache, out of the same static share (as SGLang
/// counts its draft model's weights and cache): the online drafter's training and forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Beside {
    /// Bytes in all.
    pub bytes: u64,
    /// Bytes per token of the pool (the drafter's own cache).
    pub per_token: usize,
}

/// The host's memory from `/proc/meminfo` (`MemAvailable`, `MemTotal`); zero where it cannot be read (the pool
/// must then be given with `--max-total-tokens`).
pub fn host_memory() -> Memory {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| -> usize {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
            .map_or(0, |kib| kib.saturating_mul(1024))
    };
    Memory { free: field("MemAvailable:"), total: field("MemTotal:"), reserved: 0 }
}

/// A sized pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Pool {
    /// Tokens the caches hold at most, every running request's prompt and output together.
    pub tokens: usize,
    /// Sequences the caches hold at once (a device cache's slots; on the CPU, `max_running`).
    pub sequences: usize,
    /// Bytes of cache per token.
    pub token_bytes: usize,
}

impl PoolSpec {
    /// The pool for `token_bytes` of cache per token in `mem`, for at most `max_running` sequences at once;
    /// `slot_len`: the cache is made of slots of that many positions (a device's), one per sequence.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a fraction outside `(0, 1]`, or a pool that holds no token (no slot).
    pub fn size(&self, max_running: usize, token_bytes: usize, mem: Memory, slot_len: Option<usize>) -> Result<Pool> {
        let invalid = |field: &str, reason: String| Error::Invalid { field: field.into(), reason };
        let fraction = self.mem_fraction_static.unwrap_or(DEFAULT_MEM_FRACTION);
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(invalid("mem_fraction_static", format!("{fraction} is not in (0, 1]")));
        }
        let tokens = match self.max_total_tokens {
            Some(t) => t,
            None => {
                // SGLang: the static share of the whole device, less what is in use already (by this process's
                // weights or anyone else) and what is still to come.
                let used = mem.total.saturating_sub(mem.free) as f64 + mem.reserved as f64;
                let budget = (mem.total as f64 * fraction - used).max(0.0);
                (budget / token_bytes.max(1) as f64) as usize
            }
        };
        let (tokens, sequences) = match slot_len {
            Some(len) => {
                let slots = (tokens / len.max(1)).min(max_running);
                (slots * len, slots)
            }
            None => (tokens, max_running),
        };
        if tokens == 0 || sequences == 0 {
            let need = slot_len.map_or(String::new(), |l| format!(" (one sequence of a full context: {l} tokens)"));
            return Err(invalid(
                "max_total_tokens",
                format!(
                    "the KV pool holds no request{need} at {token_bytes} bytes per token in {} free of {} bytes \
                     with --mem-fraction-static {fraction}: raise it, or give --max-total-tokens",
                    mem.free, mem.total
                ),
            ));
        }
        Ok(Pool { tokens, sequences, token_bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: usize = 1 << 30;

    #[test]
    fn sized_like_sglang_from_the_static_fraction() {
        // 100 GiB device, 10 GiB in use, 20 GiB of weights to come, 1 MiB per token: 0.9 * 100 - 10 - 20 = 60 GiB.
        let spec = PoolSpec { mem_fraction_static: Some(0.9), max_total_tokens: None };
        let mem = Memory { free: 90 * GIB, total: 100 * GIB, reserved: 20 * GIB as u64 };
        let pool = spec.size(1 << 20, 1 << 20, mem, None).unwrap();
        assert_eq!(pool.tokens, 60 * 1024);
        assert_eq!(pool.sequences, 1 << 20);
        // Slots of 1,000 positions: whole slots only, and never more than max_running.
        let slots = spec.size(1 << 20, 1 << 20, mem, Some(1000)).unwrap();
        assert_eq!((slots.sequences, slots.tokens), (61, 61_000));
        let few = spec.size(8, 1 << 20, mem, Some(1000)).unwrap();
        assert_eq!((few.sequences, few.tokens), (8, 8000));
    }

    #[test]
    fn given_tokens_override_the_fraction_and_empty_pools_are_refused() {
        let mem = Memory { free: 0, total: 0, reserved: 0 };
        let spec = PoolSpec { mem_fraction_static: None, max_total_tokens: Some(4096) };
        assert_eq!(spec.size(4, 64, mem, None).unwrap().tokens, 4096);
        assert_eq!(spec.size(4, 64, mem, Some(1024)).unwrap().sequences, 4);
        let none = PoolSpec { max_total_tokens: None, ..spec };
        let e = none.size(4, 64, mem, None).unwrap_err().to_string();
        assert!(e.contains("--max-total-tokens"), "{e}");
        let short = PoolSpec { max_total_tokens: Some(1000), ..spec };
        assert!(short.size(4, 64, mem, Some(1024)).is_err());
        let bad = PoolSpec { mem_fraction_static: Some(1.5), ..spec };
        assert!(bad.size(4, 64, mem, None).is_err());
    }

    #[test]
    fn host_memory_is_read_on_linux() {
        let m = host_memory();
        if std::path::Path::new("/proc/meminfo").exists() {
            assert!(m.total > 0 && m.free <= m.total, "{m:?}");
        }
    }
}
