//! `gpu-bench` on the simulated device (`--device sim --arch tiny`): every section runs (the copy bandwidth, decode
//! eager and with graphs, verify-k, the engine's oracle speculative decoding, the EAGLE-2 drafter's setup, EAGLE-2
//! speculative decoding at batches 1 and 2, the EAGLE-2 draft level), the
//! speculative runs commit plain decoding's tokens, the JSON holds every section, and the summary lines the GPU plan
//! keeps are printed. The first GPU run's `gpu-bench` stopped at its first error; this is the CI run of its code.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use std::process::Command;

#[test]
fn gpu_bench_runs_every_section_on_the_simulated_device() {
    let out = std::env::temp_dir().join(format!("gpu-bench-sim-{}.json", std::process::id()));
    let run = Command::new(env!("CARGO_BIN_EXE_gpu-bench"))
        .args(["--device", "sim", "--arch", "tiny", "--context", "40", "--batches", "1,2", "--steps", "2"])
        .args([
            "--verify",
            "2,4",
            "--tau",
            "2,4",
            "--sd-batches",
            "1,2",
            "--sd-tokens",
            "12",
            "--drafter-batches",
            "1,2",
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "gpu-bench failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    for section in ["decode", "verify", "oracle_sd", "eagle2_sd", "drafter_level"] {
        assert!(json[section].get("error").is_none() && !json[section].is_null(), "{section}: {}", json[section]);
    }
    let sd: Vec<&serde_json::Value> = ["oracle_sd", "eagle2_sd"]
        .iter()
        .flat_map(|k| json[*k].as_array().unwrap())
        .filter(|r| r["identical_to_plain"].is_boolean())
        .collect();
    assert_eq!(sd.len(), 6, "oracle at tau 2 and 4, and EAGLE-2, at batches 1 and 2");
    assert!(sd.iter().all(|r| r["identical_to_plain"] == true), "SD differs from plain decoding: {sd:?}");
    let summary: Vec<&str> = stdout.lines().filter(|l| l.starts_with("summary:")).collect();
    println!("{}", summary.join("\n"));
    assert!(summary.last().is_some_and(|l| l.contains("all 7 sections ok")), "{summary:?}");
}

/// A failing section is reported and the others still run (the first GPU run's `gpu-bench` stopped at its first
/// error, so nothing after its SD section ever ran): a draft width beyond the device drafter's top-k limit fails the
/// draft-level section only; the process exits with an error that the summary names.
#[test]
fn a_failing_section_does_not_stop_the_others() {
    let out = std::env::temp_dir().join(format!("gpu-bench-sim-fail-{}.json", std::process::id()));
    let run = Command::new(env!("CARGO_BIN_EXE_gpu-bench"))
        .args(["--device", "sim", "--arch", "tiny", "--context", "24", "--batches", "1", "--steps", "1"])
        .args(["--verify", "2", "--tau", "2", "--sd-batches", "1", "--sd-tokens", "6", "--drafter-batches", "1"])
        .args(["--drafter-top-k", "17", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(!run.status.success(), "a failed section must fail the process:\n{stdout}");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let _ = std::fs::remove_file(&out);
    assert!(json["drafter_level"]["error"].as_str().is_some_and(|e| e.contains("top-17")), "{}", json["drafter_level"]);
    for section in ["decode", "verify", "oracle_sd", "eagle2_sd"] {
        assert!(json[section].is_array(), "{section} did not run: {}", json[section]);
    }
    let last = stdout.lines().rfind(|l| l.starts_with("summary:")).unwrap_or_default();
    println!("{last}");
    assert!(last.contains("FAILED sections: drafter_level"), "{last}");
}
