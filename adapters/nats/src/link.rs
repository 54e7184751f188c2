//! Connecting: NATS server lists with credentials in them, a watch of whether the client is
//! connected, and the list shown everywhere without its secrets.

use crate::NatsError;
use async_nats::{ConnectOptions, Event, ServerAddr};
use std::time::Duration;
use tokio::sync::watch;

/// `url` (one NATS URL, or several separated by commas) with every credential replaced by
/// `***`: the password of `user:password@`, and a bare `token@` (NATS reads user info
/// without a colon as a token, which [`idemq_core::secrets::redact_url`] would show).
///
/// ```
/// use idemq_nats::redact;
/// assert_eq!(redact("nats://app:pw@h1:4222,nats://app:pw@h2:4222"), "nats://app:***@h1:4222,nats://app:***@h2:4222");
/// assert_eq!(redact("nats://s3cr3t@127.0.0.1:4222"), "nats://***@127.0.0.1:4222");
/// assert_eq!(redact("127.0.0.1:4222"), "127.0.0.1:4222");
/// ```
pub fn redact(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let start = one.find("://").map_or(0, |i| i + 3);
            let rest = &one[start..];
            let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            match rest[..authority_end].rfind('@') {
                Some(at) if !rest[..at].contains(':') => {
                    format!("{}***{}", &one[..start], &rest[at..])
                }
                _ => idemq_core::secrets::redact_url(one),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `%XX` escapes of a URL's user info decoded (a password may hold `@` or `:` escaped).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Credentials found in a server list.
#[derive(Default)]
struct Credentials {
    user: Option<(String, String)>,
    token: Option<String>,
}

/// The servers of `url` without their user info, and the first credentials found in it.
/// async-nats does not read user info from a URL: the client would connect anonymously.
fn parse_servers(url: &str) -> Result<(Vec<ServerAddr>, Credentials), String> {
    let mut servers = Vec::new();
    let mut creds = Credentials::default();
    for one in url.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let with_scheme = if one.contains("://") {
            one.to_string()
        } else {
            format!("nats://{one}")
        };
        let addr: ServerAddr = with_scheme
            .parse()
            .map_err(|e| format!("`{}` is not a NATS server address: {e}", redact(one)))?;
        let mut plain = addr.clone().into_inner();
        if let Some(user) = addr.username() {
            let user = percent_decode(user);
            match addr.password() {
                Some(pw) if creds.user.is_none() => {
                    creds.user = Some((user, percent_decode(pw)));
                }
                None if creds.token.is_none() => creds.token = Some(user),
                _ => {}
            }
            // Setting empty user info cannot fail on a URL that has a host.
            let _ = plain.set_password(None);
            let _ = plain.set_username("");
        }
        servers.push(ServerAddr::from_url(plain).map_err(|e| format!("`{}`: {e}", redact(one)))?);
    }
    if servers.is_empty() {
        return Err("no server address: expected nats://HOST:PORT[,nats://HOST:PORT]".into());
    }
    Ok((servers, creds))
}

/// A connected client, and a wake-up at each change of its connection.
pub(crate) struct Link {
    pub(crate) client: async_nats::Client,
    /// Bumped by the client's connect and disconnect events: the state itself is read from
    /// the client, the events only say when to read it again.
    changed: watch::Receiver<u64>,
    /// The server list without credentials, for messages.
    pub(crate) servers: String,
}

impl Link {
    /// True while connected.
    pub(crate) fn is_up(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Waits until the client is `connected` (at once if it is).
    async fn until(&self, connected: bool) {
        let mut changed = self.changed.clone();
        while self.is_up() != connected {
            if changed.changed().await.is_err() {
                // The client is gone: it never changes again.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Waits until the client is disconnected.
    pub(crate) async fn down(&self) {
        self.until(false).await
    }

    /// Waits until the client is connected.
    pub(crate) async fn restored(&self) {
        self.until(true).await
    }

    /// What `poll` and `publish` say while the server cannot be reached.
    pub(crate) fn unreachable(&self) -> String {
        format!(
            "nats server {} unreachable; the client reconnects by itself",
            self.servers
        )
    }
}

/// Connects to `url` (credentials in user info: `user:password@` or `token@`), named `name`
/// in the server's connection list; the client reconnects forever after the first success.
pub(crate) async fn connect(
    url: &str,
    name: &str,
    connect_timeout: Duration,
    request_timeout: Duration,
) -> Result<Link, NatsError> {
    let shown = redact(url);
    let (servers, creds) = parse_servers(url).map_err(NatsError::Config)?;
    let (tx, changed) = watch::channel(0u64);
    let mut options = ConnectOptions::new()
        .name(name)
        .connection_timeout(connect_timeout)
        .request_timeout(Some(request_timeout))
        .event_callback(move |event| {
            let tx = tx.clone();
            async move {
                match event {
                    Event::Connected | Event::Disconnected | Event::Closed => {
                        tracing::info!(event = %event, "nats connection");
                        tx.send_modify(|n| *n = n.wrapping_add(1));
                    }
                    other => tracing::debug!(event = %other, "nats client event"),
                }
            }
        });
    if let Some((user, pass)) = creds.user {
        options = options.user_and_password(user, pass);
    } else if let Some(token) = creds.token {
        options = options.token(token);
    }
    let client = options
        .connect(servers)
        .await
        .map_err(|e| NatsError::Connect {
            servers: shown.clone(),
            reason: idemq_core::secrets::scrub(&e.to_string(), url),
        })?;
    Ok(Link {
        client,
        changed,
        servers: shown,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_info_becomes_credentials_and_leaves_the_addresses() {
        let (servers, creds) =
            parse_servers("nats://app:p%40ss@h1:4222, h2:4223,nats://tok@h3").expect("parse");
        let shown: Vec<String> = servers
            .iter()
            .map(|s| format!("{}:{}", s.host(), s.port()))
            .collect();
        assert_eq!(shown, ["h1:4222", "h2:4223", "h3:4222"]);
        assert!(servers.iter().all(|s| s.username().is_none()));
        assert_eq!(creds.user, Some(("app".into(), "p@ss".into())));
        assert_eq!(creds.token.as_deref(), Some("tok"));
    }

    #[test]
    fn a_bad_address_is_named_without_its_secret() {
        let e = parse_servers("amqp://u:hunter2@h:1")
            .err()
            .expect("refused");
        assert!(e.contains("amqp://u:***@h:1"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        assert!(parse_servers(" , ").is_err());
    }
}
