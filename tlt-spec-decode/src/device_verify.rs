//! Verification on a device as data: what `cuda::CudaTarget` (feature `cuda`) sends, launches and reads back for one
//! `(batch, n_max)` shape of draft trees. The trees and coins go out in one packed buffer (one copy from a pinned
//! staging buffer); `sample_rows` draws the target's token at every node, `tree_accept` walks the trees,
//! `gather_path_rows` packs the accepted nodes' hidden rows; the accepted paths, committed tokens, their
//! log-probs and largest probabilities (and the packed hidden rows when recording) come back in one packed buffer.
//! [`DeviceVerifier`] runs it on a device behind the seam (`tlt_kernels::cuda::Gpu`): `cuda::CudaTarget` on its
//! model's logits, the tests on the simulated device with logits of their choosing.

use std::collections::HashMap;

use half::bf16;
use tlt_kernels::cuda::packing::Packing;
use tlt_kernels::cuda::plan::{self, AcceptInBufs, AcceptOutBufs, Buf, Launch};
use tlt_kernels::cuda::{DeviceBuf, Fetched, SharedGpu, Staged, TreeDims};

use crate::{Accepted, Coins, Error, Result, TargetInput, Verified, VerifySpec};

// Segments of the input buffer.
const IN_PARENT: usize = 0;
const IN_DRAFT: usize = 1;
const IN_NODES: usize = 2;
const IN_COINS: usize = 3;
// Segments of the result buffer.
const OUT_N_ACC: usize = 0;
const OUT_PATH: usize = 1;
const OUT_TOKENS: usize = 2;
const OUT_LOGPROBS: usize = 3;
const OUT_PMAX: usize = 4;
const OUT_HIDDEN: usize = 5;

/// The device buffers of one verification shape: the packed input and result buffers and three scratch arrays
/// (`[batch * n_max]` each) for the target's token, log-prob and largest probability at every node.
#[derive(Debug, Clone, Copy)]
pub struct VerifyBufs {
    /// [`VerifyProgram::input_bytes`] bytes.
    pub input: Buf<u8>,
    /// [`VerifyProgram::output_bytes`] bytes.
    pub output: Buf<u8>,
    /// The target's token at every node.
    pub target_tok: Buf<i32>,
    /// Its log-probability.
    pub target_lp: Buf<f32>,
    /// The largest probability of every node's distribution.
    pub target_pmax: Buf<f32>,
}

/// Where the accepted nodes' hidden rows come from when [`VerifyProgram::read`] builds the results.
#[derive(Debug, Clone, Copy)]
pub enum HiddenRows<'a> {
    /// None recorded.
    None,
    /// Packed on the device by `gather_path_rows` into the result buffer (the final norm's rows, `hidden_size`
    /// wide).
    Packed,
    /// Every node's row, `[batch * n_max, width]` (several taps: the accepted ones are picked on the host).
    All {
        /// The rows.
        rows: &'a [f32],
        /// Their width.
        width: usize,
    },
}

/// Device verification of one `(batch, n_max)` shape (batch padded to a graph bucket; padded sequences have no
/// nodes), with hidden rows `hidden_size` wide.
///
/// ```
/// use tlt_spec_decode::device_verify::VerifyProgram;
/// let v = VerifyProgram::new(2, 4, 8);
/// // Without hidden rows, only the prefix before them comes back.
/// assert!(v.result_bytes(false).unwrap() < v.result_bytes(true).unwrap());
/// assert_eq!(v.result_bytes(true).unwrap(), v.output_bytes());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyProgram {
    tree: TreeDims,
    hidden_size: usize,
    input: Packing,
    output: Packing,
}

impl VerifyProgram {
    /// The program of `batch` trees of up to `n_max` nodes.
    #[must_use]
    pub fn new(batch: usize, n_max: usize, hidden_size: usize) -> Self {
        let n = batch * n_max;
        let input = Packing::new(&[n * 4, n * 4, batch * 4, n * 8]);
        let output = Packing::new(&[batch * 4, n * 4, n * 4, n * 4, n * 4, n * hidden_size * 2]);
        Self { tree: TreeDims { batch, n_max }, hidden_size, input, output }
    }

    /// The shape.
    #[must_use]
    pub fn tree(&self) -> TreeDims {
        self.tree
    }

    /// Bytes of the packed input buffer.
    #[must_use]
    pub fn input_bytes(&self) -> usize {
        self.input.bytes()
    }

    /// Bytes of the packed result buffer.
    #[must_use]
    pub fn output_bytes(&self) -> usize {
        self.output.bytes()
    }

    /// Bytes of the result buffer to copy back: all of it with packed hidden rows, else the prefix before them.
    ///
    /// # Errors
    /// None in practice (the segments exist by construction).
    pub fn result_bytes(&self, packed_hidden: bool) -> Result<usize> {
        let seg = if packed_hidden { OUT_HIDDEN } else { OUT_PMAX };
        self.output.end_of(seg).map_err(Error::from)
    }

    /// Writes the trees of `inputs` (in the target's order, at most `batch`, each at most `n_max` nodes) and the
    /// coins of every node (`coins[b].uniform(depth)`) into the host bytes `host` ([`VerifyProgram::input_bytes`]).
    ///
    /// # Errors
    /// [`Error::Target`] for an input without a tree, too many inputs or nodes, or too few coins or host bytes.
    pub fn write_inputs(&self, inputs: &[TargetInput<'_>], coins: &[Coins], host: &mut [u8]) -> Result<()> {
        let TreeDims { batch, n_max } = self.tree;
        if inputs.len() > batch || coins.len() < inputs.len() {
            return Err(Error::Target(format!(
                "{} trees with {} coin streams for a verification of {batch}",
                inputs.len(),
                coins.len()
            )));
        }
        let n = batch * n_max;
        let (mut parent, mut draft, mut nodes, mut u) =
            (vec![-1i32; n], vec![0i32; n], vec![0i32; batch], vec![0.5; n]);
        for (b, input) in inputs.iter().enumerate() {
            let parents = input.tree.ok_or_else(|| Error::Target("target-side verification needs trees".into()))?;
            if parents.len() > n_max || parents.len() != input.tokens.len() {
                return Err(Error::Target(format!(
                    "input {b}: a tree of {} nodes ({} tokens) in a verification of {n_max}",
                    parents.len(),
                    input.tokens.len()
                )));
            }
            let mut depth = vec![0usize; parents.len()];
            for (j, (&tok, p)) in input.tokens.iter().zip(parents).enumerate() {
                let r = b * n_max + j;
                parent[r] = p.map_or(-1, |p| p as i32);
                draft[r] = tok as i32;
                if let Some(p) = *p {
                    depth[j] = depth.get(p).copied().unwrap_or(0) + 1;
                }
                u[r] = coins[b].uniform(depth[j]);
            }
            nodes[b] = parents.len() as i32;
        }
        let p = &self.input;
        p.put(host, IN_PARENT, &parent, -1)?;
        p.put(host, IN_DRAFT, &draft, 0)?;
        p.put(host, IN_NODES, &nodes, 0)?;
        p.put(host, IN_COINS, &u, 0.5)?;
        Ok(())
    }

    /// The launches, in order: the target's token at every node of `logits` (`[batch * n_max, vocab]` f32) at
    /// `temperature` (greedy at 0: no coins), the tree walk, and with `hidden_src` (the final norm's rows,
    /// `[batch * n_max, hidden_size]` bf16) the accepted rows packed into the result buffer.
    ///
    /// # Errors
    /// A plan's shape check (buffers too short, a bad temperature).
    pub fn launches(
        &self,
        vocab: usize,
        temperature: f32,
        logits: Buf<f32>,
        hidden_src: Option<Buf<bf16>>,
        b: &VerifyBufs,
    ) -> Result<Vec<Launch>> {
        let rows = self.tree.nodes();
        let (i, o) = (&self.input, &self.output);
        let coins = if temperature > 0.0 { Some(i.buf(b.input, IN_COINS)?) } else { None };
        let mut v =
            vec![plan::sample_rows(rows, vocab, temperature, logits, coins, b.target_tok, b.target_lp, b.target_pmax)?];
        let (path, n_acc) = (o.buf(b.output, OUT_PATH)?, o.buf(b.output, OUT_N_ACC)?);
        let input = AcceptInBufs {
            parent: i.buf(b.input, IN_PARENT)?,
            draft_tok: i.buf(b.input, IN_DRAFT)?,
            target_tok: b.target_tok,
            target_lp: b.target_lp,
            target_pmax: b.target_pmax,
            n_nodes: i.buf(b.input, IN_NODES)?,
        };
        let out = AcceptOutBufs {
            path,
            n_acc,
            tokens: o.buf(b.output, OUT_TOKENS)?,
            logprobs: o.buf(b.output, OUT_LOGPROBS)?,
            pmax: o.buf(b.output, OUT_PMAX)?,
        };
        v.push(plan::tree_accept(self.tree, input, out)?);
        if let Some(src) = hidden_src {
            let dst = o.buf(b.output, OUT_HIDDEN)?;
            v.push(plan::gather_path_rows(self.tree, self.tree.n_max, self.hidden_size, src, dst, path, n_acc)?);
        }
        Ok(v)
    }

    /// The first `n_inputs` verifications from the result bytes `host` (at least [`VerifyProgram::result_bytes`]
    /// of the same `hidden` choice), with their hidden rows from `hidden`.
    ///
    /// # Errors
    /// [`Error::Target`] for an accepted-node count outside `1..=n_max`, a path node outside the tree, a negative
    /// token (the sampler's mark of a row of logits with a NaN or +inf, or none above -inf), or too few bytes.
    pub fn read(&self, host: &[u8], n_inputs: usize, hidden: HiddenRows<'_>) -> Result<Vec<Verified>> {
        let TreeDims { batch, n_max } = self.tree;
        let need = self.result_bytes(matches!(hidden, HiddenRows::Packed))?;
        if host.len() < need || n_inputs > batch {
            return Err(Error::Target(format!(
                "{} result bytes for {n_inputs} of {batch} trees ({need} needed)",
                host.len()
            )));
        }
        let o = &self.output;
        let (n_acc, path, tokens) =
            (o.get::<i32>(host, OUT_N_ACC)?, o.get::<i32>(host, OUT_PATH)?, o.get::<i32>(host, OUT_TOKENS)?);
        let (logprobs, pmax) = (o.get::<f32>(host, OUT_LOGPROBS)?, o.get::<f32>(host, OUT_PMAX)?);
        let packed: Option<Vec<u16>> = match hidden {
            HiddenRows::Packed => Some(o.get::<u16>(host, OUT_HIDDEN)?),
            _ => None,
        };
        let h = self.hidden_size;
        let mut verified = Vec::with_capacity(n_inputs);
        for (b, &acc) in n_acc.iter().enumerate().take(n_inputs) {
            let n = usize::try_from(acc)
                .ok()
                .filter(|&n| (1..=n_max).contains(&n))
                .ok_or_else(|| Error::Target(format!("device acceptance returned {acc} nodes for sequence {b}")))?;
            let at = b * n_max;
            let nodes: Vec<usize> = path[at..at + n]
                .iter()
                .map(|&p| usize::try_from(p).ok().filter(|&p| p < n_max))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    Error::Target(format!("sequence {b}: device path {:?} leaves the tree", &path[at..at + n]))
                })?;
            let next = tokens[at + n - 1];
            let next_token = u32::try_from(next).map_err(|_| {
                Error::Target(format!(
                    "sequence {b}: the device sampler returned token {next} (a row of logits with a NaN or +inf, or \
                     none above -inf)"
                ))
            })?;
            let (hidden, hidden_size) = match hidden {
                HiddenRows::None => (None, 0),
                // Packed: row k of sequence b is the k-th accepted node's.
                HiddenRows::Packed => {
                    let rows = packed.as_deref().unwrap_or_default();
                    let v = rows[at * h..(at + n) * h].iter().map(|&x| bf16::from_bits(x).to_f32()).collect();
                    (Some(v), h)
                }
                HiddenRows::All { rows, width } => {
                    let row = |node: usize| rows.get((at + node) * width..(at + node + 1) * width);
                    let v: Option<Vec<f32>> =
                        nodes.iter().map(|&node| row(node)).collect::<Option<Vec<_>>>().map(|r| r.concat());
                    let v =
                        v.ok_or_else(|| Error::Target(format!("{} hidden values for rows {width} wide", rows.len())))?;
                    (Some(v), width)
                }
            };
            verified.push(Verified {
                accepted: Accepted { path: nodes, next_token },
                logprobs: logprobs[at..at + n].to_vec(),
                p_max: pmax[at..at + n].to_vec(),
                hidden_size,
                hidden,
            });
        }
        Ok(verified)
    }
}

/// Where the accepted nodes' hidden rows come from in [`DeviceVerifier::verify`].
#[derive(Debug, Clone, Copy)]
pub enum DeviceHidden<'a> {
    /// None recorded.
    None,
    /// The final norm's rows on the device (`[batch * n_max, hidden_size]` bf16): the accepted ones are packed there
    /// and come back with the results.
    Packed(Buf<bf16>),
    /// Every node's row on the host (`[batch * n_max, width]`): the accepted ones are picked there.
    Host {
        /// The rows.
        rows: &'a [f32],
        /// Their width.
        width: usize,
    },
}

/// The device buffers of one verification shape, reused across rounds: the packed trees and coins (sent in one copy
/// from pinned memory), the packed results (read back in one copy into pinned memory) and the per-node scratch.
#[derive(Debug)]
struct ShapeBuffers {
    program: VerifyProgram,
    input: Staged,
    output: Fetched,
    target_tok: DeviceBuf<i32>,
    target_lp: DeviceBuf<f32>,
    target_pm: DeviceBuf<f32>,
}

fn dev_err(e: tlt_kernels::Error) -> Error {
    Error::Target(e.to_string())
}

/// Verification of draft trees on a device: per `(batch, n_max)` shape its [`VerifyProgram`] and buffers, kept
/// across rounds. One call sends the trees and coins, launches the program after the work already queued (the
/// forward that wrote the logits) and reads the results back in one copy.
#[derive(Debug)]
pub struct DeviceVerifier {
    gpu: SharedGpu,
    hidden_size: usize,
    shapes: HashMap<(usize, usize), ShapeBuffers>,
}

impl DeviceVerifier {
    /// A verifier on `gpu` for hidden rows `hidden_size` wide.
    #[must_use]
    pub fn new(gpu: SharedGpu, hidden_size: usize) -> Self {
        Self { gpu, hidden_size, shapes: HashMap::new() }
    }

    /// Verifies `inputs` (at most `batch` trees of at most `n_max` nodes each) against `logits` (`[batch * n_max,
    /// vocab]` f32 on the device, node `j` of tree `b` at row `b * n_max + j`) with the coins and temperature of
    /// `spec`.
    ///
    /// # Errors
    /// [`Error::Target`] for trees that do not fit the shape, the device's failures, and what [`VerifyProgram::read`]
    /// finds wrong in the results.
    #[allow(clippy::too_many_arguments)]
    pub fn verify(
        &mut self,
        batch: usize,
        n_max: usize,
        vocab: usize,
        logits: Buf<f32>,
        hidden: DeviceHidden<'_>,
        inputs: &[TargetInput<'_>],
        spec: VerifySpec<'_>,
    ) -> Result<Vec<Verified>> {
        let (gpu, h) = (&self.gpu, self.hidden_size);
        let bufs = match self.shapes.entry((batch, n_max)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let program = VerifyProgram::new(batch, n_max, h);
                let n = batch * n_max;
                let g = gpu.as_ref();
                e.insert(ShapeBuffers {
                    input: Staged::new(gpu, program.input_bytes()).map_err(dev_err)?,
                    output: Fetched::new(gpu, program.output_bytes()).map_err(dev_err)?,
                    program,
                    target_tok: DeviceBuf::zeros(g, n).map_err(dev_err)?,
                    target_lp: DeviceBuf::zeros(g, n).map_err(dev_err)?,
                    target_pm: DeviceBuf::zeros(g, n).map_err(dev_err)?,
                })
            }
        };
        let program = &bufs.program;
        let input = bufs
            .input
            .send(program.input_bytes(), |host| {
                program
                    .write_inputs(inputs, spec.coins, host)
                    .map_err(|e| tlt_kernels::Error::InvalidArgument(e.to_string()))
            })
            .map_err(dev_err)?;
        let b = VerifyBufs {
            input,
            output: bufs.output.buf(),
            target_tok: bufs.target_tok.buf(),
            target_lp: bufs.target_lp.buf(),
            target_pmax: bufs.target_pm.buf(),
        };
        let packed = match hidden {
            DeviceHidden::Packed(src) => Some(src),
            _ => None,
        };
        for launch in program.launches(vocab, spec.params.temperature, logits, packed, &b)? {
            gpu.launch(&launch).map_err(dev_err)?;
        }
        let results = bufs.output.fetch(program.result_bytes(packed.is_some())?).map_err(dev_err)?;
        let rows = match hidden {
            DeviceHidden::None => HiddenRows::None,
            DeviceHidden::Packed(_) => HiddenRows::Packed,
            DeviceHidden::Host { rows, width } => HiddenRows::All { rows, width },
        };
        program.read(results, inputs.len(), rows)
    }
}
