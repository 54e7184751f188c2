//! A client for Toxiproxy's REST API: network faults between a test's client and its server
//! (latency, a half-open link, a reset, a reply cut after a number of bytes, a partition),
//! applied and removed while the test runs.
//!
//! Toxiproxy 2 (`scripts/servers.sh start toxiproxy`; its API address is
//! `IDEMQ_TEST_TOXIPROXY_URL`, the ports its proxies may listen on `IDEMQ_TEST_TOXIPROXY_PORTS`)
//! forwards each proxy's listen address to its upstream. A *toxic* on a proxy acts on every
//! connection through it, those opened later included, in one direction:
//! [`Stream::Upstream`] is what the client sends, [`Stream::Downstream`] what the server
//! answers. A toxic on the downstream hits replies to requests the server has already acted
//! on, which is the ambiguous outcome a retry must be safe for. Toxics act on bytes and
//! time, not on one chosen request: to lose exactly the reply to one request (a `COMMIT`'s),
//! use [`reply_cut`](super::reply_cut).
//!
//! idemq-core has no HTTP client: each call is one HTTP/1.1 exchange on its own connection
//! (`Connection: close`), bounded by [`Toxiproxy::with_timeout`].
//!
//! ```no_run
//! # async fn demo() -> Result<(), idemq_core::testkit::toxiproxy::ToxiproxyError> {
//! use idemq_core::testkit::toxiproxy::{Stream, Toxic, Toxiproxy};
//! use std::time::Duration;
//!
//! let toxiproxy = Toxiproxy::new("http://127.0.0.1:28474")?;
//! let pg = toxiproxy.create_proxy_in("pg", "127.0.0.1:25432", 28500..=28599).await?;
//! // The client connects to `pg.listen` instead of 127.0.0.1:25432; then:
//! let slow = Toxic::latency("slow", Stream::Downstream, Duration::from_secs(4));
//! toxiproxy.add_toxic(&pg.name, &slow).await?;
//! toxiproxy.remove_toxic(&pg.name, "slow").await?;
//! toxiproxy.set_enabled(&pg.name, false).await?; // a partition: connections closed, refused
//! toxiproxy.set_enabled(&pg.name, true).await?;
//! toxiproxy.delete_proxy(&pg.name).await?;
//! # Ok(()) }
//! ```

use serde::Deserialize;
use serde_json::{json, Value};
use std::ops::RangeInclusive;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The ports `scripts/servers.sh` sets aside for proxies (`IDEMQ_TEST_TOXIPROXY_PORTS`).
pub const DEFAULT_PORTS: RangeInclusive<u16> = 28500..=28599;

/// Why a call to Toxiproxy failed.
#[derive(Debug, thiserror::Error)]
pub enum ToxiproxyError {
    /// The API URL is not `http://HOST:PORT`.
    #[error("toxiproxy URL {url:?}: {why} (expected http://HOST:PORT)")]
    BadUrl {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The connection to the API failed (refused: the server is not running).
    #[error("toxiproxy at {addr}, {what}: {source}")]
    Io {
        /// The API's address.
        addr: String,
        /// The call (`METHOD /path`).
        what: String,
        /// The socket's error.
        #[source]
        source: std::io::Error,
    },
    /// No complete answer within the client's timeout.
    #[error("toxiproxy at {addr}, {what}: no answer within {timeout:?}")]
    Timeout {
        /// The API's address.
        addr: String,
        /// The call (`METHOD /path`).
        what: String,
        /// The client's bound on one call.
        timeout: Duration,
    },
    /// The API refused the call (404: no such proxy or toxic; 409: the name is taken; 500:
    /// among others, the listen address could not be bound).
    #[error("toxiproxy at {addr}, {what}: HTTP {status}: {message}")]
    Api {
        /// The API's address.
        addr: String,
        /// The call (`METHOD /path`).
        what: String,
        /// The HTTP status.
        status: u16,
        /// Toxiproxy's `error` field, or the body's text.
        message: String,
    },
    /// The answer is not HTTP/1.x, or not the JSON the call expects.
    #[error("toxiproxy at {addr}, {what}: unreadable answer: {why}")]
    BadResponse {
        /// The API's address.
        addr: String,
        /// The call (`METHOD /path`).
        what: String,
        /// What could not be read.
        why: String,
    },
    /// Every port of the range was taken.
    #[error("no free port for proxy {name} in 127.0.0.1:{first}-{last}")]
    NoFreePort {
        /// The proxy's name.
        name: String,
        /// The range's first port.
        first: u16,
        /// The range's last port.
        last: u16,
    },
}

impl ToxiproxyError {
    /// The proxy or toxic named does not exist (HTTP 404).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Api { status: 404, .. })
    }

    /// The proxy could not listen on the address asked for: it is taken.
    fn is_address_in_use(&self) -> bool {
        matches!(self, Self::Api { status: 500, message, .. } if message.contains("address already in use"))
    }
}

/// Which bytes a toxic acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// From the client to the server (requests).
    Upstream,
    /// From the server to the client (replies).
    Downstream,
}

impl Stream {
    fn as_str(self) -> &'static str {
        match self {
            Self::Upstream => "upstream",
            Self::Downstream => "downstream",
        }
    }
}

/// What a toxic does to the bytes of its [`Stream`].
#[derive(Debug, Clone, PartialEq)]
pub enum ToxicKind {
    /// Each chunk is held `latency` (± `jitter`) before it goes on.
    Latency {
        /// The delay.
        latency: Duration,
        /// Random variation of the delay.
        jitter: Duration,
    },
    /// Nothing gets through (the bytes are dropped) and the connection stays open: a
    /// half-open link. With a non-zero `timeout` the connection is closed after it; with
    /// zero, when the toxic is removed (Toxiproxy closes the link then).
    Timeout {
        /// When the connection is closed; zero: when the toxic is removed.
        timeout: Duration,
    },
    /// The next chunk is dropped and the connection reset (RST), `after` it arrived.
    ResetPeer {
        /// The wait between the chunk and the reset.
        after: Duration,
    },
    /// The connection is closed once `bytes` have gone through (counted per connection
    /// from when the toxic was added): a reply cut mid-stream.
    LimitData {
        /// The bytes let through.
        bytes: u64,
    },
}

/// A toxic to add to a proxy.
#[derive(Debug, Clone, PartialEq)]
pub struct Toxic {
    /// Its name on the proxy (to remove it by).
    pub name: String,
    /// What it does.
    pub kind: ToxicKind,
    /// Which direction it acts on.
    pub stream: Stream,
    /// The share of connections it acts on, from 0 to 1 (Toxiproxy draws per connection).
    pub toxicity: f32,
}

impl Toxic {
    fn new(name: &str, stream: Stream, kind: ToxicKind) -> Self {
        Self {
            name: name.to_string(),
            kind,
            stream,
            toxicity: 1.0,
        }
    }

    /// Every chunk of `stream` delayed by `latency`.
    pub fn latency(name: &str, stream: Stream, latency: Duration) -> Self {
        Self::new(
            name,
            stream,
            ToxicKind::Latency {
                latency,
                jitter: Duration::ZERO,
            },
        )
    }

    /// A half-open link: nothing on `stream` gets through, the connection stays open
    /// (until `timeout`; zero: until the toxic is removed).
    pub fn timeout(name: &str, stream: Stream, timeout: Duration) -> Self {
        Self::new(name, stream, ToxicKind::Timeout { timeout })
    }

    /// A reset (RST) instead of the next chunk of `stream`, `after` it arrived.
    pub fn reset_peer(name: &str, stream: Stream, after: Duration) -> Self {
        Self::new(name, stream, ToxicKind::ResetPeer { after })
    }

    /// The connection closed after `bytes` more bytes of `stream`.
    pub fn limit_data(name: &str, stream: Stream, bytes: u64) -> Self {
        Self::new(name, stream, ToxicKind::LimitData { bytes })
    }

    /// The same toxic on a share of the connections only (0 to 1).
    pub fn toxicity(mut self, toxicity: f32) -> Self {
        self.toxicity = toxicity;
        self
    }

    /// The JSON Toxiproxy takes (its durations are whole milliseconds).
    fn body(&self) -> Value {
        let ms = |d: &Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let (kind, attributes) = match &self.kind {
            ToxicKind::Latency { latency, jitter } => (
                "latency",
                json!({"latency": ms(latency), "jitter": ms(jitter)}),
            ),
            ToxicKind::Timeout { timeout } => ("timeout", json!({"timeout": ms(timeout)})),
            ToxicKind::ResetPeer { after } => ("reset_peer", json!({"timeout": ms(after)})),
            ToxicKind::LimitData { bytes } => ("limit_data", json!({"bytes": bytes})),
        };
        json!({
            "name": self.name,
            "type": kind,
            "stream": self.stream.as_str(),
            "toxicity": self.toxicity,
            "attributes": attributes,
        })
    }
}

/// A proxy as Toxiproxy reports it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct Proxy {
    /// Its name.
    pub name: String,
    /// The address it listens on (`127.0.0.1:PORT`): what the client connects to.
    pub listen: String,
    /// The server it forwards to.
    pub upstream: String,
    /// `false` while partitioned: no listener, no connections.
    pub enabled: bool,
    /// The toxics on it.
    #[serde(default)]
    pub toxics: Vec<ToxicState>,
}

/// A toxic as Toxiproxy reports it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ToxicState {
    /// Its name.
    pub name: String,
    /// Its type (`latency`, `timeout`, `reset_peer`, `limit_data`, …).
    #[serde(rename = "type")]
    pub kind: String,
    /// `upstream` or `downstream`.
    pub stream: String,
    /// The share of connections it acts on.
    pub toxicity: f32,
    /// Its attributes, as Toxiproxy names them.
    #[serde(default)]
    pub attributes: Value,
}

/// The REST API of one Toxiproxy server.
#[derive(Debug, Clone)]
pub struct Toxiproxy {
    /// `host:port` of the API.
    addr: String,
    timeout: Duration,
}

impl Toxiproxy {
    /// The API at `url` (`http://HOST:PORT`, as `IDEMQ_TEST_TOXIPROXY_URL`). Nothing is
    /// sent until the first call.
    pub fn new(url: &str) -> Result<Self, ToxiproxyError> {
        let bad = |why| ToxiproxyError::BadUrl {
            url: url.to_string(),
            why,
        };
        let rest = url
            .trim()
            .strip_prefix("http://")
            .ok_or_else(|| bad("not an http:// URL"))?;
        let addr = rest.trim_end_matches('/');
        if addr.contains('/') {
            return Err(bad("has a path"));
        }
        let (host, port) = addr.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        if host.is_empty() || port.parse::<u16>().is_err() {
            return Err(bad("no host, or a port that is not a number"));
        }
        Ok(Self {
            addr: addr.to_string(),
            timeout: Duration::from_secs(10),
        })
    }

    /// The bound on each call (10 s by default): a call that gets no complete answer in
    /// that time fails with [`ToxiproxyError::Timeout`].
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The server's version string (a build from source says `git`): an "is it there" call.
    pub async fn version(&self) -> Result<String, ToxiproxyError> {
        let body = self.call("GET", "/version", None).await?;
        Ok(String::from_utf8_lossy(&body).trim().to_string())
    }

    /// A proxy named `name` listening on `listen` (`127.0.0.1:PORT`) and forwarding to
    /// `upstream` (`host:port`), enabled.
    pub async fn create_proxy(
        &self,
        name: &str,
        listen: &str,
        upstream: &str,
    ) -> Result<Proxy, ToxiproxyError> {
        let body = json!({"name": name, "listen": listen, "upstream": upstream, "enabled": true});
        let what = format!("POST /proxies ({name})");
        let answer = self.call_as(&what, "POST", "/proxies", Some(&body)).await?;
        self.parse(&what, &answer)
    }

    /// A proxy on the first port of `ports` that is free on 127.0.0.1 (a port another
    /// proxy or process holds is skipped).
    pub async fn create_proxy_in(
        &self,
        name: &str,
        upstream: &str,
        ports: RangeInclusive<u16>,
    ) -> Result<Proxy, ToxiproxyError> {
        let (first, last) = (*ports.start(), *ports.end());
        for port in ports {
            match self
                .create_proxy(name, &format!("127.0.0.1:{port}"), upstream)
                .await
            {
                Err(e) if e.is_address_in_use() => continue,
                other => return other,
            }
        }
        Err(ToxiproxyError::NoFreePort {
            name: name.to_string(),
            first,
            last,
        })
    }

    /// The proxy named `name`, with its toxics.
    pub async fn proxy(&self, name: &str) -> Result<Proxy, ToxiproxyError> {
        let path = format!("/proxies/{name}");
        let what = format!("GET {path}");
        let answer = self.call_as(&what, "GET", &path, None).await?;
        self.parse(&what, &answer)
    }

    /// Deletes the proxy: its listener and every connection through it are closed.
    pub async fn delete_proxy(&self, name: &str) -> Result<(), ToxiproxyError> {
        self.call("DELETE", &format!("/proxies/{name}"), None)
            .await
            .map(drop)
    }

    /// Disables (`false`: a partition; the listener and every connection are closed, new
    /// ones refused) or enables the proxy again on the same address.
    pub async fn set_enabled(&self, name: &str, enabled: bool) -> Result<Proxy, ToxiproxyError> {
        let path = format!("/proxies/{name}");
        let what = format!("POST {path} (enabled: {enabled})");
        let body = json!({ "enabled": enabled });
        let answer = self.call_as(&what, "POST", &path, Some(&body)).await?;
        self.parse(&what, &answer)
    }

    /// Adds `toxic` to the proxy: it acts on its connections at once.
    pub async fn add_toxic(&self, proxy: &str, toxic: &Toxic) -> Result<(), ToxiproxyError> {
        self.call(
            "POST",
            &format!("/proxies/{proxy}/toxics"),
            Some(&toxic.body()),
        )
        .await
        .map(drop)
    }

    /// Removes the toxic named `toxic` from the proxy (a `timeout` toxic's connections are
    /// closed then).
    pub async fn remove_toxic(&self, proxy: &str, toxic: &str) -> Result<(), ToxiproxyError> {
        self.call("DELETE", &format!("/proxies/{proxy}/toxics/{toxic}"), None)
            .await
            .map(drop)
    }

    fn parse<T: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        body: &[u8],
    ) -> Result<T, ToxiproxyError> {
        serde_json::from_slice(body).map_err(|e| ToxiproxyError::BadResponse {
            addr: self.addr.clone(),
            what: what.to_string(),
            why: format!("{e}: {}", String::from_utf8_lossy(body)),
        })
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Vec<u8>, ToxiproxyError> {
        self.call_as(&format!("{method} {path}"), method, path, body)
            .await
    }

    /// One exchange; a status other than 2xx is an [`ToxiproxyError::Api`] error.
    async fn call_as(
        &self,
        what: &str,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Vec<u8>, ToxiproxyError> {
        let exchange = self.exchange(what, method, path, body);
        let (status, answer) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| ToxiproxyError::Timeout {
                addr: self.addr.clone(),
                what: what.to_string(),
                timeout: self.timeout,
            })??;
        if (200..300).contains(&status) {
            return Ok(answer);
        }
        Err(ToxiproxyError::Api {
            addr: self.addr.clone(),
            what: what.to_string(),
            status,
            message: api_message(&answer),
        })
    }

    async fn exchange(
        &self,
        what: &str,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Vec<u8>), ToxiproxyError> {
        let io = |source| ToxiproxyError::Io {
            addr: self.addr.clone(),
            what: what.to_string(),
            source,
        };
        let mut conn = TcpStream::connect(&self.addr).await.map_err(io)?;
        let body = body.map(Value::to_string).unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nAccept: application/json\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr,
            body.len()
        );
        conn.write_all(request.as_bytes()).await.map_err(io)?;
        let mut raw = Vec::new();
        // `Connection: close`: the server closes after its answer, so its end is the EOF.
        conn.read_to_end(&mut raw).await.map_err(io)?;
        parse_response(&raw).map_err(|why| ToxiproxyError::BadResponse {
            addr: self.addr.clone(),
            what: what.to_string(),
            why,
        })
    }
}

/// Toxiproxy's `{"error": "...", "status": N}`, or the body's text.
fn api_message(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string())
}

/// (status, body) of an HTTP/1.x response read to its end: the body by `Content-Length`,
/// chunked, or (neither) everything after the headers.
fn parse_response(raw: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| format!("no end of headers in {} bytes", raw.len()))?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| "headers not UTF-8".to_string())?;
    let rest = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.split(' ');
    let status = match (parts.next(), parts.next()) {
        (Some(v), Some(code)) if v.starts_with("HTTP/1.") => code.parse::<u16>().ok(),
        _ => None,
    }
    .ok_or_else(|| format!("not an HTTP/1.x status line: {status_line:?}"))?;
    let (mut length, mut chunked) = (None, false);
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => {
                length = Some(
                    value
                        .parse::<usize>()
                        .map_err(|_| format!("Content-Length {value:?}"))?,
                )
            }
            "transfer-encoding" => chunked = value.to_ascii_lowercase().contains("chunked"),
            _ => {}
        }
    }
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(n) = length {
        rest.get(..n)
            .ok_or_else(|| format!("body cut short: {} of {n} bytes", rest.len()))?
            .to_vec()
    } else {
        rest.to_vec()
    };
    Ok((status, body))
}

/// A chunked body's bytes (chunk extensions and trailers ignored).
fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    loop {
        let eol = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a chunk size line without its end")?;
        let line = std::str::from_utf8(&rest[..eol]).map_err(|_| "chunk size not UTF-8")?;
        let hex = line.split(';').next().unwrap_or_default().trim();
        let size =
            usize::from_str_radix(hex, 16).map_err(|_| format!("chunk size line {line:?}"))?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Ok(body);
        }
        let chunk = rest
            .get(..size)
            .ok_or_else(|| format!("chunk cut short: {} of {size} bytes", rest.len()))?;
        body.extend_from_slice(chunk);
        rest = rest.get(size + 2..).ok_or("a chunk without its end")?;
    }
}

/// The `host:port` of a server URL (`scheme://[user[:password]@]host:port[/…]`), as a
/// proxy's upstream: `None` when the URL has no explicit port.
pub fn url_host_port(url: &str) -> Option<&str> {
    let (_, after_scheme) = url.split_once("://")?;
    let authority = after_scheme.split(['/', '?']).next()?;
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    let (host, port) = host_port.rsplit_once(':')?;
    (!host.is_empty() && port.parse::<u16>().is_ok()).then_some(host_port)
}

/// `url` with its `host:port` replaced by `addr` (a proxy's listen address): the same
/// server, reached through the proxy. `None` when the URL has no explicit port.
pub fn url_via(url: &str, addr: &str) -> Option<String> {
    let host_port = url_host_port(url)?;
    let (scheme, after_scheme) = url.split_once("://")?;
    let authority = after_scheme.split(['/', '?']).next()?;
    let user = authority
        .strip_suffix(host_port)
        .filter(|u| u.is_empty() || u.ends_with('@'))?;
    let tail = &after_scheme[authority.len()..];
    Some(format!("{scheme}://{user}{addr}{tail}"))
}

/// A port range `FIRST-LAST` (as `IDEMQ_TEST_TOXIPROXY_PORTS`), `None` when it is not one.
pub fn parse_ports(s: &str) -> Option<RangeInclusive<u16>> {
    let (first, last) = s.trim().split_once('-')?;
    let (first, last) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
    (first <= last).then_some(first..=last)
}

/// The proxies' ports: `IDEMQ_TEST_TOXIPROXY_PORTS` when it is a range, else
/// [`DEFAULT_PORTS`].
pub fn ports_from_env() -> RangeInclusive<u16> {
    std::env::var("IDEMQ_TEST_TOXIPROXY_PORTS")
        .ok()
        .and_then(|s| parse_ports(&s))
        .unwrap_or(DEFAULT_PORTS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::net::TcpListener;

    #[test]
    fn responses_are_read_by_length_chunked_or_to_the_end() {
        let by_length = b"HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\n{}\r\nignored";
        assert_eq!(parse_response(by_length), Ok((201, b"{}\r\n".to_vec())));
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked), Ok((200, b"abcde".to_vec())));
        let to_the_end = b"HTTP/1.0 404 Not Found\r\nServer: x\r\n\r\nnope";
        assert_eq!(parse_response(to_the_end), Ok((404, b"nope".to_vec())));
        let short = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc");
        assert!(
            matches!(&short, Err(e) if e.contains("cut short")),
            "{short:?}"
        );
        let cut_chunk =
            parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\nabc");
        assert!(cut_chunk.is_err(), "{cut_chunk:?}");
        assert!(parse_response(b"SSH-2.0-OpenSSH\r\n\r\n").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
    }

    #[test]
    fn an_error_body_gives_its_message() {
        assert_eq!(
            api_message(b"{\"error\":\"proxy not found\",\"status\":404}\n"),
            "proxy not found"
        );
        assert_eq!(api_message(b"plain text\n"), "plain text");
    }

    #[test]
    fn toxics_are_sent_as_toxiproxy_names_them() {
        let t = Toxic::latency("slow", Stream::Downstream, Duration::from_millis(4500));
        assert_eq!(
            t.body(),
            json!({"name": "slow", "type": "latency", "stream": "downstream", "toxicity": 1.0,
                   "attributes": {"latency": 4500, "jitter": 0}})
        );
        let t = Toxic::timeout("half", Stream::Upstream, Duration::ZERO).toxicity(0.5);
        assert_eq!(t.body()["attributes"], json!({"timeout": 0}));
        assert_eq!(t.body()["stream"], "upstream");
        assert_eq!(t.body()["toxicity"], 0.5);
        let t = Toxic::reset_peer("rst", Stream::Downstream, Duration::from_millis(20));
        assert_eq!(
            (t.body()["type"].clone(), t.body()["attributes"].clone()),
            (json!("reset_peer"), json!({"timeout": 20}))
        );
        let t = Toxic::limit_data("cut", Stream::Downstream, 2048);
        assert_eq!(t.body()["attributes"], json!({"bytes": 2048}));
    }

    #[test]
    fn urls_are_rewritten_to_go_through_a_proxy() {
        let cases = [
            (
                "postgres://postgres@127.0.0.1:25432/idemq",
                "127.0.0.1:25432",
                "postgres://postgres@127.0.0.1:28500/idemq",
            ),
            (
                "mysql://idemq:idemq@127.0.0.1:23306/idemq",
                "127.0.0.1:23306",
                "mysql://idemq:idemq@127.0.0.1:28500/idemq",
            ),
            (
                "redis://127.0.0.1:22379/",
                "127.0.0.1:22379",
                "redis://127.0.0.1:28500/",
            ),
            (
                "amqp://guest:guest@127.0.0.1:24672/%2f",
                "127.0.0.1:24672",
                "amqp://guest:guest@127.0.0.1:28500/%2f",
            ),
            (
                "nats://127.0.0.1:24222",
                "127.0.0.1:24222",
                "nats://127.0.0.1:28500",
            ),
            (
                "postgres://u:p%40ss@db.local:5432?sslmode=disable",
                "db.local:5432",
                "postgres://u:p%40ss@127.0.0.1:28500?sslmode=disable",
            ),
        ];
        for (url, upstream, via) in cases {
            assert_eq!(url_host_port(url), Some(upstream), "{url}");
            assert_eq!(
                url_via(url, "127.0.0.1:28500").as_deref(),
                Some(via),
                "{url}"
            );
        }
        for no_port in ["redis://127.0.0.1/", "127.0.0.1:5432", "nats://:4222"] {
            assert_eq!(url_host_port(no_port), None, "{no_port}");
            assert_eq!(url_via(no_port, "127.0.0.1:1"), None, "{no_port}");
        }
    }

    #[test]
    fn port_ranges_and_api_urls_are_checked() {
        assert_eq!(parse_ports("28500-28599"), Some(28500..=28599));
        assert_eq!(parse_ports(" 1 - 1 "), Some(1..=1));
        assert_eq!(parse_ports("28599-28500"), None);
        assert_eq!(parse_ports("28500"), None);
        assert_eq!(parse_ports("a-b"), None);
        assert!(Toxiproxy::new("http://127.0.0.1:28474").is_ok());
        assert!(Toxiproxy::new("http://127.0.0.1:28474/").is_ok());
        for bad in [
            "127.0.0.1:28474",
            "https://127.0.0.1:28474",
            "http://127.0.0.1",
            "http://127.0.0.1:28474/proxies",
            "http://:28474",
        ] {
            let e = Toxiproxy::new(bad).expect_err(bad);
            assert!(e.to_string().contains("expected http://HOST:PORT"), "{e}");
        }
    }

    #[tokio::test]
    async fn an_api_that_is_not_there_is_named_in_the_error() {
        // A port nobody listens on: bound, then released.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let api = Toxiproxy::new(&format!("http://127.0.0.1:{port}")).expect("url");
        let e = api.version().await.expect_err("nothing listens");
        assert!(matches!(e, ToxiproxyError::Io { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains(&format!("127.0.0.1:{port}")) && text.contains("GET /version"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn an_api_that_never_answers_times_out() {
        // Accepts and reads, never answers: a hung server.
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let hold = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((c, _)) = listener.accept().await {
                held.push(c);
            }
        });
        let api = Toxiproxy::new(&format!("http://{addr}"))
            .expect("url")
            .with_timeout(Duration::from_millis(300));
        let e = api.delete_proxy("x").await.expect_err("no answer");
        assert!(matches!(e, ToxiproxyError::Timeout { .. }), "{e:?}");
        hold.abort();
    }

    /// An echo server on an ephemeral port: what goes in comes back.
    async fn echo_server() -> (String, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let task = tokio::spawn(async move {
            while let Ok((mut c, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = c.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        (addr, task)
    }

    /// Sends `msg` on `conn` and reads what comes back within `within`: `Ok(bytes)` up to
    /// `msg.len()` or the EOF, `Err` on a reset, `Ok(None)` on silence.
    async fn round_trip(
        conn: &mut TcpStream,
        msg: &[u8],
        within: Duration,
    ) -> std::io::Result<Option<Vec<u8>>> {
        conn.write_all(msg).await?;
        let mut got = Vec::new();
        let read = async {
            let mut buf = [0u8; 64];
            while got.len() < msg.len() {
                let n = conn.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
            Ok::<_, std::io::Error>(())
        };
        match tokio::time::timeout(within, read).await {
            Ok(Ok(())) => Ok(Some(got)),
            Ok(Err(e)) => Err(e),
            Err(_) if got.is_empty() => Ok(None),
            Err(_) => Ok(Some(got)),
        }
    }

    fn api() -> Option<Toxiproxy> {
        let url = crate::testkit::servers::server_url("IDEMQ_TEST_TOXIPROXY_URL")?;
        Some(Toxiproxy::new(&url).expect("IDEMQ_TEST_TOXIPROXY_URL"))
    }

    fn unique(what: &str) -> String {
        format!("idemq-testkit-{what}-{:08x}", rand::random::<u32>())
    }

    const WAIT: Duration = Duration::from_secs(3);

    /// Each toxic does what the chaos soak counts on, against the real server.
    #[tokio::test]
    async fn each_toxic_acts_on_the_connections_through_the_proxy() {
        let Some(api) = api() else { return };
        assert!(!api.version().await.expect("version").is_empty());
        let (upstream, echo) = echo_server().await;
        let name = unique("toxics");
        let proxy = api
            .create_proxy_in(&name, &upstream, ports_from_env())
            .await
            .expect("create the proxy");
        assert_eq!(
            (proxy.upstream.as_str(), proxy.enabled),
            (upstream.as_str(), true)
        );
        let connect = || TcpStream::connect(proxy.listen.clone());
        let mut conn = connect().await.expect("connect through the proxy");
        let echoed = round_trip(&mut conn, b"ping", WAIT).await.expect("echo");
        assert_eq!(echoed.as_deref(), Some(&b"ping"[..]));

        // Latency on the replies: the round trip takes at least that long.
        let slow = Toxic::latency("slow", Stream::Downstream, Duration::from_millis(400));
        api.add_toxic(&name, &slow).await.expect("add latency");
        let seen = api.proxy(&name).await.expect("get the proxy");
        assert_eq!(
            seen.toxics
                .iter()
                .map(|t| (t.name.as_str(), t.kind.as_str(), t.stream.as_str()))
                .collect::<Vec<_>>(),
            [("slow", "latency", "downstream")]
        );
        let t = Instant::now();
        let echoed = round_trip(&mut conn, b"late", WAIT).await.expect("echo");
        assert_eq!(echoed.as_deref(), Some(&b"late"[..]));
        assert!(
            t.elapsed() >= Duration::from_millis(400),
            "{:?}",
            t.elapsed()
        );
        api.remove_toxic(&name, "slow")
            .await
            .expect("remove latency");
        let t = Instant::now();
        round_trip(&mut conn, b"fast", WAIT).await.expect("echo");
        assert!(
            t.elapsed() < Duration::from_millis(400),
            "{:?}",
            t.elapsed()
        );

        // A reply cut after 3 bytes: the rest never comes, the connection is closed.
        let cut = Toxic::limit_data("cut", Stream::Downstream, 3);
        api.add_toxic(&name, &cut).await.expect("add limit_data");
        let echoed = round_trip(&mut conn, b"hello", WAIT).await;
        assert!(
            matches!(echoed.as_ref().map(Option::as_deref), Ok(Some(b"hel"))),
            "{echoed:?}"
        );
        api.remove_toxic(&name, "cut")
            .await
            .expect("remove limit_data");

        // A reset instead of the reply.
        let mut conn = connect().await.expect("connect again");
        let reset = Toxic::reset_peer("reset", Stream::Downstream, Duration::ZERO);
        api.add_toxic(&name, &reset).await.expect("add reset_peer");
        let echoed = round_trip(&mut conn, b"hello", WAIT).await;
        assert!(
            matches!(
                echoed.as_ref().map(Option::as_deref),
                Err(_) | Ok(Some(b""))
            ),
            "no reply, a reset or a close: {echoed:?}"
        );
        api.remove_toxic(&name, "reset")
            .await
            .expect("remove reset_peer");

        // Half-open: no reply and no close while the toxic is on; closed when it goes.
        let mut conn = connect().await.expect("connect again");
        let half = Toxic::timeout("half", Stream::Downstream, Duration::ZERO);
        api.add_toxic(&name, &half).await.expect("add timeout");
        let silent = round_trip(&mut conn, b"anyone", Duration::from_millis(500)).await;
        assert!(matches!(silent, Ok(None)), "silence: {silent:?}");
        api.remove_toxic(&name, "half")
            .await
            .expect("remove timeout");
        let mut buf = [0u8; 16];
        let closed = tokio::time::timeout(WAIT, conn.read(&mut buf)).await;
        assert!(
            matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
            "closed once the toxic is removed: {closed:?}"
        );
        let err = api.remove_toxic(&name, "half").await.expect_err("gone");
        assert!(err.is_not_found(), "{err}");

        api.delete_proxy(&name).await.expect("delete the proxy");
        echo.abort();
    }

    /// A disabled proxy is a partition: its connections are closed and new ones refused;
    /// enabled again, it listens on the same address.
    #[tokio::test]
    async fn a_disabled_proxy_is_a_partition_until_enabled() {
        let Some(api) = api() else { return };
        let (upstream, echo) = echo_server().await;
        let name = unique("partition");
        let proxy = api
            .create_proxy_in(&name, &upstream, ports_from_env())
            .await
            .expect("create the proxy");
        let mut conn = TcpStream::connect(&proxy.listen).await.expect("connect");
        round_trip(&mut conn, b"ping", WAIT).await.expect("echo");

        let off = api.set_enabled(&name, false).await.expect("disable");
        assert!(!off.enabled);
        let mut buf = [0u8; 16];
        let closed = tokio::time::timeout(WAIT, conn.read(&mut buf)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
        assert!(
            TcpStream::connect(&proxy.listen).await.is_err(),
            "refused while partitioned"
        );

        let on = api.set_enabled(&name, true).await.expect("enable");
        assert_eq!(
            (on.listen.as_str(), on.enabled),
            (proxy.listen.as_str(), true)
        );
        let mut conn = TcpStream::connect(&proxy.listen)
            .await
            .expect("connect again");
        let echoed = round_trip(&mut conn, b"back", WAIT).await.expect("echo");
        assert_eq!(echoed.as_deref(), Some(&b"back"[..]));

        api.delete_proxy(&name).await.expect("delete");
        assert!(TcpStream::connect(&proxy.listen).await.is_err(), "deleted");
        echo.abort();
    }

    /// The API's refusals come back as errors that say what was refused.
    #[tokio::test]
    async fn refusals_say_what_was_refused() {
        let Some(api) = api() else { return };
        let (upstream, echo) = echo_server().await;
        let name = unique("refusals");
        let proxy = api
            .create_proxy_in(&name, &upstream, ports_from_env())
            .await
            .expect("create the proxy");
        let taken = api
            .create_proxy(&name, "127.0.0.1:0", &upstream)
            .await
            .expect_err("the name is taken");
        assert!(
            matches!(taken, ToxiproxyError::Api { status: 409, .. }),
            "{taken:?}"
        );
        // The first port of the range is skipped when it is taken (here: by `proxy`).
        let port: u16 = proxy
            .listen
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .expect("the listen port");
        let second = unique("second");
        let next = api
            .create_proxy_in(&second, &upstream, port..=port.saturating_add(20))
            .await
            .expect("a later port of the range");
        assert_ne!(next.listen, proxy.listen);
        let full = api
            .create_proxy_in(&unique("third"), &upstream, port..=port)
            .await
            .expect_err("the only port is taken");
        assert!(
            matches!(full, ToxiproxyError::NoFreePort { .. }),
            "{full:?}"
        );
        for n in [&name, &second] {
            api.delete_proxy(n).await.expect("delete");
        }
        let gone = api.delete_proxy(&name).await.expect_err("already deleted");
        assert!(gone.is_not_found(), "{gone}");
        let no_proxy = api
            .add_toxic(
                &name,
                &Toxic::latency("x", Stream::Upstream, Duration::ZERO),
            )
            .await
            .expect_err("no such proxy");
        assert!(
            no_proxy.is_not_found() && no_proxy.to_string().contains("proxy not found"),
            "{no_proxy}"
        );
        echo.abort();
    }
}
