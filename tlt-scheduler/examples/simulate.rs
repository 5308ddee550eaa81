//! Runs the cluster simulator: `cargo run --release -p tlt-scheduler --example simulate -- [config.json]`.
//! Without an argument it uses `SimConfig::default()`; prints the config's summary to stderr and the
//! report as JSON to stdout.

use tlt_scheduler::sim::{simulate, SimConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cfg: SimConfig = match std::env::args().nth(1) {
        Some(path) => serde_json::from_str(&std::fs::read_to_string(path)?)?,
        None => SimConfig::default(),
    };
    let t = std::time::Instant::now();
    let report = simulate(&cfg)?;
    eprintln!(
        "{} workers x {} requests, {} RL steps: baseline/adaptive {:.3}, baseline/online {:.3}, idle {:.3} / {:.3} / {:.3} ({:.2} s)",
        cfg.workers,
        cfg.requests_per_worker,
        cfg.rl_steps,
        report.makespan_ratio_baseline_over_adaptive,
        report.makespan_ratio_baseline_over_online,
        report.modes[0].mean_idle_fraction,
        report.modes[1].mean_idle_fraction,
        report.modes[2].mean_idle_fraction,
        t.elapsed().as_secs_f64()
    );
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
