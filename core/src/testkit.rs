//! Conformance kits and test helpers (feature `testkit`): one kit per seam.
//!
//! - [`store`]: every [`DedupStore`](crate::DedupStore) passes it
//!   ([`store_contract_tests!`](crate::store_contract_tests));
//! - [`source`]: every broker adapter's [`Source`](crate::Source) passes it against its real
//!   broker ([`source_contract_tests!`](crate::source_contract_tests));
//! - [`ready`]: bounded waits for a server node to be ready before a test acts on it (a
//!   Redis node still loading its dataset, a JetStream replica not yet current);
//! - [`servers`]: a test's server URL, or a recorded skip; [`fuzz`]: wire-shaped random bytes
//!   and text; [`process`], [`switchable`], [`clock_skew`]: helpers for crash, outage and
//!   clock-skew tests; [`storm`]: keys claimed and completed while a server is disrupted;
//!   [`reply_cut`]: a TCP proxy that loses exactly the reply to one request (the ambiguous
//!   outcome every retry must be safe for);
//! - [`toxiproxy`]: a client for Toxiproxy's API, for byte- and time-based network faults
//!   (latency, half-open links, resets, replies cut after N bytes, partitions).

pub mod fuzz;
pub mod process;
pub mod ready;
pub mod reply_cut;
pub mod servers;
pub mod source;
pub mod store;
pub mod storm;
pub mod switchable;
pub mod toxiproxy;

/// The clock-skew scenario, shared by the SQL and Redis stores' tests.
pub mod clock_skew {
    use crate::store::set_test_clock_skew_ms;
    use crate::{
        ClaimOutcome, ClaimRequest, CompleteOutcome, DedupKey, DedupStore, ExtendOutcome,
        FencingToken, Lease,
    };
    use std::time::Duration;

    /// Process-wide clock skew for the client side, reset on drop (even when a check panics).
    struct Skew;

    impl Skew {
        fn set(ms: i64) -> Self {
            set_test_clock_skew_ms(ms);
            Skew
        }
    }

    impl Drop for Skew {
        fn drop(&mut self) {
            set_test_clock_skew_ms(0);
        }
    }

    const HOUR_MS: i64 = 3_600_000;

    fn key(tag: &str, name: &str) -> DedupKey {
        let g = crate::ConsumerGroup::new(&format!("skew-{tag}-{}", FencingToken::random()))
            .expect("valid group");
        DedupKey::new(&g, name).expect("valid key")
    }

    async fn claim(store: &dyn DedupStore, k: &DedupKey, lease_ms: u64) -> ClaimOutcome {
        store
            .claim(&ClaimRequest::new(
                k.clone(),
                Duration::from_millis(lease_ms),
            ))
            .await
            .expect("claim")
    }

    fn acquired(o: &ClaimOutcome, what: &str) -> Lease {
        match o {
            ClaimOutcome::Acquired(l) => *l,
            other => panic!("{what}: expected Acquired, got {other:?}"),
        }
    }

    fn in_flight(o: &ClaimOutcome, what: &str) {
        assert!(
            matches!(o, ClaimOutcome::InFlight { .. }),
            "{what}: expected InFlight, got {o:?}"
        );
    }

    /// A client whose clock is an hour ahead or behind neither takes over a live lease nor sees a
    /// dead one as live, whatever it does (claim, extend, complete, list_stuck).
    /// A client whose clock runs an hour ahead or behind neither takes over a live lease nor sees
    /// a dead one as live, for stores that decide leases on their own clock (SQL, Redis; not the
    /// memory store, whose clock *is* the client's). The skew is process-wide
    /// ([`set_test_clock_skew_ms`]): run it alone in its test binary. `tag` names the store in
    /// failure messages and keys.
    pub async fn skewed_clients_agree_on_leases(store: &dyn DedupStore, tag: &str) {
        let short = 300u64;
        let pause = Duration::from_millis(700);
        for skew in [HOUR_MS, -HOUR_MS] {
            let tag = format!("{tag}{}", if skew > 0 { "-ahead" } else { "-behind" });
            // A live lease taken by a correct clock is not taken over by the skewed one.
            let live = key(&tag, "live");
            acquired(&claim(store, &live, 30_000).await, "correct client claims");
            {
                let _s = Skew::set(skew);
                in_flight(
                    &claim(store, &live, 30_000).await,
                    "skewed client on a live lease",
                );
                let stuck = store
                    .list_stuck(Duration::ZERO, 10_000)
                    .await
                    .expect("list_stuck");
                assert!(
                    stuck.iter().all(|r| r.key != live),
                    "skewed client lists a live lease as stuck"
                );
            }
            // A dead lease is taken over by the skewed client.
            let dead = key(&tag, "dead");
            acquired(&claim(store, &dead, short).await, "correct client claims");
            tokio::time::sleep(pause).await;
            {
                let _s = Skew::set(skew);
                let l = acquired(
                    &claim(store, &dead, 30_000).await,
                    "skewed client on a dead lease",
                );
                assert!(l.takeover, "an ended lease is a takeover: {l:?}");
            }
            // A lease the skewed client takes lives as long as asked, no more, no less.
            let mine = key(&tag, "mine");
            {
                let _s = Skew::set(skew);
                acquired(&claim(store, &mine, short).await, "skewed client claims");
            }
            in_flight(
                &claim(store, &mine, 30_000).await,
                "correct client right after",
            );
            tokio::time::sleep(pause).await;
            let l = acquired(
                &claim(store, &mine, 30_000).await,
                "correct client after the lease",
            );
            assert!(l.takeover, "{l:?}");
            // A heartbeat from the skewed client keeps its lease alive, on the store's clock.
            let beat = key(&tag, "beat");
            let tok = {
                let _s = Skew::set(skew);
                let l = acquired(&claim(store, &beat, short).await, "skewed client claims");
                let ext = store
                    .extend(&beat, l.token, Duration::from_millis(30_000))
                    .await
                    .expect("extend");
                assert!(
                    matches!(ext, ExtendOutcome::Extended { .. }),
                    "skewed heartbeat: {ext:?}"
                );
                l.token
            };
            tokio::time::sleep(pause).await;
            in_flight(
                &claim(store, &beat, 30_000).await,
                "heartbeated lease of a skewed client",
            );
            // Its completion is kept for the retention asked, on the store's clock.
            {
                let _s = Skew::set(skew);
                let done = store
                    .complete(&beat, tok, None, Duration::from_millis(short))
                    .await
                    .expect("complete");
                assert_eq!(done, CompleteOutcome::Completed);
            }
            assert!(
                matches!(
                    claim(store, &beat, 30_000).await,
                    ClaimOutcome::Duplicate(_)
                ),
                "completed by a skewed client: duplicate within retention"
            );
            tokio::time::sleep(pause).await;
            let l = acquired(&claim(store, &beat, 30_000).await, "retention over");
            assert_eq!(l.attempt, 1, "a fresh lifecycle after retention: {l:?}");
        }
    }
}
