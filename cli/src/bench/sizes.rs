//! How much each scenario measures: the sizes of one profile
//! ([`Profile`](super::suite::Profile)).

/// Sizes of one profile.
#[derive(Debug, Clone)]
pub struct Sizes {
    /// Seconds each timed phase runs (at least three calls).
    pub phase_secs: f64,
    /// Interleaved rounds; the best of each phase is kept.
    pub rounds: usize,
    /// Claim batch sizes of the store sweep.
    pub batches: Vec<usize>,
    /// Retained keys of the local-layer checks.
    pub local_keys: Vec<usize>,
    /// Distinct keys replayed in the duplicate storm.
    pub storm_keys: usize,
    /// Of those, how many the remote store alone replays (it is much slower).
    pub storm_store_sample: usize,
    /// Retained-key counts of the growth scenarios.
    pub retained: Vec<usize>,
    /// Messages per broker consumer run.
    pub broker_messages: usize,
    /// Messages per Kafka consumer run: its consumers run at 10^5-10^6 records/s, so 20 000
    /// records timed mostly the first fetches, and the ratios swung from run to run.
    pub kafka_messages: usize,
    /// Rounds of the broker comparisons.
    pub broker_rounds: usize,
    /// Records per producer run.
    pub producer_messages: usize,
    /// Rounds of the producer comparison: one producer run swings by ±25 % here (a
    /// best of two could not tell 0.8x from 1.0x).
    pub producer_rounds: usize,
    /// Messages of the engine vs bare poll+ack scenario.
    pub engine_messages: usize,
}
