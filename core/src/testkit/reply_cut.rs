//! A TCP proxy that loses exactly the reply to one request: the deterministic injector for
//! ambiguous outcomes.
//!
//! A test puts the proxy between a client and its server and arms it with a byte pattern
//! of a request (`COMMIT`, a script's SHA, an ack's subject). The proxy lets that request
//! through, waits for the server's reply — so the server has acted on it — and then, instead
//! of passing the reply on, either resets the client's connection ([`ReplyFault::Reset`])
//! or swallows that reply and everything after it while keeping the connection open
//! ([`ReplyFault::Swallow`]: a half-open link, the client waits for its own timeout). The
//! client cannot tell whether its request took effect: the moment every retry must be safe
//! for, hit every time rather than by luck. Byte- and time-based faults (Toxiproxy's) cannot
//! be aimed at one request; this one can, for protocols where a client waits for a reply
//! before sending its next request on a connection (PostgreSQL and MySQL transactions,
//! Redis scripts, request-reply acks).
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use idemq_core::testkit::reply_cut::{ReplyCutProxy, ReplyFault};
//! let proxy = ReplyCutProxy::start("127.0.0.1:5432").await?;
//! // Connect the client to `proxy.addr()`; then, just before the commit goes out:
//! proxy.arm(b"COMMIT\0", 1, ReplyFault::Reset);
//! // … the client's COMMIT is executed by the server; the client sees a reset.
//! assert_eq!(proxy.cuts(), 1);
//! # Ok(()) }
//! ```

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// What the client sees instead of the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyFault {
    /// The connection is reset (RST) after the server replied: "connection reset by peer".
    Reset,
    /// The reply and everything after it are dropped; the connection stays open (half-open),
    /// so the client waits until its own timeout gives up.
    Swallow,
}

#[derive(Debug)]
struct Armed {
    pattern: Vec<u8>,
    remaining: usize,
    fault: ReplyFault,
}

#[derive(Debug, Default)]
struct Shared {
    armed: Mutex<Vec<Armed>>,
    cuts: AtomicUsize,
    connections: AtomicUsize,
    tasks: Mutex<Vec<AbortHandle>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// The fault of the first armed pattern `window` contains, used up by one match.
    fn take_match(&self, window: &[u8]) -> Option<ReplyFault> {
        let mut armed = lock(&self.armed);
        let i = armed.iter().position(|a| {
            a.remaining > 0
                && !a.pattern.is_empty()
                && window.windows(a.pattern.len()).any(|w| w == a.pattern)
        })?;
        armed[i].remaining -= 1;
        let fault = armed[i].fault;
        armed.retain(|a| a.remaining > 0);
        Some(fault)
    }

    fn longest_pattern(&self) -> usize {
        lock(&self.armed)
            .iter()
            .map(|a| a.pattern.len())
            .max()
            .unwrap_or(0)
    }
}

/// The proxy (see the module docs). Dropping it stops it and closes its connections.
#[derive(Debug)]
pub struct ReplyCutProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl ReplyCutProxy {
    /// Listens on an ephemeral loopback port and forwards every connection to `upstream`
    /// (`host:port`). Nothing is cut until [`ReplyCutProxy::arm`].
    pub async fn start(upstream: &str) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let upstream = upstream.to_string();
        let s = shared.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                s.connections.fetch_add(1, Ordering::Relaxed);
                let conn = tokio::spawn(relay(client, upstream.clone(), s.clone()));
                let mut tasks = lock(&s.tasks);
                tasks.retain(|t| !t.is_finished());
                tasks.push(conn.abort_handle());
            }
        });
        lock(&shared.tasks).push(accept.abort_handle());
        Ok(Self { addr, shared })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Cuts the replies to the next `times` requests (on any connection) whose bytes contain
    /// `pattern`, as `fault` says.
    pub fn arm(&self, pattern: &[u8], times: usize, fault: ReplyFault) {
        lock(&self.shared.armed).push(Armed {
            pattern: pattern.to_vec(),
            remaining: times,
            fault,
        });
    }

    /// Forgets every armed pattern not used up yet.
    pub fn disarm(&self) {
        lock(&self.shared.armed).clear();
    }

    /// How many replies were cut so far.
    pub fn cuts(&self) -> usize {
        self.shared.cuts.load(Ordering::Relaxed)
    }

    /// How many client connections the proxy accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::Relaxed)
    }
}

impl Drop for ReplyCutProxy {
    fn drop(&mut self) {
        for t in lock(&self.shared.tasks).drain(..) {
            t.abort();
        }
    }
}

/// How a relayed connection ended.
enum End {
    Closed,
    Reset,
}

async fn relay(client: TcpStream, upstream: String, shared: Arc<Shared>) {
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return; // the client sees its connection closed, as with a server that is down
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    // Set by the request that matched, before it is forwarded: the next bytes the server
    // sends on this connection are its reply.
    let pending: Mutex<Option<ReplyFault>> = Mutex::new(None);
    let up = async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut tail: Vec<u8> = Vec::new();
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            // A pattern split across two reads is still found: the window keeps the end of
            // the previous read.
            let mut window = std::mem::take(&mut tail);
            window.extend_from_slice(&buf[..n]);
            if let Some(fault) = shared.take_match(&window) {
                *lock(&pending) = Some(fault);
            }
            if sw.write_all(&buf[..n]).await.is_err() {
                break;
            }
            let keep = shared.longest_pattern().saturating_sub(1);
            tail = window.split_off(window.len().saturating_sub(keep));
        }
        let _ = sw.shutdown().await;
        End::Closed
    };
    let down = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => return End::Closed,
                Ok(n) => n,
            };
            let fault = lock(&pending).take();
            match fault {
                Some(ReplyFault::Reset) => {
                    shared.cuts.fetch_add(1, Ordering::Relaxed);
                    return End::Reset;
                }
                Some(ReplyFault::Swallow) => {
                    shared.cuts.fetch_add(1, Ordering::Relaxed);
                    // Half-open: nothing more reaches the client until it gives up.
                    while let Ok(n) = sr.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                    }
                    return End::Closed;
                }
                None => {
                    if cw.write_all(&buf[..n]).await.is_err() {
                        return End::Closed;
                    }
                }
            }
        }
    };
    let end = tokio::select! {
        e = up => e,
        e = down => e,
    };
    if let (End::Reset, Ok(client)) = (end, cr.reunite(cw)) {
        // SO_LINGER 0: closing sends RST, not FIN.
        #[allow(deprecated)]
        let _ = client.set_linger(Some(std::time::Duration::ZERO));
        drop(client);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that answers every line with "ok <line>" and counts the lines it executed.
    async fn echo_server() -> (SocketAddr, Arc<AtomicUsize>) {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let executed = Arc::new(AtomicUsize::new(0));
        let e = executed.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let e = e.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        e.fetch_add(1, Ordering::Relaxed);
                        let mut reply = b"ok ".to_vec();
                        reply.extend_from_slice(&buf[..n]);
                        if s.write_all(&reply).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        (addr, executed)
    }

    async fn ask(c: &mut TcpStream, line: &[u8]) -> std::io::Result<Vec<u8>> {
        c.write_all(line).await?;
        let mut buf = [0u8; 1024];
        let n = c.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(buf[..n].to_vec())
    }

    #[tokio::test]
    async fn the_armed_request_is_executed_and_its_reply_lost() {
        let (server, executed) = echo_server().await;
        let proxy = ReplyCutProxy::start(&server.to_string())
            .await
            .expect("proxy");
        let mut c = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert_eq!(ask(&mut c, b"BEGIN").await.expect("begin"), b"ok BEGIN");
        proxy.arm(b"COMMIT", 1, ReplyFault::Reset);
        assert!(ask(&mut c, b"COMMIT").await.is_err(), "the reply was cut");
        assert_eq!(executed.load(Ordering::Relaxed), 2, "the server ran COMMIT");
        assert_eq!(proxy.cuts(), 1);
        // Used up: the next connection's COMMIT is answered.
        let mut c = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert_eq!(ask(&mut c, b"COMMIT").await.expect("commit"), b"ok COMMIT");
        assert_eq!(proxy.connections(), 2);
    }

    #[tokio::test]
    async fn a_swallowed_reply_leaves_the_connection_open_and_silent() {
        let (server, executed) = echo_server().await;
        let proxy = ReplyCutProxy::start(&server.to_string())
            .await
            .expect("proxy");
        let mut c = TcpStream::connect(proxy.addr()).await.expect("connect");
        proxy.arm(b"ACK", 1, ReplyFault::Swallow);
        let waited =
            tokio::time::timeout(std::time::Duration::from_millis(300), ask(&mut c, b"ACK")).await;
        assert!(waited.is_err(), "no reply and no close: {waited:?}");
        assert_eq!(executed.load(Ordering::Relaxed), 1);
        assert_eq!(proxy.cuts(), 1);
    }

    #[tokio::test]
    async fn a_pattern_split_across_writes_is_found() {
        let (server, executed) = echo_server().await;
        let proxy = ReplyCutProxy::start(&server.to_string())
            .await
            .expect("proxy");
        proxy.arm(b"COMMIT", 1, ReplyFault::Reset);
        let mut c = TcpStream::connect(proxy.addr()).await.expect("connect");
        c.write_all(b"COM").await.expect("write");
        c.flush().await.expect("flush");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        // The server answered the first half; the proxy armed on the second.
        let mut buf = [0u8; 64];
        let n = c.read(&mut buf).await.expect("first half answered");
        assert_eq!(&buf[..n], b"ok COM");
        assert!(ask(&mut c, b"MIT").await.is_err());
        assert_eq!(executed.load(Ordering::Relaxed), 2);
        assert_eq!(proxy.cuts(), 1);
    }
}
