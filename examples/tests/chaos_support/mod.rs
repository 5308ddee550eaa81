//! The chaos harness's parts: a tiny model with a byte-level tokenizer, `train` runs in their own directories,
//! seeded kills, and the final state a run leaves (checkpoint and metrics, wall-clock fields left out).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tlt_model::{EosTokens, Llama, LlamaConfig};

/// The run: 4 GRPO steps of 4 prompts x 4 answers with TLT (EAGLE-2 drafter on its fixed schedule, SD from the
/// first qualifying round), a checkpoint after every step.
const CONFIG: &str = r#"
checkpoint_every = 1

[export]
at_end = false

[task]
name = "arithmetic"
seed = 6

# "1 - 1", judged by the last number of the answer: the fixture's model, drawn to emit the digit 0 now and then,
# is right about as often as wrong, so groups have reward variance and every step trains.
[task.arithmetic]
min_ops = 1
max_ops = 1
max_operand = 1
ops = "-"

[task.reward]
flexible = true

[eval]
prompts = 2
max_new_tokens = 6

[trainer]
steps = 4
seed = 3
prompts_per_step = 4
group_size = 4
max_new_tokens = 12
temperature = 1.0
micro_batch_tokens = 96

[trainer.sd]
drafter = "eagle2"
schedule = { kind = "fixed", steps = 3 }
publish_every = 1

[trainer.sd.gate]
threshold = 16
on_after = 1
off_threshold = 16
off_after = 1

[trainer.sd.mab]
arms = [{ steps = 2, top_k = 1, verify_tokens = 3 }, { steps = 3, top_k = 2, verify_tokens = 6 }]
thresholds = [1, 4]
seed = 0
"#;

/// Wall-clock fields of a metrics line or the trainer state (by the end of their key): they differ between any two
/// runs, killed or not. `tail_share` is the share of decode *time* spent in the tail.
const TIMING: [&str; 5] = ["_s", "seconds", "per_s", "latency", "tail_share"];

/// A seeded generator (SplitMix64): the harness's choices, reproducible from `TLT_CHAOS_SEED`.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A model, its config and a scratch root for runs.
pub struct Fixture {
    root: PathBuf,
    model: PathBuf,
    config: PathBuf,
}

/// Makes the model at `path` sample diverse answers that hold the digit 0 now and then: the LM head is scaled down
/// to logits of about unit spread (random weights give ~8: nearly greedy sampling), every token's embedding gets a
/// constant first component, which the residual stream carries to the final norm, and the LM head's row of `0`
/// reads it.
fn digits_likely(path: &Path) {
    use candle_core::{Device, Tensor};
    let mut tensors = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    let head = (&tensors["lm_head.weight"] * 0.125).unwrap();
    tensors.insert("lm_head.weight".into(), head);
    let mut set = |name: &str, rows: std::ops::Range<usize>, value: f32| {
        let t = &tensors[name];
        let mut m: Vec<Vec<f32>> = t.to_vec2().unwrap();
        for row in &mut m[rows] {
            row[0] = value;
        }
        let flat: Vec<f32> = m.concat();
        let shaped = Tensor::from_vec(flat, t.shape(), &Device::Cpu).unwrap();
        tensors.insert(name.to_string(), shaped);
    };
    set("model.embed_tokens.weight", 0..264, DIGIT_PULL.0);
    set("lm_head.weight", usize::from(b'0')..usize::from(b'0') + 1, DIGIT_PULL.1);
    candle_core::safetensors::save(&tensors, path).unwrap();
}

/// The embedding's constant component and the LM-head weight of `0` on it.
const DIGIT_PULL: (f32, f32) = (20.0, 0.7);

impl Fixture {
    /// A fresh root under the temporary directory, with a seeded 2-layer model (hidden 64, vocabulary 264) whose
    /// end of sequence is `<|im_end|>`, and the run config.
    pub fn new(name: &str) -> Self {
        let root = std::env::temp_dir().join(format!("tlt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let model = root.join("model");
        std::fs::create_dir_all(&model).unwrap();
        let tokenizer = tlt_model::byte_tokenizer().unwrap();
        let mut cfg = LlamaConfig::tiny(264, 64, 2);
        cfg.eos_token_id = Some(EosTokens::One(258));
        let llama = Llama::random(cfg, 17).unwrap();
        tlt_model::save_hf_dir(&llama, Some(&tokenizer), &model, candle_core::DType::F32).unwrap();
        digits_likely(&model.join("model.safetensors"));
        let config = root.join("config.toml");
        std::fs::write(&config, CONFIG).unwrap();
        Self { root, model, config }
    }

    /// A run in `<root>/<name>` (emptied) on `ranks` ranks.
    pub fn run(&self, name: &str, ranks: usize) -> Run<'_> {
        let out = self.root.join(name);
        let _ = std::fs::remove_dir_all(&out);
        Run { fx: self, out, ranks, hits: HashMap::new() }
    }

    pub fn clean(&self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Where a kill landed: the point, the hit of it in its process, the rank.
#[derive(Debug, Clone)]
pub struct Kill {
    pub point: String,
    pub hit: u64,
    pub rank: usize,
}

impl Kill {
    /// The phase of the run the point belongs to.
    pub fn phase(&self) -> &'static str {
        match self.point.split('.').next().unwrap_or("") {
            "ckpt" => "checkpoint write",
            "rollout" => "rollout",
            "update" => "policy update",
            "drafter" => "drafter step",
            "metrics" => "metrics append",
            _ => "other",
        }
    }
}

impl std::fmt::Display for Kill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} #{} (rank {})", self.point, self.hit, self.rank)
    }
}

/// Whether `out` is a process (or an MPI job) that a kill point ended.
pub fn killed(out: &Output) -> bool {
    stderr(out).contains("tlt-chaos: killed at") && !out.status.success()
}

pub fn stderr(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// How `train` starts: fresh, from the checkpoint (an error without one), or from it where one exists.
#[derive(Debug, Clone, Copy)]
pub enum Resume {
    No,
    Checkpoint,
    OrFresh,
}

impl From<bool> for Resume {
    fn from(resume: bool) -> Self {
        if resume {
            Self::Checkpoint
        } else {
            Self::No
        }
    }
}

/// One run directory.
pub struct Run<'a> {
    fx: &'a Fixture,
    out: PathBuf,
    ranks: usize,
    /// Hits of each kill point in an uninterrupted process of this run ([`Self::complete`] counts them).
    hits: HashMap<String, u64>,
}

/// The phases' kill points, checkpoint writes twice as likely as the others (they are five points).
const CYCLE: [&[&str]; 6] = [
    &["ckpt.written", "ckpt.rename.next", "ckpt.rename.old", "ckpt.rename.in", "ckpt.removed.old"],
    &["rollout.round"],
    &["update.micro", "update.step"],
    &["ckpt.written", "ckpt.rename.next", "ckpt.rename.old", "ckpt.rename.in", "ckpt.removed.old"],
    &["drafter.step"],
    &["metrics.torn"],
];

impl Run<'_> {
    /// The run's directory for the TLT mode.
    pub fn dir(&self) -> PathBuf {
        self.out.join("tlt")
    }

    /// `train` once (`--resume` when asked) with `failpoints` armed (on one rank of `TLT_CHAOS_RANK`'s choosing,
    /// set by the caller) and the kill points' hits traced.
    pub fn train(&self, resume: bool, failpoints: Option<&str>) -> Output {
        self.train_on(resume, failpoints, None, &[])
    }

    /// [`Self::train`] with the points armed on `rank` only (all ranks: `None`), `resume` as [`Resume`] says, and
    /// `extra` arguments.
    pub fn train_on(
        &self,
        resume: impl Into<Resume>,
        failpoints: Option<&str>,
        rank: Option<usize>,
        extra: &[&str],
    ) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_train"));
        cmd.args(["--mode", "tlt", "--no-export", "--config"]).arg(&self.fx.config);
        cmd.arg("--model").arg(&self.fx.model).arg("--out").arg(&self.out);
        cmd.args(["--ranks", &self.ranks.to_string()]).args(extra);
        match resume.into() {
            Resume::No => {}
            Resume::Checkpoint => {
                cmd.arg("--resume");
            }
            Resume::OrFresh => {
                cmd.args(["--resume", "--allow-fresh"]);
            }
        }
        cmd.env("RAYON_NUM_THREADS", "1").env("TLT_CHAOS_TRACE", "1").env_remove("FAILPOINTS");
        if let Some(f) = failpoints {
            cmd.env("FAILPOINTS", f);
        }
        if let Some(r) = rank {
            cmd.env("TLT_CHAOS_RANK", r.to_string());
        }
        cmd.output().unwrap()
    }

    /// Runs (or resumes, where a checkpoint exists) to the end without kills, counting each point's hits.
    pub fn complete(mut self) -> Self {
        let resume = self.dir().join("run.json").exists();
        let out = self.train(resume, None);
        assert!(out.status.success(), "an uninterrupted run failed:\n{}", stderr(&out));
        for line in stderr(&out).lines() {
            if let Some(p) = line.split("tlt-chaos: at ").nth(1).and_then(|p| p.split_whitespace().next()) {
                *self.hits.entry(p.to_string()).or_default() += 1;
            }
        }
        self
    }

    /// Runs to the end with seeded kills: the first process is killed at a point of the cycle's next phase, each
    /// resumed process is killed again with probability 1/3 (at most 3 kills), until one completes. Returns the
    /// kills that landed (empty: the chosen hit was never reached) and how many processes had one armed.
    pub fn complete_with_kills(&self, rng: &mut Rng) -> (Vec<Kill>, usize) {
        let hits = self.reference_hits();
        let mut kills = Vec::new();
        let (mut resume, mut checkpointed, mut armed) = (false, false, 0);
        loop {
            let arm = kills.is_empty() || (kills.len() < 3 && rng.below(3) == 0);
            let choice = arm.then(|| {
                let phase = CYCLE[rng.below(CYCLE.len() as u64) as usize];
                let point = phase[rng.below(phase.len() as u64) as usize];
                let per_process = hits.get(point).copied().unwrap_or(1) / self.ranks as u64;
                let span = if resume { per_process.div_ceil(2) } else { per_process };
                let rank = rng.below(self.ranks as u64) as usize;
                Kill { point: point.to_string(), hit: rng.below(span.max(1)), rank }
            });
            let spec = choice.as_ref().map(|k| format!("{}={}*off->return", k.point, k.hit));
            armed += usize::from(choice.is_some());
            // A kill before the first checkpoint was complete leaves nothing to resume: the user's remedy is
            // `--resume --allow-fresh`. Once one was (a checkpoint write reached `.next`), `--resume` must find it.
            let how = match (resume, checkpointed) {
                (false, _) => Resume::No,
                (true, true) => Resume::Checkpoint,
                (true, false) => Resume::OrFresh,
            };
            let out = self.train_on(how, spec.as_deref(), choice.as_ref().map(|k| k.rank), &[]);
            let text = stderr(&out);
            checkpointed |=
                text.contains(&format!("tlt-chaos: at ckpt.rename.next ({})", self.dir().join("checkpoint").display()));
            match choice {
                Some(k) if killed(&out) => {
                    assert!(text.contains(&format!("tlt-chaos: killed at {}", k.point)), "{text}");
                    kills.push(k);
                    resume = true;
                }
                // Done; with no kill, the chosen hit lay past the run's end.
                _ if out.status.success() => return (kills, armed),
                _ => panic!("`train` failed without a kill (after kills at {kills:?}):\n{text}"),
            }
        }
    }

    /// How often point `name` was reached in [`Self::complete`]'s process (all ranks).
    pub fn hits(&self, name: &str) -> u64 {
        self.hits.get(name).copied().unwrap_or(0)
    }

    fn reference_hits(&self) -> HashMap<String, u64> {
        let path = self.out.parent().unwrap().join(format!("reference-{}", self.ranks)).join("hits.json");
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    }

    /// What the run left: every checkpoint file (bytes; `state.json` and the metrics as JSON without wall-clock
    /// fields), and the metrics lines of every rank. Also saves this run's kill-point hit counts for later runs.
    pub fn final_state(&self) -> BTreeMap<String, serde_json::Value> {
        std::fs::write(self.out.join("hits.json"), serde_json::to_vec(&self.hits).unwrap()).unwrap();
        let mut state = BTreeMap::new();
        let dir = self.dir();
        collect(&dir.join("checkpoint"), "checkpoint", &mut state);
        for rel in ["metrics.jsonl", "ranks/rank-1.jsonl"] {
            let path = dir.join(rel);
            if let Ok(text) = std::fs::read_to_string(&path) {
                let lines: Vec<serde_json::Value> =
                    text.lines().map(|l| without_timing(serde_json::from_str(l).unwrap())).collect();
                state.insert(rel.to_string(), serde_json::Value::Array(lines));
            }
        }
        state
    }

    pub fn clean(&self) {
        let _ = std::fs::remove_dir_all(&self.out);
    }
}

/// Every file under `dir` into `out` (keys `prefix/relative path`): JSON files parsed and without wall-clock
/// fields, others as their bytes in hex (compared exactly).
fn collect(dir: &Path, prefix: &str, out: &mut BTreeMap<String, serde_json::Value>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let (path, name) = (e.path(), e.file_name().to_string_lossy().into_owned());
        let key = format!("{prefix}/{name}");
        if path.is_dir() {
            collect(&path, &key, out);
        } else if name.ends_with(".json") {
            let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            out.insert(key, without_timing(v));
        } else {
            let bytes = std::fs::read(&path).unwrap();
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            out.insert(key, serde_json::Value::String(format!("{} bytes: {hex}", bytes.len())));
        }
    }
}

/// `v` without the keys that hold wall-clock measurements (at any depth), and with the bandit's window samples
/// (`[arm, reward, weight]`: a reward is tokens per second of a step, its weight the step's seconds) cut to
/// their arms: which arm ran, in which bucket and order, is compared; what the clock said is not.
fn without_timing(v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Object(m) => Value::Object(
            m.into_iter()
                .filter(|(k, _)| !TIMING.iter().any(|t| k.ends_with(t)))
                .map(|(k, v)| match (k.as_str(), v) {
                    ("windows", Value::Array(buckets)) => {
                        let arms = |w: Value| match w {
                            Value::Array(s) => Value::Array(s.into_iter().map(|x| x[0].clone()).collect()),
                            other => other,
                        };
                        (k, Value::Array(buckets.into_iter().map(arms).collect()))
                    }
                    (_, v) => (k, without_timing(v)),
                })
                .collect(),
        ),
        serde_json::Value::Array(a) => serde_json::Value::Array(a.into_iter().map(without_timing).collect()),
        other => other,
    }
}

/// The first key whose value differs between `a` and `b`, with both values (shortened).
pub fn first_difference(
    a: &BTreeMap<String, serde_json::Value>,
    b: &BTreeMap<String, serde_json::Value>,
) -> Option<String> {
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter().find(|k| a.get(*k) != b.get(*k)).map(|k| {
        let show = |v: Option<&serde_json::Value>| {
            let s = v.map_or("(missing)".to_string(), ToString::to_string);
            s.chars().take(400).collect::<String>()
        };
        format!("{k}: expected {} got {}", show(a.get(k)), show(b.get(k)))
    })
}
