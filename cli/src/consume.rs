//! `idemq consume`: a generic idempotent sink for trying things out. It consumes a Kafka
//! topic, a RabbitMQ queue, a RocketMQ topic or a NATS JetStream stream through the
//! idempotent consumer over any store URL, and prints each message processed (not its
//! duplicates) as one JSON line.
//!
//! Printing is the handler's effect, and it happens before the dedup record is completed:
//! a run killed in between printed lines that the next run prints again (`"takeover":
//! true`), so stdout is at-least-once after a crash, like any effect outside the store.
//! stderr says what the consumer waits for, reports dead letters as they happen (count and
//! last reason, at most every [`DEAD_LETTER_NOTE_EVERY`]) and ends with the counts.

use clap::Args;
use idemq::core::source::{Readiness, ReadinessProbe};
use idemq::{
    async_trait, ClaimedMessage, ConsumerConfig, ConsumerStats, Delivery, Envelope, HandlerError,
    IdempotentConsumer, KeyStrategy, Settle, Source, SourceError,
};
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct ConsumeArgs {
    /// What to consume: kafka://HOST:PORT[,HOST:PORT]/TOPIC,
    /// amqp://USER:PASS@HOST:PORT/VHOST?queue=QUEUE, rocketmq://NAMESRV:PORT/TOPIC, or
    /// nats://[USER:PASS@]HOST:PORT[,HOST:PORT]/STREAM[?subject=FILTER&durable=NAME&dlq=SUBJECT]
    /// (the durable consumer defaults to --group; each needs idemq built with that broker's
    /// feature).
    #[arg(long)]
    broker: String,
    /// The dedup store: sqlite://file.db?mode=rwc, postgres://…, mysql://…, redis://…, memory://
    #[arg(long, env = "IDEMQ_STORE_URL")]
    store: String,
    /// Where the business key is: header:NAME, json:/POINTER, dedup-header (the
    /// `idemq-dedup-key` header, else the broker's native slots: on RabbitMQ
    /// `x-deduplication-header` then `message_id`, on RocketMQ `KEYS`, on NATS
    /// `Nats-Msg-Id`), message-key.
    #[arg(long)]
    key: String,
    /// Consumer group: the Kafka/RocketMQ group (the NATS durable consumer unless the URL
    /// names one) and the dedup key's namespace.
    #[arg(long, default_value = "idemq-consume")]
    group: String,
    /// Stop after this many seconds without a new message once the source is ready (a
    /// Kafka consumer: partitions assigned); the wait for partitions does not count
    /// (default: run until Ctrl-C).
    #[arg(long)]
    idle_exit: Option<u64>,
    /// Stop once this many messages have been processed (duplicates not counted).
    #[arg(long)]
    max_messages: Option<u64>,
    #[command(flatten)]
    kafka: KafkaArgs,
}

/// Kafka group membership (refused with another broker's URL).
#[derive(Args, Default)]
struct KafkaArgs {
    /// Kafka: join the group as static member ID (`group.instance.id`), one ID per consumer
    /// process, the same across its restarts. A restart after a crash then takes its
    /// partitions back at once instead of after the dead member's session timeout; a
    /// member that does not come back holds its partitions for that timeout.
    #[arg(long, value_name = "ID")]
    instance_id: Option<String>,
    /// Kafka: the group session timeout in seconds (`session.timeout.ms`; librdkafka's
    /// default is 45): how long a silent member keeps its partitions. With --instance-id,
    /// make it longer than a restart takes.
    #[arg(long, value_name = "SECS")]
    session_timeout: Option<u64>,
}

impl KafkaArgs {
    fn any(&self) -> bool {
        self.instance_id.is_some() || self.session_timeout.is_some()
    }
}

/// Why the broker URL was not usable.
#[derive(Debug, thiserror::Error)]
enum BrokerUrlError {
    #[error("`{0}` is not a broker URL: expected kafka://host:port/topic, amqp://host:port/vhost?queue=q, rocketmq://namesrv:port/topic or nats://host:port/stream")]
    NotAUrl(String),
    #[error("unknown broker URL scheme `{0}`: use kafka://, amqp:// (or amqps://), rocketmq:// or nats://")]
    UnknownScheme(String),
    #[error("broker URL scheme `{scheme}` needs idemq built with feature `{feature}` (cargo build --features {feature})")]
    #[allow(dead_code)] // only built without some broker feature
    FeatureDisabled {
        scheme: String,
        feature: &'static str,
    },
    #[error("--instance-id and --session-timeout are Kafka group settings; `{0}` is not a Kafka broker URL")]
    NotKafka(String),
    #[error("`{url}` names no {what}: {example}")]
    #[allow(dead_code)] // only built with some broker feature
    Missing {
        url: String,
        what: &'static str,
        example: &'static str,
    },
}

fn key_strategy(spec: &str, group: &str) -> anyhow::Result<KeyStrategy> {
    let strategy = if let Some(name) = spec.strip_prefix("header:") {
        KeyStrategy::header(group, name)?
    } else if let Some(pointer) = spec.strip_prefix("json:") {
        KeyStrategy::json_pointer(group, pointer)?
    } else if spec == "dedup-header" {
        KeyStrategy::dedup_header(group)?
    } else if spec == "message-key" {
        KeyStrategy::message_key(group)?
    } else {
        anyhow::bail!(
            "unknown --key `{spec}`: use header:NAME, json:/POINTER, dedup-header or message-key"
        )
    };
    Ok(strategy)
}

/// `scheme://authority/path?query` split at the first `/` after the authority, without
/// touching the authority (which may hold a password).
#[allow(dead_code)] // only built with some broker feature
fn split_url(url: &str) -> Option<(&str, &str, &str, Option<&str>)> {
    let (scheme, rest) = url.split_once("://")?;
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    Some((scheme, authority, path, query))
}

#[allow(unused_variables)] // without broker features, only the refusals use the arguments
async fn open_source(url: &str, group: &str, kafka: &KafkaArgs) -> anyhow::Result<Box<dyn Source>> {
    let shown = shown_url(url);
    let scheme = url
        .split_once("://")
        .map(|(s, _)| s.to_ascii_lowercase())
        .ok_or_else(|| BrokerUrlError::NotAUrl(shown.clone()))?;
    if kafka.any() && scheme != "kafka" {
        return Err(BrokerUrlError::NotKafka(shown).into());
    }
    match scheme.as_str() {
        #[cfg(feature = "kafka")]
        "kafka" => {
            let (_, brokers, topic, _) =
                split_url(url).ok_or_else(|| BrokerUrlError::NotAUrl(shown.clone()))?;
            if topic.is_empty() {
                return Err(BrokerUrlError::Missing {
                    url: shown,
                    what: "topic",
                    example: "kafka://127.0.0.1:9092/payments",
                }
                .into());
            }
            let mut cfg = idemq::kafka::KafkaSourceConfig::new(brokers, group, &[topic]);
            if let Some(id) = &kafka.instance_id {
                cfg = cfg.static_member(id);
            }
            if let Some(secs) = kafka.session_timeout {
                cfg = cfg.session_timeout(Duration::from_secs(secs));
            }
            Ok(Box::new(idemq::kafka::KafkaSource::connect(cfg).await?))
        }
        #[cfg(feature = "rabbitmq")]
        "amqp" | "amqps" => {
            let (_, _, _, query) =
                split_url(url).ok_or_else(|| BrokerUrlError::NotAUrl(shown.clone()))?;
            let params: Vec<(&str, &str)> = query
                .unwrap_or("")
                .split('&')
                .filter_map(|p| p.split_once('='))
                .collect();
            let Some(queue) = params.iter().find(|(k, _)| *k == "queue").map(|(_, v)| *v) else {
                return Err(BrokerUrlError::Missing {
                    url: shown,
                    what: "queue",
                    example: "amqp://guest:guest@127.0.0.1:5672/%2f?queue=payments",
                }
                .into());
            };
            // The AMQP URL lapin sees keeps its own parameters, without ours.
            let rest: Vec<String> = params
                .iter()
                .filter(|(k, _)| *k != "queue")
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let base = url.split_once('?').map_or(url, |(b, _)| b);
            let amqp = if rest.is_empty() {
                base.to_string()
            } else {
                format!("{base}?{}", rest.join("&"))
            };
            let cfg = idemq::rabbitmq::RabbitSourceConfig::new(amqp, queue);
            Ok(Box::new(idemq::rabbitmq::RabbitSource::connect(cfg).await?))
        }
        #[cfg(feature = "rocketmq")]
        "rocketmq" => {
            let (_, namesrv, topic, _) =
                split_url(url).ok_or_else(|| BrokerUrlError::NotAUrl(shown.clone()))?;
            if topic.is_empty() {
                return Err(BrokerUrlError::Missing {
                    url: shown,
                    what: "topic",
                    example: "rocketmq://127.0.0.1:9876/payments",
                }
                .into());
            }
            let cfg = idemq::rocketmq::RocketSourceConfig::new(namesrv, group, topic);
            Ok(Box::new(idemq::rocketmq::RocketSource::connect(cfg).await?))
        }
        #[cfg(feature = "nats")]
        "nats" => Ok(Box::new(
            idemq::nats::NatsSource::connect(nats_config(url, group)?).await?,
        )),
        #[cfg(not(feature = "kafka"))]
        "kafka" => Err(disabled(scheme, "kafka")),
        #[cfg(not(feature = "rabbitmq"))]
        "amqp" | "amqps" => Err(disabled(scheme, "rabbitmq")),
        #[cfg(not(feature = "rocketmq"))]
        "rocketmq" => Err(disabled(scheme, "rocketmq")),
        #[cfg(not(feature = "nats"))]
        "nats" => Err(disabled(scheme, "nats")),
        _ => Err(BrokerUrlError::UnknownScheme(scheme).into()),
    }
}

/// `url` for messages: without the password of its user info, and, on a `nats://` URL,
/// without a bare token (`nats://TOKEN@host`), which is a credential there.
fn shown_url(url: &str) -> String {
    let shown = idemq::core::secrets::redact_url(url);
    match shown.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("nats") => {
            let authority = rest.split(['/', '?']).next().unwrap_or("");
            match authority.rfind('@') {
                Some(at) if !authority[..at].contains(':') => {
                    format!("{scheme}://***{}", &rest[at..])
                }
                _ => shown,
            }
        }
        _ => shown,
    }
}

/// The source settings a `nats://` URL names: servers (with their credentials) before the
/// path, the stream as the path, `subject=` (repeatable), `durable=` (default: the group)
/// and `dlq=` in the query.
#[cfg(feature = "nats")]
fn nats_config(url: &str, group: &str) -> anyhow::Result<idemq::nats::NatsSourceConfig> {
    let shown = shown_url(url);
    let (scheme, servers, stream, query) =
        split_url(url).ok_or_else(|| BrokerUrlError::NotAUrl(shown.clone()))?;
    if stream.is_empty() || stream.contains('/') {
        return Err(BrokerUrlError::Missing {
            url: shown,
            what: "stream",
            example: "nats://127.0.0.1:4222/ORDERS?subject=orders.>",
        }
        .into());
    }
    let mut cfg =
        idemq::nats::NatsSourceConfig::new(format!("{scheme}://{servers}"), stream, group);
    for (k, v) in query
        .unwrap_or("")
        .split('&')
        .filter_map(|p| p.split_once('='))
    {
        match k {
            "subject" => cfg.subjects.push(v.to_string()),
            "durable" => cfg.durable = v.to_string(),
            "dlq" => cfg.dead_letter_subject = Some(v.to_string()),
            other => anyhow::bail!(
                "`{shown}`: unknown parameter `{other}` (nats:// takes subject=, durable= and dlq=)"
            ),
        }
    }
    Ok(cfg)
}

#[allow(dead_code)] // only built without some broker feature
fn disabled(scheme: String, feature: &'static str) -> anyhow::Error {
    BrokerUrlError::FeatureDisabled { scheme, feature }.into()
}

/// One processed message as a JSON line.
fn line(m: &ClaimedMessage) -> String {
    let env = &m.envelope;
    let mut v = serde_json::json!({
        "key": m.key.business_key(),
        "source": env.source.name,
        "partition": env.source.partition,
        "position": env.source.position.as_ref().and_then(|p| match p {
            idemq::Position::Offset(o) | idemq::Position::QueueOffset(o) => Some(*o),
            // A delivery tag numbers deliveries on one channel, not messages.
            idemq::Position::DeliveryTag(t) | idemq::Position::Sequence(t) => {
                Some(i64::try_from(*t).unwrap_or(i64::MAX))
            }
            // A shape this CLI does not know yet: no number rather than a wrong one.
            _ => None,
        }),
        "attempt": m.attempt,
        // An earlier run may have printed this message and died before recording it done.
        "takeover": m.takeover,
    });
    match std::str::from_utf8(&env.payload) {
        Ok(text) => v["payload"] = text.into(),
        Err(_) => {
            let hex: String = env.payload.iter().map(|b| format!("{b:02x}")).collect();
            v["payload_hex"] = hex.into();
        }
    }
    v.to_string()
}

pub async fn run(args: ConsumeArgs) -> anyhow::Result<ExitCode> {
    let keys = key_strategy(&args.key, &args.group)?;
    let store = idemq::open_store(&args.store).await?;
    let last_reason = LastReason::default();
    let mut source = NotingRejects {
        inner: open_source(&args.broker, &args.group, &args.kafka).await?,
        last: last_reason.clone(),
    };
    let out = Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let consumer = IdempotentConsumer::new(store, keys, move |m: ClaimedMessage| {
        let out = out.clone();
        async move {
            let text = line(&m);
            let mut out = out
                .lock()
                .map_err(|_| HandlerError::permanent("stdout lock poisoned"))?;
            // A closed stdout (`| head`) fails the message: it is retried, not lost.
            writeln!(out, "{text}")
                .and_then(|()| out.flush())
                .map_err(HandlerError::retryable)?;
            Ok(None)
        }
    })
    .with_config(ConsumerConfig {
        max_batch: 64,
        ..ConsumerConfig::default()
    });
    let readiness = source.readiness();
    let mut watch = Watch::new(
        args.idle_exit.map(Duration::from_secs),
        args.max_messages,
        wait_hint(&args.broker),
    );
    let stop = async {
        let watching = async {
            let mut notes = Vec::new();
            loop {
                let stop = watch.tick(
                    Instant::now(),
                    readiness.check(),
                    &consumer.stats(),
                    last_reason.get().as_deref(),
                    &mut notes,
                );
                for note in notes.drain(..) {
                    say(&note);
                }
                if stop {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            () = watching => {}
        }
    };
    consumer.run(&mut source, stop).await?;
    let s = consumer.stats();
    if let Some(note) =
        watch.dead_letter_note(Instant::now(), &s, last_reason.get().as_deref(), true)
    {
        say(&note);
    }
    let _ = writeln!(
        std::io::stderr(),
        "consumed: processed={} duplicates_skipped={} dead_lettered={} retried={}",
        s.processed,
        s.duplicates,
        s.rejected,
        s.retried
    );
    Ok(ExitCode::SUCCESS)
}

/// One note on stderr. A closed stderr is no reason to stop consuming (`eprintln!` would
/// panic).
fn say(note: &str) {
    let _ = writeln!(std::io::stderr(), "idemq consume: {note}");
}

/// What a long wait for a Kafka assignment may mean, said once, with the first reminder.
fn wait_hint(broker: &str) -> Option<&'static str> {
    let hint = "a consumer of the group that died without leaving (killed, crashed) keeps \
                its partitions until its session times out (session.timeout.ms, 45 s by \
                default; a restart with the dead one's --instance-id takes them at once); a \
                topic that does not exist is never assigned";
    broker
        .to_ascii_lowercase()
        .starts_with("kafka://")
        .then_some(hint)
}

/// How often a wait that goes on is reported again.
const WAIT_NOTE_EVERY: Duration = Duration::from_secs(10);

/// The most often dead letters are reported (a poison stream must not flood stderr).
const DEAD_LETTER_NOTE_EVERY: Duration = Duration::from_secs(10);

/// The reason of the last dead letter, shared by the deliveries and the watcher.
#[derive(Clone, Default)]
struct LastReason(Arc<std::sync::Mutex<Option<String>>>);

impl LastReason {
    fn set(&self, reason: &str) {
        let mut last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *last = Some(reason.to_string());
    }
    fn get(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The source, with each delivery's reject reason kept for the stderr note (the engine
/// counts dead letters but keeps no reason).
struct NotingRejects {
    inner: Box<dyn Source>,
    last: LastReason,
}

#[async_trait]
impl Source for NotingRejects {
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        let Some(batch) = self.inner.poll(max).await? else {
            return Ok(None);
        };
        Ok(Some(
            batch
                .into_iter()
                .map(|d| NotedDelivery::wrap(d, self.last.clone()))
                .collect(),
        ))
    }
    async fn after_batch(&mut self) -> Result<(), SourceError> {
        self.inner.after_batch().await
    }
    async fn close(&mut self) -> Result<(), SourceError> {
        self.inner.close().await
    }
    fn readiness(&self) -> ReadinessProbe {
        self.inner.readiness()
    }
}

/// One delivery of the source inside another: settling the outer one settles it. The
/// envelope moves out to the outer delivery and comes back before a nack, reject or
/// abandon, as the source's own settlement expects.
struct NotedDelivery {
    inner: Option<Delivery>,
    last: LastReason,
}

impl NotedDelivery {
    fn wrap(mut d: Delivery, last: LastReason) -> Delivery {
        let empty = Envelope::new(d.envelope.broker, String::new(), bytes::Bytes::new());
        let envelope = std::mem::replace(&mut d.envelope, empty);
        Delivery::new(
            envelope,
            Box::new(Self {
                inner: Some(d),
                last,
            }),
        )
    }
}

#[async_trait]
impl Settle for NotedDelivery {
    async fn ack(&mut self) -> Result<(), SourceError> {
        match self.inner.take() {
            Some(d) => d.ack().await,
            None => Ok(()),
        }
    }
    async fn nack(&mut self, redeliver_after: Duration) -> Result<(), SourceError> {
        match self.inner.take() {
            Some(d) => d.nack(redeliver_after).await,
            // Only after a reject that failed, when the inner delivery already fell back
            // to a nack of its own and failed that too.
            None => Err(SourceError::Broker(
                "the delivery was settled already".into(),
            )),
        }
    }
    async fn reject(&mut self, reason: &str) -> Result<(), SourceError> {
        self.last.set(reason);
        match self.inner.take() {
            Some(d) => d.reject(reason).await,
            None => Ok(()),
        }
    }
    fn abandon(&mut self) {
        // Dropping the inner delivery unsettled abandons it at its source.
        drop(self.inner.take());
    }
    fn is_stale(&self) -> bool {
        self.inner.as_ref().is_some_and(Delivery::is_stale)
    }
    fn take_back(&mut self, envelope: Envelope) {
        if let Some(d) = &mut self.inner {
            d.envelope = envelope;
        }
    }
}

/// Decides, a few times a second, what to say on stderr and when to stop: `--idle-exit`
/// counts only while the source is ready (a Kafka consumer holds its assignment), never
/// while it waits for partitions, which after a crash of a group member can take as long
/// as that member's session timeout.
struct Watch {
    idle: Option<Duration>,
    max_messages: Option<u64>,
    wait_hint: Option<&'static str>,
    /// Messages settled so far (processed, duplicates, dead-lettered), as last seen.
    seen: u64,
    /// Since when the source has been ready with nothing new; `None` while it waits.
    idle_since: Option<Instant>,
    /// Since when the source has been waiting, and when that was last said.
    waiting: Option<(Instant, Instant)>,
    /// What the source held when last said (re-said when it changes).
    holding: Option<String>,
    /// Dead letters when last said, and when that was.
    dead_letters_said: (u64, Option<Instant>),
}

impl Watch {
    fn new(
        idle: Option<Duration>,
        max_messages: Option<u64>,
        wait_hint: Option<&'static str>,
    ) -> Self {
        Self {
            idle,
            max_messages,
            wait_hint,
            seen: 0,
            idle_since: None,
            waiting: None,
            holding: None,
            dead_letters_said: (0, None),
        }
    }

    /// A note on the messages dead-lettered since the last one, if any were and the last
    /// note is at least [`DEAD_LETTER_NOTE_EVERY`] old (`now`: whatever its age).
    fn dead_letter_note(
        &mut self,
        now: Instant,
        s: &ConsumerStats,
        last_reason: Option<&str>,
        at_once: bool,
    ) -> Option<String> {
        let (said, at) = self.dead_letters_said;
        let due = at_once || at.is_none_or(|at| now.duration_since(at) >= DEAD_LETTER_NOTE_EVERY);
        if s.rejected <= said || !due {
            return None;
        }
        self.dead_letters_said = (s.rejected, Some(now));
        let new = s.rejected - said;
        let plural = if new == 1 { "message" } else { "messages" };
        let total = if said == 0 {
            String::new()
        } else {
            format!(" ({} in all)", s.rejected)
        };
        Some(format!(
            "dead-lettered {new} {plural}{total}; last reason: {}",
            last_reason.unwrap_or("unknown")
        ))
    }

    /// One look at the source and the counters; pushes what to say onto `notes` and
    /// answers whether to stop.
    fn tick(
        &mut self,
        now: Instant,
        readiness: Readiness,
        s: &ConsumerStats,
        last_reason: Option<&str>,
        notes: &mut Vec<String>,
    ) -> bool {
        notes.extend(self.dead_letter_note(now, s, last_reason, false));
        if self.max_messages.is_some_and(|max| s.processed >= max) {
            return true;
        }
        let settled = s.processed + s.duplicates + s.rejected;
        let moved = settled != self.seen;
        self.seen = settled;
        match readiness {
            Readiness::Waiting(what) => {
                self.idle_since = None;
                self.holding = None;
                match &mut self.waiting {
                    None => {
                        notes.push(format!("waiting for {what}"));
                        self.waiting = Some((now, now));
                    }
                    Some((since, said)) if now.duration_since(*said) >= WAIT_NOTE_EVERY => {
                        let first = said == since;
                        let hint = match self.wait_hint {
                            Some(h) if first => format!("; {h}"),
                            _ => String::new(),
                        };
                        notes.push(format!(
                            "still waiting for {what} ({} s so far{hint})",
                            now.duration_since(*since).as_secs()
                        ));
                        *said = now;
                    }
                    Some(_) => {}
                }
                false
            }
            Readiness::Ready(holding) => {
                self.waiting = None;
                if self.holding.as_deref() != Some(holding.as_str()) {
                    notes.push(format!("ready: {holding}"));
                    self.holding = Some(holding);
                }
                let since = match self.idle_since {
                    Some(since) if !moved => since,
                    _ => *self.idle_since.insert(now),
                };
                self.idle
                    .is_some_and(|idle| now.duration_since(since) >= idle)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(processed: u64) -> ConsumerStats {
        let mut s = ConsumerStats::default();
        s.processed = processed;
        s
    }

    #[test]
    fn idle_exit_counts_only_while_the_source_is_ready() {
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        let waiting =
            || Readiness::Waiting("partitions of p from the group coordinator of g".into());
        let ready = || Readiness::Ready("assigned 2 partitions: p[0], p[1]".into());
        let mut w = Watch::new(
            Some(Duration::from_secs(2)),
            None,
            wait_hint("kafka://h:1/p"),
        );
        let mut notes = Vec::new();
        // 45 s of waiting for partitions (a dead member's session timeout) never stops it.
        for s in 0..45 {
            assert!(
                !w.tick(at(s), waiting(), &stats(0), None, &mut notes),
                "stopped at {s} s"
            );
        }
        assert_eq!(
            notes[0],
            "waiting for partitions of p from the group coordinator of g"
        );
        assert_eq!(notes.len(), 5, "said at 0, 10, 20, 30, 40 s: {notes:?}");
        assert!(
            notes[1].starts_with("still waiting for partitions of p"),
            "{notes:?}"
        );
        assert!(notes[1].contains("(10 s so far; ") && notes[1].contains("session.timeout.ms"));
        assert!(
            notes[2].ends_with("(20 s so far)"),
            "the hint is said once: {notes:?}"
        );
        notes.clear();
        // The idle clock starts once it is assigned.
        assert!(!w.tick(at(45), ready(), &stats(0), None, &mut notes));
        assert_eq!(notes, ["ready: assigned 2 partitions: p[0], p[1]"]);
        assert!(!w.tick(at(46), ready(), &stats(0), None, &mut notes));
        // A message resets it.
        assert!(!w.tick(at(47), ready(), &stats(1), None, &mut notes));
        assert!(!w.tick(at(48), ready(), &stats(1), None, &mut notes));
        // An eager rebalance takes the partitions away: the clock stops, and restarts from
        // the new assignment.
        assert!(!w.tick(at(60), waiting(), &stats(1), None, &mut notes));
        assert!(!w.tick(at(61), ready(), &stats(1), None, &mut notes));
        assert!(!w.tick(at(62), ready(), &stats(1), None, &mut notes));
        assert!(w.tick(at(63), ready(), &stats(1), None, &mut notes));
        assert_eq!(notes.len(), 3, "{notes:?}");
    }

    #[test]
    fn dead_letters_are_said_with_the_last_reason_at_most_every_ten_seconds() {
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        let ready = || Readiness::Ready("connected".into());
        let rejected = |n: u64| {
            let mut s = ConsumerStats::default();
            s.rejected = n;
            s
        };
        let mut w = Watch::new(None, None, None);
        let mut notes = Vec::new();
        w.tick(at(0), ready(), &rejected(0), None, &mut notes);
        notes.clear();
        w.tick(at(1), ready(), &rejected(3), Some("no key"), &mut notes);
        assert_eq!(notes, ["dead-lettered 3 messages; last reason: no key"]);
        // Every message of a poison stream dead-lettered: one note per 10 s, not per message.
        for s in 2..11 {
            w.tick(
                at(s),
                ready(),
                &rejected(3 + s),
                Some("bad key"),
                &mut notes,
            );
        }
        assert_eq!(notes.len(), 1, "{notes:?}");
        w.tick(at(11), ready(), &rejected(14), Some("bad key"), &mut notes);
        assert_eq!(
            notes[1],
            "dead-lettered 11 messages (14 in all); last reason: bad key"
        );
        // Nothing new: nothing said; at the end, what is left is said at once.
        w.tick(at(30), ready(), &rejected(14), Some("bad key"), &mut notes);
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert_eq!(
            w.dead_letter_note(at(31), &rejected(15), Some("last"), true)
                .as_deref(),
            Some("dead-lettered 1 message (15 in all); last reason: last")
        );
    }

    #[test]
    fn a_line_says_whether_an_earlier_run_may_have_printed_it() {
        let env = Envelope::new(idemq::BrokerKind::MEMORY, "payments", "{\"id\":1}");
        let key = idemq::DedupKey::from_stored("g:pay-1");
        let (_, lease) = idemq::LeaseWatch::pair();
        for takeover in [false, true] {
            let m = ClaimedMessage::new(
                Arc::new(env.clone()),
                key.clone(),
                idemq::FencingToken::random(),
                2,
                takeover,
                lease.clone(),
            );
            let v: serde_json::Value = serde_json::from_str(&line(&m)).unwrap();
            assert_eq!(v["takeover"], takeover, "{v}");
            assert_eq!(v["attempt"], 2, "{v}");
            assert_eq!(v["key"], "pay-1", "{v}");
        }
    }

    #[test]
    fn max_messages_stops_it_and_no_idle_exit_runs_on() {
        let t0 = Instant::now();
        let ready = || Readiness::Ready("connected".into());
        let mut notes = Vec::new();
        let mut w = Watch::new(None, Some(3), None);
        assert!(!w.tick(t0, ready(), &stats(2), None, &mut notes));
        assert!(!w.tick(
            t0 + Duration::from_secs(3600),
            ready(),
            &stats(2),
            None,
            &mut notes
        ));
        assert!(w.tick(
            t0 + Duration::from_secs(3601),
            ready(),
            &stats(3),
            None,
            &mut notes
        ));
        assert_eq!(notes, ["ready: connected"]);
    }

    #[test]
    fn key_specs_are_parsed_or_refused_with_the_choices() {
        for ok in [
            "header:order-id",
            "json:/payment_id",
            "dedup-header",
            "message-key",
        ] {
            assert!(key_strategy(ok, "g").is_ok(), "{ok}");
        }
        let e = key_strategy("xpath://id", "g")
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains("header:NAME, json:/POINTER"), "{e}");
    }

    #[tokio::test]
    async fn kafka_membership_flags_are_refused_for_other_brokers() {
        let static_member = KafkaArgs {
            instance_id: Some("payments-1".into()),
            session_timeout: None,
        };
        let e = open_source(
            "amqp://u:hunter2@127.0.0.1:1/%2f?queue=q",
            "g",
            &static_member,
        )
        .await
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--instance-id and --session-timeout are Kafka"),
            "{e}"
        );
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[tokio::test]
    async fn broker_urls_name_what_is_wrong_without_the_password() {
        let e = open_source("payments", "g", &KafkaArgs::default())
            .await
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not a broker URL"), "{e}");
        let e = open_source("mqtt://u:hunter2@h/t", "g", &KafkaArgs::default())
            .await
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown broker URL scheme `mqtt`"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        #[cfg(feature = "kafka")]
        {
            let e = open_source("kafka://127.0.0.1:1", "g", &KafkaArgs::default())
                .await
                .map(|_| ())
                .unwrap_err()
                .to_string();
            assert!(e.contains("names no topic"), "{e}");
        }
        #[cfg(feature = "rabbitmq")]
        {
            let e = open_source(
                "amqp://u:hunter2@127.0.0.1:1/%2f",
                "g",
                &KafkaArgs::default(),
            )
            .await
            .map(|_| ())
            .unwrap_err()
            .to_string();
            assert!(e.contains("names no queue"), "{e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
        #[cfg(not(feature = "kafka"))]
        {
            let e = open_source("kafka://h:1/t", "g", &KafkaArgs::default())
                .await
                .map(|_| ())
                .unwrap_err()
                .to_string();
            assert!(e.contains("feature `kafka`"), "{e}");
        }
    }

    /// What `open_source` answers for `url`, which must fail.
    #[cfg(feature = "nats")]
    async fn refusal(url: &str) -> String {
        match open_source(url, "g", &KafkaArgs::default()).await {
            Ok(_) => panic!("{url} was accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[cfg(feature = "nats")]
    #[tokio::test]
    async fn nats_urls_say_what_is_wrong_without_their_credentials() {
        let no_stream = refusal("nats://s3cr3t@127.0.0.1:1").await;
        assert!(no_stream.contains("names no stream"), "{no_stream}");
        let unknown = refusal("nats://u:hunter2@127.0.0.1:1/S?queue=q").await;
        assert!(unknown.contains("unknown parameter `queue`"), "{unknown}");
        // An unreachable server: named without the token, with what to check.
        let down = refusal("nats://s3cr3t@127.0.0.1:1/ORDERS").await;
        assert!(
            down.contains("cannot connect to nats at nats://***@127.0.0.1:1"),
            "{down}"
        );
        for e in [&no_stream, &unknown, &down] {
            assert!(!e.contains("s3cr3t") && !e.contains("hunter2"), "{e}");
        }
        let url =
            "nats://u:p@h1:4222,h2:4222/ORDERS?subject=orders.>&subject=refunds.*&dlq=dead.orders";
        let cfg = nats_config(url, "billing").expect("a nats URL");
        assert_eq!(cfg.url, "nats://u:p@h1:4222,h2:4222");
        assert_eq!([cfg.stream, cfg.durable], ["ORDERS", "billing"]);
        assert_eq!(cfg.subjects, ["orders.>", "refunds.*"]);
        assert_eq!(cfg.dead_letter_subject.as_deref(), Some("dead.orders"));
    }
}
