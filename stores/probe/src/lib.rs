//! Which server answers at a host and port, for startup error messages only.
//!
//! When a driver fails in a way its own message does not explain (a protocol error, a
//! handshake that never completes), the store asks the port itself: a MySQL/MariaDB server
//! speaks first (its greeting), a PostgreSQL server answers an `SSLRequest` with one byte
//! (`N` or `S`), a Redis server answers `PING`. Each question is a fresh short connection
//! with a short read timeout; nothing is sent before a driver has failed, so a healthy
//! startup never touches the server twice.
//!
//! Its own small crate so that every store that connects over TCP asks the same way: the SQL
//! stores and the Redis store share it, and the core stays free of database protocols.
//!
//! ```no_run
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use idemq_probe::{endpoint, identify, Server};
//! let ep = endpoint("postgres://db.example:5432/app", 5432).expect("host and port");
//! if identify(&ep).await == Some(Server::MySql) {
//!     eprintln!("{}:{} answers as MySQL, not PostgreSQL", ep.host, ep.port);
//! }
//! # });
//! ```
#![warn(missing_docs)]

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A host and port taken from a store URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The host as written (IPv6 without brackets).
    pub host: String,
    /// The port, or the scheme's default.
    pub port: u16,
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// The host and port of `scheme://user:pass@host:port/path?query`, `default_port` when the
/// URL names none; `None` when the URL has no host (a Unix socket, a file).
pub fn endpoint(url: &str, default_port: u16) -> Option<Endpoint> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
        let (h, after) = v6.split_once(']')?;
        (h, after.strip_prefix(':'))
    } else {
        match hostport.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (hostport, None),
        }
    };
    if host.is_empty() {
        return None;
    }
    let port = match port {
        Some(p) if !p.is_empty() => p.parse().ok()?,
        _ => default_port,
    };
    Some(Endpoint {
        host: host.to_owned(),
        port,
    })
}

/// A server identified by [`identify`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// MySQL or MariaDB (it greets first).
    MySql,
    /// PostgreSQL (answers an `SSLRequest` with one byte).
    Postgres,
    /// Redis (answers `PING`).
    Redis,
}

impl Server {
    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Server::MySql => "MySQL/MariaDB",
            Server::Postgres => "PostgreSQL",
            Server::Redis => "Redis",
        }
    }
    /// The URL scheme that reaches it.
    pub fn scheme(self) -> &'static str {
        match self {
            Server::MySql => "mysql://",
            Server::Postgres => "postgres://",
            Server::Redis => "redis://",
        }
    }
}

const READ_WAIT: Duration = Duration::from_millis(400);
const CONNECT_WAIT: Duration = Duration::from_millis(500);

/// Sends `hello` (if any) on a fresh connection and returns the first bytes answered within
/// [`READ_WAIT`] (empty when the server stays silent).
async fn ask(ep: &Endpoint, hello: &[u8]) -> Option<Vec<u8>> {
    let addr = (ep.host.as_str(), ep.port);
    let mut s = tokio::time::timeout(CONNECT_WAIT, TcpStream::connect(addr))
        .await
        .ok()?
        .ok()?;
    if !hello.is_empty() {
        s.write_all(hello).await.ok()?;
    }
    let mut buf = [0u8; 64];
    match tokio::time::timeout(READ_WAIT, s.read(&mut buf)).await {
        Ok(Ok(n)) => Some(buf[..n].to_vec()),
        Ok(Err(_)) | Err(_) => Some(Vec::new()),
    }
}

/// Which of MySQL/MariaDB, PostgreSQL and Redis answers at `ep`, if any (half a second at
/// most: the three questions go out at once, each on its own connection).
pub async fn identify(ep: &Endpoint) -> Option<Server> {
    // PostgreSQL's SSLRequest: length 8, code 80877103; the answer is `N` or `S`.
    const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
    let (first, pg, redis) =
        tokio::join!(ask(ep, b""), ask(ep, &SSL_REQUEST), ask(ep, b"PING\r\n"));
    // MySQL's greeting: 3-byte length, sequence 0, protocol version 10.
    let first = first?;
    if first.len() >= 5 && first[3] == 0 && first[4] == 10 {
        return Some(Server::MySql);
    }
    if !first.is_empty() {
        return None;
    }
    if matches!(pg.as_deref(), Some([b'N'] | [b'S'])) {
        return Some(Server::Postgres);
    }
    let redis = redis?;
    if redis.starts_with(b"+PONG") || redis.starts_with(b"-NOAUTH") || redis.starts_with(b"-ERR") {
        return Some(Server::Redis);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_come_from_urls() {
        let e = |u, d| endpoint(u, d).map(|e| e.to_string());
        assert_eq!(
            e("postgres://u:p@db1:6543/x?sslmode=disable", 5432).as_deref(),
            Some("db1:6543")
        );
        assert_eq!(e("mysql://db1/x", 3306).as_deref(), Some("db1:3306"));
        assert_eq!(
            e("redis://:pw@[::1]:7000/0", 6379).as_deref(),
            Some("[::1]:7000")
        );
        assert_eq!(e("redis://h", 6379).as_deref(), Some("h:6379"));
        assert_eq!(e("sqlite::memory:", 0), None);
        assert_eq!(e("postgres:///db?host=/run/pg", 5432), None);
    }
}
