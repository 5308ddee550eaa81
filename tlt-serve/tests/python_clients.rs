//! Clients nobody here wrote, in Python, against the `tlt-serve` binary (a tiny model with a byte-level tokenizer,
//! served on a local port):
//! - the `openai` package against the OpenAI endpoints, completions and chat completions (the checkpoint carries a
//!   ChatML template in `tokenizer_config.json`; `scripts/check_openai_client.py`): the client's own types read every
//!   answer and the raw JSON is compared field by field with them;
//! - slime's rollout payloads and parsing (`scripts/check_slime_client.py`; slime is not on PyPI, so the script sends
//!   what its rollout sends and reads answers as it does, with `requests`);
//! - TRL's `VLLMClient` request and parsing code (`scripts/check_trl_client.py`, trl 1.16.0 installed without its
//!   GPU dependencies), whose samples are then checked against SGLang's `/generate` with the same seed;
//! - TRL's `GRPOTrainer` itself training against the binary through `python/tlt_trl`, its weights synced by disk
//!   (`scripts/check_trl_grpo.py`), the served tokens then the synced checkpoint's;
//! - the verl adapter (`python/tlt_verl`, aiohttp) driven as verl's agent loop drives its rollout servers
//!   (`scripts/check_verl_adapter.py`), against the SGLang mock and the binary, and registered in verl 0.9.1 itself
//!   (its `LLMServerManager` on a local Ray, its load balancer and `LLMServerClient`);
//! - slime's deployment: PyPI's sglang-router 0.3.2 (the Rust gateway, started as slime starts it:
//!   `scripts/run_sglang_router.py`, 127.0.0.1 only, killed at the end) in front of the binary, the engine
//!   registered as slime registers it, slime's rollout, eval and abort through it (`check_slime_client.py --router`);
//! - slime's external-engine start-up: its discovery and server-argument assert against `/server_info`
//!   (`scripts/check_slime_startup.py`), and the assert failing for flags this server does not run with.
//!
//! Without a package a test says SKIP, unless `TLT_REQUIRE_PYTHON_CHECK` is set (`cargo xtask test` installs the
//! packages and sets it), then it fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tlt_model::{EosTokens, Llama, LlamaConfig};

mod common;

/// Kills the server when the test ends, however it ends.
struct Serving(Child);

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

fn healthy(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.starts_with("HTTP/1.1 200")
}

/// Whether `module` imports; SKIP (false) when not, unless the checks are required.
fn importable(test: &str, module: &str) -> bool {
    let probe = Command::new(python()).args(["-c", &format!("import {module}")]).output();
    match probe {
        Ok(o) if o.status.success() => true,
        _ if std::env::var_os("TLT_REQUIRE_PYTHON_CHECK").is_none() => {
            println!("SKIP {test}: the `{module}` package is not importable");
            false
        }
        other => panic!("TLT_REQUIRE_PYTHON_CHECK is set but `import {module}` fails: {other:?}"),
    }
}

/// The binary serving a tiny model (byte-level tokenizer, ChatML chat template in `tokenizer_config.json`) on a
/// free port, SD on; its checkpoint directory and port.
fn serve_binary(name: &str) -> (Serving, std::path::PathBuf, u16) {
    serve_binary_with(name, &[])
}

/// [`serve_binary`] with more command-line arguments.
fn serve_binary_with(name: &str, args: &[&str]) -> (Serving, std::path::PathBuf, u16) {
    let dir = std::env::temp_dir().join(format!("tlt-serve-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cfg = LlamaConfig::tiny(264, 64, 2);
    cfg.eos_token_id = Some(EosTokens::One(258));
    let model = Llama::random(cfg, 3).unwrap();
    let tok = tlt_model::byte_tokenizer().unwrap();
    tlt_model::save_hf_dir(&model, Some(&tok), &dir, candle_core::DType::F32).unwrap();
    // A tokenizer_config.json with a ChatML template, as an export writes it: `/v1/chat/completions` renders with it.
    let config = tlt_rl::trainer::tokenizer_config(model.config(), &tok, Some(tlt_rl::task::CHATML_JINJA));
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let server = Command::new(env!("CARGO_BIN_EXE_tlt-serve"))
        .arg("--model")
        .arg(&dir)
        .args(["--port", &port.to_string()])
        // The verl adapter's check updates the weights from the checkpoint itself.
        .arg("--weights-dir")
        .arg(&dir)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let serving = Serving(server);
    let t = Instant::now();
    while !healthy(port) {
        assert!(t.elapsed() < Duration::from_secs(60), "tlt-serve did not come up on port {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
    (serving, dir, port)
}

/// Runs `scripts/<script>` with `args`: its output (asserting success).
fn run_script(script: &str, args: &[String]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts").join(script);
    let out = Command::new(python()).arg(&script).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(out.status.success(), "{} failed:\n{text}", script.display());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_openai_package_reads_every_answer() {
    if !importable("the_openai_package_reads_every_answer", "openai") {
        return;
    }
    let (_serving, dir, port) = serve_binary("openai");
    run_script("check_openai_client.py", &[format!("http://127.0.0.1:{port}/v1"), dir.display().to_string()]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn trls_vllm_client_generates_and_parses_log_probs() {
    if !importable("trls_vllm_client_generates_and_parses_log_probs", "trl.import_utils, requests") {
        return;
    }
    let (_serving, dir, port) = serve_binary("trl");
    let prompts = vec![vec![72u32, 105, 33], vec![49, 32, 45, 32, 49, 61]];
    let out = run_script(
        "check_trl_client.py",
        &[format!("http://127.0.0.1:{port}"), serde_json::to_string(&prompts).unwrap()],
    );
    let batch: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    // Sample 0 of a request seeded 7 is SGLang's /generate with sampling_seed 7: the same tokens and log-probs.
    let body = serde_json::json!({"input_ids": prompts[0], "return_logprob": true,
        "sampling_params": {"temperature": 0.7, "max_new_tokens": 12, "sampling_seed": 7}});
    let (status, sglang) = common::post(std::net::SocketAddr::from(([127, 0, 0, 1], port)), "/generate", &body);
    assert_eq!(status, 200, "{sglang}");
    assert_eq!(batch["completion_ids"][0], sglang["output_ids"], "TRL's parse vs /generate");
    let trl_lps: Vec<f64> = batch["logprobs"][0].as_array().unwrap().iter().map(|l| l[0].as_f64().unwrap()).collect();
    let sg_lps: Vec<f64> = sglang["meta_info"]["output_token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t[0].as_f64().unwrap())
        .collect();
    assert_eq!(trl_lps, sg_lps);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn slimes_rollout_payloads_and_parsing_work() {
    if !importable("slimes_rollout_payloads_and_parsing_work", "requests") {
        return;
    }
    let (_serving, dir, port) = serve_binary("slime");
    let prompts = vec![vec![72u32, 105, 33], vec![49, 32, 45, 32, 49, 61]];
    run_script(
        "check_slime_client.py",
        &[format!("http://127.0.0.1:{port}"), serde_json::to_string(&prompts).unwrap()],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// TRL 1.16's `GRPOTrainer`, unchanged, against the binary through `python/tlt_trl` (`scripts/check_trl_grpo.py`):
/// it constructs (TRL's start-up checks), trains two GRPO steps with its generation through TRL's client and two
/// weight syncs (the first the initial weights, the second the weights after a step), and what the server serves
/// after the last sync is the greedy decoding of that synced checkpoint in process, token for token. The server runs
/// with `--api-key`: the client sends it on every request.
#[test]
fn trls_grpo_trainer_constructs_trains_and_syncs_its_weights_into_the_server() {
    let modules = "trl.trainer.grpo_trainer, datasets, accelerate, torch, transformers";
    if !importable("trls_grpo_trainer_constructs_trains_and_syncs_its_weights_into_the_server", modules) {
        return;
    }
    let key = "trl-grpo-key";
    let (_serving, dir, port) = serve_binary_with("trl-grpo", &["--api-key", key]);
    let url = format!("http://127.0.0.1:{port}");
    let weights = dir.join("trl-sync");
    let args = [url, dir.display().to_string(), weights.display().to_string(), key.to_string()];
    let out = run_script("check_trl_grpo.py", &args);
    let last: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let synced = tlt_model::load(Path::new(last["dir"].as_str().unwrap())).unwrap().model;
    let prompt = [72u32, 105, 33];
    let mut cache = synced.new_cache();
    let seq = cache.add_sequence();
    let argmax =
        |row: Vec<f32>| row.iter().enumerate().fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0;
    let mut next = argmax(synced.prefill(&mut cache, seq, &prompt).unwrap().to_vec1().unwrap()) as u32;
    let mut want = vec![next];
    while want.len() < 12 {
        next = argmax(synced.decode(&mut cache, &[(seq, next)]).unwrap().to_vec2().unwrap().remove(0)) as u32;
        want.push(next);
    }
    let body = serde_json::json!({"input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": true}});
    let addr = ([127, 0, 0, 1], port).into();
    let bearer = format!("Bearer {key}");
    let headers = [("Content-Type", "application/json"), ("Authorization", bearer.as_str())];
    let (status, answer) = common::request(addr, "POST", "/generate", &headers, body.to_string().as_bytes());
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["meta_info"]["weight_version"], last["weight_version"]);
    assert_eq!(common::ids(&answer), want, "the server does not serve the synced checkpoint");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The reference mock of SGLang's API (`scripts/sglang_mock.py`, Python's standard library only) on a free port,
/// started with `args`; its port.
fn serve_sglang_mock(args: &[&str]) -> (Serving, u16) {
    use std::io::{BufRead, BufReader};
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/sglang_mock.py");
    let mut child =
        Command::new(python()).arg(&script).args(["--port", "0"]).args(args).stdout(Stdio::piped()).spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let serving = Serving(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let port = line
        .trim()
        .strip_prefix("SGLANG_MOCK_PORT=")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("the SGLang mock did not say its port: {line:?}"));
    println!("SGLang mock listening on port {port}");
    (serving, port)
}

/// Per check (`POST /generate`, ...), every key path of the answers with the JSON types seen there, as
/// `check_slime_client.py --schema-out` writes it.
type Shapes = std::collections::BTreeMap<String, std::collections::BTreeMap<String, Vec<String>>>;

/// Whether `path` lies inside a list that `paths` saw only empty (so its elements could not be observed).
fn inside_empty_list(paths: &std::collections::BTreeMap<String, Vec<String>>, path: &str) -> bool {
    path.match_indices('[').any(|(i, _)| {
        let list = &path[..i];
        paths.get(list).is_some_and(|t| t.iter().any(|t| t == "array"))
            && !paths.keys().any(|p| p.starts_with(list) && p[list.len()..].starts_with('['))
    })
}

#[test]
fn slimes_reads_of_sglangs_answers_conform_field_by_field() {
    if !importable("slimes_reads_of_sglangs_answers_conform_field_by_field", "requests") {
        return;
    }
    let prompts = serde_json::to_string(&vec![vec![72u32, 105, 33], vec![49, 32, 45, 32, 49, 61]]).unwrap();
    let out = std::env::temp_dir().join(format!("tlt-slime-schemas-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let (mock_schema, ours_schema) = (out.join("sglang-mock.json"), out.join("tlt-serve.json"));

    // The reference: SGLang's answers as its source shapes them, with a speculative algorithm as tlt-serve runs one;
    // 50 ms a token, so that the script surely sees its long requests running before it pauses them.
    let (_mock, mock_port) =
        serve_sglang_mock(&["--enable-metrics", "--speculative-algorithm", "NGRAM", "--token-delay", "0.05"]);
    run_script(
        "check_slime_client.py",
        &[
            format!("http://127.0.0.1:{mock_port}"),
            prompts.clone(),
            "--server-kind".into(),
            "sglang".into(),
            "--schema-out".into(),
            mock_schema.display().to_string(),
        ],
    );
    let (_serving, dir, port) = serve_binary("conformance");
    run_script(
        "check_slime_client.py",
        &[format!("http://127.0.0.1:{port}"), prompts, "--schema-out".into(), ours_schema.display().to_string()],
    );

    let load = |p: &Path| -> serde_json::Value { serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap() };
    let (mock, ours) = (load(&mock_schema), load(&ours_schema));
    let mock_shapes: Shapes = serde_json::from_value(mock["shapes"].clone()).unwrap();
    let ours_shapes: Shapes = serde_json::from_value(ours["shapes"].clone()).unwrap();
    let reads = &mock["reads"];
    let empty = std::collections::BTreeMap::new();
    let mut failures = Vec::new();
    let mut compared = 0;
    for (check, paths) in &mock_shapes {
        let theirs = ours_shapes.get(check).unwrap_or(&empty);
        for (path, types) in paths {
            let reader = reads[check][path].as_str();
            match (theirs.get(path), reader) {
                (Some(t), r) if t != types => {
                    println!("TYPES  {check} {path}: SGLang {types:?}, tlt-serve {t:?}");
                    if let Some(r) = r {
                        failures.push(format!("{check} {path} (read by {r}): SGLang {types:?}, tlt-serve {t:?}"));
                    }
                }
                (Some(_), Some(r)) => {
                    compared += 1;
                    println!("same   {check} {path} {types:?} (read by {r})");
                }
                (Some(_), None) => {}
                (None, r) if inside_empty_list(theirs, path) => {
                    let r = r.map(|r| format!(", read by {r}")).unwrap_or_default();
                    println!("unseen {check} {path}{r}: inside lists that tlt-serve only answered empty");
                }
                (None, r) => {
                    println!("only SGLang    {check} {path} {types:?}");
                    if let Some(r) = r {
                        failures
                            .push(format!("{check} {path} {types:?} (read by {r}): absent from tlt-serve's answer"));
                    }
                }
            }
        }
        for (path, types) in theirs.iter().filter(|(p, _)| !paths.contains_key(*p)) {
            println!("only tlt-serve {check} {path} {types:?}");
        }
    }
    for check in ours_shapes.keys().filter(|c| !mock_shapes.contains_key(*c)) {
        println!("only tlt-serve {check}");
    }
    for (check, paths) in reads.as_object().unwrap() {
        for (path, reader) in paths.as_object().unwrap() {
            if !mock_shapes.get(check).is_some_and(|p| p.contains_key(path)) {
                let tlt = match ours_shapes.get(check).and_then(|p| p.get(path)) {
                    Some(types) => format!("tlt-serve sends it, {types:?}"),
                    None => "tlt-serve does not send it either".into(),
                };
                println!("not in SGLang's answer: {check} {path} (read by {reader}); {tlt}");
            }
        }
    }
    println!(
        "{compared} fields that slime or the script reads: the same JSON types in SGLang's and tlt-serve's answers"
    );
    assert!(compared > 0, "nothing was compared");
    assert!(
        failures.is_empty(),
        "tlt-serve's answers differ from SGLang's where slime reads them:\n{}",
        failures.join("\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn verls_rollout_server_contract_holds_through_the_adapter() {
    if !importable("verls_rollout_server_contract_holds_through_the_adapter", "aiohttp, pydantic") {
        return;
    }
    let prompts = serde_json::to_string(&vec![vec![72u32, 105, 33], vec![49, 32, 45, 32, 49, 61]]).unwrap();
    // The reference first: SGLang's answers as the mock shapes them (50 ms a token, so that requests stay in flight).
    let (_mock, mock_port) = serve_sglang_mock(&["--enable-metrics", "--token-delay", "0.05"]);
    run_script(
        "check_verl_adapter.py",
        &[format!("http://127.0.0.1:{mock_port}"), prompts.clone(), "--server-kind".into(), "sglang".into()],
    );
    // Then the binary, with an API key and a weight update from the checkpoint it serves.
    let (_serving, dir, port) = serve_binary_with("verl", &["--api-key", "verl-key"]);
    let url = format!("http://127.0.0.1:{port}");
    let out = run_script(
        "check_verl_adapter.py",
        &[
            url,
            prompts,
            "--update-weights-from".into(),
            dir.display().to_string(),
            "--api-key".into(),
            "verl-key".into(),
        ],
    );
    assert!(out.contains("ok key:"), "{out}");
    assert!(out.contains("verl adapter: all checks passed"), "{out}");
    // With the checks required, verl itself (installed by `cargo xtask test`) drove the adapter, not stand-ins.
    if std::env::var_os("TLT_REQUIRE_PYTHON_CHECK").is_some() {
        assert!(out.contains(" itself: get_rollout_replica_class"), "verl's own classes did not run:\n{out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A free port on 127.0.0.1.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Whether `GET path` on `port` answers 200.
fn answers(port: u16, path: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes());
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.starts_with("HTTP/1.1 200")
}

/// PyPI's sglang-router, started as slime starts it (`scripts/run_sglang_router.py`), on 127.0.0.1 and a free
/// port, with no workers yet; killed when the guard drops. Its port.
fn serve_sglang_router() -> (Serving, u16) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/run_sglang_router.py");
    let (port, metrics) = (free_port(), free_port());
    let child = Command::new(python())
        .arg(&script)
        .args([port.to_string(), metrics.to_string()])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut serving = Serving(child);
    let t = Instant::now();
    while !answers(port, "/workers") {
        if let Ok(Some(status)) = serving.0.try_wait() {
            panic!("sglang-router exited before it served: {status}");
        }
        assert!(t.elapsed() < Duration::from_secs(60), "sglang-router did not come up on port {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("sglang-router listening on 127.0.0.1:{port}");
    (serving, port)
}

#[test]
fn slimes_rollout_and_eval_go_through_the_real_sglang_router() {
    let modules = "requests, sglang_router.launch_router, sglang_router.sglang_router_rs";
    if !importable("slimes_rollout_and_eval_go_through_the_real_sglang_router", modules) {
        return;
    }
    let (_serving, dir, port) = serve_binary("router");
    let (_router, router_port) = serve_sglang_router();
    let prompts = vec![vec![72u32, 105, 33], vec![49, 32, 45, 32, 49, 61]];
    let out = run_script(
        "check_slime_client.py",
        &[
            format!("http://127.0.0.1:{port}"),
            serde_json::to_string(&prompts).unwrap(),
            "--router".into(),
            format!("http://127.0.0.1:{router_port}"),
        ],
    );
    for line in ["ok rollout through the router", "ok eval through the router", "ok abort_all through the router"] {
        assert!(out.contains(line), "{line:?} missing:\n{out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn slimes_start_up_assert_passes_against_get_server_info() {
    if !importable("slimes_start_up_assert_passes_against_get_server_info", "requests") {
        return;
    }
    let (_serving, dir, port) = serve_binary("startup");
    let base = format!("http://127.0.0.1:{port}");
    let out = run_script("check_slime_startup.py", std::slice::from_ref(&base));
    assert!(out.contains("ok slime's start-up assert over ['enable_memory_saver']"), "{out}");
    // The negative controls: slime launched with flags this server does not run as fails its own assert.
    for flag in ["--fp16", "--offload-rollout", "--use-rollout-routing-replay"] {
        let out = run_script("check_slime_startup.py", &[base.clone(), flag.into(), "--expect-fail".into()]);
        assert!(out.contains("ok the start-up assert fails as expected"), "{flag}: {out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
