//! Engine settings: batch, leases, ordering, retries.

use std::time::Duration;

/// Which messages must run one after another.
///
/// Messages of one *lane* run in delivery order; when one of them is not acked (handler
/// failure, another worker holds it, store trouble), the later ones of its lane in the batch
/// are sent back unrun with the same delay, so they cannot overtake it. Sources keep the order
/// of what is sent back (Kafka holds the partition; the memory broker holds the lane).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeliveryOrder {
    /// Handlers of a batch run concurrently (up to `max_concurrency`).
    #[default]
    Unordered,
    /// One lane per partition / queue (Kafka partition, RocketMQ queue, AMQP queue).
    PerPartition,
    /// One lane per ordering key
    /// ([`Envelope::effective_ordering_key`](crate::Envelope::effective_ordering_key):
    /// RocketMQ sharding key, Kafka record key); messages without one are unordered.
    PerKey,
}

/// Back-off for failed handlers: exponential by attempt, capped, with jitter, and a bound on
/// attempts after which the message is dead-lettered with its last error.
///
/// The attempt number is the store's (it survives consumer restarts and counts every
/// acquisition of the key in this lifecycle), so a message that always fails reaches the
/// dead-letter whichever consumer runs it, and does not pin a partition or spin a queue.
///
/// ```
/// use idemq_core::engine::RetryPolicy;
/// use std::time::Duration;
/// let p = RetryPolicy { jitter: 0.0, ..RetryPolicy::default() };
/// assert_eq!(p.delay(1), Duration::from_secs(1));
/// assert_eq!(p.delay(3), Duration::from_secs(4));
/// assert_eq!(p.delay(30), p.max_delay);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Delay after the first failure.
    pub initial_delay: Duration,
    /// Longest delay.
    pub max_delay: Duration,
    /// Growth per attempt (2.0 doubles).
    pub multiplier: f64,
    /// Random spread, a fraction of the delay either way (0.2 = ±20%), so a crowd of
    /// failures does not come back in one wave.
    pub jitter: f64,
    /// After this many failed attempts the message is dead-lettered; `None` retries forever.
    pub max_attempts: Option<u32>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(300),
            multiplier: 2.0,
            jitter: 0.2,
            max_attempts: Some(10),
        }
    }
}

impl RetryPolicy {
    /// The same delay every time, no jitter, no bound on attempts.
    pub fn fixed(delay: Duration) -> Self {
        Self {
            initial_delay: delay,
            max_delay: delay,
            multiplier: 1.0,
            jitter: 0.0,
            max_attempts: None,
        }
    }

    /// Doubling from `initial` to `max`, no jitter, no bound on attempts: the back-off of a
    /// loop that keeps trying until its server answers (a reconnect, a store outage). Add
    /// spread with [`with_jitter`](Self::with_jitter) where many clients retry at once.
    ///
    /// ```
    /// use idemq_core::engine::RetryPolicy;
    /// use std::time::Duration;
    /// let mut waits = RetryPolicy::backoff(Duration::from_millis(100), Duration::from_millis(300)).waits();
    /// let first: Vec<_> = (0..3).map(|_| waits.next_delay().as_millis()).collect();
    /// assert_eq!(first, [100, 200, 300]);
    /// waits.reset(); // an attempt worked
    /// assert_eq!(waits.next_delay(), Duration::from_millis(100));
    /// ```
    pub fn backoff(initial: Duration, max: Duration) -> Self {
        Self {
            initial_delay: initial,
            max_delay: max,
            multiplier: 2.0,
            jitter: 0.0,
            max_attempts: None,
        }
    }

    /// Sets the random spread (builder form): a fraction of each delay either way.
    pub fn with_jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }

    /// The waits of one run of failures under this policy.
    pub fn waits(&self) -> Backoff {
        Backoff {
            policy: *self,
            failures: 0,
        }
    }

    /// Bounds the attempts (builder form).
    pub fn with_max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n);
        self
    }

    /// The delay before attempt `attempt + 1`, after attempt `attempt` (1-based) failed.
    pub fn delay(&self, attempt: u32) -> Duration {
        let capped = self.nominal_delay(attempt).as_secs_f64();
        let j = self.jitter.clamp(0.0, 1.0);
        let spread = if j > 0.0 {
            use rand::Rng;
            rand::thread_rng().gen_range(-j..=j)
        } else {
            0.0
        };
        Duration::from_secs_f64((capped * (1.0 + spread)).max(0.0)).min(self.max_delay)
    }

    /// [`delay`](Self::delay) without its jitter.
    pub fn nominal_delay(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(63) as i32;
        let base = self.initial_delay.as_secs_f64() * self.multiplier.max(1.0).powi(exp);
        Duration::from_secs_f64(base.min(self.max_delay.as_secs_f64()))
    }

    /// The nominal delays of the first `attempts` retries, added up.
    pub fn nominal_total(&self, attempts: u32) -> Duration {
        (1..=attempts).map(|a| self.nominal_delay(a)).sum()
    }

    /// True when attempt `attempt` was the last one allowed.
    pub fn exhausted(&self, attempt: u32) -> bool {
        self.max_attempts.is_some_and(|m| attempt >= m)
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.max_delay < self.initial_delay {
            return Err("retry.max_delay must be ≥ retry.initial_delay".into());
        }
        if !(self.multiplier.is_finite() && self.multiplier >= 1.0) {
            return Err("retry.multiplier must be a finite number ≥ 1".into());
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err("retry.jitter must be within 0..=1 (a fraction of the delay)".into());
        }
        if self.max_attempts == Some(0) {
            return Err("retry.max_attempts 0 would dead-letter every message unrun: use None for no bound, or ≥ 1".into());
        }
        Ok(())
    }
}

/// Engine settings. Defaults suit handlers that take up to a few seconds.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// Most deliveries taken per poll (and claimed per round trip).
    pub max_batch: usize,
    /// Most handlers running at once, per batch.
    pub max_concurrency: usize,
    /// Batches in progress at once (≥ 1). With more than one, while a batch waits on its
    /// store (claim and completion round trips, a commit's fsync) the next one is polled and
    /// started, so broker and store latencies overlap instead of adding up: the knob for a
    /// remote store, or for a push source that hands over a few messages at a time
    /// (RocketMQ's listeners). Each batch runs up to `max_concurrency` handlers. Unordered
    /// consumption only: batches then finish out of order, so
    /// [`validate`](Self::validate) refuses more than one with an ordering. A copy of a key
    /// that meets its own earlier copy still in flight in another batch comes back after a
    /// short delay (as with two consumers), never runs twice.
    pub pipeline_depth: usize,
    /// Which messages run one after another.
    pub ordering: DeliveryOrder,
    /// Lease per claim; a crashed worker's keys are taken over after it.
    pub lease: Duration,
    /// Heartbeat period extending leases of running handlers (`None` = lease / 3).
    pub heartbeat: Option<Duration>,
    /// Longest wait for one heartbeat round trip; a heartbeat that hangs counts as failed.
    pub heartbeat_timeout: Duration,
    /// How long completed keys are remembered (duplicates skipped).
    pub retention: Duration,
    /// Back-off and attempt bound for failed handlers.
    pub retry: RetryPolicy,
    /// Redelivery delay after a lost lease (fenced completion) or a stale delivery.
    pub redelivery_delay: Duration,
    /// Longest wait before redelivering a message another worker holds.
    pub in_flight_delay_max: Duration,
    /// First back-off after a store error; doubles up to `store_backoff_max`.
    pub store_backoff: Duration,
    /// Longest back-off after store errors.
    pub store_backoff_max: Duration,
    /// Store retries of a claim before the batch is nacked.
    pub store_retries: u32,
    /// How long to keep retrying a completion after the handlers succeeded (the effects
    /// happened; nacking would run them again). Leases are kept alive meanwhile.
    pub complete_patience: Duration,
    /// Longest a handler may run; on expiry it is cancelled, its key released and the
    /// message redelivered. `None`: no limit (the heartbeat keeps the lease).
    pub handler_timeout: Option<Duration>,
    /// Longest a user hook (`Handler::on_duplicate`, `Handler::on_dead_letter`) may run;
    /// on expiry it is cut off (logged, counted in `idemq_hook_failures_total`) and the
    /// message is settled as it would have been anyway, so a hung hook cannot stall the
    /// consumer.
    pub hook_timeout: Duration,
    /// Largest result a handler may return for the store to replay to duplicates.
    pub max_result_bytes: usize,
    /// Compare payload hashes: the same key with another payload is rejected, not skipped.
    pub payload_check: bool,
    /// This worker's id, kept in records for audit.
    pub worker_id: String,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            max_batch: 100,
            max_concurrency: 16,
            pipeline_depth: 1,
            ordering: DeliveryOrder::Unordered,
            lease: Duration::from_secs(30),
            heartbeat: None,
            heartbeat_timeout: Duration::from_secs(5),
            retention: Duration::from_secs(7 * 24 * 3600),
            retry: RetryPolicy::default(),
            redelivery_delay: Duration::from_secs(1),
            in_flight_delay_max: Duration::from_secs(5),
            store_backoff: Duration::from_millis(100),
            store_backoff_max: Duration::from_secs(10),
            store_retries: 4,
            complete_patience: Duration::from_secs(300),
            handler_timeout: None,
            hook_timeout: Duration::from_secs(30),
            max_result_bytes: 64 * 1024,
            payload_check: true,
            worker_id: format!(
                "pid{}-{:06x}",
                std::process::id(),
                rand::random::<u32>() & 0xff_ffff
            ),
        }
    }
}

/// One run of failed attempts under a [`RetryPolicy`]: each [`next_delay`](Self::next_delay)
/// is the wait before the next attempt, [`reset`](Self::reset) starts over after one that
/// worked. Every retry loop of idemq (the poll loop's rest after an outage, store calls,
/// reconnects, a database's transaction retries) waits through one of these.
#[derive(Debug, Clone)]
pub struct Backoff {
    policy: RetryPolicy,
    failures: u32,
}

impl Backoff {
    /// The wait after one more failure.
    pub fn next_delay(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.policy.delay(self.failures)
    }

    /// The wait [`next_delay`](Self::next_delay) would answer, without counting a failure
    /// and without jitter.
    pub fn peek_nominal(&self) -> Duration {
        self.policy.nominal_delay(self.failures.saturating_add(1))
    }

    /// An attempt worked: the next failure waits the initial delay again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }

    /// Failures since the last reset.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

/// A floor on redelivery delays, so a broker without delayed redelivery doesn't spin.
pub(crate) const MIN_REDELIVERY_DELAY: Duration = Duration::from_millis(50);

impl ConsumerConfig {
    /// The back-off after a store error: `store_backoff` doubling up to `store_backoff_max`.
    pub(crate) fn store_backoff_policy(&self) -> RetryPolicy {
        RetryPolicy::backoff(self.store_backoff, self.store_backoff_max)
    }

    /// The time budget of claim retries: `store_retries` waits of the store back-off.
    pub(crate) fn store_retries_budget(&self) -> Duration {
        self.store_backoff_policy()
            .nominal_total(self.store_retries)
            + Duration::from_millis(1)
    }

    /// The heartbeat period.
    pub(crate) fn beat(&self) -> Duration {
        self.heartbeat
            .unwrap_or(self.lease / 3)
            .max(Duration::from_millis(10))
    }

    /// Checks combinations that would break the guarantees, and says what to change.
    ///
    /// ```
    /// use idemq_core::ConsumerConfig;
    /// use std::time::Duration;
    /// let bad = ConsumerConfig { lease: Duration::from_secs(5), heartbeat: Some(Duration::from_secs(10)), ..Default::default() };
    /// assert!(bad.validate().unwrap_err().contains("heartbeat"));
    /// ```
    pub fn validate(&self) -> Result<(), String> {
        if self.lease < Duration::from_millis(50) {
            return Err(format!(
                "lease {:?} is too short to cover a claim round trip: use at least 50ms (seconds in production)",
                self.lease
            ));
        }
        if let Some(h) = self.heartbeat {
            if h.is_zero() || h >= self.lease {
                return Err(format!(
                    "heartbeat {h:?} must be shorter than the lease {:?} (lease / 3 is a good value), or the lease lapses between beats",
                    self.lease
                ));
            }
        }
        if self.pipeline_depth == 0 {
            return Err("pipeline_depth 0 would never poll: use 1 (or more for an unordered consumer over a remote store)".into());
        }
        if self.pipeline_depth > 1 && self.ordering != DeliveryOrder::Unordered {
            return Err(format!(
                "pipeline_depth {} with ordering {:?}: batches in progress together finish out of order, so an ordered consumer runs one batch at a time (set pipeline_depth to 1)",
                self.pipeline_depth, self.ordering
            ));
        }
        if self.heartbeat_timeout.is_zero() {
            return Err("heartbeat_timeout 0 fails every heartbeat: use a few seconds".into());
        }
        if self.in_flight_delay_max < MIN_REDELIVERY_DELAY {
            return Err(format!(
                "in_flight_delay_max {:?} is below the {MIN_REDELIVERY_DELAY:?} floor: redeliveries would spin",
                self.in_flight_delay_max
            ));
        }
        if self.store_backoff.is_zero() || self.store_backoff_max < self.store_backoff {
            return Err("store_backoff must be > 0 and store_backoff_max ≥ store_backoff, or a store outage becomes a hot retry loop".into());
        }
        if self.handler_timeout.is_some_and(|t| t.is_zero()) {
            return Err("handler_timeout 0 cancels every handler: use None for no limit".into());
        }
        if self.hook_timeout.is_zero() {
            return Err("hook_timeout 0 cuts off every on_duplicate and on_dead_letter hook: use a few seconds".into());
        }
        if self.retention.is_zero() {
            return Err("retention 0 forgets keys at once: every redelivery would run again; use the broker's redelivery horizon (days)".into());
        }
        if self.worker_id.is_empty() || self.worker_id.len() > 255 || self.worker_id.contains('\0')
        {
            return Err(
                "worker_id must be 1 to 255 bytes without NUL: it is kept in records for audit"
                    .into(),
            );
        }
        self.retry.validate()
    }
}
