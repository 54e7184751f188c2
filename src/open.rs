//! Opening a store from a URL, for the CLI and for configuration files.

use idemq_core::{DedupStore, MemoryStore, StoreError};
use std::sync::Arc;

/// URL schemes `open_store` knows, with the feature each needs.
pub const SUPPORTED_SCHEMES: &[(&str, &str)] = &[
    ("memory", "(always)"),
    ("sqlite", "sqlite"),
    ("postgres", "postgres"),
    ("postgresql", "postgres"),
    ("mysql", "mysql"),
    ("mariadb", "mysql"),
    ("redis", "redis"),
    ("redis+cluster", "redis"),
    ("nats-kv", "nats-kv"),
];

/// Why a store URL could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenStoreError {
    /// The URL has no `scheme:` part.
    #[error("`{0}` is not a store URL: expected e.g. sqlite://idemq.db, postgres://host/db, mysql://host/db, redis://host/ or memory://")]
    NotAUrl(String),
    /// The scheme is not one idemq knows.
    #[error(
        "unknown store URL scheme `{scheme}`: {}use one of {}",
        did_you_mean(scheme),
        list_schemes()
    )]
    UnknownScheme {
        /// The scheme given.
        scheme: String,
    },
    /// The scheme is known but this build lacks its feature.
    #[error("store URL scheme `{scheme}` needs idemq built with feature `{feature}` (cargo build --features {feature})")]
    FeatureDisabled {
        /// The scheme given.
        scheme: String,
        /// The cargo feature that enables it.
        feature: &'static str,
    },
    /// The store refused to open.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// `did you mean `postgres://`? ` for a scheme one or two edits away from a known one.
fn did_you_mean(scheme: &str) -> String {
    SUPPORTED_SCHEMES
        .iter()
        .chain(&[("rediss", "redis")])
        .map(|(s, _)| (edit_distance(scheme, s), *s))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, s)| format!("did you mean `{s}://`? "))
        .unwrap_or_default()
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

fn list_schemes() -> String {
    SUPPORTED_SCHEMES
        .iter()
        .map(|(s, _)| format!("{s}://"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Opens the dedup store a URL names, running its migrations.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let err = idemq::open_store("cassandra://db1/ks").await.err().unwrap();
/// assert!(err.to_string().contains("unknown store URL scheme `cassandra`"));
/// let mem = idemq::open_store("memory://").await.unwrap();
/// # let _ = mem;
/// # });
/// ```
pub async fn open_store(url: &str) -> Result<Arc<dyn DedupStore>, OpenStoreError> {
    let scheme = url
        .split_once(':')
        .map(|(s, _)| s.to_ascii_lowercase())
        .filter(|s| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'-')
        })
        .ok_or_else(|| OpenStoreError::NotAUrl(idemq_core::secrets::redact_url(url)))?;
    // Unused when every store feature is on.
    #[allow(unused_variables)]
    let disabled = |feature| OpenStoreError::FeatureDisabled {
        scheme: scheme.clone(),
        feature,
    };
    match scheme.as_str() {
        "memory" => Ok(Arc::new(MemoryStore::new())),
        "sqlite" => {
            #[cfg(feature = "sqlite")]
            {
                let s = idemq_sql::SqliteStore::connect(url, Default::default()).await?;
                Ok(Arc::new(s))
            }
            #[cfg(not(feature = "sqlite"))]
            Err(disabled("sqlite"))
        }
        "postgres" | "postgresql" => {
            #[cfg(feature = "postgres")]
            {
                let s = idemq_sql::PgStore::connect(url, Default::default()).await?;
                Ok(Arc::new(s))
            }
            #[cfg(not(feature = "postgres"))]
            Err(disabled("postgres"))
        }
        "mysql" | "mariadb" => {
            #[cfg(feature = "mysql")]
            {
                let url = url.replacen("mariadb:", "mysql:", 1);
                let s = idemq_sql::MySqlStore::connect(&url, Default::default()).await?;
                Ok(Arc::new(s))
            }
            #[cfg(not(feature = "mysql"))]
            Err(disabled("mysql"))
        }
        "redis" | "rediss" | "redis+cluster" => {
            #[cfg(feature = "redis")]
            {
                let s = idemq_redis::RedisStore::connect(url, Default::default()).await?;
                Ok(Arc::new(s))
            }
            #[cfg(not(feature = "redis"))]
            Err(disabled("redis"))
        }
        "nats-kv" => {
            #[cfg(feature = "nats-kv")]
            {
                let s = idemq_nats_kv::NatsKvStore::connect(url, Default::default()).await?;
                Ok(Arc::new(s))
            }
            #[cfg(not(feature = "nats-kv"))]
            Err(disabled("nats-kv"))
        }
        _ => Err(OpenStoreError::UnknownScheme { scheme }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_unknown_scheme_names_the_scheme_and_the_supported_ones() {
        let e = open_store("mongodb://localhost/x")
            .await
            .err()
            .expect("error");
        assert!(matches!(e, OpenStoreError::UnknownScheme { ref scheme } if scheme == "mongodb"));
        let msg = e.to_string();
        assert!(
            msg.contains("mongodb") && msg.contains("sqlite://") && msg.contains("redis://"),
            "{msg}"
        );
    }

    #[tokio::test]
    async fn a_misspelt_scheme_gets_a_suggestion() {
        let msg = open_store("postgress://u:secret@localhost/db")
            .await
            .err()
            .expect("error")
            .to_string();
        assert!(msg.contains("did you mean `postgres://`?"), "{msg}");
        assert!(!msg.contains("secret"), "{msg}");
        let far = open_store("cassandra://x").await.err().expect("error");
        assert!(!far.to_string().contains("did you mean"), "{far}");
    }

    #[tokio::test]
    async fn text_without_a_scheme_is_not_a_url() {
        for bad in ["", "idemq.db", ":nothing", "/tmp/x.db"] {
            assert!(
                matches!(open_store(bad).await, Err(OpenStoreError::NotAUrl(_))),
                "{bad:?}"
            );
        }
    }

    #[tokio::test]
    async fn memory_and_sqlite_open() {
        assert!(open_store("memory://").await.is_ok());
        #[cfg(feature = "sqlite")]
        assert!(open_store("sqlite::memory:").await.is_ok());
    }
}
