//! Regression inputs from fuzzing the drafter loaders (`cargo xtask fuzz drafter`, see `xtask/README.md`): seed checkpoints and every
//! finding, one directory each (`config.json` + `model.safetensors`) under `tests/fuzz-regressions/`, loaded as
//! EAGLE-2 and as EAGLE-3 against the fuzzer's tiny target. Each must load as one of them (`ok-*`), be rejected by
//! both (`err-*`), or either (any other name), and never panic.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

mod common;

use std::path::Path;

use tlt_drafter::{Eagle2Drafter, Eagle3Drafter};

#[test]
fn drafter_checkpoints_load_or_fail_cleanly() {
    let target = common::target("llama", 3);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("fuzz-regressions");
    let mut dirs: Vec<_> =
        std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no regression checkpoints");
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let e2 = Eagle2Drafter::load(&dir, &target).map(drop);
        let e3 = Eagle3Drafter::load(&dir, &target).map(drop);
        let loaded = e2.is_ok() || e3.is_ok();
        if name.starts_with("ok-") {
            assert!(loaded, "{name} should load: eagle2 {e2:?}, eagle3 {e3:?}");
        } else if name.starts_with("err-") {
            assert!(!loaded, "{name} should be rejected");
        }
    }
}
