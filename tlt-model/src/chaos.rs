//! Kill points for fault injection: named places where the chaos harness (`cargo xtask chaos`) makes this process
//! die by `SIGKILL` (no unwinding, no destructors, no buffered output flushed), to prove that a job resumes from
//! whatever a kill at that place leaves on disk.
//!
//! With `TLT_CHAOS_TRACE` set, every point reached says so on stderr (`tlt-chaos: at NAME`, and ` (PATH)` for a
//! checkpoint write's directory): a harness counts a run's hits before it picks where to kill, and sees which
//! checkpoints were complete before a kill.
//!
//! Points are armed through the `FAILPOINTS` environment variable in the [`fail`](https://docs.rs/fail) crate's
//! syntax (`name=actions;...`), read by [`arm_from_env`]; a point *fires* when its actions evaluate to `return`.
//! `ckpt.rename.old=2*off->return` kills the process the third time a checkpoint write reaches that point;
//! `rollout.round=5*off->return(stop)` stops it there (`SIGSTOP`), as a hung or suspended rank. With
//! the crate's `failpoints` feature off (the default) every function here is empty and [`arm_from_env`] refuses a
//! set `FAILPOINTS`, so a harness never believes it killed a build that cannot be killed.
//!
//! The points (every one is also listed in [`POINTS`]):
//! - `ckpt.*`: a checkpoint write ([`crate::write_dir_atomic`]) after each of its steps;
//! - `ckpt.two_rename` (not a kill): writes with the earlier two-rename protocol and skips recovery, and
//!   `ckpt.two_rename.between` kills between its renames: the harness's negative control;
//! - `rollout.round`, `update.micro`, `update.step`, `drafter.step`, `metrics.torn` (half a metrics line written):
//!   placed by the trainer (`tlt-rl`).

/// Every kill point the workspace places, for harnesses that pick among them.
pub const POINTS: [&str; 10] = [
    "ckpt.written",
    "ckpt.rename.next",
    "ckpt.rename.old",
    "ckpt.rename.in",
    "ckpt.removed.old",
    "rollout.round",
    "update.micro",
    "update.step",
    "drafter.step",
    "metrics.torn",
];

/// Arms the points that `FAILPOINTS` names (nothing when it is unset or empty).
///
/// # Errors
/// [`crate::Error::InvalidInput`] for a malformed entry or action, or when `FAILPOINTS` is set in a build without
/// the `failpoints` feature.
pub fn arm_from_env() -> crate::Result<()> {
    let Ok(spec) = std::env::var("FAILPOINTS") else { return Ok(()) };
    for entry in spec.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        let (name, actions) = entry
            .split_once('=')
            .ok_or_else(|| crate::Error::InvalidInput(format!("FAILPOINTS entry `{entry}` is not `name=actions`")))?;
        arm(name.trim(), actions.trim())?;
    }
    Ok(())
}

#[cfg(feature = "failpoints")]
fn arm(name: &str, actions: &str) -> crate::Result<()> {
    fail::cfg(name, actions).map_err(|e| crate::Error::InvalidInput(format!("FAILPOINTS `{name}={actions}`: {e}")))
}

#[cfg(not(feature = "failpoints"))]
fn arm(name: &str, _: &str) -> crate::Result<()> {
    Err(crate::Error::InvalidInput(format!(
        "FAILPOINTS arms `{name}`, but this build has no kill points (tlt-model's `failpoints` feature)"
    )))
}

/// Whether point `name` fires now (its actions evaluate to `return`); counts a hit. Always false without the
/// `failpoints` feature.
#[inline]
#[must_use]
pub fn fires(name: &str) -> bool {
    fires_on(name, None)
}

/// [`fires`], the trace naming the file or directory `on` that the point is about.
#[inline]
#[must_use]
pub fn fires_on(name: &str, on: Option<&std::path::Path>) -> bool {
    fired(name, on).is_some()
}

/// When point `name` fires, the argument of its `return(ARG)` action (`Some(None)`: no argument).
fn fired(name: &str, on: Option<&std::path::Path>) -> Option<Option<String>> {
    #[cfg(feature = "failpoints")]
    {
        static TRACE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *TRACE.get_or_init(|| std::env::var_os("TLT_CHAOS_TRACE").is_some()) {
            let on = on.map(|p| format!(" ({})", p.display())).unwrap_or_default();
            say(&format!("tlt-chaos: at {name}{on}\n"));
        }
        fail::eval(name, |arg| arg)
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = (name, on);
        None
    }
}

/// Dies by `SIGKILL` here when point `name` fires.
#[inline]
pub fn kill_point(name: &str) {
    kill_point_on(name, None);
}

/// [`kill_point`] about the file or directory `on` (named in the trace). An action `return(stop)` stops the
/// process here instead (`SIGSTOP`: it stays, holding its resources and answering nothing, until continued).
#[inline]
pub fn kill_point_on(name: &str, on: Option<&std::path::Path>) {
    match fired(name, on) {
        Some(Some(arg)) if arg == "stop" => stop_now(name),
        Some(_) => kill_now(name),
        None => {}
    }
}

/// Stops this process by `SIGSTOP` (saying where on stderr first); returns if it is continued.
fn stop_now(name: &str) {
    say(&format!("tlt-chaos: stopped at {name}\n"));
    #[cfg(feature = "failpoints")]
    // SAFETY: `raise` has no memory-safety preconditions.
    unsafe {
        libc::raise(libc::SIGSTOP);
    }
}

/// Dies by `SIGKILL` at once, saying where on stderr first (unbuffered), so the harness can tell where its kills
/// landed.
pub fn kill_now(name: &str) -> ! {
    say(&format!("tlt-chaos: killed at {name}\n"));
    #[cfg(feature = "failpoints")]
    // SAFETY: `raise` has no memory-safety preconditions; SIGKILL cannot be caught, so it does not return.
    unsafe {
        libc::raise(libc::SIGKILL);
    }
    // Without the feature nothing fires; should SIGKILL ever fail to end the process, abort without unwinding.
    std::process::abort()
}

/// `line` on stderr in one write, so that lines of several processes sharing a pipe (MPI ranks) stay whole.
fn say(line: &str) {
    use std::io::Write as _;
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

#[cfg(test)]
mod tests {
    #[test]
    fn malformed_entries_are_errors_and_unset_means_disarmed() {
        // The variable is read by the test process only through these calls; no other test sets it.
        std::env::set_var("FAILPOINTS", "no-equals-sign");
        assert!(super::arm_from_env().is_err());
        std::env::remove_var("FAILPOINTS");
        assert!(super::arm_from_env().is_ok());
        assert!(!super::fires("ckpt.written"), "nothing fires unarmed");
    }

    #[cfg(feature = "failpoints")]
    #[test]
    fn a_point_fires_at_its_counted_hit() {
        super::arm("test.point", "2*off->return").unwrap();
        let hits: Vec<bool> = (0..4).map(|_| super::fires("test.point")).collect();
        assert_eq!(hits, [false, false, true, true]);
        assert!(super::arm("test.point", "bogus(").is_err());
    }
}
