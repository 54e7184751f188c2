//! [`NatsKvOptions`]: the settings of a [`NatsKvStore`](crate::NatsKvStore), their validation
//! ([`validate_bucket`], [`validate_prefix`], the replica count) and the `nats-kv://` URL form.

use idemq_core::secrets::redact_url;
use idemq_core::StoreError;
use std::time::Duration;

/// The bucket used unless configured.
pub const DEFAULT_BUCKET: &str = "idemq";
/// The key prefix used unless configured.
pub const DEFAULT_PREFIX: &str = "idemq";
/// The longest bucket name accepted (the stream is `KV_<bucket>`).
pub const MAX_BUCKET_LEN: usize = 64;
/// The longest key prefix accepted.
pub const MAX_PREFIX_LEN: usize = 64;
/// How long an in-progress record stays in the bucket after its lease ends, when the
/// bucket takes per-key TTLs (so a crashed worker's key can be taken over with its attempt
/// count and shows in `list_stuck`).
pub const DEFAULT_IN_PROGRESS_GRACE: Duration = Duration::from_secs(24 * 3600);
/// How long a completed record stays in the bucket after its retention ends, when the
/// bucket takes per-key TTLs (visible to `get`, deleted by `purge_expired`; the server
/// drops it by itself afterwards).
pub const DEFAULT_COMPLETED_GRACE: Duration = Duration::from_secs(600);
/// The URL scheme of `idemq::open_store`-style URLs: `nats-kv://host:port/bucket`.
pub const NATS_KV_SCHEME: &str = "nats-kv";

/// Checks a bucket name: 1 to 64 characters of `A-Z a-z 0-9 _ -`.
///
/// The bucket names a stream (`KV_<bucket>`) and a subject token (`$KV.<bucket>.…`): a dot
/// would split the token, `*` and `>` are subject wildcards, a space ends the subject.
///
/// ```
/// use idemq_nats_kv::validate_bucket;
/// assert!(validate_bucket("idemq_payments-v2").is_ok());
/// for bad in ["", "a.b", "a b", "x*", ">", "a\nb"] {
///     assert!(validate_bucket(bad).is_err());
/// }
/// ```
pub fn validate_bucket(bucket: &str) -> Result<(), StoreError> {
    validate_token("bucket name", bucket, MAX_BUCKET_LEN)
}

/// Checks a key prefix: 1 to 64 characters of `A-Z a-z 0-9 _ -`, the first token of every
/// key the store writes (`<prefix>.<encoded dedup key>`).
///
/// ```
/// use idemq_nats_kv::validate_prefix;
/// assert!(validate_prefix("orders-v2").is_ok());
/// for bad in ["", "a.b", "a b", "*", "a>", &"p".repeat(65)] {
///     assert!(validate_prefix(bad).is_err());
/// }
/// ```
pub fn validate_prefix(prefix: &str) -> Result<(), StoreError> {
    validate_token("key prefix", prefix, MAX_PREFIX_LEN)
}

fn validate_token(what: &str, s: &str, max: usize) -> Result<(), StoreError> {
    let ok = !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(StoreError::Config(format!(
            "invalid NATS KV {what} {s:?}: use 1 to {max} characters from A-Z a-z 0-9 _ - \
             (dots split subject tokens, `*` and `>` are wildcards)"
        )))
    }
}

/// The settings of a [`NatsKvStore`](crate::NatsKvStore).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsKvOptions {
    /// The KV bucket (default [`DEFAULT_BUCKET`]); validated by [`validate_bucket`].
    pub bucket: String,
    /// The key prefix (default [`DEFAULT_PREFIX`]); validated by [`validate_prefix`]. Two
    /// stores with different prefixes share a bucket without seeing each other's records.
    pub prefix: String,
    /// Replicas of a bucket the store creates: 1 (one server), 3 or 5 (a cluster; 3
    /// survives one node). An existing bucket keeps its own (default 1).
    pub replicas: usize,
    /// Create the bucket when it does not exist (default `true`).
    pub create_bucket: bool,
    /// `max_age` of a bucket the store creates: the server drops any record older than
    /// this, whatever its state (default zero: unlimited). Set it well above the longest
    /// retention plus lease, or completed keys are forgotten early.
    pub max_age: Duration,
    /// Per-key TTLs (NATS 2.11+, `Nats-TTL`): a bucket the store creates allows them, and
    /// every write carries one (lease or retention plus the graces below), so records leave
    /// by themselves (default `true`). With `false`, or on an existing bucket that does not
    /// allow them, records stay until `purge_expired`, `forget` or `max_age`.
    pub per_key_ttl: bool,
    /// How long in-progress records outlive their lease (default [`DEFAULT_IN_PROGRESS_GRACE`]).
    pub in_progress_grace: Duration,
    /// How long completed records outlive their retention (default [`DEFAULT_COMPLETED_GRACE`]).
    pub completed_grace: Duration,
    /// Timeout of the first connection (default 2 s).
    pub connect_timeout: Duration,
    /// Timeout of each request and publish acknowledgement (default 5 s); a timeout is
    /// [`StoreError::Unavailable`].
    pub request_timeout: Duration,
    /// How often the store re-reads the server's time (default 1 s; see the crate docs).
    pub clock_resync: Duration,
    /// Operations of one batch in flight at once (default 256).
    pub max_concurrency: usize,
}

impl Default for NatsKvOptions {
    fn default() -> Self {
        Self {
            bucket: DEFAULT_BUCKET.into(),
            prefix: DEFAULT_PREFIX.into(),
            replicas: 1,
            create_bucket: true,
            max_age: Duration::ZERO,
            per_key_ttl: true,
            in_progress_grace: DEFAULT_IN_PROGRESS_GRACE,
            completed_grace: DEFAULT_COMPLETED_GRACE,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
            clock_resync: Duration::from_secs(1),
            max_concurrency: 256,
        }
    }
}

impl NatsKvOptions {
    /// Checks every setting (names, replicas, durations) without connecting.
    pub fn validate(&self) -> Result<(), StoreError> {
        validate_bucket(&self.bucket)?;
        validate_prefix(&self.prefix)?;
        if !matches!(self.replicas, 1 | 3 | 5) {
            return Err(StoreError::Config(format!(
                "NATS KV replicas must be 1 (one server), 3 or 5 (a cluster), got {}",
                self.replicas
            )));
        }
        if self.request_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(StoreError::Config(
                "NATS KV connect_timeout and request_timeout must be above zero".into(),
            ));
        }
        if self.max_concurrency == 0 {
            return Err(StoreError::Config(
                "NATS KV max_concurrency must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// A URL split into the server addresses to dial and the settings it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ParsedUrl {
    /// `nats://host:port` (or `tls://`, `ws://`…), one per server.
    pub servers: Vec<String>,
}

/// Reads `nats-kv://[user:pass@]host:port[,host:port…]/bucket[?prefix=p&replicas=3]`
/// (bucket and query override `opts`) or a plain `nats://…` / `tls://…` server URL
/// (comma-separated hosts allowed; `opts` decide the bucket).
pub(crate) fn parse_url(url: &str, opts: &mut NatsKvOptions) -> Result<ParsedUrl, StoreError> {
    let bad = |why: &str| {
        StoreError::Config(format!(
            "invalid NATS KV URL `{}`: {why}; expected nats-kv://host:port/bucket or nats://host:port",
            redact_url(url)
        ))
    };
    let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("no scheme"))?;
    let scheme = scheme.to_ascii_lowercase();
    let server_scheme = match scheme.as_str() {
        NATS_KV_SCHEME => "nats",
        "nats" | "tls" | "ws" | "wss" => scheme.as_str(),
        _ => return Err(bad("unknown scheme")),
    };
    let (authority, path_query) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let (path, query) = path_query.split_once('?').unwrap_or((path_query, ""));
    if scheme == NATS_KV_SCHEME {
        let bucket = path.trim_start_matches('/');
        if !bucket.is_empty() {
            opts.bucket = bucket.to_string();
        }
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "prefix" => opts.prefix = v.to_string(),
                "replicas" => {
                    opts.replicas = v.parse().map_err(|_| bad("`replicas` must be 1, 3 or 5"))?
                }
                other => {
                    return Err(bad(&format!(
                        "unknown parameter `{other}` (known: prefix, replicas)"
                    )))
                }
            }
        }
    } else if !(path.is_empty() || path == "/") || !query.is_empty() {
        return Err(bad(
            "a nats:// URL names servers only; put the bucket in the options or use nats-kv://host/bucket",
        ));
    }
    // Credentials before the first host apply to all of them.
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let servers: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| match userinfo {
            Some(u) => format!("{server_scheme}://{u}@{h}"),
            None => format!("{server_scheme}://{h}"),
        })
        .collect();
    if servers.is_empty() {
        return Err(bad("no host"));
    }
    Ok(ParsedUrl { servers })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nats_kv_url_names_servers_bucket_and_settings() {
        let mut o = NatsKvOptions::default();
        let p = parse_url(
            "nats-kv://u:pw@127.0.0.1:1,127.0.0.1:2/orders?prefix=pay&replicas=3",
            &mut o,
        )
        .expect("valid");
        assert_eq!(
            p.servers,
            ["nats://u:pw@127.0.0.1:1", "nats://u:pw@127.0.0.1:2"]
        );
        assert_eq!(
            (o.bucket.as_str(), o.prefix.as_str(), o.replicas),
            ("orders", "pay", 3)
        );
        let mut o = NatsKvOptions::default();
        let p = parse_url("nats://127.0.0.1:4222", &mut o).expect("valid");
        assert_eq!(p.servers, ["nats://127.0.0.1:4222"]);
        assert_eq!(o, NatsKvOptions::default());
    }

    #[test]
    fn bad_urls_and_settings_are_config_errors() {
        for url in [
            "nats-kv://h/b?bogus=1",
            "nats-kv://h/b?replicas=x",
            "nats://h/bucket",
            "http://h/",
            "nats-kv:///b",
            "no-scheme",
        ] {
            let e = parse_url(url, &mut NatsKvOptions::default()).expect_err(url);
            assert!(matches!(e, StoreError::Config(_)), "{url}: {e:?}");
        }
        let bad = NatsKvOptions {
            replicas: 2,
            ..NatsKvOptions::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("replicas"));
    }
}
