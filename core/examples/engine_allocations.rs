//! The engine's per-message cost over the in-memory broker and store, next to the bare
//! poll + ack loop, measured in one run: messages per second and heap allocations per
//! message (counted by a wrapping global allocator, so the allocation figures are exact
//! and do not depend on the machine's load; the rates do).
//!
//! ```text
//! cargo run --release -p idemq-core --example engine_allocations [MESSAGES] [ROUNDS] [engine]
//! ```
//!
//! Profiling: build with `CARGO_PROFILE_RELEASE_DEBUG=line-tables-only` and run under
//! `perf record --call-graph dwarf` or `heaptrack`.

use idemq_core::broker::MemoryBroker;
use idemq_core::{
    BrokerKind, ClaimedMessage, ConsumerConfig, DedupStore, Envelope, HandlerError,
    IdempotentConsumer, KeyStrategy, MemoryStore, Source,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

/// Counts allocations (and reallocations) and hands them to the system allocator.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call forwards to `System` with the caller's own arguments.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const BATCH: usize = 256;

fn fill(n: usize) -> MemoryBroker {
    let broker = MemoryBroker::new();
    for i in 0..n {
        broker.publish(
            Envelope::new(BrokerKind::MEMORY, "bench", format!("payload {i}"))
                .with_header("k", format!("m-{i}")),
        );
    }
    broker
}

/// Runs `f` and returns (messages/s, allocations per message).
async fn measure<F, Fut>(n: usize, f: F) -> Result<(f64, f64), Box<dyn std::error::Error>>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<(), Box<dyn std::error::Error>>>,
{
    let before = ALLOCATIONS.load(Relaxed);
    let started = Instant::now();
    f().await?;
    let rate = n as f64 / started.elapsed().as_secs_f64().max(1e-9);
    let per_message = (ALLOCATIONS.load(Relaxed) - before) as f64 / n as f64;
    Ok((rate, per_message))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let n: usize = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(200_000);
    let rounds: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(3);
    // `engine` skips the bare loop, so that a profile holds the engine's path only.
    let engine_only = args.next().as_deref() == Some("engine");
    for round in 1..=rounds {
        let (bare, bare_allocs) = if engine_only {
            (f64::NAN, f64::NAN)
        } else {
            let broker = fill(n);
            let mut source = broker.subscribe();
            measure(n, || async move {
                while let Some(batch) = source.poll(BATCH).await? {
                    for d in batch {
                        d.ack().await?;
                    }
                }
                Ok(())
            })
            .await?
        };

        let broker = fill(n);
        let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
        let consumer = IdempotentConsumer::new(
            store,
            KeyStrategy::header("bench", "k")?,
            |_m: ClaimedMessage| async move { Ok::<_, HandlerError>(None) },
        )
        .with_config(ConsumerConfig {
            max_batch: BATCH,
            ..ConsumerConfig::default()
        });
        let (engine, engine_allocs) = measure(n, || async {
            consumer.run_until_idle(&mut broker.subscribe()).await?;
            Ok(())
        })
        .await?;
        println!(
            "round {round}: bare {bare:>9.0} msgs/s {bare_allocs:>5.1} allocs/msg | \
             engine + memory store {engine:>9.0} msgs/s {engine_allocs:>5.1} allocs/msg | \
             {:.2}x of bare",
            engine / bare
        );
    }
    Ok(())
}
