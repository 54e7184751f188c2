//! [`NatsKvStore`]: connecting (bucket found or created), and the `DedupStore` impl whose
//! every write is a compare-and-set on the key's revision.

use crate::clock::ServerClock;
use crate::codec::{encode_key, encode_record};
use crate::kv::{Bucket, Slot};
use crate::options::{parse_url, NatsKvOptions};
use async_nats::jetstream::{self, kv};
use async_trait::async_trait;
use futures::{StreamExt, TryStreamExt};
use idemq_core::secrets::redact_url;
use idemq_core::store::{check_distinct_keys, duration_ms};
use idemq_core::{
    acquired_record, evaluate_claim_request, ClaimOutcome, ClaimRequest, ClaimVerdict,
    CompleteOutcome, Completion, DedupKey, DedupRecord, DedupStore, ExtendOutcome, FencingToken,
    RecordStatus, ReleaseOutcome, RollbackOutcome, StoreError, StoreStats,
};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Compare-and-set rounds on one key before a call gives up as contended (retryable).
const MAX_ROUNDS: usize = 64;
/// How long the marker of a purged record (or of one whose TTL ran out) stays.
pub(crate) const MARKER_TTL: Duration = Duration::from_secs(60);
/// Revision conflicts met and retried (another writer came between a read and a write).
pub const CAS_RETRIES: &str = "idemq_nats_kv_cas_retries_total";

/// A [`DedupStore`] on a NATS JetStream key-value bucket (see the crate docs).
#[derive(Clone)]
pub struct NatsKvStore {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) bucket: Bucket,
    pub(crate) clock: ServerClock,
    pub(crate) opts: NatsKvOptions,
    /// `<prefix>.`
    pub(crate) key_prefix: String,
    client: async_nats::Client,
    servers: String,
}

impl fmt::Debug for NatsKvStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsKvStore")
            .field("servers", &self.inner.servers)
            .field("bucket", &self.inner.opts.bucket)
            .field("prefix", &self.inner.opts.prefix)
            .field("per_key_ttl", &self.inner.bucket.ttl)
            .finish()
    }
}

impl NatsKvStore {
    /// Connects to the server(s) of `url` and opens (or creates) the bucket.
    ///
    /// `url` is `nats-kv://[user:pass@]host:port[,host:port…]/bucket[?prefix=…&replicas=3]`
    /// (bucket and parameters override `options`) or a server URL `nats://host:port`
    /// (`tls://`, several hosts comma-separated). Names are checked before any connection
    /// ([`StoreError::Config`]); a server that does not answer at start-up is a `Config`
    /// error naming it (a typo must not look like an outage to retry).
    pub async fn connect(url: &str, options: NatsKvOptions) -> Result<Self, StoreError> {
        let mut opts = options;
        let parsed = parse_url(url, &mut opts)?;
        opts.validate()?;
        let shown = parsed
            .servers
            .iter()
            .map(|s| redact_url(s))
            .collect::<Vec<_>>()
            .join(",");
        let client = async_nats::ConnectOptions::new()
            .name("idemq-nats-kv")
            .connection_timeout(opts.connect_timeout)
            .request_timeout(Some(opts.request_timeout))
            // Reconnect quickly: a cluster's other nodes are up while one restarts.
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis((attempts as u64).saturating_mul(100).min(1000))
            })
            .connect(parsed.servers.clone())
            .await
            .map_err(|e| {
                StoreError::Config(format!(
                    "cannot connect to NATS at {shown}: {e} (is nats-server running there, with JetStream?)"
                ))
            })?;
        let js = jetstream::ContextBuilder::new()
            .timeout(opts.request_timeout)
            .ack_timeout(opts.request_timeout)
            .build(client.clone());
        let store = open_bucket(&js, &opts, &shown).await?;
        let stream = store.stream.clone();
        let ttl = stream.cached_info().config.allow_message_ttl;
        if opts.per_key_ttl && !ttl {
            tracing::warn!(
                bucket = %opts.bucket,
                "the NATS KV bucket does not allow per-key TTLs (created without limit markers, or a server before 2.11): records stay until purge_expired, forget or the bucket's max_age"
            );
        }
        let subject_prefix = store.put_prefix.clone().unwrap_or(store.prefix.clone());
        let bucket = Bucket {
            kv: store.clone(),
            js: js.clone(),
            stream,
            subject_prefix,
            ttl: ttl && opts.per_key_ttl,
        };
        let clock = ServerClock::new(js, store.stream_name.clone(), opts.clock_resync);
        // Read the time once now: a server too old to tell it fails here, not on a claim.
        clock.now_ms().await?;
        Ok(Self {
            inner: Arc::new(Inner {
                bucket,
                clock,
                key_prefix: format!("{}.", opts.prefix),
                opts,
                client,
                servers: shown,
            }),
        })
    }

    /// The settings in force (after the URL's).
    pub fn options(&self) -> &NatsKvOptions {
        &self.inner.opts
    }

    /// Whether writes carry per-key TTLs (the option is on and the bucket allows them).
    pub fn per_key_ttl(&self) -> bool {
        self.inner.bucket.ttl
    }

    /// The KV key (within the bucket) that holds `key`'s record: `<prefix>.<encoded key>`
    /// (see [`crate::codec::encode_key`]).
    pub fn kv_key(&self, key: &DedupKey) -> String {
        format!("{}{}", self.inner.key_prefix, encode_key(key.as_str()))
    }

    /// The name of the stream behind the bucket (`KV_<bucket>`), e.g. to find its leader.
    pub fn stream_name(&self) -> String {
        format!("KV_{}", self.inner.opts.bucket)
    }

    /// The name of the server that leads the bucket's stream now (`None` on a single
    /// server, or while the cluster elects one): the node whose loss makes writes wait.
    pub async fn stream_leader(&self) -> Result<Option<String>, StoreError> {
        let info =
            self.inner.bucket.stream.get_info().await.map_err(|e| {
                StoreError::Unavailable(format!("cannot read the stream info: {e}"))
            })?;
        Ok(info.cluster.and_then(|c| c.leader))
    }

    /// The NATS client (shared with the store).
    pub fn client(&self) -> &async_nats::Client {
        &self.inner.client
    }

    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }

    async fn now(&self) -> Result<i64, StoreError> {
        self.inner.now().await
    }

    fn in_progress_ttl(&self, until_ms: i64, now: i64) -> Duration {
        Duration::from_millis(until_ms.saturating_sub(now).max(0) as u64)
            .saturating_add(self.inner.opts.in_progress_grace)
    }

    async fn claim_one(&self, req: &ClaimRequest, now: i64) -> Result<ClaimOutcome, StoreError> {
        let key = self.kv_key(&req.key);
        let token = req.token.unwrap_or_else(FencingToken::random);
        // Optimistic: a fresh key is created in one round trip (a write at revision 0);
        // anything else is read back and judged by the claim rules.
        let mut slot = Slot {
            revision: 0,
            record: None,
        };
        for _ in 0..MAX_ROUNDS {
            let verdict = evaluate_claim_request(slot.record.as_ref(), req, now);
            let taken_over = match (verdict, &slot.record) {
                (ClaimVerdict::Answer(o), _) => return Ok(o),
                (ClaimVerdict::TakeOver, r) => r.as_ref(),
                _ => None,
            };
            let (lease, record) = acquired_record(req, taken_over, token, now);
            let ttl = self.in_progress_ttl(lease.until_ms, now);
            let b = &self.inner.bucket;
            match b
                .write(&key, encode_record(&record), slot.revision, Some(ttl))
                .await?
            {
                Some(_) => return Ok(ClaimOutcome::Acquired(lease)),
                None => {
                    if slot.revision != 0 || slot.record.is_some() {
                        metrics::counter!(CAS_RETRIES).increment(1);
                    }
                    slot = b.read(&key).await?;
                }
            }
        }
        Err(contended(&req.key))
    }

    /// Reads `key` and, while the record is owned by `token`, rewrites it with `change`
    /// (compare-and-set at the revision read; read again on a conflict). A missing record or
    /// another token answers `fenced`; `settled` answers an owner's record that needs no
    /// write (`Some`); `change` builds the new record, its TTL and the answer.
    async fn fenced_update<T>(
        &self,
        key: &DedupKey,
        token: FencingToken,
        fenced: T,
        settled: impl Fn(&DedupRecord) -> Option<T>,
        change: impl Fn(&DedupRecord) -> (DedupRecord, Duration, T),
    ) -> Result<T, StoreError> {
        let kv_key = self.kv_key(key);
        let b = &self.inner.bucket;
        let mut slot = b.read(&kv_key).await?;
        for _ in 0..MAX_ROUNDS {
            let Some(r) = slot.record.as_ref() else {
                return Ok(fenced);
            };
            if r.token != token {
                return Ok(fenced);
            }
            if let Some(answer) = settled(r) {
                return Ok(answer);
            }
            let (new, ttl, answer) = change(r);
            match b
                .write(&kv_key, encode_record(&new), slot.revision, Some(ttl))
                .await?
            {
                Some(_) => return Ok(answer),
                None => {
                    metrics::counter!(CAS_RETRIES).increment(1);
                    slot = b.read(&kv_key).await?;
                }
            }
        }
        Err(contended(key))
    }

    /// Releases `key` if `token` holds it; `unrun` takes back the attempt its claim counted.
    async fn give_back(
        &self,
        key: &DedupKey,
        token: FencingToken,
        unrun: bool,
    ) -> Result<ReleaseOutcome, StoreError> {
        let now = self.now().await?;
        let ttl = self.in_progress_ttl(now, now);
        self.fenced_update(
            key,
            token,
            ReleaseOutcome::Fenced,
            |r| (r.status.is_terminal() || r.is_released()).then_some(ReleaseOutcome::Fenced),
            |r| {
                let mut new = r.clone();
                new.lease_until_ms = 0;
                if unrun {
                    new.attempts = new.attempts.saturating_sub(1);
                }
                (new, ttl, ReleaseOutcome::Released)
            },
        )
        .await
    }

    async fn complete_one(&self, c: &Completion, now: i64) -> Result<CompleteOutcome, StoreError> {
        let ttl = c.retention.saturating_add(self.inner.opts.completed_grace);
        self.fenced_update(
            &c.key,
            c.token,
            CompleteOutcome::Fenced,
            |r| match r.status {
                // Completion is idempotent for the token that owns the completed record,
                // and says the key was done before (a retry whose first reply was lost).
                RecordStatus::Completed => Some(CompleteOutcome::AlreadyCompleted),
                // Given up for good: nobody may complete it.
                RecordStatus::RolledBack => Some(CompleteOutcome::Fenced),
                // A released token owns nothing.
                RecordStatus::InProgress if r.is_released() => Some(CompleteOutcome::Fenced),
                // In progress, even past its lease: nobody took it over, so it is the
                // token's (the contract's "a lease that ended still belongs to its token").
                RecordStatus::InProgress => None,
            },
            |r| {
                let mut new = r.clone();
                new.status = RecordStatus::Completed;
                new.result = c.result.clone();
                new.completed_ms = Some(now);
                new.expires_ms = Some(now.saturating_add(duration_ms(c.retention)));
                (new, ttl, CompleteOutcome::Completed)
            },
        )
        .await
    }

    async fn roll_back_one(
        &self,
        key: &DedupKey,
        token: FencingToken,
        retention: Duration,
    ) -> Result<RollbackOutcome, StoreError> {
        let now = self.now().await?;
        let ttl = retention.saturating_add(self.inner.opts.completed_grace);
        self.fenced_update(
            key,
            token,
            RollbackOutcome::Fenced,
            |r| match r.status {
                // A repeat by the same token (its first reply lost).
                RecordStatus::RolledBack => Some(RollbackOutcome::RolledBack),
                RecordStatus::Completed => Some(RollbackOutcome::Fenced),
                RecordStatus::InProgress if r.is_released() => Some(RollbackOutcome::Fenced),
                RecordStatus::InProgress => None,
            },
            |r| {
                let mut new = r.clone();
                new.status = RecordStatus::RolledBack;
                new.result = None;
                new.completed_ms = Some(now);
                new.expires_ms = Some(now.saturating_add(duration_ms(retention)));
                (new, ttl, RollbackOutcome::RolledBack)
            },
        )
        .await
    }

    async fn extend_one(
        &self,
        key: &DedupKey,
        token: FencingToken,
        lease: Duration,
        now: i64,
    ) -> Result<ExtendOutcome, StoreError> {
        let until = now.saturating_add(duration_ms(lease));
        self.fenced_update(
            key,
            token,
            ExtendOutcome::Fenced,
            |r| (r.status.is_terminal() || r.is_released()).then_some(ExtendOutcome::Fenced),
            |r| {
                let mut new = r.clone();
                new.lease_until_ms = until;
                let ttl = self.in_progress_ttl(until, now);
                (new, ttl, ExtendOutcome::Extended { until_ms: until })
            },
        )
        .await
    }
}

fn contended(key: &DedupKey) -> StoreError {
    StoreError::Unavailable(format!(
        "`{key}` changed under every one of {MAX_ROUNDS} compare-and-set attempts; retry later"
    ))
}

async fn open_bucket(
    js: &jetstream::Context,
    opts: &NatsKvOptions,
    shown: &str,
) -> Result<kv::Store, StoreError> {
    use async_nats::jetstream::context::{CreateKeyValueErrorKind, KeyValueErrorKind};
    let missing = match js.get_key_value(&opts.bucket).await {
        Ok(store) => return Ok(store),
        Err(e) if e.kind() == KeyValueErrorKind::GetBucket => e,
        Err(e) => {
            return Err(StoreError::Unavailable(format!(
                "cannot open NATS KV bucket `{}` at {shown}: {e}",
                opts.bucket
            )))
        }
    };
    if !opts.create_bucket {
        return Err(StoreError::Config(format!(
            "NATS KV bucket `{}` does not exist at {shown} and create_bucket is off: {missing}",
            opts.bucket
        )));
    }
    let config = kv::Config {
        bucket: opts.bucket.clone(),
        description: "idemq dedup records".into(),
        history: 1,
        max_age: opts.max_age,
        storage: jetstream::stream::StorageType::File,
        num_replicas: opts.replicas,
        limit_markers: opts.per_key_ttl.then_some(MARKER_TTL),
        ..Default::default()
    };
    match js.create_key_value(config).await {
        Ok(store) => Ok(store),
        Err(e) if e.kind() == CreateKeyValueErrorKind::LimitMarkersNotSupported => {
            Err(StoreError::Config(format!(
                "the NATS server at {shown} does not support per-key TTLs (nats-server 2.11+); \
                 set NatsKvOptions::per_key_ttl = false: {e}"
            )))
        }
        // Another store created it meanwhile, or the config differs: open what is there.
        Err(e) => js.get_key_value(&opts.bucket).await.map_err(|_| {
            StoreError::Unavailable(format!(
                "cannot create NATS KV bucket `{}` at {shown}: {e}",
                opts.bucket
            ))
        }),
    }
}

#[async_trait]
impl DedupStore for NatsKvStore {
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<ClaimOutcome>, StoreError> {
        check_distinct_keys(reqs)?;
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        // One reading of the server's clock judges the whole batch.
        let now = self.now().await?;
        let n = self.inner.opts.max_concurrency;
        futures::stream::iter(
            reqs.iter()
                .map(|r| self.claim_one(r, now))
                .collect::<Vec<_>>(),
        )
        .buffered(n)
        .try_collect()
        .await
    }

    async fn complete_batch(
        &self,
        items: &[Completion],
    ) -> Result<Vec<CompleteOutcome>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let now = self.now().await?;
        let n = self.inner.opts.max_concurrency;
        futures::stream::iter(
            items
                .iter()
                .map(|c| self.complete_one(c, now))
                .collect::<Vec<_>>(),
        )
        .buffered(n)
        .try_collect()
        .await
    }

    async fn release(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.give_back(key, token, false).await
    }

    async fn release_unrun(
        &self,
        key: &DedupKey,
        token: FencingToken,
    ) -> Result<ReleaseOutcome, StoreError> {
        self.give_back(key, token, true).await
    }

    async fn roll_back(
        &self,
        key: &DedupKey,
        token: FencingToken,
        retention: Duration,
    ) -> Result<RollbackOutcome, StoreError> {
        self.roll_back_one(key, token, retention).await
    }

    async fn extend(
        &self,
        key: &DedupKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<ExtendOutcome, StoreError> {
        let now = self.now().await?;
        self.extend_one(key, token, lease, now).await
    }

    async fn extend_batch(
        &self,
        leases: &[(DedupKey, FencingToken)],
        lease: Duration,
    ) -> Result<Vec<ExtendOutcome>, StoreError> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let now = self.now().await?;
        let n = self.inner.opts.max_concurrency;
        futures::stream::iter(
            leases
                .iter()
                .map(|(k, t)| self.extend_one(k, *t, lease, now))
                .collect::<Vec<_>>(),
        )
        .buffered(n)
        .try_collect()
        .await
    }

    async fn get(&self, key: &DedupKey) -> Result<Option<DedupRecord>, StoreError> {
        Ok(self.inner.bucket.read(&self.kv_key(key)).await?.record)
    }

    async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        crate::scan::purge_expired(self, limit).await
    }

    async fn list_stuck(
        &self,
        stale_for: Duration,
        limit: usize,
    ) -> Result<Vec<DedupRecord>, StoreError> {
        crate::scan::list_stuck(self, stale_for, limit).await
    }

    async fn forget(&self, key: &DedupKey) -> Result<bool, StoreError> {
        let kv_key = self.kv_key(key);
        let b = &self.inner.bucket;
        for _ in 0..MAX_ROUNDS {
            let slot = b.read(&kv_key).await?;
            if slot.record.is_none() {
                return Ok(false);
            }
            if b.purge(&kv_key, slot.revision, MARKER_TTL).await? {
                return Ok(true);
            }
        }
        Err(contended(key))
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        crate::scan::stats(self).await
    }
}

impl Inner {
    /// The server's time (see [`crate::clock`]); a failed reading is forgotten so the next
    /// call asks again.
    pub(crate) async fn now(&self) -> Result<i64, StoreError> {
        let r = self.clock.now_ms().await;
        if r.is_err() {
            self.clock.invalidate();
        }
        r
    }
}
