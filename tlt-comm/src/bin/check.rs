//! `mpirun -np N tlt-comm-check`: every [`tlt_comm::Comm`] operation of [`tlt_comm::mpi::MpiComm`] across the ranks,
//! each result checked on every rank; prints one line per rank and exits non-zero on the first wrong result. The
//! all-reduces and broadcasts run again in chunks of 7 elements ([`MpiComm::set_max_count`]), with the same results
//! bit for bit.
//!
//! `TLT_COMM_CHECK_PAST_INT=bytes|f32` instead moves one buffer of 2^31 + 5 elements (past MPI's `int` count, at
//! the default chunk limit): a broadcast of bytes from the last rank (2 GiB per rank), or an f32 all-reduce (8 GiB
//! per rank, and two 512 MiB chunk copies).
//!
//! `TLT_COMM_CHECK_LATE=stop|<ms>` instead checks the deadlines: rank 1 stops itself (`SIGSTOP`) or computes for
//! `<ms>` before a barrier that rank 0 enters at once, with the limits of `TLT_COMM_CHECK_DEADLINES=<wait
//! ms>,<silence ms>`.

use std::process::ExitCode;

use std::time::{Duration, Instant};

use tlt_comm::mpi::MpiComm;
use tlt_comm::{Comm, Deadlines};

/// Rank 1 late for a barrier: stopped or computing, as `late` says.
fn late_for_a_barrier(late: &str) -> Result<String, String> {
    let ms = |s: &str| s.trim().parse::<u64>().map(Duration::from_millis).map_err(|e| format!("`{s}`: {e}"));
    let limits = std::env::var("TLT_COMM_CHECK_DEADLINES").unwrap_or_else(|_| "30000,2000".into());
    let (wait, silence) = limits.split_once(',').ok_or("TLT_COMM_CHECK_DEADLINES is `<wait ms>,<silence ms>`")?;
    let c = MpiComm::init_with(Deadlines { wait: ms(wait)?, silence: ms(silence)? }).map_err(|e| e.to_string())?;
    let (r, n) = (c.rank(), c.size());
    if r == 1 {
        if late == "stop" {
            let pid = std::process::id().to_string();
            std::process::Command::new("kill").args(["-STOP", &pid]).status().map_err(|e| e.to_string())?;
        } else {
            // Busy, as a rank still decoding its share: the main thread does not touch MPI.
            std::thread::sleep(ms(late)?);
        }
    }
    let t = Instant::now();
    c.barrier().map_err(|e| format!("rank {r}: {e}"))?;
    Ok(format!("rank {r} of {n}: barrier after {:.1} s", t.elapsed().as_secs_f64()))
}

/// All-reduces and a broadcast under `c`'s chunk limit: f32 and f64 sums of 1000 rank-dependent values that are
/// exact in any order, checked against their values, 1001 bytes from the last rank and an empty all-reduce; returns
/// the bits of 1000 rounded f32 and f64 sums, for comparing across limits.
fn chunked(c: &MpiComm) -> Result<(Vec<u32>, Vec<u64>), String> {
    let (r, n) = (c.rank(), c.size());
    let e = |e: tlt_comm::Error| format!("rank {r}, at most {} elements per call: {e}", c.max_count());
    let want =
        |ok: bool, what: &str| if ok { Ok(()) } else { Err(format!("rank {r}, limit {}: {what}", c.max_count())) };
    // Halves of small integers (f32) and integers near 1e15 (f64): every partial sum is exact.
    let mut v: Vec<f32> = (0..1000).map(|i| (i % 97 * (r + 1)) as f32 + 0.5 * r as f32).collect();
    c.all_reduce_sum_f32(&mut v).map_err(e)?;
    let sum = |i: usize| (0..n).map(|k| (i % 97 * (k + 1)) as f64 + 0.5 * k as f64).sum::<f64>();
    want(v.iter().enumerate().all(|(i, &x)| f64::from(x) == sum(i)), &format!("all-reduce f32 gave {:?}", &v[..9]))?;
    let mut d: Vec<f64> = (0..1000).map(|i| 1e15 + (i * n + r) as f64).collect();
    c.all_reduce_sum_f64(&mut d).map_err(e)?;
    let sum = |i: usize| 1e15 * n as f64 + (i * n * n + n * (n - 1) / 2) as f64;
    want(d.iter().enumerate().all(|(i, &x)| x == sum(i)), &format!("all-reduce f64 gave {:?}", &d[..9]))?;
    // Rounded sums: compared bit for bit by the caller.
    let mut x: Vec<f32> = (0..1000).map(|i| ((i + 1) as f32).sqrt() / (r + 3) as f32).collect();
    c.all_reduce_sum_f32(&mut x).map_err(e)?;
    let mut y: Vec<f64> = (0..1000).map(|i| ((i + 1) as f64).ln() / (r + 3) as f64).collect();
    c.all_reduce_sum_f64(&mut y).map_err(e)?;
    // 1001 bytes (143 chunks of 7) after their length (8 bytes: 2 chunks of at most 7) replace other lengths.
    let bytes: Vec<u8> = (0..1001).map(|i| (i * 31 + 7) as u8).collect();
    let mut b = if r == n - 1 { bytes.clone() } else { vec![1; 3 * r] };
    c.broadcast_bytes(n - 1, &mut b).map_err(e)?;
    want(b == bytes, "broadcast of 1001 bytes")?;
    c.all_reduce_sum_f32(&mut []).map_err(e)?;
    Ok((x.iter().map(|v| v.to_bits()).collect(), y.iter().map(|v| v.to_bits()).collect()))
}

/// One buffer of 2^31 + 5 elements across the ranks, as `what` says (`bytes` or `f32`), checked on every rank.
fn past_int_count(c: &MpiComm, what: &str) -> Result<String, String> {
    let (r, n) = (c.rank(), c.size());
    let len = (1usize << 31) + 5;
    let t = Instant::now();
    let ok = match what {
        "bytes" => {
            let mut b = if r == n - 1 { (0..len).map(|i| (i % 251) as u8).collect() } else { Vec::new() };
            c.broadcast_bytes(n - 1, &mut b).map_err(|e| e.to_string())?;
            b.len() == len && b.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8)
        }
        "f32" => {
            // Small integers: exact sums; the last elements differ from the rest, so a lost last chunk shows.
            let mut v: Vec<f32> = (0..len).map(|i| if i + 5 >= len { 2.0 } else { (r + 1) as f32 }).collect();
            c.all_reduce_sum_f32(&mut v).map_err(|e| e.to_string())?;
            let (head, tail) = v.split_at(len - 5);
            head.iter().all(|&x| x == (n * (n + 1) / 2) as f32) && tail.iter().all(|&x| x == 2.0 * n as f32)
        }
        _ => return Err(format!("TLT_COMM_CHECK_PAST_INT={what}: `bytes` or `f32`")),
    };
    if !ok {
        return Err(format!("rank {r}: {what} past MPI's int count: wrong values"));
    }
    Ok(format!("rank {r} of {n}: {len} {what} in {:.1} s", t.elapsed().as_secs_f64()))
}

fn run() -> Result<String, String> {
    if let Ok(late) = std::env::var("TLT_COMM_CHECK_LATE") {
        return late_for_a_barrier(&late);
    }
    let c = MpiComm::init().map_err(|e| e.to_string())?;
    if let Ok(what) = std::env::var("TLT_COMM_CHECK_PAST_INT") {
        return past_int_count(&c, &what);
    }
    let (r, n) = (c.rank(), c.size());
    let e = |e: tlt_comm::Error| e.to_string();
    if std::env::var_os("TLT_COMM_CHECK_UNDELIVERED").is_some() {
        // Rank 0 leaves a large message nobody receives and closes: its drop must abort the job, not hang it.
        if r == 0 && n > 1 {
            c.send(1, 9, &vec![0u8; 8 << 20]).map_err(e)?;
        }
        return Ok(format!("rank {r} of {n}: closing"));
    }
    let want = |ok: bool, what: &str| if ok { Ok(()) } else { Err(format!("rank {r}: {what}")) };
    // Sums: f32 exact for small integers, f64 for counts.
    let mut v = vec![r as f32 + 1.0, 0.5];
    c.all_reduce_sum_f32(&mut v).map_err(e)?;
    let total = (n * (n + 1) / 2) as f32;
    want(v == [total, 0.5 * n as f32], &format!("all-reduce f32 gave {v:?}"))?;
    let mut d = vec![1e15 + r as f64];
    c.all_reduce_sum_f64(&mut d).map_err(e)?;
    want(d[0] == 1e15 * n as f64 + (n * (n - 1) / 2) as f64, &format!("all-reduce f64 gave {d:?}"))?;
    // Gathers of different lengths (rank r sends r bytes of value r, rank 0 none).
    let all = c.all_gather_bytes(&vec![r as u8; r]).map_err(e)?;
    want(all.iter().enumerate().all(|(k, b)| b == &vec![k as u8; k]), &format!("all-gather gave {all:?}"))?;
    // A broadcast from the last rank replaces every other rank's buffer, whatever its length.
    let mut b = if r == n - 1 { b"from the last rank".to_vec() } else { vec![7; r] };
    c.broadcast_bytes(n - 1, &mut b).map_err(e)?;
    want(b == b"from the last rank", "broadcast")?;
    // Empty buffers: an empty broadcast empties every rank's buffer, an all-gather of nothing gives empty parts.
    c.broadcast_bytes(0, &mut if r == 0 { Vec::new() } else { b.clone() }).map_err(e)?;
    let mut empty = if r == 0 { Vec::new() } else { b.clone() };
    c.broadcast_bytes(0, &mut empty).map_err(e)?;
    want(empty.is_empty(), "empty broadcast")?;
    let none = c.all_gather_bytes(&[]).map_err(e)?;
    want(none.len() == n && none.iter().all(Vec::is_empty), "empty all-gather")?;
    // Point to point: every rank sends to the next; nothing else has that tag.
    if n > 1 {
        let next = (r + 1) % n;
        c.send(next, 3, format!("hello {next} from {r}").as_bytes()).map_err(e)?;
        let (from, bytes) = c.recv(3).map_err(e)?;
        want(from == (r + n - 1) % n && bytes == format!("hello {r} from {from}").as_bytes(), "point to point")?;
        // Large messages both ways before any receive: a blocking send would wait for a receiver that is itself
        // sending (the data-parallel drafter's features and weights cross like this).
        let big = vec![r as u8; 8 << 20];
        c.send(next, 5, &big).map_err(e)?;
        let prev = (r + n - 1) % n;
        let (from, bytes) = c.recv(5).map_err(e)?;
        want(from == prev && bytes.len() == 8 << 20 && bytes.iter().all(|&b| b == prev as u8), "8 MB each way")?;
        c.send(next, 4, &[]).map_err(e)?;
        let (from, bytes) = c.recv(4).map_err(e)?;
        want(from == (r + n - 1) % n && bytes.is_empty(), "empty message")?;
    }
    // Chunks: at 7 elements per MPI call the same results, bit for bit, as at the default limit (one call each).
    want(c.max_count() == MpiComm::DEFAULT_MAX_COUNT, "the default chunk limit")?;
    let whole = chunked(&c)?;
    let bad = [0, i32::MAX as usize + 1, usize::MAX].map(|m| c.set_max_count(m).is_err());
    want(bad == [true; 3] && c.max_count() == MpiComm::DEFAULT_MAX_COUNT, "chunk limits past MPI's count accepted")?;
    c.set_max_count(7).map_err(e)?;
    let in_chunks = chunked(&c)?;
    want(in_chunks == whole, "sums in chunks of 7 differ from whole ones")?;
    c.set_max_count(MpiComm::DEFAULT_MAX_COUNT).map_err(e)?;
    c.barrier().map_err(e)?;
    want(c.try_recv(3).map_err(e)?.is_none(), "a message left over")?;
    want(c.send(r, 3, b"x").is_err() && c.broadcast_bytes(n, &mut b).is_err(), "bad ranks accepted")?;
    Ok(format!("rank {r} of {n}: all-reduce, all-gather, broadcast, point-to-point, chunks of 7, barrier ok"))
}

fn main() -> ExitCode {
    match run() {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(msg) => {
            eprintln!("tlt-comm-check: {msg}");
            ExitCode::FAILURE
        }
    }
}
