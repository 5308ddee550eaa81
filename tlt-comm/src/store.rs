//! A client of torch.distributed's `TCPStore`, the key-value store through which torch's process groups meet: the
//! trainer's rank 0 hosts it at `master_address:master_port` (`init_method="tcp://..."`), every other rank connects
//! to it, and an NCCL group's rank 0 leaves the communicator's unique id there for the others to read. This is how
//! a rollout server joins the weight-update group of slime, SGLang's updater and verl: as one more rank of the
//! trainer's own torch group, so the trainer runs unchanged.
//!
//! The wire protocol is torch's (`torch/csrc/distributed/c10d/TCPStore.cpp`, `TCPStoreBackend.hpp`), spoken by the
//! legacy and the libuv servers alike: a query is one byte naming it followed by its arguments, strings and byte
//! vectors as a little-endian `u64` length and the bytes, integers in native (little-endian) order. A connection
//! opens with `VALIDATE` (a magic number the server checks) and a `PING` whose nonce comes back. User keys carry the
//! store's `/` prefix, as `TCPStore::set/get/add` add it; [`prefixed`] gives the key torch's `PrefixStore` makes of
//! one (`prefix + "/" + key`, nested).
//!
//! Tested against torch's own `TCPStore` and `PrefixStore` (`tests/store.rs`, `scripts/check_tcpstore.py`).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// `VALIDATE`'s magic number (`validationMagicNumber` in torch's TCPStore).
const MAGIC: u32 = 0x3C85_F7CE;

/// The prefix `TCPStore` puts before every user key (`keyPrefix_`).
const KEY_PREFIX: &str = "/";

/// The key every rank's store client adds one to on joining (`initKey_`, no user prefix); the master's constructor
/// waits until it counts the world size.
pub const INIT_KEY: &str = "init/";

/// The largest value this client reads (an NCCL id is 128 bytes; the largest torch stores are pickled objects).
const MAX_VALUE: u64 = 1 << 24;

/// torch's `QueryType`, in its order.
#[derive(Clone, Copy)]
#[repr(u8)]
enum Query {
    Validate = 0,
    Set = 1,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    Ping = 13,
}

/// torch's `CheckResponseType::READY`.
const READY: u8 = 0;
/// torch's `WaitResponseType::STOP_WAITING`.
const STOP_WAITING: u8 = 0;

fn io(what: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::Rendezvous(format!("{what}: {e}"))
}

/// A key as torch's `PrefixStore(prefix, store)` stores it, prefixes outermost first: `["a", "b/"]` and `"0"` give
/// `"a/b//0"`.
#[must_use]
pub fn prefixed(prefixes: &[&str], key: &str) -> String {
    prefixes.iter().rev().fold(key.to_string(), |k, p| format!("{p}/{k}"))
}

/// The key under which rank 0 of a torch NCCL group made as SGLang's `init_custom_process_group` makes it (slime's
/// trainer and SGLang's engines both) leaves the unique id of the group's `index`-th communicator (0: the one its
/// first collective opens). The prefixes: `PrefixStore(group_name, store)` by `init_custom_process_group`, then
/// `"{group_name}/"` and the device's `"cuda/"` by torch's `_new_process_group_helper`; the key is
/// `ProcessGroupNCCL::broadcastUniqueNCCLID`'s counter.
#[must_use]
pub fn nccl_id_key(group_name: &str, index: usize) -> String {
    prefixed(&[group_name, &format!("{group_name}/"), "cuda/"], &index.to_string())
}

/// One connection to a torch `TCPStore`.
#[derive(Debug)]
pub struct TcpStore {
    stream: TcpStream,
    timeout: Duration,
}

impl TcpStore {
    /// Connects to the store at `host:port`, retrying refused connections until `timeout` (the trainer may open it
    /// after this side starts), then validates and pings as torch's client does. Reads wait at most `timeout`.
    ///
    /// # Errors
    /// [`Error::Rendezvous`] when no store answers in time or it answers otherwise than torch's does.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Self> {
        let t0 = Instant::now();
        let addrs: Vec<_> = (host, port)
            .to_socket_addrs()
            .map_err(|e| Error::Rendezvous(format!("resolving {host}:{port}: {e}")))?
            .collect();
        let stream = loop {
            let last = addrs.iter().map(|a| TcpStream::connect_timeout(a, Duration::from_secs(1))).find_map(|r| {
                r.map_err(|e| Error::Rendezvous(format!("connecting to the TCPStore at {host}:{port}: {e}"))).ok()
            });
            match last {
                Some(s) => break s,
                None if t0.elapsed() < timeout => std::thread::sleep(Duration::from_millis(50)),
                None => {
                    return Err(Error::Rendezvous(format!(
                        "no TCPStore answered at {host}:{port} within {timeout:.1?}"
                    )))
                }
            }
        };
        stream.set_nodelay(true).map_err(io("setting TCP_NODELAY"))?;
        stream.set_read_timeout(Some(timeout)).map_err(io("setting the read timeout"))?;
        let mut store = Self { stream, timeout };
        let mut q = store.query(Query::Validate);
        q.extend_from_slice(&MAGIC.to_le_bytes());
        store.send(&q)?;
        let nonce = std::process::id();
        let mut q = store.query(Query::Ping);
        q.extend_from_slice(&nonce.to_le_bytes());
        store.send(&q)?;
        let back = u32::from_le_bytes(store.recv_array()?);
        if back != nonce {
            return Err(Error::Rendezvous(format!(
                "the store answered ping {nonce} with {back}: not a torch TCPStore"
            )));
        }
        Ok(store)
    }

    /// Joins the job as the store's clients do when told the world size: adds one to [`INIT_KEY`], returning the
    /// count after it.
    ///
    /// # Errors
    /// As [`TcpStore::add`].
    pub fn join(&mut self) -> Result<i64> {
        self.add_raw(INIT_KEY, 1)
    }

    /// `store.add(key, delta)`: the counter after adding.
    ///
    /// # Errors
    /// [`Error::Rendezvous`] on a broken connection; a key holding a non-number closes it (torch's server refuses).
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        self.add_raw(&format!("{KEY_PREFIX}{key}"), delta)
    }

    fn add_raw(&mut self, key: &str, delta: i64) -> Result<i64> {
        let mut q = self.query(Query::Add);
        put_bytes(&mut q, key.as_bytes());
        q.extend_from_slice(&delta.to_le_bytes());
        self.send(&q)?;
        Ok(i64::from_le_bytes(self.recv_array()?))
    }

    /// `store.set(key, value)`.
    ///
    /// # Errors
    /// [`Error::Rendezvous`] on a broken connection.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let mut q = self.query(Query::Set);
        put_bytes(&mut q, format!("{KEY_PREFIX}{key}").as_bytes());
        put_bytes(&mut q, value);
        self.send(&q)
    }

    /// Whether `key` is set now (`store.check([key])`).
    ///
    /// # Errors
    /// [`Error::Rendezvous`] on a broken connection.
    pub fn check(&mut self, key: &str) -> Result<bool> {
        let mut q = self.query(Query::Check);
        q.extend_from_slice(&1u64.to_le_bytes());
        put_bytes(&mut q, format!("{KEY_PREFIX}{key}").as_bytes());
        self.send(&q)?;
        Ok(self.recv_array::<1>()?[0] == READY)
    }

    /// `store.get(key)`: waits (at most the connection's timeout) until `key` is set, then reads it.
    ///
    /// # Errors
    /// [`Error::Rendezvous`] when the key is not set in time or the connection breaks.
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>> {
        let full = format!("{KEY_PREFIX}{key}");
        let mut q = self.query(Query::Wait);
        q.extend_from_slice(&1u64.to_le_bytes());
        put_bytes(&mut q, full.as_bytes());
        self.send(&q)?;
        let mut answer = [0u8; 1];
        self.stream.read_exact(&mut answer).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                Error::Rendezvous(format!("key {key:?} was not set in the TCPStore within {:.1?}", self.timeout))
            }
            _ => io("waiting on the TCPStore")(e),
        })?;
        if answer[0] != STOP_WAITING {
            return Err(Error::Rendezvous(format!("the wait for {key:?} was cancelled")));
        }
        let mut q = self.query(Query::Get);
        put_bytes(&mut q, full.as_bytes());
        self.send(&q)?;
        let len = u64::from_le_bytes(self.recv_array()?);
        if len > MAX_VALUE {
            return Err(Error::Rendezvous(format!("the value of {key:?} is {len} bytes (at most {MAX_VALUE} read)")));
        }
        let mut value = vec![0; usize::try_from(len).unwrap_or(0)];
        self.stream.read_exact(&mut value).map_err(io("reading a value from the TCPStore"))?;
        Ok(value)
    }

    fn query(&self, q: Query) -> Vec<u8> {
        vec![q as u8]
    }

    fn send(&mut self, bytes: &[u8]) -> Result<()> {
        self.stream.write_all(bytes).map_err(io("writing to the TCPStore"))
    }

    fn recv_array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0; N];
        self.stream.read_exact(&mut b).map_err(io("reading from the TCPStore"))?;
        Ok(b)
    }
}

fn put_bytes(q: &mut Vec<u8>, bytes: &[u8]) {
    q.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    q.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_nest_as_torchs_prefix_store() {
        assert_eq!(prefixed(&[], "0"), "0");
        assert_eq!(prefixed(&["g"], "0"), "g/0");
        assert_eq!(prefixed(&["g", "g/", "cuda/"], "0"), "g/g//cuda//0");
    }

    #[test]
    fn nothing_listening_is_an_error_in_time() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let t0 = Instant::now();
        let e = TcpStore::connect("127.0.0.1", port, Duration::from_millis(300)).unwrap_err();
        assert!(e.to_string().contains("no TCPStore answered"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5));
    }
}
