//! Business ids for producers that have none: Snowflake-style 64-bit ids (milliseconds since
//! an epoch, a worker id, a per-millisecond sequence) that never repeat and never go
//! backwards, even when the wall clock does.
//!
//! A dedup key must name the business event, and a producer without a natural id (an order
//! number, a payment id) has to mint one *once*, before the first send, and resend with the
//! same id. A fingerprint of the payload plus a timestamp is not that: when the clock stepped
//! back (NTP, a VM migration), two different events got the same fingerprint and the second
//! was dropped as a duplicate. [`SnowflakeIds`] refuses to hand out an id older than the last
//! one: it waits out a small step back and fails with [`IdError::ClockWentBackwards`] past
//! that, so a skewed clock costs a retry, never a collision.
//!
//! Layout (the common one): 1 sign bit (0), 41 bits of milliseconds since `epoch_ms` (~69
//! years), 10 bits of worker id (0–1023, unique per live producer), 12 bits of sequence
//! (4096 ids per millisecond per worker; the 4097th waits for the next millisecond).

use std::sync::{Arc, Mutex};
use std::time::Duration;

const WORKER_BITS: u32 = 10;
const SEQUENCE_BITS: u32 = 12;
const TIME_BITS: u32 = 41;
/// The largest worker id.
pub const MAX_WORKER: u16 = (1 << WORKER_BITS) - 1;
const MAX_SEQUENCE: u16 = (1 << SEQUENCE_BITS) - 1;

/// Why no id was handed out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdError {
    /// The worker id does not fit in 10 bits.
    #[error("worker id {0} is out of range: use 0..={MAX_WORKER}, one per live producer")]
    WorkerOutOfRange(u16),
    /// The clock is before the epoch, or so far after it that 41 bits no longer hold it.
    #[error("clock at {now_ms} ms is outside the id range of epoch {epoch_ms} ms (41 bits of milliseconds)")]
    ClockOutOfRange {
        /// The clock's reading.
        now_ms: u64,
        /// The generator's epoch.
        epoch_ms: u64,
    },
    /// The clock stepped back further than the generator waits: handing out an id now could
    /// repeat one already given. Retry later; fix the clock if it persists.
    #[error("the clock went back {} ms (now {now_ms} ms, last id at {last_ms} ms); refusing to hand out an id that could repeat one", last_ms - now_ms)]
    ClockWentBackwards {
        /// The clock's reading.
        now_ms: u64,
        /// The millisecond of the last id handed out.
        last_ms: u64,
    },
}

/// A clock in milliseconds since the Unix epoch.
pub type MillisClock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// Snowflake-style id generator; see the [module](self) docs. Cheap to share (`Arc`), safe
/// to call from many threads.
///
/// ```
/// use idemq_core::idgen::SnowflakeIds;
///
/// let ids = SnowflakeIds::new(7).unwrap();
/// let (a, b) = (ids.next_id().unwrap(), ids.next_id().unwrap());
/// assert!(b > a);
/// assert_eq!(SnowflakeIds::parts(b, ids.epoch_ms()).1, 7);
/// // The dedup key of a message the producer resends with the same id:
/// let key = format!("order-{a}");
/// # let _ = key;
/// ```
pub struct SnowflakeIds {
    worker: u16,
    epoch_ms: u64,
    max_backwards: Duration,
    clock: MillisClock,
    /// (millisecond of the last id, its sequence)
    last: Mutex<(u64, u16)>,
}

impl std::fmt::Debug for SnowflakeIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnowflakeIds")
            .field("worker", &self.worker)
            .field("epoch_ms", &self.epoch_ms)
            .finish_non_exhaustive()
    }
}

/// 2024-01-01T00:00:00Z, the default epoch.
pub const DEFAULT_EPOCH_MS: u64 = 1_704_067_200_000;

fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl SnowflakeIds {
    /// A generator for `worker` (0..=1023) on the wall clock, epoch 2024-01-01, waiting out
    /// clock steps back of up to 10 ms.
    pub fn new(worker: u16) -> Result<Self, IdError> {
        Self::with_clock(worker, DEFAULT_EPOCH_MS, Arc::new(wall_clock_ms))
    }

    /// A generator on `clock` (milliseconds since the Unix epoch) with ids counted from
    /// `epoch_ms`.
    pub fn with_clock(worker: u16, epoch_ms: u64, clock: MillisClock) -> Result<Self, IdError> {
        if worker > MAX_WORKER {
            return Err(IdError::WorkerOutOfRange(worker));
        }
        Ok(Self {
            worker,
            epoch_ms,
            max_backwards: Duration::from_millis(10),
            clock,
            last: Mutex::new((0, 0)),
        })
    }

    /// Waits out clock steps back of up to `d` before failing (default 10 ms).
    pub fn with_max_backwards(mut self, d: Duration) -> Self {
        self.max_backwards = d;
        self
    }

    /// The epoch ids count from.
    pub fn epoch_ms(&self) -> u64 {
        self.epoch_ms
    }

    /// The next id: larger than every id this generator handed out before.
    pub fn next_id(&self) -> Result<u64, IdError> {
        let mut waited = Duration::ZERO;
        loop {
            let now = (self.clock)();
            let span = now
                .checked_sub(self.epoch_ms)
                .filter(|t| *t < (1 << TIME_BITS))
                .ok_or(IdError::ClockOutOfRange {
                    now_ms: now,
                    epoch_ms: self.epoch_ms,
                })?;
            let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            let (last_ms, seq) = *last;
            let next = if now < last_ms {
                None // the clock went back
            } else if now == last_ms {
                (seq < MAX_SEQUENCE).then_some((now, seq + 1)) // None: this ms is used up
            } else {
                Some((now, 0))
            };
            if let Some((ms, seq)) = next {
                *last = (ms, seq);
                return Ok((span << (WORKER_BITS + SEQUENCE_BITS))
                    | (u64::from(self.worker) << SEQUENCE_BITS)
                    | u64::from(seq));
            }
            drop(last);
            if now < last_ms && waited >= self.max_backwards {
                return Err(IdError::ClockWentBackwards {
                    now_ms: now,
                    last_ms,
                });
            }
            // Wait for the next millisecond (sequence used up, or a small step back).
            std::thread::sleep(Duration::from_micros(200));
            waited += Duration::from_micros(200);
        }
    }

    /// Splits an id into (milliseconds since the Unix epoch, worker, sequence).
    pub fn parts(id: u64, epoch_ms: u64) -> (u64, u16, u16) {
        let seq = (id & u64::from(MAX_SEQUENCE)) as u16;
        let worker = ((id >> SEQUENCE_BITS) & u64::from(MAX_WORKER)) as u16;
        (
            (id >> (WORKER_BITS + SEQUENCE_BITS)) + epoch_ms,
            worker,
            seq,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    fn fixed(at: Arc<AtomicU64>) -> MillisClock {
        Arc::new(move || at.load(Ordering::SeqCst))
    }

    #[test]
    fn ids_from_many_threads_are_unique_and_each_threads_ids_increase() {
        let ids = Arc::new(SnowflakeIds::new(3).expect("worker"));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let ids = ids.clone();
                std::thread::spawn(move || {
                    let got: Vec<u64> = (0..10_000).map(|_| ids.next_id().expect("id")).collect();
                    assert!(got.windows(2).all(|w| w[1] > w[0]), "increasing per thread");
                    got
                })
            })
            .collect();
        let mut all: Vec<u64> = threads
            .into_iter()
            .flat_map(|t| t.join().expect("thread"))
            .collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "no id handed out twice");
        let (ms, worker, _) = SnowflakeIds::parts(all[0], DEFAULT_EPOCH_MS);
        assert_eq!(worker, 3);
        assert!(
            ms.abs_diff(wall_clock_ms()) < 60_000,
            "timestamp part is now"
        );
    }

    #[test]
    fn a_clock_that_steps_back_is_refused_not_turned_into_a_repeated_id() {
        let at = Arc::new(AtomicU64::new(DEFAULT_EPOCH_MS + 5_000));
        let ids = SnowflakeIds::with_clock(1, DEFAULT_EPOCH_MS, fixed(at.clone()))
            .expect("worker")
            .with_max_backwards(Duration::from_millis(2));
        let before = ids.next_id().expect("id");
        at.store(DEFAULT_EPOCH_MS + 4_000, Ordering::SeqCst); // NTP stepped back 1 s
        let err = ids.next_id().expect_err("refused");
        assert_eq!(
            err,
            IdError::ClockWentBackwards {
                now_ms: DEFAULT_EPOCH_MS + 4_000,
                last_ms: DEFAULT_EPOCH_MS + 5_000
            }
        );
        assert!(err.to_string().contains("went back 1000 ms"), "{err}");
        at.store(DEFAULT_EPOCH_MS + 5_001, Ordering::SeqCst); // caught up
        assert!(ids.next_id().expect("id") > before);
    }

    #[test]
    fn a_used_up_millisecond_waits_for_the_next_one() {
        let at = Arc::new(AtomicU64::new(DEFAULT_EPOCH_MS + 10));
        let ids = SnowflakeIds::with_clock(2, DEFAULT_EPOCH_MS, fixed(at.clone())).expect("w");
        for seq in 0..=MAX_SEQUENCE {
            let id = ids.next_id().expect("id");
            assert_eq!(
                SnowflakeIds::parts(id, DEFAULT_EPOCH_MS),
                (DEFAULT_EPOCH_MS + 10, 2, seq)
            );
        }
        // The 4097th id of the millisecond waits until the clock moves on.
        let mover = {
            let at = at.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                at.store(DEFAULT_EPOCH_MS + 11, Ordering::SeqCst);
            })
        };
        let id = ids.next_id().expect("id");
        mover.join().expect("mover");
        assert_eq!(
            SnowflakeIds::parts(id, DEFAULT_EPOCH_MS),
            (DEFAULT_EPOCH_MS + 11, 2, 0)
        );
    }

    #[test]
    fn bad_settings_are_clear_errors() {
        assert_eq!(
            SnowflakeIds::new(1024).expect_err("range"),
            IdError::WorkerOutOfRange(1024)
        );
        let early =
            SnowflakeIds::with_clock(0, DEFAULT_EPOCH_MS, Arc::new(|| 1_000)).expect("worker");
        let err = early.next_id().expect_err("before the epoch");
        assert!(
            matches!(err, IdError::ClockOutOfRange { now_ms: 1_000, .. }),
            "{err}"
        );
    }
}
