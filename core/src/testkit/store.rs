//! The store kit: every [`DedupStore`] must pass it.
//!
//! Each case takes one or more handles to the *same* backend (for SQL and Redis stores, give
//! each handle its own connection pool, so races really cross connections). Cases use a fresh
//! random consumer group, so they can run in parallel against a shared server and leave other
//! data alone. Failures panic with a message saying which rule broke.
//!
//! The [`store_contract_tests!`](crate::store_contract_tests) macro expands to one
//! `#[tokio::test]` per case:
//!
//! ```ignore
//! idemq_core::store_contract_tests!(async {
//!     let store: std::sync::Arc<dyn idemq_core::DedupStore> = std::sync::Arc::new(idemq_core::MemoryStore::new());
//!     Some(vec![store.clone(), store])
//! });
//! ```

use crate::key::{ConsumerGroup, DedupKey};
use crate::store::{
    now_ms, ClaimOutcome, ClaimRequest, CompleteOutcome, Completion, DedupStore, ExtendOutcome,
    FencingToken, Lease, PayloadHash, RecordStatus, ReleaseOutcome, RollbackOutcome,
};
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;

/// Handles to one backend.
pub type Handles = [Arc<dyn DedupStore>];

const LONG: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_millis(400);
const RETAIN: Duration = Duration::from_secs(3600);

fn group() -> ConsumerGroup {
    let g = format!("kit-{:016x}", FencingToken::random().0);
    ConsumerGroup::new(&g).expect("generated group is valid")
}

fn key(g: &ConsumerGroup, k: &str) -> DedupKey {
    DedupKey::new(g, k).expect("test key is valid")
}

fn req(k: &DedupKey, lease: Duration) -> ClaimRequest {
    ClaimRequest::new(k.clone(), lease).with_worker("kit")
}

async fn acquire(s: &Arc<dyn DedupStore>, k: &DedupKey, lease: Duration) -> Lease {
    match s.claim(&req(k, lease)).await.expect("claim") {
        ClaimOutcome::Acquired(l) => l,
        other => panic!("claim of fresh/free key {k} must be Acquired, got {other:?}"),
    }
}

fn kind(o: &ClaimOutcome) -> &'static str {
    match o {
        ClaimOutcome::Acquired(_) => "acquired",
        ClaimOutcome::Duplicate(_) => "duplicate",
        ClaimOutcome::InFlight { .. } => "in_flight",
        ClaimOutcome::PayloadConflict(_) => "conflict",
        ClaimOutcome::RolledBack(_) => "rolled_back",
    }
}

/// N workers race for the same keys: exactly one `Acquired` per key, the rest `InFlight`.
pub async fn race_one_key_exactly_one_acquired(h: &Handles) {
    let g = group();
    let workers = 16usize;
    for round in 0..10 {
        let k = key(&g, &format!("race-{round}"));
        let barrier = Arc::new(tokio::sync::Barrier::new(workers));
        let mut tasks = Vec::new();
        for i in 0..workers {
            let s = h[i % h.len()].clone();
            let k = k.clone();
            let b = barrier.clone();
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                s.claim(&req(&k, LONG)).await
            }));
        }
        let mut acquired = 0;
        for t in tasks {
            match t.await.expect("task").expect("claim") {
                ClaimOutcome::Acquired(_) => acquired += 1,
                ClaimOutcome::InFlight { until_ms } => assert!(until_ms > now_ms()),
                other => panic!("racing claim must be Acquired or InFlight, got {other:?}"),
            }
        }
        assert_eq!(
            acquired, 1,
            "exactly one of {workers} racing workers acquires {k}"
        );
    }
}

/// Workers race batch claims over the same keys in different orders: each key acquired once.
pub async fn race_batches_exactly_one_acquired_per_key(h: &Handles) {
    let g = group();
    let keys: Vec<DedupKey> = (0..40).map(|i| key(&g, &format!("b-{i}"))).collect();
    let workers = 8usize;
    let barrier = Arc::new(tokio::sync::Barrier::new(workers));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let s = h[w % h.len()].clone();
        let mut ks = keys.clone();
        // Different orders make lock-ordering deadlocks show up.
        ks.rotate_left((w * 7) % keys.len());
        if w % 2 == 1 {
            ks.reverse();
        }
        let b = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let reqs: Vec<ClaimRequest> = ks.iter().map(|k| req(k, LONG)).collect();
            b.wait().await;
            let out = s.claim_batch(&reqs).await;
            (ks, out)
        }));
    }
    let mut wins = std::collections::HashMap::<DedupKey, usize>::new();
    for t in tasks {
        let (ks, out) = t.await.expect("task");
        let out = out.expect("claim_batch");
        assert_eq!(out.len(), ks.len(), "one outcome per request");
        for (k, o) in ks.iter().zip(out) {
            match o {
                ClaimOutcome::Acquired(_) => *wins.entry(k.clone()).or_default() += 1,
                ClaimOutcome::InFlight { .. } => {}
                other => panic!("racing batch claim of {k}: got {other:?}"),
            }
        }
    }
    for k in &keys {
        assert_eq!(wins.get(k), Some(&1), "key {k} acquired exactly once");
    }
}

/// N workers race to take over an ended lease and a completed record past retention:
/// exactly one wins each, with a live lease and the right attempt number.
pub async fn race_takeover_exactly_one_acquired(h: &Handles) {
    let g = group();
    let workers = 16usize;
    for round in 0..4 {
        let crashed = round % 2 == 0;
        let k = key(&g, &format!("takeover-{round}"));
        let l = acquire(
            &h[0],
            &k,
            Duration::from_millis(if crashed { 1 } else { LONG.as_millis() as u64 }),
        )
        .await;
        if !crashed {
            h[0].complete(&k, l.token, None, Duration::from_millis(1))
                .await
                .expect("complete");
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        let barrier = Arc::new(tokio::sync::Barrier::new(workers));
        let mut tasks = Vec::new();
        for i in 0..workers {
            let s = h[i % h.len()].clone();
            let k = k.clone();
            let b = barrier.clone();
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                s.claim(&req(&k, LONG)).await
            }));
        }
        let mut won = Vec::new();
        for t in tasks {
            match t.await.expect("task").expect("claim") {
                ClaimOutcome::Acquired(l) => won.push(l),
                ClaimOutcome::InFlight { .. } => {}
                other => panic!("racing takeover must be Acquired or InFlight, got {other:?}"),
            }
        }
        assert_eq!(
            won.len(),
            1,
            "exactly one of {workers} takes over {k}: {won:?}"
        );
        let w = won[0];
        assert!(
            w.until_ms > now_ms() + 1000,
            "the winner's lease is live: {w:?}"
        );
        assert_eq!(w.attempt, if crashed { 2 } else { 1 }, "{w:?}");
        let rec = h[0].get(&k).await.expect("get").expect("record");
        assert_eq!(rec.token, w.token);
        assert_eq!(rec.status, RecordStatus::InProgress);
        assert_eq!(
            rec.lease_until_ms, w.until_ms,
            "the stored lease is the one handed out"
        );
        assert_eq!(rec.attempts, w.attempt);
    }
}

/// An expired lease is taken over; the old holder is fenced on complete, release and extend.
pub async fn lease_expiry_takeover_and_fencing(h: &Handles) {
    let g = group();
    let k = key(&g, "crashy");
    let a = &h[0];
    let b = &h[h.len() - 1];
    let first = acquire(a, &k, SHORT).await;
    assert_eq!(first.attempt, 1);
    assert!(!first.takeover);
    match b.claim(&req(&k, SHORT)).await.expect("claim") {
        ClaimOutcome::InFlight { until_ms } => assert_eq!(until_ms, first.until_ms),
        other => panic!("live lease must answer InFlight, got {other:?}"),
    }
    tokio::time::sleep(SHORT + Duration::from_millis(250)).await;
    let second = acquire(b, &k, LONG).await;
    assert!(second.takeover, "claim after lease expiry is a takeover");
    assert_eq!(second.attempt, 2);
    assert_ne!(second.token, first.token, "a takeover gets a new token");
    assert_eq!(
        a.complete(&k, first.token, None, RETAIN)
            .await
            .expect("complete"),
        CompleteOutcome::Fenced,
        "the old holder's complete is fenced"
    );
    assert_eq!(
        a.release(&k, first.token).await.expect("release"),
        ReleaseOutcome::Fenced
    );
    assert_eq!(
        a.extend(&k, first.token, LONG).await.expect("extend"),
        ExtendOutcome::Fenced
    );
    let rec = a.get(&k).await.expect("get").expect("record exists");
    assert_eq!(
        rec.status,
        RecordStatus::InProgress,
        "fenced calls change nothing"
    );
    assert_eq!(rec.token, second.token);
    assert_eq!(
        b.complete(&k, second.token, None, RETAIN)
            .await
            .expect("complete"),
        CompleteOutcome::Completed
    );
    assert!(matches!(
        a.claim(&req(&k, LONG)).await.expect("claim"),
        ClaimOutcome::Duplicate(_)
    ));
}

/// A caller-chosen token out of `1..=i64::MAX` is refused with an error naming the range,
/// and claims nothing (the key stays free for a valid claim).
pub async fn out_of_range_tokens_are_refused(h: &Handles) {
    let g = group();
    let k = key(&g, "bad-token");
    for bad in [0, -5, i64::MIN] {
        let r = h[0]
            .claim(&req(&k, LONG).with_token(FencingToken(bad)))
            .await;
        let e = r.expect_err("a claim with an out-of-range token must be refused");
        assert!(
            e.to_string().contains("1..=i64::MAX"),
            "error must name the range: {e}"
        );
    }
    acquire(&h[0], &k, LONG).await;
}

/// A claim retried with the same token (its first reply was lost) gets back the lease it
/// holds, not `InFlight` against itself; another claimer still sees `InFlight`.
pub async fn retried_claim_with_its_token_is_idempotent(h: &Handles) {
    let g = group();
    let s = &h[0];
    let k = key(&g, "retried");
    let t = FencingToken::random();
    let first = match s.claim(&req(&k, LONG).with_token(t)).await.expect("claim") {
        ClaimOutcome::Acquired(l) => l,
        o => panic!("fresh key: {o:?}"),
    };
    assert_eq!(first.token, t, "the store acquires with the caller's token");
    match h[h.len() - 1]
        .claim(&req(&k, LONG).with_token(t))
        .await
        .expect("claim")
    {
        ClaimOutcome::Acquired(l) => {
            assert_eq!(l.token, t);
            assert_eq!(l.until_ms, first.until_ms, "the same lease, not a new one");
            assert_eq!(l.attempt, 1);
        }
        o => panic!("a retried claim with its own token must be Acquired, got {o:?}"),
    }
    // The batch form answers the same.
    let again = s
        .claim_batch(&[req(&k, LONG).with_token(t)])
        .await
        .expect("claim_batch");
    assert!(
        matches!(again[0], ClaimOutcome::Acquired(l) if l.token == t),
        "{again:?}"
    );
    assert!(matches!(
        s.claim(&req(&k, LONG).with_token(FencingToken::random()))
            .await
            .expect("claim"),
        ClaimOutcome::InFlight { .. }
    ));
    assert_eq!(
        s.complete(&k, t, None, RETAIN).await.expect("complete"),
        CompleteOutcome::Completed
    );
    assert!(
        matches!(
            s.claim(&req(&k, LONG).with_token(t)).await.expect("claim"),
            ClaimOutcome::Duplicate(_)
        ),
        "once completed, even the owner's token sees a duplicate"
    );
    // A claim retried with its token after its key was given back (a batch claim that
    // failed part-way releases what it acquired, then the engine retries with the same
    // tokens) must never hand out a lease that is not live: the handler would run without
    // holding the key.
    let k = key(&g, "retried-after-release");
    let t = FencingToken::random();
    let l = match s.claim(&req(&k, LONG).with_token(t)).await.expect("claim") {
        ClaimOutcome::Acquired(l) => l,
        o => panic!("fresh key: {o:?}"),
    };
    assert_eq!(
        s.release(&k, l.token).await.expect("release"),
        ReleaseOutcome::Released
    );
    for store in [s, &h[h.len() - 1]] {
        let again = store
            .claim_batch(&[req(&k, LONG).with_token(t)])
            .await
            .expect("claim_batch");
        if let ClaimOutcome::Acquired(l) = again[0] {
            assert!(
                l.until_ms > crate::now_ms(),
                "a retried claim after a release answered a lease that is not live: {l:?}"
            );
            let ClaimOutcome::InFlight { .. } = s
                .claim(&req(&k, LONG).with_token(FencingToken::random()))
                .await
                .expect("claim")
            else {
                panic!("the key is held again: another token must see it in flight")
            };
            break;
        }
    }
}

/// A heartbeat keeps the lease alive past its first end.
pub async fn extend_keeps_the_lease(h: &Handles) {
    let g = group();
    let k = key(&g, "long-job");
    let s = &h[0];
    let l = acquire(s, &k, SHORT).await;
    tokio::time::sleep(SHORT / 2).await;
    match s
        .extend(&k, l.token, Duration::from_secs(5))
        .await
        .expect("extend")
    {
        ExtendOutcome::Extended { until_ms } => assert!(until_ms > l.until_ms),
        other => panic!("the owner's extend must succeed: {other:?}"),
    }
    tokio::time::sleep(SHORT).await;
    assert!(
        matches!(
            h[h.len() - 1].claim(&req(&k, LONG)).await.expect("claim"),
            ClaimOutcome::InFlight { .. }
        ),
        "an extended lease is still live after the original end"
    );
}

/// A batch heartbeat answers per lease, in order: the owner's extends, a stranger's token is
/// fenced, and nothing else changes.
pub async fn extend_batch_answers_each_lease(h: &Handles) {
    let g = group();
    let (a, b) = (key(&g, "hb-a"), key(&g, "hb-b"));
    let s = &h[0];
    let la = acquire(s, &a, SHORT).await;
    let lb = acquire(s, &b, SHORT).await;
    let stranger = FencingToken::random();
    let outs = s
        .extend_batch(&[(a.clone(), la.token), (b.clone(), stranger)], LONG)
        .await
        .expect("extend_batch");
    assert_eq!(outs.len(), 2, "one outcome per lease");
    assert!(
        matches!(outs[0], ExtendOutcome::Extended { until_ms } if until_ms > la.until_ms),
        "{outs:?}"
    );
    assert_eq!(
        outs[1],
        ExtendOutcome::Fenced,
        "a stranger's token must be fenced"
    );
    tokio::time::sleep(SHORT + SHORT / 2).await;
    assert!(
        matches!(
            h[h.len() - 1].claim(&req(&a, LONG)).await.expect("claim"),
            ClaimOutcome::InFlight { .. }
        ),
        "the extended lease is live past its first end"
    );
    assert!(
        matches!(
            h[h.len() - 1].claim(&req(&b, LONG)).await.expect("claim"),
            ClaimOutcome::Acquired(_)
        ),
        "the lease a stranger tried to extend ended on time (owner {})",
        lb.token
    );
}

/// A claim given back without its handler running does not count an attempt: attempts
/// count runs, so a message held behind a failing one cannot use up its retry budget.
pub async fn an_unrun_release_takes_back_its_attempt(h: &Handles) {
    let g = group();
    let k = key(&g, "held-behind");
    let s = &h[0];
    for round in 0..3 {
        let l = acquire(s, &k, LONG).await;
        assert_eq!(
            l.attempt, 1,
            "round {round}: claims given back unrun are not attempts"
        );
        assert_eq!(
            s.release_unrun(&k, l.token).await.expect("release_unrun"),
            ReleaseOutcome::Released
        );
        assert_eq!(
            s.release_unrun(&k, l.token).await.expect("release_unrun"),
            ReleaseOutcome::Fenced,
            "a second release of the token is fenced (and takes back nothing)"
        );
    }
    // A run that failed counts; the unrun claims around it do not.
    let ran = acquire(&h[h.len() - 1], &k, LONG).await;
    assert_eq!(ran.attempt, 1);
    assert_eq!(
        s.release(&k, ran.token).await.expect("release"),
        ReleaseOutcome::Released
    );
    let held = acquire(s, &k, LONG).await;
    assert_eq!(held.attempt, 2, "one failed run before this claim");
    assert_eq!(
        s.release_unrun(&k, held.token)
            .await
            .expect("release_unrun"),
        ReleaseOutcome::Released
    );
    let next = acquire(s, &k, LONG).await;
    assert_eq!(next.attempt, 2, "still one failed run");
}

/// Release gives the key back at once; a second release with the same token is fenced.
pub async fn release_makes_the_key_claimable(h: &Handles) {
    let g = group();
    let k = key(&g, "failing");
    let s = &h[0];
    let l = acquire(s, &k, LONG).await;
    assert_eq!(
        s.release(&k, l.token).await.expect("release"),
        ReleaseOutcome::Released
    );
    // A released token owns nothing, even before anyone claims the key again.
    assert_eq!(
        s.complete(&k, l.token, None, RETAIN)
            .await
            .expect("complete"),
        CompleteOutcome::Fenced,
        "complete after release is fenced"
    );
    assert_eq!(
        s.extend(&k, l.token, LONG).await.expect("extend"),
        ExtendOutcome::Fenced,
        "extend after release is fenced"
    );
    assert_eq!(
        s.release(&k, l.token).await.expect("release"),
        ReleaseOutcome::Fenced,
        "a second release is fenced"
    );
    let again = acquire(&h[h.len() - 1], &k, LONG).await;
    assert_eq!(again.attempt, 2, "attempts count across releases");
    assert!(!again.takeover, "claiming a released key is not a takeover");
    assert_eq!(
        s.release(&k, l.token).await.expect("release"),
        ReleaseOutcome::Fenced
    );
    assert_eq!(
        s.complete(&k, l.token, None, RETAIN)
            .await
            .expect("complete"),
        CompleteOutcome::Fenced
    );
}

/// Completed records are duplicates until retention ends, then claimable afresh and purged.
pub async fn retention_expiry_and_purge(h: &Handles) {
    let g = group();
    let s = &h[0];
    let short_retain = Duration::from_millis(300);
    let mut keys = Vec::new();
    for i in 0..5 {
        let k = key(&g, &format!("old-{i}"));
        let l = acquire(s, &k, LONG).await;
        assert_eq!(
            s.complete(&k, l.token, None, short_retain)
                .await
                .expect("complete"),
            CompleteOutcome::Completed
        );
        keys.push(k);
    }
    let kept = key(&g, "kept");
    let l = acquire(s, &kept, LONG).await;
    s.complete(&kept, l.token, None, RETAIN)
        .await
        .expect("complete");
    assert!(matches!(
        s.claim(&req(&keys[0], LONG)).await.expect("claim"),
        ClaimOutcome::Duplicate(_)
    ));
    tokio::time::sleep(short_retain + Duration::from_millis(250)).await;
    // Past retention, a claim starts a new lifecycle even before a purge.
    let fresh = acquire(s, &keys[4], LONG).await;
    assert_eq!(fresh.attempt, 1, "an expired record starts over");
    // Purge works in bounded chunks.
    let first = s.purge_expired(2).await.expect("purge");
    assert!(first <= 2, "purge respects its limit (deleted {first})");
    let mut total = first;
    for _ in 0..1000 {
        let n = s.purge_expired(100).await.expect("purge");
        if n == 0 {
            break;
        }
        total += n;
    }
    assert!(
        total >= 4,
        "the 4 expired records are purged (purged {total})"
    );
    for k in &keys[..4] {
        assert!(s.get(k).await.expect("get").is_none(), "{k} purged");
    }
    assert!(
        s.get(&kept).await.expect("get").is_some(),
        "unexpired record kept"
    );
    assert!(
        s.get(&keys[4]).await.expect("get").is_some(),
        "re-acquired record not purged"
    );
}

/// A key rolled back by the token that owns it refuses every claim (whatever its payload,
/// batched or not) until its retention ends, fences its former holder's completion, answers
/// a repeat with the same token `RolledBack` and a stale token `Fenced`; past retention it is
/// claimed afresh and purged.
pub async fn rolled_back_keys_refuse_claims_until_retention_ends(h: &Handles) {
    let g = group();
    let (s, other) = (&h[0], &h[h.len() - 1]);
    let short_retain = Duration::from_millis(400);
    // The check-back's path: the local transaction's lease ended, the check-back took the key
    // over (fencing it) and rolls it back.
    let k = key(&g, "dropped");
    let late = acquire(s, &k, SHORT).await;
    tokio::time::sleep(SHORT + Duration::from_millis(100)).await;
    let check = acquire(other, &k, LONG).await;
    assert!(check.takeover, "an ended lease is taken over");
    assert_eq!(
        other
            .roll_back(&k, late.token, RETAIN)
            .await
            .expect("roll_back"),
        RollbackOutcome::Fenced,
        "a token taken over cannot roll the key back"
    );
    assert_eq!(
        other
            .roll_back(&k, check.token, short_retain)
            .await
            .expect("roll_back"),
        RollbackOutcome::RolledBack
    );
    assert_eq!(
        other
            .roll_back(&k, check.token, short_retain)
            .await
            .expect("roll_back again"),
        RollbackOutcome::RolledBack,
        "a repeat with the same token (its first reply lost) is answered the same"
    );
    assert_eq!(
        s.complete(&k, late.token, None, RETAIN)
            .await
            .expect("complete"),
        CompleteOutcome::Fenced,
        "the late holder's completion after the roll-back"
    );
    assert_eq!(
        s.complete(&k, check.token, None, RETAIN)
            .await
            .expect("complete"),
        CompleteOutcome::Fenced,
        "a rolled-back key cannot be completed, even by the token that rolled it back"
    );
    assert_eq!(
        s.release(&k, check.token).await.expect("release"),
        ReleaseOutcome::Fenced,
        "a rolled-back key cannot be released"
    );
    let hashed = req(&k, LONG).with_payload_hash(PayloadHash::of(b"other"));
    for (what, r) in [
        ("claim", req(&k, LONG)),
        ("claim with a payload hash", hashed),
    ] {
        match s.claim(&r).await.expect("claim") {
            ClaimOutcome::RolledBack(rec) => {
                assert_eq!(rec.status, RecordStatus::RolledBack, "{what}");
                assert!(
                    rec.expires_ms.is_some(),
                    "{what}: a rolled-back record expires"
                );
            }
            o => panic!("{what} of a rolled-back key: {} ({o:?})", kind(&o)),
        }
    }
    let fresh = key(&g, "fresh-beside");
    let batch = s
        .claim_batch(&[req(&fresh, LONG), req(&k, LONG)])
        .await
        .expect("claim_batch");
    assert_eq!(
        batch.iter().map(kind).collect::<Vec<_>>(),
        ["acquired", "rolled_back"],
        "a batch answers a rolled-back key as the single claim does"
    );
    let rec = s.get(&k).await.expect("get").expect("the record is kept");
    assert_eq!(rec.status, RecordStatus::RolledBack);
    // A key nobody held (the check-back before a local transaction that never ran here).
    let never = key(&g, "never-claimed");
    let check = acquire(other, &never, LONG).await;
    assert_eq!(
        other
            .roll_back(&never, check.token, RETAIN)
            .await
            .expect("roll_back"),
        RollbackOutcome::RolledBack
    );
    assert!(matches!(
        s.claim(&req(&never, LONG)).await.expect("claim"),
        ClaimOutcome::RolledBack(_)
    ));
    // Past its retention the key starts a new lifecycle, and a purge deletes what is left.
    tokio::time::sleep(short_retain + Duration::from_millis(300)).await;
    let again = acquire(s, &k, LONG).await;
    assert_eq!(
        again.attempt, 1,
        "an expired rolled-back record starts over"
    );
    let gone = key(&g, "purged");
    let l = acquire(s, &gone, LONG).await;
    s.roll_back(&gone, l.token, Duration::from_millis(50))
        .await
        .expect("roll_back");
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..1000 {
        if s.purge_expired(100).await.expect("purge") == 0 {
            break;
        }
    }
    assert!(
        s.get(&gone).await.expect("get").is_none(),
        "an expired rolled-back record is purged"
    );
    assert!(
        s.get(&never).await.expect("get").is_some(),
        "a rolled-back record within retention is kept"
    );
}

/// The same key with a different payload is reported, not skipped.
pub async fn payload_conflict_is_reported(h: &Handles) {
    let g = group();
    let k = key(&g, "collide");
    let s = &h[0];
    let a = PayloadHash::of(b"{\"amount\":10}");
    let b = PayloadHash::of(b"{\"amount\":99}");
    let l = match s
        .claim(&req(&k, LONG).with_payload_hash(a))
        .await
        .expect("claim")
    {
        ClaimOutcome::Acquired(l) => l,
        o => panic!("fresh key: {o:?}"),
    };
    match s
        .claim(&req(&k, LONG).with_payload_hash(b))
        .await
        .expect("claim")
    {
        ClaimOutcome::PayloadConflict(r) => assert_eq!(r.payload_hash, Some(a)),
        o => panic!("different payload while in flight must be a conflict, got {o:?}"),
    }
    s.complete(&k, l.token, None, RETAIN)
        .await
        .expect("complete");
    assert!(matches!(
        s.claim(&req(&k, LONG).with_payload_hash(b))
            .await
            .expect("claim"),
        ClaimOutcome::PayloadConflict(_)
    ));
    assert!(matches!(
        s.claim(&req(&k, LONG).with_payload_hash(a))
            .await
            .expect("claim"),
        ClaimOutcome::Duplicate(_)
    ));
    assert!(matches!(
        s.claim(&req(&k, LONG)).await.expect("claim"),
        ClaimOutcome::Duplicate(_)
    ));
    // After a failure (release) or a crash (lease ended), a corrected resend with another
    // payload is acquired, not stuck behind the failed attempt's hash.
    for crash in [false, true] {
        let k = key(
            &g,
            if crash {
                "fixed-after-crash"
            } else {
                "fixed-after-failure"
            },
        );
        let lease = if crash {
            Duration::from_millis(1)
        } else {
            LONG
        };
        let first = match s
            .claim(&req(&k, lease).with_payload_hash(a))
            .await
            .expect("claim")
        {
            ClaimOutcome::Acquired(l) => l,
            o => panic!("fresh key: {o:?}"),
        };
        if crash {
            tokio::time::sleep(Duration::from_millis(20)).await;
        } else {
            s.release(&k, first.token).await.expect("release");
        }
        match s
            .claim(&req(&k, LONG).with_payload_hash(b))
            .await
            .expect("claim")
        {
            ClaimOutcome::Acquired(l) => assert_eq!(l.attempt, 2),
            o => panic!(
                "corrected resend after {} must be acquired, got {o:?}",
                if crash { "a crash" } else { "a failure" }
            ),
        }
        let rec = s.get(&k).await.expect("get").expect("record");
        assert_eq!(rec.payload_hash, Some(b), "the new attempt's hash is kept");
    }
}

/// The stored result comes back with the duplicate; completion is idempotent for its token.
pub async fn stored_result_is_returned(h: &Handles) {
    let g = group();
    let s = &h[0];
    let k = key(&g, "with-result");
    let l = acquire(s, &k, LONG).await;
    let receipt = Bytes::from_static(b"receipt-7\x00\xff");
    // The second call is the retry of a call whose reply was lost: it changes nothing and
    // says so, so that a caller's transaction repeating the effect knows to roll back.
    for want in [
        CompleteOutcome::Completed,
        CompleteOutcome::AlreadyCompleted,
    ] {
        assert_eq!(
            s.complete(&k, l.token, Some(receipt.clone()), RETAIN)
                .await
                .expect("complete"),
            want,
            "complete is idempotent for the owning token, and a repeat says it was done before"
        );
    }
    match h[h.len() - 1].claim(&req(&k, LONG)).await.expect("claim") {
        ClaimOutcome::Duplicate(r) => {
            assert_eq!(r.result, Some(receipt));
            assert_eq!(r.status, RecordStatus::Completed);
            assert_eq!(r.token, l.token);
            assert!(r.completed_ms.is_some());
            assert!(r.expires_ms.is_some());
            assert_eq!(r.worker.as_deref(), Some("kit"));
        }
        o => panic!("expected Duplicate with result, got {o:?}"),
    }
    let k2 = key(&g, "no-result");
    let l2 = acquire(s, &k2, LONG).await;
    s.complete(&k2, l2.token, None, RETAIN)
        .await
        .expect("complete");
    match s.claim(&req(&k2, LONG)).await.expect("claim") {
        ClaimOutcome::Duplicate(r) => assert_eq!(r.result, None),
        o => panic!("expected Duplicate, got {o:?}"),
    }
}

/// A batch answers exactly what single claims answer, key by key, and completes in batch.
pub async fn batch_claims_equal_single_claims(h: &Handles) {
    let s = &h[0];
    let pa = PayloadHash::of(b"a");
    let pb = PayloadHash::of(b"b");
    // Two identical worlds: one probed key by key, one by a single batch.
    let mut answers = Vec::new();
    for _world in 0..2 {
        let g = group();
        let k = |n: &str| key(&g, n);
        let fresh = k("fresh");
        let l = acquire(s, &k("done"), LONG).await;
        s.complete(&k("done"), l.token, Some(Bytes::from_static(b"r")), RETAIN)
            .await
            .expect("complete");
        acquire(s, &k("busy"), LONG).await;
        acquire(s, &k("crashed"), Duration::from_millis(1)).await;
        let l = match s
            .claim(&req(&k("conflict"), LONG).with_payload_hash(pa))
            .await
            .expect("claim")
        {
            ClaimOutcome::Acquired(l) => l,
            o => panic!("{o:?}"),
        };
        s.complete(&k("conflict"), l.token, None, RETAIN)
            .await
            .expect("complete");
        answers.push((g, fresh));
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let names = ["fresh", "done", "busy", "crashed", "conflict"];
    let mk = |g: &ConsumerGroup| -> Vec<ClaimRequest> {
        names
            .iter()
            .map(|n| {
                let r = req(&key(g, n), LONG);
                if *n == "conflict" {
                    r.with_payload_hash(pb)
                } else {
                    r
                }
            })
            .collect()
    };
    let singles_reqs = mk(&answers[0].0);
    let mut singles = Vec::new();
    for r in &singles_reqs {
        singles.push(s.claim(r).await.expect("claim"));
    }
    let batch_reqs = mk(&answers[1].0);
    let batch = h[h.len() - 1]
        .claim_batch(&batch_reqs)
        .await
        .expect("claim_batch");
    let sk: Vec<_> = singles.iter().map(kind).collect();
    let bk: Vec<_> = batch.iter().map(kind).collect();
    assert_eq!(
        sk,
        ["acquired", "duplicate", "in_flight", "acquired", "conflict"]
    );
    assert_eq!(bk, sk, "batch claims answer what single claims answer");
    if let (ClaimOutcome::Duplicate(a), ClaimOutcome::Duplicate(b)) = (&singles[1], &batch[1]) {
        assert_eq!(a.result, b.result);
    }
    if let ClaimOutcome::Acquired(l) = &batch[3] {
        assert!(l.takeover && l.attempt == 2, "batch takeover: {l:?}");
    }
    // Batch completion: owners complete, a stranger token is fenced.
    let mut items = Vec::new();
    for (r, o) in batch_reqs.iter().zip(&batch) {
        if let ClaimOutcome::Acquired(l) = o {
            items.push(Completion {
                key: r.key.clone(),
                token: l.token,
                result: None,
                retention: RETAIN,
            });
        }
    }
    items.push(Completion {
        key: batch_reqs[2].key.clone(),
        token: FencingToken::random(),
        result: None,
        retention: RETAIN,
    });
    let done = s.complete_batch(&items).await.expect("complete_batch");
    assert_eq!(
        done,
        vec![
            CompleteOutcome::Completed,
            CompleteOutcome::Completed,
            CompleteOutcome::Fenced
        ]
    );
    // The same batch again (its first reply lost): the keys it completed say so.
    let again = s
        .complete_batch(&items)
        .await
        .expect("complete_batch again");
    assert_eq!(
        again,
        vec![
            CompleteOutcome::AlreadyCompleted,
            CompleteOutcome::AlreadyCompleted,
            CompleteOutcome::Fenced
        ]
    );
    // A batch naming a key twice is refused rather than answered by order.
    let twice = vec![req(&answers[1].1, LONG), req(&answers[1].1, LONG)];
    assert!(s.claim_batch(&twice).await.is_err());
    assert!(s.claim_batch(&[]).await.expect("empty batch").is_empty());
}

/// Abandoned in-progress records are listed for operators and can be forgotten by hand.
pub async fn stuck_records_are_listed_and_forgettable(h: &Handles) {
    let g = group();
    let s = &h[0];
    let k = key(&g, "abandoned");
    acquire(s, &k, Duration::from_millis(50)).await;
    let live = key(&g, "alive");
    acquire(s, &live, LONG).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stuck = s
        .list_stuck(Duration::from_millis(100), 100_000)
        .await
        .expect("list_stuck");
    assert!(stuck.iter().any(|r| r.key == k), "abandoned key listed");
    assert!(!stuck.iter().any(|r| r.key == live), "live key not listed");
    assert!(s.forget(&k).await.expect("forget"));
    assert!(!s.forget(&k).await.expect("forget"));
    assert!(s.get(&k).await.expect("get").is_none());
    assert_eq!(acquire(s, &k, LONG).await.attempt, 1);
}

/// `stats` counts each state on a store that holds nothing else (call it with a fresh
/// store: an empty table or prefix; the contract cases share theirs and run concurrently).
pub async fn stats_count_records_by_state(s: &Arc<dyn DedupStore>) {
    let g = group();
    let empty = s.stats().await.expect("stats");
    assert_eq!(empty.total(), 0, "a fresh store holds nothing: {empty:?}");
    acquire(s, &key(&g, "live"), LONG).await;
    acquire(s, &key(&g, "abandoned"), Duration::from_millis(50)).await;
    let released = key(&g, "released");
    let l = acquire(s, &released, LONG).await;
    s.release(&released, l.token).await.expect("release");
    let done = key(&g, "done");
    let l = acquire(s, &done, LONG).await;
    s.complete(&done, l.token, None, RETAIN)
        .await
        .expect("complete");
    let expired = key(&g, "expired");
    let l = acquire(s, &expired, LONG).await;
    s.complete(&expired, l.token, None, Duration::from_millis(50))
        .await
        .expect("complete");
    let dropped = key(&g, "rolled-back");
    let l = acquire(s, &dropped, LONG).await;
    s.roll_back(&dropped, l.token, RETAIN)
        .await
        .expect("roll_back");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stats = s.stats().await.expect("stats");
    assert_eq!(
        (
            stats.in_progress,
            stats.abandoned,
            stats.completed,
            stats.rolled_back
        ),
        (1, 2, 1, 1),
        "live; abandoned + released; done; rolled back: {stats:?}"
    );
    // A store whose records expire by themselves (Redis TTLs) may have dropped it already.
    assert!(stats.expired <= 1, "{stats:?}");
    s.purge_expired(100).await.expect("purge");
    let after = s.stats().await.expect("stats");
    assert_eq!((after.expired, after.total()), (0, 5), "{after:?}");
}

/// Runs every case in sequence (handy outside the macro).
pub async fn run_all(h: &Handles) {
    race_one_key_exactly_one_acquired(h).await;
    race_batches_exactly_one_acquired_per_key(h).await;
    race_takeover_exactly_one_acquired(h).await;
    lease_expiry_takeover_and_fencing(h).await;
    retried_claim_with_its_token_is_idempotent(h).await;
    extend_keeps_the_lease(h).await;
    release_makes_the_key_claimable(h).await;
    retention_expiry_and_purge(h).await;
    payload_conflict_is_reported(h).await;
    rolled_back_keys_refuse_claims_until_retention_ends(h).await;
    stored_result_is_returned(h).await;
    batch_claims_equal_single_claims(h).await;
    stuck_records_are_listed_and_forgettable(h).await;
}

/// Expands to one `#[tokio::test]` per contract case. The argument is an async expression
/// yielding `Option<Vec<Arc<dyn DedupStore>>>`: handles to one backend, or `None` to skip
/// when its server is not configured (make that a failure in CI).
#[macro_export]
macro_rules! store_contract_tests {
    ($handles:expr) => {
        $crate::store_contract_tests!(@case $handles;
            race_one_key_exactly_one_acquired,
            race_batches_exactly_one_acquired_per_key,
            race_takeover_exactly_one_acquired,
            lease_expiry_takeover_and_fencing,
            retried_claim_with_its_token_is_idempotent,
            out_of_range_tokens_are_refused,
            extend_keeps_the_lease,
            extend_batch_answers_each_lease,
            release_makes_the_key_claimable,
            an_unrun_release_takes_back_its_attempt,
            retention_expiry_and_purge,
            payload_conflict_is_reported,
            rolled_back_keys_refuse_claims_until_retention_ends,
            stored_result_is_returned,
            batch_claims_equal_single_claims,
            stuck_records_are_listed_and_forgettable);
    };
    (@case $handles:expr; $($name:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                let handles: Option<Vec<std::sync::Arc<dyn $crate::DedupStore>>> = $handles.await;
                if let Some(h) = handles {
                    $crate::testkit::store::$name(&h).await;
                }
            }
        )*
    };
}
