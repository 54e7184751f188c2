//! Operations over every record of the store's prefix: `stats`, `list_stuck`,
//! `purge_expired`.
//!
//! Cost: the bucket's `keys()` (an ordered consumer delivering the headers of the latest
//! entry of **every** key in the bucket, other prefixes included), then one leader read per
//! key of this prefix, `max_concurrency` at a time. For operators and dashboards, not the
//! message path: O(keys in the bucket) messages and O(keys of the prefix) requests.

use crate::kv::Slot;
use crate::store::{NatsKvStore, MARKER_TTL};
use futures::{StreamExt, TryStreamExt};
use idemq_core::store::duration_ms;
use idemq_core::{DedupRecord, RecordStatus, StoreError, StoreStats};
use std::time::Duration;

/// Every record under the store's prefix, with its revision.
async fn records(store: &NatsKvStore) -> Result<Vec<(String, u64, DedupRecord)>, StoreError> {
    let inner = store.inner();
    let unavailable = |e: &dyn std::fmt::Display| {
        StoreError::Unavailable(format!(
            "cannot list the keys of NATS KV bucket `{}`: {e}",
            inner.opts.bucket
        ))
    };
    let keys: Vec<String> = inner
        .bucket
        .kv
        .keys()
        .await
        .map_err(|e| unavailable(&e))?
        .try_filter(|k| futures::future::ready(k.starts_with(&inner.key_prefix)))
        .try_collect()
        .await
        .map_err(|e| unavailable(&e))?;
    let slots: Vec<(String, Slot)> = futures::stream::iter(keys)
        .map(|k| async move {
            let slot = inner.bucket.read(&k).await?;
            Ok::<_, StoreError>((k, slot))
        })
        .buffered(inner.opts.max_concurrency)
        .try_collect()
        .await?;
    Ok(slots
        .into_iter()
        // A key purged or expired since it was listed holds no record.
        .filter_map(|(k, s)| s.record.map(|r| (k, s.revision, r)))
        .collect())
}

pub(crate) async fn stats(store: &NatsKvStore) -> Result<StoreStats, StoreError> {
    let recs = records(store).await?;
    let now = store.inner().now().await?;
    let mut stats = StoreStats::default();
    for (_, _, r) in &recs {
        stats.count(r, now);
    }
    Ok(stats)
}

pub(crate) async fn list_stuck(
    store: &NatsKvStore,
    stale_for: Duration,
    limit: usize,
) -> Result<Vec<DedupRecord>, StoreError> {
    let recs = records(store).await?;
    let cutoff = store
        .inner()
        .now()
        .await?
        .saturating_sub(duration_ms(stale_for));
    let mut v: Vec<DedupRecord> = recs
        .into_iter()
        .map(|(_, _, r)| r)
        .filter(|r| r.status == RecordStatus::InProgress && r.lease_until_ms <= cutoff)
        .collect();
    v.sort_by(|a, b| (a.lease_until_ms, &a.key).cmp(&(b.lease_until_ms, &b.key)));
    v.truncate(limit);
    Ok(v)
}

/// Purges completed records past retention, each only at the revision judged (a record
/// claimed afresh meanwhile is left alone).
pub(crate) async fn purge_expired(store: &NatsKvStore, limit: usize) -> Result<u64, StoreError> {
    if limit == 0 {
        return Ok(0);
    }
    let recs = records(store).await?;
    let now = store.inner().now().await?;
    let doomed: Vec<(String, u64)> = recs
        .into_iter()
        .filter(|(_, _, r)| r.is_retention_expired(now))
        .take(limit)
        .map(|(k, rev, _)| (k, rev))
        .collect();
    let inner = store.inner();
    let purged: Vec<bool> = futures::stream::iter(doomed)
        .map(|(k, rev)| async move { inner.bucket.purge(&k, rev, MARKER_TTL).await })
        .buffered(inner.opts.max_concurrency)
        .try_collect()
        .await?;
    Ok(purged.into_iter().filter(|p| *p).count() as u64)
}
