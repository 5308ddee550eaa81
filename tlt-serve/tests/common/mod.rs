//! What the server tests share: a tiny model, a server on a free port, and HTTP/1.1 written by hand.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)] // Tests: a panic is the failure report.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use serde_json::Value;
use tlt_model::{EosTokens, Llama, LlamaConfig};
use tlt_serve::worker::DecodeConfig;
use tlt_serve::{ServeConfig, Server};

pub const VOCAB: usize = 64;

pub fn tiny() -> Llama {
    let mut cfg = LlamaConfig::tiny(VOCAB, 64, 2);
    cfg.eos_token_id = Some(EosTokens::One(1));
    Llama::random(cfg, 5).unwrap()
}

/// A model big enough that a long request takes a while (about a second for 3,000 tokens), with a 4,096-token
/// context; `seed` picks its weights.
pub fn slow(seed: u64) -> Llama {
    let mut cfg = LlamaConfig::tiny(VOCAB, 128, 4);
    cfg.max_position_embeddings = 4096;
    cfg.eos_token_id = Some(EosTokens::One(1));
    Llama::random(cfg, seed).unwrap()
}

/// A server of [`tiny`] on a free port, SD on or off; its address.
pub fn serve(speculate: bool) -> SocketAddr {
    serve_model(tiny(), speculate)
}

/// A server of `model` on a free port, speculating in every round or never, weight version `v1`; its address.
pub fn serve_model(model: Llama, speculate: bool) -> SocketAddr {
    let decode = if speculate {
        DecodeConfig::always_speculate()
    } else {
        DecodeConfig { speculate, ..DecodeConfig::default() }
    };
    serve_with(model, decode)
}

/// A server of `model` decoding as `decode`, weight version `v1`; its address. The runtime lives as long as the test
/// process.
pub fn serve_with(model: Llama, decode: DecodeConfig) -> SocketAddr {
    // Weight updates from the system's temporary directory (where the tests write their checkpoints).
    let guard = tlt_serve::guard::GuardConfig { weights_dirs: vec![std::env::temp_dir()], ..Default::default() };
    let cfg = ServeConfig {
        decode,
        model_name: "tiny".into(),
        weight_version: Some("v1".into()),
        guard,
        ..ServeConfig::default()
    };
    serve_config(model, None, cfg)
}

/// A server of `model` with `tokenizer` and `cfg` on a free port; its address. The runtime lives as long as the
/// test process.
pub fn serve_config(model: Llama, tokenizer: Option<tokenizers::Tokenizer>, cfg: ServeConfig) -> SocketAddr {
    serve_server(Server::start(model, tokenizer, cfg).unwrap())
}

/// `server` on a free port; its address. The runtime lives as long as the test process.
pub fn serve_server(server: Server) -> SocketAddr {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || rt.block_on(async { axum::serve(listener, server.router).await.unwrap() }));
    addr
}

/// Opens a connection and writes `POST path` with `body` (raw bytes, `Connection: close`); the stream to read the
/// answer from.
pub fn send_post(addr: SocketAddr, path: &str, body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body);
    s
}

/// Reads a whole HTTP answer from `s`: (status, JSON body; `Null` when it is not JSON).
pub fn reply(mut s: TcpStream) -> (u16, Value) {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out);
    let status: u16 = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let json = text.split("\r\n\r\n").nth(1).and_then(|b| serde_json::from_str(b).ok()).unwrap_or(Value::Null);
    (status, json)
}

/// `method path` with `headers` and `body` written by hand (no `Content-Type` unless given): (status, JSON body).
pub fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, Value) {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body);
    reply(s)
}

/// `POST path` with `body` (raw bytes): (status, JSON body).
pub fn post_raw(addr: SocketAddr, path: &str, body: &[u8]) -> (u16, Value) {
    reply(send_post(addr, path, body))
}

/// `POST path` with `body`: the raw response text (head and body, chunked framing included).
pub fn post_text(addr: SocketAddr, path: &str, body: &Value) -> String {
    let mut s = send_post(addr, path, body.to_string().as_bytes());
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    post_raw(addr, path, body.to_string().as_bytes())
}

pub fn get(addr: SocketAddr, path: &str) -> u16 {
    get_body(addr, path).0
}

/// `GET path`: (status, body).
pub fn get_body(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, out.split("\r\n\r\n").nth(1).unwrap_or("").to_string())
}

/// The value of Prometheus metric `name` in `/metrics`.
pub fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (status, text) = get_body(addr, "/metrics");
    assert_eq!(status, 200);
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("tlt_serve_{name} ")))
        .unwrap_or_else(|| panic!("no {name}:\n{text}"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// The output ids of a `/generate` answer.
pub fn ids(v: &Value) -> Vec<u32> {
    v["output_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

/// The device of a device test and its name in answers: the CUDA device on a GPU machine (`TLT_REQUIRE_GPU=1` makes
/// a missing one an error), else a fresh simulated device.
pub fn test_device() -> (tlt_kernels::cuda::SharedGpu, &'static str) {
    let gpu = tlt_cuda_sim::test_devices("tlt-serve", &[tlt_cuda_sim::Schedule::Lazy]).unwrap().remove(0);
    let name = if tlt_kernels::cuda::driver_available() { "cuda:0" } else { "sim" };
    (gpu, name)
}

/// A server of `model` on a fresh [`test_device`], decoding as `decode`, with a pool of `tokens` (slots of the
/// model's full context); its address.
pub fn serve_sim(model: Llama, decode: DecodeConfig, tokens: usize) -> SocketAddr {
    let (gpu, name) = test_device();
    let guard = tlt_serve::guard::GuardConfig { weights_dirs: vec![std::env::temp_dir()], ..Default::default() };
    let pool = tlt_serve::pool::PoolSpec { max_total_tokens: Some(tokens), ..Default::default() };
    let cfg = ServeConfig {
        decode,
        model_name: "tiny".into(),
        weight_version: Some("v1".into()),
        guard,
        pool,
        ..ServeConfig::default()
    };
    let beside = cfg.decode.beside(model.config());
    let backend =
        tlt_serve::backend::DeviceBackend::new(model, gpu, name, &cfg.pool, cfg.decode.max_running, beside).unwrap();
    serve_server(Server::start_on(backend, None, cfg).unwrap())
}

/// Tokens of one slot of [`tiny`]'s device cache (its context, plus the largest draft tree).
pub fn sim_slot() -> usize {
    tlt_serve::backend::slot_len(tiny().config())
}
