//! `train`'s command line around `--resume`: without a checkpoint it is an error (a fresh run there would truncate
//! the run's metrics), unless `--allow-fresh`; `--allow-fresh` alone is refused. The resume check runs before the
//! model loads, so a missing model shows which check a command passed.

use std::process::Command;

fn train(out: &std::path::Path, extra: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--mode", "tlt", "--model", "/nonexistent/model.gguf", "--out"])
        .arg(out)
        .args(extra)
        .output()
        .unwrap_or_else(|e| panic!("running train: {e}"));
    (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn resume_without_a_checkpoint_is_an_error_unless_a_fresh_start_is_allowed() {
    let out = std::env::temp_dir().join(format!("tlt-train-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let (ok, err) = train(&out, &["--resume"]);
    assert!(!ok && err.contains("no checkpoint in") && err.contains("--allow-fresh"), "{err}");
    // Allowed to start fresh, it gets as far as loading the (missing) model.
    let (ok, err) = train(&out, &["--resume", "--allow-fresh"]);
    assert!(!ok && !err.contains("no checkpoint in") && err.contains("/nonexistent/model.gguf"), "{err}");
    // An interrupted checkpoint write (complete, not yet renamed into place) is recovered and found: the run then
    // fails on the missing model, not for want of a checkpoint.
    let next = out.join("tlt").join(".checkpoint.next");
    std::fs::create_dir_all(&next).unwrap_or_else(|e| panic!("{e}"));
    std::fs::write(next.join("state.json"), "{}").unwrap_or_else(|e| panic!("{e}"));
    let (ok, err) = train(&out, &["--resume"]);
    assert!(!ok && !err.contains("no checkpoint in"), "{err}");
    assert!(out.join("tlt").join("checkpoint").join("state.json").exists(), "recovered into place");
    for flag in ["--allow-fresh", "--allow-changed-task"] {
        let (ok, err) = train(&out, &[flag]);
        assert!(!ok && err.contains("--resume"), "{flag} needs --resume: {err}");
    }
    let _ = std::fs::remove_dir_all(&out);
}
