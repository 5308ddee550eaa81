//! The `openai` Python package against the `tlt-serve` binary's OpenAI endpoints (`scripts/check_openai_client.py`):
//! a tiny model with a byte-level tokenizer, served on a local port; the client's own types read every answer and
//! the raw JSON is compared field by field with them. Without the package it says SKIP, unless
//! `TLT_REQUIRE_PYTHON_CHECK` is set (`cargo xtask test` installs the package and sets it), then it fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tlt_model::{EosTokens, Llama, LlamaConfig};

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

#[test]
fn the_openai_package_reads_every_answer() {
    let probe = Command::new(python()).args(["-c", "import openai; print(openai.__version__)"]).output();
    let version = match probe {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        _ if std::env::var_os("TLT_REQUIRE_PYTHON_CHECK").is_none() => {
            println!("SKIP the_openai_package_reads_every_answer: the `openai` package is not importable");
            return;
        }
        other => panic!("TLT_REQUIRE_PYTHON_CHECK is set but `import openai` fails: {other:?}"),
    };
    let dir = std::env::temp_dir().join(format!("tlt-serve-openai-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cfg = LlamaConfig::tiny(264, 64, 2);
    cfg.eos_token_id = Some(EosTokens::One(258));
    let model = Llama::random(cfg, 3).unwrap();
    tlt_model::save_hf_dir(&model, Some(&tlt_model::byte_tokenizer().unwrap()), &dir, candle_core::DType::F32).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let server = Command::new(env!("CARGO_BIN_EXE_tlt-serve"))
        .arg("--model")
        .arg(&dir)
        .args(["--port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _serving = Serving(server);
    let t = Instant::now();
    while !healthy(port) {
        assert!(t.elapsed() < Duration::from_secs(60), "tlt-serve did not come up on port {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/check_openai_client.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(format!("http://127.0.0.1:{port}/v1"))
        .arg(dir.display().to_string())
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("openai {version}:\n{text}");
    assert!(out.status.success(), "the openai client's checks failed:\n{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
