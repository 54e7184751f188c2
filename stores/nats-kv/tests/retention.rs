//! Per-key TTLs (`Nats-TTL`, NATS 2.11+): on a bucket that allows them every write carries
//! one, so records leave by themselves after their lease or retention plus the grace; on a
//! bucket without them they stay until `purge_expired`.

mod support;

use idemq_core::{ClaimOutcome, ClaimRequest, ConsumerGroup, DedupKey, DedupStore};
use std::time::{Duration, Instant};
use support::*;

async fn acquire(s: &dyn DedupStore, k: &DedupKey, lease: Duration) -> idemq_core::Lease {
    match s
        .claim(&ClaimRequest::new(k.clone(), lease))
        .await
        .expect("claim")
    {
        ClaimOutcome::Acquired(l) => l,
        o => panic!("fresh key: {o:?}"),
    }
}

/// Polls `get` until the record is gone; the time it took.
async fn gone_after(s: &dyn DedupStore, k: &DedupKey, limit: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if s.get(k).await.expect("get").is_none() {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_leave_by_themselves_after_their_ttl_and_stay_without_one() {
    let Some(url) = single_url() else { return };
    let mut o = options("idemq_test_ttl", &unique_prefix("ttl"), 1);
    o.in_progress_grace = Duration::from_secs(1);
    o.completed_grace = Duration::from_secs(1);
    let s = store(&url, o).await;
    assert!(
        s.per_key_ttl(),
        "a bucket the store creates takes per-key TTLs"
    );
    let g = ConsumerGroup::new("ttl").unwrap();
    let done = DedupKey::new(&g, "done").unwrap();
    let crashed = DedupKey::new(&g, "crashed").unwrap();
    let l = acquire(&s, &done, Duration::from_secs(30)).await;
    s.complete(&done, l.token, None, Duration::from_secs(1))
        .await
        .expect("complete");
    acquire(&s, &crashed, Duration::from_secs(1)).await;
    // Retention or lease 1 s + grace 1 s: TTL 2 s; the server expires on its own schedule.
    for k in [&done, &crashed] {
        let t = gone_after(&s, k, Duration::from_secs(20)).await;
        assert!(t.is_some(), "{k} still there 20 s after its TTL of 2 s");
    }
    // The key is claimable afresh (the server left a marker, read as no record).
    assert_eq!(acquire(&s, &done, Duration::from_secs(30)).await.attempt, 1);

    // Without TTLs a completed record past retention stays until purged.
    let mut o = options("idemq_test_nottl", &unique_prefix("nottl"), 1);
    o.per_key_ttl = false;
    o.completed_grace = Duration::from_secs(1);
    let s = store(&url, o).await;
    assert!(!s.per_key_ttl());
    let kept = DedupKey::new(&g, "kept").unwrap();
    let l = acquire(&s, &kept, Duration::from_secs(30)).await;
    s.complete(&kept, l.token, None, Duration::from_millis(100))
        .await
        .expect("complete");
    assert_eq!(gone_after(&s, &kept, Duration::from_secs(4)).await, None);
    assert!(s.purge_expired(1000).await.expect("purge") >= 1);
    assert!(s.get(&kept).await.expect("get").is_none());
}
