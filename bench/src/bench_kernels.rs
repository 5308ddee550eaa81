//! `cargo xtask bench kernels`: tlt-kernels' skinny GEMM `y[m, n] = x[m, k] · W[n, k]^T` on one thread, per weight
//! shape, weight format and row count `m`, with the weights streamed from DRAM; f32 also against candle-core's
//! `x.matmul(&w.t())` on the same tensors. Writes `target/bench/kernels.json` and `kernels.md`.
//!
//! For every (shape, format) a set of distinct copies of the matrix is built whose total size exceeds
//! `--set-mib` (far beyond the last-level cache), and every timed pass calls the GEMM once per copy, in turn, so each
//! call finds its weights in DRAM. The time per call is the pass time divided by the number of copies; the median over
//! `--repeats` passes is reported.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::str::FromStr;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{CpuStorage, Device, Storage, Tensor};
use serde::Serialize;
use tlt_kernels::{gemm_with, GemmConfig, Isa, MatRef, Matrix, WeightDType, WeightsRef};
use tracing::{info, warn};

use crate::report::{self, median, Header};
use crate::sysinfo::{self, MachineInfo, Probe};

const MIB: usize = 1 << 20;

/// A weight shape, written `KxN` (in × out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Input features (columns of `W`, the reduction length).
    k: usize,
    /// Output features (rows of `W`).
    n: usize,
}

impl FromStr for Shape {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (k, n) = s.split_once(['x', 'X']).ok_or_else(|| format!("`{s}` is not KxN (in x out)"))?;
        let parse = |v: &str| v.trim().parse::<usize>().map_err(|e| format!("`{s}`: {e}"));
        let (k, n) = (parse(k)?, parse(n)?);
        if k == 0 || n == 0 {
            return Err(format!("`{s}`: dimensions must be positive"));
        }
        Ok(Self { k, n })
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.k, self.n)
    }
}

/// The formats, in report order.
const DTYPES: [WeightDType; 6] =
    [WeightDType::F32, WeightDType::F16, WeightDType::Bf16, WeightDType::Q8_0, WeightDType::Q4_0, WeightDType::Q4_1];

fn dtype_name(d: WeightDType) -> &'static str {
    match d {
        WeightDType::F32 => "f32",
        WeightDType::F16 => "f16",
        WeightDType::Bf16 => "bf16",
        WeightDType::Q8_0 => "q8_0",
        WeightDType::Q4_0 => "q4_0",
        WeightDType::Q4_1 => "q4_1",
    }
}

fn parse_dtype(s: &str) -> Result<WeightDType, String> {
    DTYPES
        .into_iter()
        .find(|d| dtype_name(*d).eq_ignore_ascii_case(s.trim()))
        .ok_or_else(|| format!("unknown weight format `{s}` (f32, f16, bf16, q8_0, q4_0, q4_1)"))
}

/// Options of `cargo xtask bench kernels`.
#[derive(Debug, Clone, clap::Args)]
pub struct KernelArgs {
    /// Timed passes over the whole set of copies per (shape, format, m); the median is reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Weight shapes as in×out (KxN), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "576x1536,1536x576,576x49152,1024x4096")]
    shapes: Vec<Shape>,
    /// Rows of `x` (tokens per call), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    ms: Vec<usize>,
    /// Weight formats, comma-separated (f32, f16, bf16, q8_0, q4_0, q4_1).
    #[arg(long, value_delimiter = ',', value_parser = parse_dtype, default_value = "f32,f16,bf16,q8_0,q4_0,q4_1")]
    dtypes: Vec<WeightDType>,
    /// The copies of each matrix together exceed this many MiB (the smallest count that does, at least 2).
    #[arg(long, default_value_t = 256)]
    set_mib: usize,
    /// Threads for our GEMM and the bandwidth probe (default: the cores available, as candle uses).
    #[arg(long)]
    threads: Option<usize>,
    /// Size of the read-bandwidth probe buffer in MiB (at least 512).
    #[arg(long, default_value_t = 512)]
    probe_mib: usize,
    /// `cpu` (the default): this suite measures the CPU path; a CUDA device is refused with what to run instead.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
}

/// One (shape, format, m) measurement.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    /// `KxN` (in × out).
    pub shape: String,
    /// Input features.
    pub k: usize,
    /// Output features.
    pub n: usize,
    /// Weight format.
    pub dtype: &'static str,
    /// Rows of `x`.
    pub m: usize,
    /// Distinct copies of the matrix rotated through.
    pub copies: usize,
    /// Total size of the copies, MiB.
    pub set_mib: f64,
    /// Bytes of weights one call streams.
    pub weight_bytes: usize,
    /// Median time per call, µs.
    pub us_per_call: f64,
    /// Every pass's time per call, µs, in run order.
    pub us_per_call_runs: Vec<f64>,
    /// `us_per_call / us_per_call at m = 1` (same shape and format).
    pub ratio_vs_m1: Option<f64>,
    /// `weight_bytes / us_per_call`, GB/s (10^9 B/s).
    pub weight_gb_per_s: f64,
    /// At m = 1: `weight_gb_per_s / read_bandwidth_gbs`.
    pub bw_fraction: Option<f64>,
    /// f32 only: candle-core's median time per call, µs.
    pub candle_us: Option<f64>,
    /// f32 only: every candle pass's time per call, µs.
    pub candle_us_runs: Option<Vec<f64>>,
    /// f32 only: `candle_us / us_per_call`.
    pub speedup_vs_candle: Option<f64>,
    /// Formats other than f32, at m = 1: `us_per_call(f32, m = 1) / us_per_call`.
    pub speedup_vs_f32: Option<f64>,
}

/// One target of the issue, evaluated on one shape.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    /// The metric, e.g. `ratio_vs_m1`.
    pub metric: &'static str,
    /// Weight format it is read at.
    pub dtype: &'static str,
    /// Row count it is read at.
    pub m: usize,
    /// `"<="` or `">="`.
    pub op: &'static str,
    /// The bound.
    pub threshold: f64,
    /// The measured value (`null` when that cell was not measured).
    pub value: Option<f64>,
    /// Whether `value op threshold` holds (`null` when not measured).
    pub pass: Option<bool>,
}

/// Agreement of our f32 GEMM with candle's on one shape.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// Row count compared.
    pub m: usize,
    /// `max |ours - candle| / max |candle|`.
    pub max_rel_err: f64,
}

/// The whole `kernels.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Suite, schema version, time, commit, command line and machine.
    #[serde(flatten)]
    pub header: Header,
    /// Instruction set of our GEMM (`Isa::best()`).
    pub isa: &'static str,
    /// Every instruction set this CPU runs.
    pub isa_available: Vec<&'static str>,
    /// Threads of our GEMM.
    pub threads: usize,
    /// Timed passes per cell.
    pub repeats: usize,
    /// Minimum total size of a set of copies, MiB.
    pub set_mib_min: usize,
    /// Single-thread read bandwidth, GB/s (10^9 B/s).
    pub read_bandwidth_gbs: f64,
    /// How `read_bandwidth_gbs` was measured.
    pub read_bandwidth_probe: Probe,
    /// Every measurement: shapes in `--shapes` order, then formats, then `m`.
    pub results: Vec<Entry>,
    /// Our f32 output against candle's, per shape.
    pub checks: BTreeMap<String, Check>,
    /// The targets per shape.
    pub targets: BTreeMap<String, Vec<Target>>,
    /// Whether every measured target passes.
    pub all_targets_pass: bool,
}

/// The copies of one matrix.
enum Set {
    /// f32 as candle tensors (`[n, k]`), which both our GEMM (reading the storage in place) and candle use.
    F32(Vec<Tensor>),
    /// Converted formats.
    Packed(Vec<Matrix>),
}

impl Set {
    fn len(&self) -> usize {
        match self {
            Set::F32(v) => v.len(),
            Set::Packed(v) => v.len(),
        }
    }
}

/// Runs `f` on the f32 storage of the contiguous tensor `t`.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(CpuStorage::F32(data)) = &*storage else { bail!("expected an f32 CPU tensor") };
    let (a, b) = layout.contiguous_offsets().context("expected a contiguous tensor")?;
    Ok(f(&data[a..b]))
}

/// Deterministic pseudo-random values in [-1, 1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    tlt_kernels::SeededRng::new(seed).uniform_vec(len, -1.0, 1.0)
}

/// The smallest number of copies (at least 2) of `bytes` whose total exceeds `set_mib` MiB.
fn copies_for(bytes: usize, set_mib: usize) -> usize {
    (set_mib * MIB / bytes.max(1) + 1).max(2)
}

fn build_set(shape: Shape, w: &[f32], dtype: WeightDType, set_mib: usize) -> Result<Set> {
    let bytes = dtype.row_bytes(shape.k) * shape.n;
    let copies = copies_for(bytes, set_mib);
    Ok(if dtype == WeightDType::F32 {
        Set::F32(
            (0..copies)
                .map(|_| Tensor::from_vec(w.to_vec(), (shape.n, shape.k), &Device::Cpu))
                .collect::<candle_core::Result<_>>()?,
        )
    } else {
        let first = Matrix::from_f32(shape.n, shape.k, w, dtype)?;
        Set::Packed(std::iter::repeat_with(|| first.clone()).take(copies).collect())
    })
}

/// One pass of our GEMM over every copy; seconds per call.
fn pass_ours(set: &Set, shape: Shape, cfg: GemmConfig, x: &[f32], m: usize, y: &mut [f32]) -> Result<f64> {
    let t = Instant::now();
    match set {
        Set::F32(ts) => {
            for w in ts {
                with_f32(w, |w| gemm_with(cfg, x, m, MatRef::new(shape.n, shape.k, WeightsRef::F32(w))?, None, y))??;
            }
        }
        Set::Packed(ms) => {
            for w in ms {
                gemm_with(cfg, x, m, w.view(), None, y)?;
            }
        }
    }
    std::hint::black_box(&*y);
    Ok(t.elapsed().as_secs_f64() / set.len() as f64)
}

/// One pass of candle's `x.matmul(&w.t())` over every copy; seconds per call. Afterwards it sleeps
/// [`SETTLE`] (untimed) so candle's worker threads are parked before our pass runs.
fn pass_candle(ts: &[Tensor], x: &Tensor) -> Result<f64> {
    let t = Instant::now();
    for w in ts {
        std::hint::black_box(x.matmul(&w.t()?)?);
    }
    let secs = t.elapsed().as_secs_f64() / ts.len() as f64;
    std::thread::sleep(SETTLE);
    Ok(secs)
}

/// Pause after each candle pass (its rayon workers spin for a while after a parallel call).
const SETTLE: std::time::Duration = std::time::Duration::from_millis(20);

/// `max |ours - candle| / max |candle|` on the first copy at `m` rows.
fn check_against_candle(ts: &[Tensor], shape: Shape, cfg: GemmConfig, m: usize) -> Result<Check> {
    let x = values(m * shape.k, 7);
    let mut y = vec![0f32; m * shape.n];
    with_f32(&ts[0], |w| gemm_with(cfg, &x, m, MatRef::new(shape.n, shape.k, WeightsRef::F32(w))?, None, &mut y))??;
    let xt = Tensor::from_slice(&x, (m, shape.k), &Device::Cpu)?;
    let theirs: Vec<f32> = xt.matmul(&ts[0].t()?)?.flatten_all()?.to_vec1()?;
    let scale = theirs.iter().fold(0f32, |a, v| a.max(v.abs())).max(f32::MIN_POSITIVE);
    let err = y.iter().zip(&theirs).fold(0f32, |a, (p, q)| a.max((p - q).abs()));
    Ok(Check { m, max_rel_err: f64::from(err / scale) })
}

/// Runs the suite and writes `target/bench/kernels.{json,md}`.
pub fn run(args: &KernelArgs) -> Result<()> {
    if args.repeats == 0 || args.shapes.is_empty() || args.ms.is_empty() || args.dtypes.is_empty() {
        bail!("--repeats, --shapes, --ms and --dtypes must be non-empty / positive");
    }
    if args.ms.contains(&0) {
        bail!("--ms must list positive row counts");
    }
    for s in &args.shapes {
        if s.k % 32 != 0 && args.dtypes.iter().any(|d| d.is_blocked()) {
            bail!("shape {s}: K must be a multiple of 32 for the block formats");
        }
    }
    let timestamp = sysinfo::utc_timestamp();
    let machine = MachineInfo::collect();
    let isa = Isa::best();
    let threads = args.threads.unwrap_or_else(tlt_kernels::default_threads).max(1);
    let cfg = GemmConfig { isa, threads };
    info!(isa = isa.name(), threads, candle_threads = machine.candle_threads, "kernel benchmark");
    info!(mib = args.probe_mib.max(512), threads, "probing read bandwidth");
    let (bw_gbs, probe) = Probe::run(args.probe_mib, threads);
    info!(gb_per_s = format!("{bw_gbs:.2}"), "read bandwidth");

    let mut results: Vec<Entry> = Vec::new();
    let mut checks = BTreeMap::new();
    for &shape in &args.shapes {
        let w = values(shape.n * shape.k, 1);
        let first_of_shape = results.len();
        for &dtype in &args.dtypes {
            let set = build_set(shape, &w, dtype, args.set_mib)?;
            let weight_bytes = dtype.row_bytes(shape.k) * shape.n;
            let set_mib = (weight_bytes * set.len()) as f64 / MIB as f64;
            info!(shape = %shape, dtype = dtype_name(dtype), copies = set.len(), set_mib = format!("{set_mib:.0}"), "timing");
            if let Set::F32(ts) = &set {
                if let Some(&m) = args.ms.iter().find(|&&m| m == 8).or(args.ms.first()) {
                    let c = check_against_candle(ts, shape, cfg, m)?;
                    if c.max_rel_err > 1e-4 {
                        warn!(shape = %shape, m, max_rel_err = c.max_rel_err, "f32 GEMM disagrees with candle");
                    }
                    checks.insert(shape.to_string(), c);
                }
            }
            let first_of_dtype = results.len();
            for &m in &args.ms {
                let x = values(m * shape.k, 2);
                let xt = Tensor::from_slice(&x, (m, shape.k), &Device::Cpu)?;
                let mut y = vec![0f32; m * shape.n];
                // Warm-up pass of each (code paths, allocator), not timed.
                pass_ours(&set, shape, cfg, &x, m, &mut y)?;
                if let Set::F32(ts) = &set {
                    pass_candle(ts, &xt)?;
                }
                let (mut ours, mut theirs) = (Vec::new(), Vec::new());
                for r in 0..args.repeats {
                    match &set {
                        // Interleaved, alternating who goes first.
                        Set::F32(ts) if r % 2 == 1 => {
                            theirs.push(pass_candle(ts, &xt)? * 1e6);
                            ours.push(pass_ours(&set, shape, cfg, &x, m, &mut y)? * 1e6);
                        }
                        Set::F32(ts) => {
                            ours.push(pass_ours(&set, shape, cfg, &x, m, &mut y)? * 1e6);
                            theirs.push(pass_candle(ts, &xt)? * 1e6);
                        }
                        Set::Packed(_) => ours.push(pass_ours(&set, shape, cfg, &x, m, &mut y)? * 1e6),
                    }
                }
                let us = median(&ours);
                let candle_us = (!theirs.is_empty()).then(|| median(&theirs));
                let gbs = weight_bytes as f64 / us / 1e3;
                results.push(Entry {
                    shape: shape.to_string(),
                    k: shape.k,
                    n: shape.n,
                    dtype: dtype_name(dtype),
                    m,
                    copies: set.len(),
                    set_mib,
                    weight_bytes,
                    us_per_call: us,
                    us_per_call_runs: ours,
                    ratio_vs_m1: None,
                    weight_gb_per_s: gbs,
                    bw_fraction: (m == 1).then(|| gbs / bw_gbs),
                    candle_us,
                    candle_us_runs: (!theirs.is_empty()).then_some(theirs),
                    speedup_vs_candle: candle_us.map(|c| c / us),
                    speedup_vs_f32: None,
                });
            }
            let t1 = results[first_of_dtype..].iter().find(|e| e.m == 1).map(|e| e.us_per_call);
            for e in &mut results[first_of_dtype..] {
                e.ratio_vs_m1 = t1.map(|t1| e.us_per_call / t1);
            }
            let row: Vec<String> =
                results[first_of_dtype..].iter().map(|e| format!("m={} {:.1}µs", e.m, e.us_per_call)).collect();
            info!(shape = %shape, dtype = dtype_name(dtype), "{}", row.join(", "));
        }
        let f32_m1 = results[first_of_shape..].iter().find(|e| e.dtype == "f32" && e.m == 1).map(|e| e.us_per_call);
        for e in &mut results[first_of_shape..] {
            if e.dtype != "f32" && e.m == 1 {
                e.speedup_vs_f32 = f32_m1.map(|t| t / e.us_per_call);
            }
        }
    }

    let targets: BTreeMap<String, Vec<Target>> =
        args.shapes.iter().map(|s| (s.to_string(), evaluate_targets(&results, &s.to_string()))).collect();
    let all_targets_pass = targets.values().flatten().all(|t| t.pass != Some(false));
    let report = Report {
        header: Header::new("kernels", 1, timestamp, machine),
        isa: isa.name(),
        isa_available: Isa::available().into_iter().map(Isa::name).collect(),
        threads: cfg.threads,
        repeats: args.repeats,
        set_mib_min: args.set_mib,
        read_bandwidth_gbs: bw_gbs,
        read_bandwidth_probe: probe,
        results,
        checks,
        targets,
        all_targets_pass,
    };
    let table = markdown(&report, &args.shapes, &args.dtypes, &args.ms);
    report::write_outputs("kernels", &report, &table)?;
    println!("{table}");
    Ok(())
}

/// The targets on one shape.
fn evaluate_targets(results: &[Entry], shape: &str) -> Vec<Target> {
    let get = |dtype: &str, m: usize| results.iter().find(|e| e.shape == shape && e.dtype == dtype && e.m == m);
    let mut out = Vec::new();
    let mut push =
        |metric: &'static str, dtype: &'static str, m: usize, op: &'static str, threshold: f64, value: Option<f64>| {
            let pass = value.map(|v| if op == "<=" { v <= threshold } else { v >= threshold });
            out.push(Target { metric, dtype, m, op, threshold, value, pass });
        };
    for (m, bound) in [(2, 1.15), (4, 1.35), (8, 1.7)] {
        push("ratio_vs_m1", "f32", m, "<=", bound, get("f32", m).and_then(|e| e.ratio_vs_m1));
    }
    push("bw_fraction", "f32", 1, ">=", 0.8, get("f32", 1).and_then(|e| e.bw_fraction));
    push("speedup_vs_candle", "f32", 8, ">=", 2.0, get("f32", 8).and_then(|e| e.speedup_vs_candle));
    for dtype in ["q8_0", "q4_0", "q4_1"] {
        push("speedup_vs_f32", dtype, 1, ">=", 2.5, get(dtype, 1).and_then(|e| e.speedup_vs_f32));
    }
    out
}

/// One table per shape (rows: formats, columns: m; cells: µs per call and ratio to m = 1), then the targets.
fn markdown(r: &Report, shapes: &[Shape], dtypes: &[WeightDType], ms: &[usize]) -> String {
    let mut s = format!(
        "# kernels: skinny GEMM y[m,n] = x[m,k]·W[n,k]^T, weights from DRAM\n\n\
         tlt-kernels `gemm_with` ({}, {} threads) vs candle-core `x.matmul(&w.t())` ({} threads); {}; read \
         bandwidth with the same threads {:.2} GB/s; every call reads its own copy of W (sets of ≥ {} MiB); median of {} passes; \
         commit {}; {}\n\n\
         Cells: µs per call (ratio to m=1). `GB/s`, `bw` (fraction of the probe) and `vs f32` are at m=1.\n",
        r.isa,
        r.threads,
        r.header.machine.candle_threads,
        r.header.machine.cpu_model,
        r.read_bandwidth_gbs,
        r.set_mib_min,
        r.repeats,
        r.header.git_commit,
        r.header.timestamp,
    );
    let head: String = ms.iter().map(|m| format!(" m={m} |")).collect();
    let rule: String = ms.iter().map(|_| "---:|").collect();
    for shape in shapes {
        let name = shape.to_string();
        let get = |dtype: &str, m: usize| r.results.iter().find(|e| e.shape == name && e.dtype == dtype && e.m == m);
        let copies: Vec<String> = dtypes
            .iter()
            .filter_map(|d| get(dtype_name(*d), ms[0]).map(|e| format!("{} {}", dtype_name(*d), e.copies)))
            .collect();
        let _ = write!(
            s,
            "\n## {name} (k={}, n={}; copies: {})\n\n| dtype |{head} GB/s | bw | vs f32 |\n|---|{rule}---:|---:|---:|\n",
            shape.k,
            shape.n,
            copies.join(", ")
        );
        let opt = |v: Option<f64>, prec: usize| v.map_or("–".to_string(), |v| format!("{v:.prec$}"));
        for &d in dtypes {
            let dn = dtype_name(d);
            let _ = write!(s, "| {dn} |");
            for &m in ms {
                match get(dn, m) {
                    Some(e) => {
                        let _ = write!(s, " {:.1} ({}) |", e.us_per_call, opt(e.ratio_vs_m1, 2));
                    }
                    None => s.push_str(" – |"),
                }
            }
            let m1 = get(dn, 1);
            let _ = writeln!(
                s,
                " {} | {} | {} |",
                opt(m1.map(|e| e.weight_gb_per_s), 2),
                opt(m1.and_then(|e| e.bw_fraction), 3),
                opt(m1.and_then(|e| e.speedup_vs_f32), 2)
            );
        }
        if dtypes.contains(&WeightDType::F32) {
            s.push_str("| candle f32 |");
            for &m in ms {
                match get("f32", m) {
                    Some(e) => {
                        let _ = write!(s, " {} (×{}) |", opt(e.candle_us, 1), opt(e.speedup_vs_candle, 2));
                    }
                    None => s.push_str(" – |"),
                }
            }
            s.push_str(" | | |\n");
            s.push_str("\n(candle row: µs per call and our speedup, candle time / ours.)\n");
        }
    }
    s.push_str(
        "\n## targets\n\n| shape | metric | dtype | m | target | measured | pass |\n|---|---|---|---:|---|---:|---|\n",
    );
    for shape in shapes.iter().map(Shape::to_string) {
        for t in r.targets.get(&shape).into_iter().flatten() {
            let _ = writeln!(
                s,
                "| {shape} | {} | {} | {} | {} {} | {} | {} |",
                t.metric,
                t.dtype,
                t.m,
                t.op,
                t.threshold,
                t.value.map_or("–".into(), |v| format!("{v:.3}")),
                match t.pass {
                    Some(true) => "yes",
                    Some(false) => "**no**",
                    None => "not measured",
                }
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse() {
        assert_eq!("576x1536".parse::<Shape>(), Ok(Shape { k: 576, n: 1536 }));
        assert!("576".parse::<Shape>().is_err());
        assert!("0x4".parse::<Shape>().is_err());
    }

    #[test]
    fn copies_exceed_the_set() {
        let bytes = 576 * 49152 * 4;
        assert_eq!(copies_for(bytes, 256), 3);
        assert!(copies_for(576 * 1536 * 4, 256) * 576 * 1536 * 4 > 256 * MIB);
    }
}
