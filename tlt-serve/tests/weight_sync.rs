//! SGLang's weight sync from the trainer's GPUs (`/init_weights_update_group`, `/update_weights_from_distributed`,
//! `/destroy_weights_update_group`) on a server without a CUDA device: slime's trainer side (torch's own rendezvous,
//! `scripts/check_weight_sync_init.py`) completes its rendezvous with the server and reads a refusal that says what
//! to do; updates are checked against the served model before anything is received; a bucket of tensors laid over
//! the weights serves exactly what a disk checkpoint of the same weights serves.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // Tests: a panic is the failure report.

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

mod common;
use common::*;

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The trainer (torch) joins its group's rendezvous with the CPU server, which then refuses the group by name of
/// what it lacks; without torch, SKIP unless the checks are required.
#[test]
fn a_cpu_server_joins_the_trainers_rendezvous_then_refuses_the_group() {
    let probe = Command::new(python()).args(["-c", "import torch.distributed"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        assert!(std::env::var_os("TLT_REQUIRE_PYTHON_CHECK").is_none(), "torch is required but does not import");
        println!("SKIP a_cpu_server_joins_the_trainers_rendezvous_then_refuses_the_group: torch is not importable");
        return;
    }
    let addr = serve(false);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/check_weight_sync_init.py");
    let out = Command::new(python()).arg(script).args(["--url", &format!("http://{addr}")]).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(said.trim()).unwrap();
    println!("{v}");
    assert_eq!(v["rendezvous"], "complete");
    assert_eq!(v["status"], 400, "{v}");
    let msg = v["body"]["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("needs a CUDA device") && msg.contains("update_weights_from_disk"), "{v}");
    // Nothing was joined: an update names no group.
    let (code, body) = post(addr, "/update_weights_from_distributed", &update(&["model.norm.weight"], &[vec![64]]));
    assert_eq!(code, 400);
    assert!(body.to_string().contains("no group"), "{body}");
}

fn update(names: &[&str], shapes: &[Vec<usize>]) -> Value {
    json!({"names": names, "dtypes": vec!["bfloat16"; names.len()], "shapes": shapes,
           "group_name": "weight_update_group", "flush_cache": true, "weight_version": "v2"})
}

/// Every refusal before anything is received, each beside a request the same route takes.
#[test]
fn updates_are_checked_against_the_served_model_before_receiving() {
    let addr = serve(false);
    let norm = tiny().weights().named_tensors().into_iter().find(|(n, _)| n == "model.norm.weight").unwrap();
    let shape = norm.1.dims().to_vec();
    for (body, field, says) in [
        (update(&["model.nope.weight"], std::slice::from_ref(&shape)), "names", "not a parameter"),
        (update(&["model.norm.weight"], &[vec![shape[0] + 1]]), "shapes", "in the served model"),
        (json!({"names": ["model.norm.weight"], "dtypes": ["int8"], "shapes": [shape]}), "dtypes", "not served"),
        (json!({"names": ["model.norm.weight"], "dtypes": [], "shapes": [shape]}), "names", "differ in length"),
        (json!({"names": [], "dtypes": [], "shapes": []}), "names", "tensors"),
    ] {
        let (code, v) = post(addr, "/update_weights_from_distributed", &body);
        assert_eq!(code, 400, "{body}: {v}");
        let e = v.to_string();
        assert!(e.contains(field) && e.contains(says), "{body}: {e}");
    }
    // The well-formed update is refused only for want of a group.
    let (code, v) = post(addr, "/update_weights_from_distributed", &update(&["model.norm.weight"], &[shape]));
    assert_eq!(code, 400);
    assert!(v.to_string().contains("no group `weight_update_group` is joined"), "{v}");
    for (body, says) in [
        (json!({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2}), "rank 0 of 2"),
        (
            json!({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo"}),
            "`gloo` is not served",
        ),
    ] {
        let (code, v) = post(addr, "/init_weights_update_group", &body);
        assert_eq!(code, 400, "{v}");
        assert!(v.to_string().contains(says), "{v}");
    }
    let (code, v) = post(addr, "/destroy_weights_update_group", &json!({"group_name": "g"}));
    assert_eq!(code, 400);
    assert!(v.to_string().contains("no group `g`"), "{v}");
}

/// Tensors laid over the served weights (all of them, or a bucket) are the weights a checkpoint of the same values
/// holds, bit for bit; a tensor of another shape is refused.
#[test]
fn a_bucket_laid_over_the_weights_is_the_checkpoints_weights() {
    let old = tiny();
    let new = tlt_model::Llama::random(old.config().clone(), 99).unwrap();
    let all: Vec<_> = new.weights().named_tensors();
    let whole = tlt_serve::distributed::overlay(&old, all.clone()).unwrap();
    for ((n, a), (_, b)) in whole.weights().named_tensors().iter().zip(&all) {
        let (a, b) =
            (a.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{n}");
    }
    // A bucket: only its tensors change.
    let bucket: Vec<_> = all.iter().filter(|(n, _)| n.contains("layers.0.")).cloned().collect();
    assert!(!bucket.is_empty());
    let part = tlt_serve::distributed::overlay(&old, bucket).unwrap();
    let olds = old.weights().named_tensors();
    for (((n, p), (_, o)), (_, w)) in part.weights().named_tensors().iter().zip(&olds).zip(&all) {
        let want = if n.contains("layers.0.") { w } else { o };
        let (p, want) =
            (p.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        assert_eq!(p, want, "{n}");
    }
    let (name, t) = &all[0];
    let wrong = t.flatten_all().unwrap();
    assert!(tlt_serve::distributed::overlay(&old, vec![(name.clone(), wrong)]).is_err(), "a misshapen tensor");
}
