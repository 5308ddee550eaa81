//! tlt-comm's TCPStore client against torch's own: `scripts/check_tcpstore.py` is a trainer's rank 0 opening a
//! weight-update group as slime and SGLang do (torch's `rendezvous` hosting the store, SGLang's
//! `init_custom_process_group` prefixes, the store torch hands its NCCL backend); this test is the other rank, as
//! `tlt-serve` joins: it connects, joins the job (the store's constructor on rank 0 waits for that), reads the NCCL
//! id at the key [`nccl_id_key`] computes, and answers through the plain store.
//!
//! Without torch the test says SKIP, unless `TLT_REQUIRE_PYTHON_CHECK` is set (`cargo xtask test` installs torch and
//! sets it), then it fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use tlt_comm::store::{nccl_id_key, TcpStore};

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Whether torch imports; SKIP (false) when not, unless the checks are required.
fn torch_importable(test: &str) -> bool {
    let probe = Command::new(python()).args(["-c", "import torch.distributed"]).output();
    if probe.is_ok_and(|o| o.status.success()) {
        return true;
    }
    assert!(
        std::env::var_os("TLT_REQUIRE_PYTHON_CHECK").is_none(),
        "TLT_REQUIRE_PYTHON_CHECK is set but `import torch.distributed` fails"
    );
    println!("SKIP {test}: torch is not importable");
    false
}

#[test]
fn joins_a_torch_groups_rendezvous_and_reads_its_nccl_id() {
    if !torch_importable("joins_a_torch_groups_rendezvous_and_reads_its_nccl_id") {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/check_tcpstore.py");
    let group = "weight_update_group";
    let trainer = Command::new(python())
        .arg(&script)
        .args(["--port", &port.to_string(), "--world-size", "2", "--group-name", group])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut store = TcpStore::connect("127.0.0.1", port, Duration::from_secs(60)).unwrap();
    assert_eq!(store.join().unwrap(), 2, "this rank is the second to join a world of two");
    let id = store.get(&nccl_id_key(group, 0)).unwrap();
    assert_eq!(id.len(), 128, "an NCCL unique id");
    assert!(store.check(&nccl_id_key(group, 0)).unwrap());
    assert!(!store.check(&nccl_id_key(group, 1)).unwrap(), "only the first communicator's id is set");
    store.set("tlt/got", &id).unwrap();
    assert_eq!(store.add("tlt/count", 5).unwrap(), 5);
    let out = trainer.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    println!("{said}");
    assert!(out.status.success(), "the trainer's side failed: {said}");
}

/// A key nobody sets: `get` gives up after the connection's timeout with an error naming the key.
#[test]
fn a_key_never_set_times_out_by_name() {
    if !torch_importable("a_key_never_set_times_out_by_name") {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let code = format!(
        "import time, datetime; from torch.distributed import TCPStore; \
         s = TCPStore('127.0.0.1', {port}, 1, True, timeout=datetime.timedelta(seconds=30)); time.sleep(20)"
    );
    let mut server = Command::new(python()).args(["-c", &code]).spawn().unwrap();
    let mut store = TcpStore::connect("127.0.0.1", port, Duration::from_secs(30)).unwrap();
    store.set("k", b"v").unwrap();
    assert_eq!(store.get("k").unwrap(), b"v");
    let mut store = TcpStore::connect("127.0.0.1", port, Duration::from_millis(500)).unwrap();
    let e = store.get("never").unwrap_err().to_string();
    let _ = server.kill();
    let _ = server.wait();
    assert!(e.contains("\"never\"") && e.contains("not set"), "{e}");
}
