//! The fuzz targets: their seed files (written by our own savers or taken from the real SmolLM2 GGUF), the
//! structure-aware mutators, and the loader each input is fed to.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::ValueEnum;
use serde_json::Value;
use tlt_kernels::SplitMix64;

/// A loader under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Target {
    /// `tlt_model::load` on a `.gguf` file (the real SmolLM2 GGUF's header and tokenizer metadata, mutated).
    Gguf,
    /// `tlt_model::load` on an HF directory whose `model.safetensors` (header and body) is mutated.
    Safetensors,
    /// `tlt_model::load` on an HF directory whose `config.json` is mutated.
    ConfigJson,
    /// `tlt_model::load_tokenizer_json` on a mutated SmolLM2 `tokenizer.json`.
    TokenizerJson,
    /// `tlt_drafter::checkpoint::load_eagle2` / `load_eagle3` on mutated checkpoint directories.
    Drafter,
    /// `tlt_rl::runner::RunConfig::from_toml` on a mutated run config (the demo's).
    RunToml,
}

/// How a seed file is mutated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Gguf,
    Safetensors,
    Json,
    Toml,
}

/// One seed: a directory of files, the one that gets mutated, and what its format is.
#[derive(Debug, Clone)]
pub struct Seed {
    dir: PathBuf,
    file: &'static str,
    format: Format,
    /// Which drafter loader reads it (drafter target only).
    eagle3: bool,
    bytes: Vec<u8>,
}

const GGUF_PREFIX: usize = 3 << 20;

impl Seed {
    /// The seed file's bytes.
    #[cfg(test)]
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// Writes (once) and reads the seeds of `target` under `root`.
pub fn seeds(target: Target, root: &Path, gguf: &Path) -> Result<Vec<Seed>> {
    let tiny = tlt_model::LlamaConfig::tiny(64, 16, 2);
    let model = tlt_model::Llama::random(tiny.clone(), 0)?;
    let hf = root.join("seed-hf");
    if !hf.join("config.json").exists() {
        tlt_model::save_hf_dir(&model, None, &hf, candle_core::DType::F32)?;
    }
    // Qwen3: q/k head norms and a head_dim of its own (4 heads of 8 in a hidden size of 16 would be 4 wide).
    let qwen3 = root.join("seed-hf-qwen3");
    if !qwen3.join("config.json").exists() {
        let mut cfg = tiny.clone();
        cfg.model_type = "qwen3".into();
        cfg.head_dim = Some(8);
        tlt_model::save_hf_dir(&tlt_model::Llama::random(cfg, 0)?, None, &qwen3, candle_core::DType::F32)?;
    }
    let seed = |dir: &Path, file: &'static str, format: Format, eagle3: bool| -> Result<Seed> {
        let bytes =
            std::fs::read(dir.join(file)).with_context(|| format!("reading seed {}", dir.join(file).display()))?;
        Ok(Seed { dir: dir.to_path_buf(), file, format, eagle3, bytes })
    };
    Ok(match target {
        Target::Gguf => {
            let dir = root.join("seed-gguf");
            let path = dir.join("model.gguf");
            if !path.exists() {
                std::fs::create_dir_all(&dir)?;
                let bytes = std::fs::read(gguf).with_context(|| format!("reading {}", gguf.display()))?;
                std::fs::write(&path, &bytes[..bytes.len().min(GGUF_PREFIX)])?;
            }
            vec![seed(&dir, "model.gguf", Format::Gguf, false)?]
        }
        Target::Safetensors => vec![
            seed(&hf, "model.safetensors", Format::Safetensors, false)?,
            seed(&qwen3, "model.safetensors", Format::Safetensors, false)?,
        ],
        Target::ConfigJson => {
            vec![seed(&hf, "config.json", Format::Json, false)?, seed(&qwen3, "config.json", Format::Json, false)?]
        }
        Target::TokenizerJson => {
            let dir = root.join("seed-tokenizer");
            if !dir.join("tokenizer.json").exists() {
                std::fs::create_dir_all(&dir)?;
                let tok = tlt_model::GgufFile::open(gguf)?.tokenizer()?.context("the GGUF carries no tokenizer")?;
                tok.save(dir.join("tokenizer.json"), false).map_err(|e| anyhow::anyhow!("saving tokenizer: {e}"))?;
            }
            vec![seed(&dir, "tokenizer.json", Format::Json, false)?]
        }
        Target::Drafter => {
            use tlt_drafter::{DrafterConfig, Eagle2Drafter, Eagle3Drafter, FrozenTarget, SaveDType, VocabMap};
            let (d2, d3) = (root.join("seed-eagle2"), root.join("seed-eagle3"));
            if !d3.join("config.json").exists() {
                let frozen = FrozenTarget::new(&model);
                let cfg2 = DrafterConfig::eagle2_from_target(model.config(), true);
                Eagle2Drafter::random(cfg2, frozen.clone(), 1)?.save(&d2, SaveDType::Bf16)?;
                let vocab = VocabMap::from_tokens((0..64u32).cycle().take(200), 64, 16, &[2])?;
                let cfg3 = DrafterConfig::eagle3_from_target(model.config(), 16);
                Eagle3Drafter::random(cfg3, vocab, frozen, 2)?.save(&d3, SaveDType::Bf16)?;
            }
            vec![
                seed(&d2, "config.json", Format::Json, false)?,
                seed(&d2, "model.safetensors", Format::Safetensors, false)?,
                seed(&d3, "config.json", Format::Json, true)?,
                seed(&d3, "model.safetensors", Format::Safetensors, true)?,
            ]
        }
        Target::RunToml => {
            let dir = root.join("seed-toml");
            std::fs::create_dir_all(&dir)?;
            let demo = crate::env::workspace_root().join("examples/configs/demo.toml");
            std::fs::copy(&demo, dir.join("run.toml")).with_context(|| format!("copying {}", demo.display()))?;
            vec![seed(&dir, "run.toml", Format::Toml, false)?]
        }
    })
}

/// The mutated bytes of input `i` of a run with `seed` (a pure function of both and the seeds).
pub fn input(seeds: &[Seed], seed: u64, i: u64) -> (usize, Vec<u8>) {
    let mut rng = SplitMix64::new(seed).fork(i);
    let which = (i % seeds.len() as u64) as usize;
    let s = &seeds[which];
    let mut bytes = s.bytes.clone();
    for _ in 0..1 + rng.below(3) {
        bytes = match (s.format, rng.below(10)) {
            (_, 0) => bytes_mutation(bytes, &mut rng),
            (Format::Gguf, _) => gguf_mutation(bytes, &mut rng),
            (Format::Safetensors, _) => safetensors_mutation(bytes, &mut rng),
            (Format::Json, _) => json_mutation(bytes, &mut rng),
            (Format::Toml, _) => toml_mutation(bytes, &mut rng),
        };
    }
    (which, bytes)
}

/// Feeds one input to the loader: `Ok(outcome)` names what happened (`ok` or the error's kind), for counting.
pub fn exercise(target: Target, seeds: &[Seed], which: usize, bytes: &[u8], work: &Path) -> Result<String> {
    let s = &seeds[which];
    let dir = work.join(format!("case{which}"));
    if !dir.exists() {
        std::fs::create_dir_all(&dir)?;
        for entry in std::fs::read_dir(&s.dir)? {
            let entry = entry?;
            std::fs::copy(entry.path(), dir.join(entry.file_name()))?;
        }
    }
    let path = dir.join(s.file);
    std::fs::write(&path, bytes)?;
    let tiny = tlt_model::LlamaConfig::tiny(64, 16, 2);
    let outcome = match target {
        Target::Gguf => gguf_stages(&path),
        Target::Safetensors | Target::ConfigJson => class(tlt_model::load(&dir).map(drop)),
        Target::TokenizerJson => class(tlt_model::load_tokenizer_json(&path).map(drop)),
        Target::Drafter if s.eagle3 => class(tlt_drafter::checkpoint::load_eagle3(&dir, &tiny).map(drop)),
        Target::Drafter => class(tlt_drafter::checkpoint::load_eagle2(&dir, &tiny).map(drop)),
        Target::RunToml => {
            let text = String::from_utf8_lossy(bytes);
            class(tlt_rl::runner::RunConfig::from_toml(&text).map(drop))
        }
    };
    Ok(outcome)
}

/// The GGUF loader stage by stage (header, config, tokenizer, then the whole load), so outcomes say how far an
/// input got.
fn gguf_stages(path: &Path) -> String {
    let file = match tlt_model::GgufFile::open(path) {
        Ok(f) => f,
        Err(e) => return format!("open:{}", class::<tlt_model::Error>(Err(e))),
    };
    if let Err(e) = file.config() {
        return format!("config:{}", class::<tlt_model::Error>(Err(e)));
    }
    if let Err(e) = file.tokenizer() {
        return format!("tokenizer:{}", class::<tlt_model::Error>(Err(e)));
    }
    drop(file);
    format!("load:{}", class(tlt_model::load(path).map(drop)))
}

/// `ok`, or the error's variant name (its `Debug` up to the first brace or parenthesis).
fn class<E: std::fmt::Debug>(r: std::result::Result<(), E>) -> String {
    match r {
        Ok(()) => "ok".into(),
        Err(e) => {
            let d = format!("{e:?}");
            d.split(['(', '{', ' ']).next().unwrap_or("error").to_string()
        }
    }
}

/// Values that break length and count arithmetic.
const INTERESTING: [u64; 12] = [0, 1, 2, 7, 255, 4096, 65_535, 1 << 31, (1 << 32) - 1, 1 << 40, u64::MAX / 2, u64::MAX];

fn bytes_mutation(mut b: Vec<u8>, rng: &mut SplitMix64) -> Vec<u8> {
    if b.is_empty() {
        return vec![rng.next_u64() as u8];
    }
    match rng.below(4) {
        0 => b.truncate(rng.below(b.len())),
        1 => {
            for _ in 0..1 + rng.below(8) {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
        }
        2 => {
            let i = rng.below(b.len());
            let n = rng.below(64).min(b.len() - i);
            let chunk = b[i..i + n].to_vec();
            let at = rng.below(b.len());
            b.splice(at..at, chunk);
        }
        _ => {
            let i = rng.below(b.len());
            b[i] = rng.next_u64() as u8;
        }
    }
    b
}

/// Overwrites the little-endian integer of `width` bytes at `at` with an interesting value or a near miss of
/// the current one.
fn poke_int(b: &mut [u8], at: usize, width: usize, rng: &mut SplitMix64) {
    if at + width > b.len() {
        return;
    }
    let mut cur = [0u8; 8];
    cur[..width].copy_from_slice(&b[at..at + width]);
    let cur = u64::from_le_bytes(cur);
    let v = match rng.below(3) {
        0 => INTERESTING[rng.below(INTERESTING.len())],
        1 => cur.wrapping_add(1 + rng.below(16) as u64),
        _ => cur.wrapping_sub(1 + rng.below(16) as u64),
    };
    b[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
}

/// Offsets of the GGUF header's integers: version, tensor count, KV count, then per KV its key length and value
/// type, per string value its length, per array its element type and count (walked as far as the bytes allow).
fn gguf_fields(b: &[u8]) -> Vec<(usize, usize)> {
    let rd = |at: usize, w: usize| -> Option<u64> {
        let s = b.get(at..at + w)?;
        let mut v = [0u8; 8];
        v[..w].copy_from_slice(s);
        Some(u64::from_le_bytes(v))
    };
    let mut f = vec![(4, 4), (8, 8), (16, 8)];
    let Some(kvs) = rd(16, 8) else { return f };
    let mut at = 24;
    let scalar = |t: u64| -> Option<usize> {
        Some(match t {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            _ => return None,
        })
    };
    for _ in 0..kvs.min(10_000) {
        let Some(klen) = rd(at, 8) else { break };
        f.push((at, 8));
        at += 8 + klen as usize;
        let Some(t) = rd(at, 4) else { break };
        f.push((at, 4));
        at += 4;
        match t {
            8 => {
                let Some(n) = rd(at, 8) else { break };
                f.push((at, 8));
                at += 8 + n as usize;
            }
            9 => {
                let (Some(et), Some(n)) = (rd(at, 4), rd(at + 4, 8)) else { break };
                f.push((at, 4));
                f.push((at + 4, 8));
                at += 12;
                for _ in 0..n {
                    if et == 8 {
                        let Some(len) = rd(at, 8) else { break };
                        if rng_free_sample(at) {
                            f.push((at, 8));
                        }
                        at += 8 + len as usize;
                    } else if let Some(w) = scalar(et) {
                        at += w * n as usize;
                        break;
                    } else {
                        break;
                    }
                }
            }
            t => match scalar(t) {
                Some(w) => at += w,
                None => break,
            },
        }
    }
    f
}

/// Keeps one array-string length field in 64 (vocabularies have tens of thousands).
fn rng_free_sample(at: usize) -> bool {
    (at / 8).is_multiple_of(64)
}

fn gguf_mutation(mut b: Vec<u8>, rng: &mut SplitMix64) -> Vec<u8> {
    let fields = gguf_fields(&b);
    match rng.below(4) {
        0 => {
            let cut = rng.below(b.len().max(1));
            b.truncate(cut);
        }
        _ if !fields.is_empty() => {
            let (at, w) = fields[rng.below(fields.len())];
            poke_int(&mut b, at, w, rng);
        }
        _ => return bytes_mutation(b, rng),
    }
    b
}

fn safetensors_mutation(mut b: Vec<u8>, rng: &mut SplitMix64) -> Vec<u8> {
    let hlen = b.get(..8).map_or(0, |h| u64::from_le_bytes(h.try_into().unwrap_or([0; 8])) as usize);
    match rng.below(4) {
        0 => poke_int(&mut b, 0, 8, rng),
        1 => b.truncate(rng.below(b.len().max(1))),
        _ if hlen > 0 && 8usize.checked_add(hlen).is_some_and(|end| end <= b.len()) => {
            let header = json_mutation(b[8..8 + hlen].to_vec(), rng);
            let mut out = (header.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(&header);
            out.extend_from_slice(&b[8 + hlen..]);
            return out;
        }
        _ => return bytes_mutation(b, rng),
    }
    b
}

/// Mutates one node of a JSON document (or its text, when it does not parse).
fn json_mutation(b: Vec<u8>, rng: &mut SplitMix64) -> Vec<u8> {
    let Ok(mut v) = serde_json::from_slice::<Value>(&b) else { return bytes_mutation(b, rng) };
    mutate_value(&mut v, rng, 0);
    serde_json::to_vec(&v).unwrap_or(b)
}

fn mutate_value(v: &mut Value, rng: &mut SplitMix64, depth: usize) {
    let descend = depth < 6 && rng.below(4) != 0;
    match v {
        Value::Object(m) if descend && !m.is_empty() => {
            let key = m.keys().nth(rng.below(m.len())).cloned().unwrap_or_default();
            if rng.below(8) == 0 {
                m.remove(&key);
            } else if let Some(child) = m.get_mut(&key) {
                mutate_value(child, rng, depth + 1);
            }
        }
        Value::Array(a) if descend && !a.is_empty() => {
            let i = rng.below(a.len());
            match rng.below(8) {
                0 => {
                    a.remove(i);
                }
                1 => {
                    let c = a[i].clone();
                    a.push(c);
                }
                _ => mutate_value(&mut a[i], rng, depth + 1),
            }
        }
        _ => *v = replacement(v, rng),
    }
}

fn replacement(v: &Value, rng: &mut SplitMix64) -> Value {
    match rng.below(8) {
        0 => Value::Null,
        1 => Value::Bool(rng.below(2) == 0),
        2 => Value::from(INTERESTING[rng.below(INTERESTING.len())]),
        3 => Value::from(-(rng.below(1 << 20) as i64) - 1),
        4 => serde_json::json!(f64::MAX / (1 + rng.below(3)) as f64),
        5 => Value::from(["", "F16", "BF16", "I64", "bool", "llama", "NaN", "qwen2", "qwen3"][rng.below(9)]),
        6 => Value::Array(vec![v.clone(), v.clone()]),
        _ => match v.as_u64() {
            Some(n) => Value::from(n.wrapping_mul(1 + rng.below(1000) as u64)),
            None => serde_json::json!({}),
        },
    }
}

fn toml_mutation(b: Vec<u8>, rng: &mut SplitMix64) -> Vec<u8> {
    let text = String::from_utf8_lossy(&b).into_owned();
    let Ok(doc) = toml::from_str::<toml::Value>(&text) else { return bytes_mutation(b, rng) };
    // TOML has no null and no huge integers: mutate the JSON image, then map back where TOML can say it.
    let Ok(mut json) = serde_json::to_value(&doc) else { return b };
    mutate_value(&mut json, rng, 0);
    match serde_json::from_value::<toml::Value>(json).ok().and_then(|t| toml::to_string(&t).ok()) {
        Some(s) => s.into_bytes(),
        None => bytes_mutation(b, rng),
    }
}
