//! Producer configuration: librdkafka's own keys, with typed builders that validate them.
//!
//! [`KafkaProducerConfig`] is a string map of librdkafka properties (so librdkafka's
//! `CONFIGURATION.md` applies as written), plus two constructors that set a safe
//! combination — [`KafkaProducerConfig::idempotent`] and [`KafkaProducerConfig::transactional`]
//! — and a [`KafkaProducerConfig::validate`] that refuses combinations which silently lose
//! the guarantee, with a message naming the key and the fix:
//!
//! ```
//! use idemq_kafka::KafkaProducerConfig;
//! let err = KafkaProducerConfig::idempotent("127.0.0.1:9092")
//!     .set("acks", "1")
//!     .validate()
//!     .unwrap_err();
//! assert!(err.to_string().contains("acks=1 breaks idempotence: use acks=all"));
//! ```

use rdkafka::ClientConfig;
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// librdkafka's `acks` and its alias.
const ACKS: [&str; 2] = ["acks", "request.required.acks"];
/// librdkafka's in-flight bound and its alias.
const IN_FLIGHT: [&str; 2] = ["max.in.flight.requests.per.connection", "max.in.flight"];
/// librdkafka's retry count and its alias.
const RETRIES: [&str; 2] = ["retries", "message.send.max.retries"];
/// The most in-flight requests per connection that keep idempotent ordering.
pub const MAX_IDEMPOTENT_IN_FLIGHT: i64 = 5;
/// Kafka's default `transaction.max.timeout.ms` (15 minutes).
pub const DEFAULT_BROKER_MAX_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(900);

/// What the configuration was built to guarantee.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProducerMode {
    /// Plain properties (checked only for what they enable themselves).
    Plain,
    /// [`KafkaProducerConfig::idempotent`]: no duplicates from producer retries.
    Idempotent,
    /// [`KafkaProducerConfig::transactional`]: idempotent plus atomic multi-partition writes.
    Transactional,
}

/// One unsafe setting, with the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigProblem {
    /// `bootstrap.servers` is not set.
    #[error("bootstrap.servers is missing: set it to the broker list, host:port[,host:port]")]
    MissingBootstrap,
    /// acks other than all with idempotence.
    #[error("acks={acks} breaks idempotence: use acks=all")]
    AcksBreakIdempotence {
        /// The value found.
        acks: String,
    },
    /// More than 5 requests in flight with idempotence.
    #[error("{key}={value} breaks idempotence (ordering and dedup hold for at most 5 in-flight requests): use {key}=5 or less")]
    TooManyInFlight {
        /// The key used.
        key: String,
        /// The value found.
        value: i64,
    },
    /// Retries disabled with idempotence.
    #[error("{key}=0 breaks idempotence: a lost ack then loses the message instead of retrying it; remove {key} (librdkafka retries within message.timeout.ms)")]
    NoRetries {
        /// The key used.
        key: String,
    },
    /// The idempotent or transactional builder, overridden with `enable.idempotence=false`.
    #[error(
        "enable.idempotence=false contradicts the {mode} builder: remove enable.idempotence=false"
    )]
    IdempotenceDisabled {
        /// `idempotent()` or `transactional()`.
        mode: &'static str,
    },
    /// `transactional.id` with `enable.idempotence=false`.
    #[error("transactional.id={id} with enable.idempotence=false: transactions require idempotence; remove enable.idempotence=false")]
    TransactionalWithoutIdempotence {
        /// The transactional id.
        id: String,
    },
    /// The transactional builder without a usable `transactional.id`.
    #[error("transactional.id is missing or empty: a transactional producer needs a stable id, unique per producer instance (e.g. \"<app>-<instance>\")")]
    MissingTransactionalId,
    /// `transaction.timeout.ms` above the broker's `transaction.max.timeout.ms`.
    #[error("transaction.timeout.ms={value} exceeds the broker's transaction.max.timeout.ms={max}: the producer's InitProducerId fails; use transaction.timeout.ms={max} or less (or raise the broker's limit)")]
    TransactionTimeoutTooLong {
        /// The producer's timeout.
        value: u64,
        /// The broker's maximum.
        max: u64,
    },
    /// `message.timeout.ms` above `transaction.timeout.ms`.
    #[error("message.timeout.ms={message} exceeds transaction.timeout.ms={transaction}: librdkafka refuses it; use message.timeout.ms={transaction} or less")]
    MessageTimeoutAboveTransactionTimeout {
        /// message.timeout.ms.
        message: u64,
        /// transaction.timeout.ms.
        transaction: u64,
    },
    /// A numeric key that does not hold a number.
    #[error("{key}={value} is not a number: use an integer")]
    NotANumber {
        /// The key.
        key: String,
        /// The value found.
        value: String,
    },
    /// A line of a properties file that is not `key=value`.
    #[error("line {line} is not key=value: {text:?}")]
    Malformed {
        /// 1-based line number.
        line: usize,
        /// The line.
        text: String,
    },
}

/// One rule of the validator ([`KafkaProducerConfig::explain`] gives each one's verdict).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Rule {
    /// `bootstrap.servers` is set.
    Bootstrap,
    /// Idempotence: `acks=all`.
    AcksAll,
    /// Idempotence: at most 5 requests in flight per connection.
    InFlight,
    /// Idempotence: retries not disabled.
    Retries,
    /// The idempotent / transactional builder is not overridden with
    /// `enable.idempotence=false`.
    IdempotenceKept,
    /// `transactional.id` only with idempotence.
    TransactionsNeedIdempotence,
    /// A transactional producer has a `transactional.id`.
    TransactionalId,
    /// `transaction.timeout.ms` within the broker's `transaction.max.timeout.ms`.
    TransactionTimeout,
    /// `message.timeout.ms` within `transaction.timeout.ms`.
    MessageTimeout,
}

impl Rule {
    /// Every rule, in the order they are checked.
    pub const ALL: [Rule; 9] = [
        Rule::Bootstrap,
        Rule::AcksAll,
        Rule::InFlight,
        Rule::Retries,
        Rule::IdempotenceKept,
        Rule::TransactionsNeedIdempotence,
        Rule::TransactionalId,
        Rule::TransactionTimeout,
        Rule::MessageTimeout,
    ];

    /// What the rule asks, in one line.
    pub fn describe(self) -> &'static str {
        match self {
            Rule::Bootstrap => "bootstrap.servers is set",
            Rule::AcksAll => "idempotence: acks=all",
            Rule::InFlight => "idempotence: max.in.flight.requests.per.connection <= 5",
            Rule::Retries => "idempotence: retries not disabled",
            Rule::IdempotenceKept => {
                "builder's idempotence not overridden by enable.idempotence=false"
            }
            Rule::TransactionsNeedIdempotence => "transactional.id only with idempotence",
            Rule::TransactionalId => "transactional producer has a transactional.id",
            Rule::TransactionTimeout => {
                "transaction.timeout.ms <= the broker's transaction.max.timeout.ms"
            }
            Rule::MessageTimeout => "message.timeout.ms <= transaction.timeout.ms",
        }
    }
}

impl ConfigProblem {
    /// The rule this problem breaks (`None` for a malformed properties line).
    pub fn rule(&self) -> Option<Rule> {
        Some(match self {
            ConfigProblem::MissingBootstrap => Rule::Bootstrap,
            ConfigProblem::AcksBreakIdempotence { .. } => Rule::AcksAll,
            ConfigProblem::TooManyInFlight { .. } => Rule::InFlight,
            ConfigProblem::NoRetries { .. } => Rule::Retries,
            ConfigProblem::IdempotenceDisabled { .. } => Rule::IdempotenceKept,
            ConfigProblem::TransactionalWithoutIdempotence { .. } => {
                Rule::TransactionsNeedIdempotence
            }
            ConfigProblem::MissingTransactionalId => Rule::TransactionalId,
            ConfigProblem::TransactionTimeoutTooLong { .. } => Rule::TransactionTimeout,
            ConfigProblem::MessageTimeoutAboveTransactionTimeout { .. } => Rule::MessageTimeout,
            ConfigProblem::NotANumber { key, .. } => match key.as_str() {
                k if IN_FLIGHT.contains(&k) => Rule::InFlight,
                k if RETRIES.contains(&k) => Rule::Retries,
                "transaction.timeout.ms" => Rule::TransactionTimeout,
                _ => Rule::MessageTimeout,
            },
            ConfigProblem::Malformed { .. } => return None,
        })
    }
}

/// One rule's verdict on a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleVerdict {
    /// The rule applies and holds.
    Holds,
    /// The rule does not apply to this configuration (why).
    NotApplicable(&'static str),
    /// The rule is broken: the problems found, each naming the key and the fix.
    Broken(Vec<ConfigProblem>),
}

/// Every problem found in a configuration (never empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The problems, in the order checked.
    pub problems: Vec<ConfigProblem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let msgs: Vec<String> = self.problems.iter().map(|p| p.to_string()).collect();
        write!(
            f,
            "unsafe Kafka producer configuration: {}",
            msgs.join("; ")
        )
    }
}

impl std::error::Error for ConfigError {}

/// librdkafka producer properties with typed, validating builders (`Debug` shows secret
/// properties such as `sasl.password` as `***`).
#[derive(Clone)]
pub struct KafkaProducerConfig {
    props: BTreeMap<String, String>,
    mode: ProducerMode,
    broker_max_transaction_timeout: Duration,
}

impl std::fmt::Debug for KafkaProducerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown: BTreeMap<&str, &str> = self
            .props
            .iter()
            .map(|(k, v)| (k.as_str(), idemq_core::secrets::shown_value(k, v)))
            .collect();
        f.debug_struct("KafkaProducerConfig")
            .field("props", &shown)
            .field("mode", &self.mode)
            .field(
                "broker_max_transaction_timeout",
                &self.broker_max_transaction_timeout,
            )
            .finish()
    }
}

impl KafkaProducerConfig {
    /// Plain properties with `bootstrap.servers` set.
    pub fn new(bootstrap_servers: &str) -> Self {
        Self {
            props: BTreeMap::new(),
            mode: ProducerMode::Plain,
            broker_max_transaction_timeout: DEFAULT_BROKER_MAX_TRANSACTION_TIMEOUT,
        }
        .set("bootstrap.servers", bootstrap_servers)
    }

    /// An idempotent producer: `enable.idempotence=true`, `acks=all`,
    /// `max.in.flight.requests.per.connection=5` (retries stay at librdkafka's unbounded
    /// default, bounded by `message.timeout.ms`).
    pub fn idempotent(bootstrap_servers: &str) -> Self {
        let mut c = Self::new(bootstrap_servers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set(
                "max.in.flight.requests.per.connection",
                MAX_IDEMPOTENT_IN_FLIGHT.to_string(),
            );
        c.mode = ProducerMode::Idempotent;
        c
    }

    /// A transactional producer: [`KafkaProducerConfig::idempotent`] plus
    /// `transactional.id` (stable across restarts of this instance, unique among instances:
    /// a new producer with the same id fences the old one).
    pub fn transactional(bootstrap_servers: &str, transactional_id: &str) -> Self {
        let mut c = Self::idempotent(bootstrap_servers).set("transactional.id", transactional_id);
        c.mode = ProducerMode::Transactional;
        c
    }

    /// Parses a Java-style properties file (`key=value` or `key: value` lines, `#`/`!`
    /// comments). The mode follows the properties: transactional when `transactional.id`
    /// is set, idempotent when `enable.idempotence=true`.
    pub fn from_properties(text: &str) -> Result<Self, ConfigError> {
        let mut props = BTreeMap::new();
        let mut problems = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with('!') {
                continue;
            }
            match line.split_once(['=', ':']) {
                Some((k, v)) if !k.trim().is_empty() => {
                    props.insert(k.trim().to_string(), v.trim().to_string());
                }
                _ => problems.push(ConfigProblem::Malformed {
                    line: i + 1,
                    text: raw.to_string(),
                }),
            }
        }
        if !problems.is_empty() {
            return Err(ConfigError { problems });
        }
        let mode = if props.contains_key("transactional.id") {
            ProducerMode::Transactional
        } else if props.get("enable.idempotence").map(String::as_str) == Some("true") {
            ProducerMode::Idempotent
        } else {
            ProducerMode::Plain
        };
        Ok(Self {
            props,
            mode,
            broker_max_transaction_timeout: DEFAULT_BROKER_MAX_TRANSACTION_TIMEOUT,
        })
    }

    /// Sets a librdkafka property (builder form).
    pub fn set(mut self, key: &str, value: impl Into<String>) -> Self {
        self.props.insert(key.to_string(), value.into());
        self
    }

    /// Removes a property (builder form).
    pub fn unset(mut self, key: &str) -> Self {
        self.props.remove(key);
        self
    }

    /// A property's value.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.props.get(key).map(String::as_str)
    }

    /// All properties.
    pub fn properties(&self) -> impl Iterator<Item = (&str, &str)> {
        self.props.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// What the configuration promises.
    pub fn mode(&self) -> ProducerMode {
        self.mode
    }

    /// The broker's `transaction.max.timeout.ms`, when it differs from Kafka's default of
    /// 15 minutes (builder form).
    pub fn broker_max_transaction_timeout(mut self, max: Duration) -> Self {
        self.broker_max_transaction_timeout = max;
        self
    }

    /// The first of `keys` that is set, with its value.
    fn first_of<'a>(&'a self, keys: &[&'a str]) -> Option<(&'a str, &'a str)> {
        keys.iter()
            .find_map(|k| self.props.get(*k).map(|v| (*k, v.as_str())))
    }

    fn number(&self, key: &str, value: &str, problems: &mut Vec<ConfigProblem>) -> Option<i64> {
        match value.trim().parse::<i64>() {
            Ok(n) => Some(n),
            Err(_) => {
                problems.push(ConfigProblem::NotANumber {
                    key: key.to_string(),
                    value: value.to_string(),
                });
                None
            }
        }
    }

    /// Every problem in the configuration (empty when safe).
    pub fn problems(&self) -> Vec<ConfigProblem> {
        let mut out = Vec::new();
        if self
            .get("bootstrap.servers")
            .is_none_or(|s| s.trim().is_empty())
        {
            out.push(ConfigProblem::MissingBootstrap);
        }
        let txn_id = self.get("transactional.id");
        let idem_flag = self.get("enable.idempotence").map(str::trim);
        let idem_off = idem_flag == Some("false");
        if idem_off {
            match self.mode {
                ProducerMode::Idempotent => out.push(ConfigProblem::IdempotenceDisabled {
                    mode: "idempotent()",
                }),
                ProducerMode::Transactional => out.push(ConfigProblem::IdempotenceDisabled {
                    mode: "transactional()",
                }),
                ProducerMode::Plain => {}
            }
            if let Some(id) = txn_id.filter(|id| !id.trim().is_empty()) {
                out.push(ConfigProblem::TransactionalWithoutIdempotence { id: id.to_string() });
            }
        }
        if self.mode == ProducerMode::Transactional && txn_id.is_none_or(|id| id.trim().is_empty())
        {
            out.push(ConfigProblem::MissingTransactionalId);
        }
        let idempotent = self.mode != ProducerMode::Plain
            || idem_flag == Some("true")
            || txn_id.is_some_and(|id| !id.trim().is_empty());
        if idempotent {
            self.idempotence_problems(&mut out);
        }
        if txn_id.is_some() || self.mode == ProducerMode::Transactional {
            self.transaction_timeout_problems(&mut out);
        }
        out
    }

    fn idempotence_problems(&self, out: &mut Vec<ConfigProblem>) {
        if let Some((_, acks)) = self.first_of(&ACKS) {
            let a = acks.trim();
            if a != "all" && a != "-1" {
                out.push(ConfigProblem::AcksBreakIdempotence {
                    acks: a.to_string(),
                });
            }
        }
        if let Some((key, v)) = self.first_of(&IN_FLIGHT) {
            if let Some(n) = self.number(key, v, out) {
                if n > MAX_IDEMPOTENT_IN_FLIGHT {
                    out.push(ConfigProblem::TooManyInFlight {
                        key: key.to_string(),
                        value: n,
                    });
                }
            }
        }
        if let Some((key, v)) = self.first_of(&RETRIES) {
            if self.number(key, v, out) == Some(0) {
                out.push(ConfigProblem::NoRetries {
                    key: key.to_string(),
                });
            }
        }
    }

    fn transaction_timeout_problems(&self, out: &mut Vec<ConfigProblem>) {
        // librdkafka's default transaction.timeout.ms is 60 s; message.timeout.ms 300 s, but
        // librdkafka lowers the default message timeout to the transaction timeout itself,
        // so only an explicit message.timeout.ms can conflict.
        let txn = match self.get("transaction.timeout.ms") {
            Some(v) => match self.number("transaction.timeout.ms", v, out) {
                Some(n) => n.max(0) as u64,
                None => return,
            },
            None => 60_000,
        };
        let max = self.broker_max_transaction_timeout.as_millis() as u64;
        if txn > max {
            out.push(ConfigProblem::TransactionTimeoutTooLong { value: txn, max });
        }
        if let Some(v) = self.get("message.timeout.ms") {
            if let Some(m) = self.number("message.timeout.ms", v, out) {
                let m = m.max(0) as u64;
                if m > txn {
                    out.push(ConfigProblem::MessageTimeoutAboveTransactionTimeout {
                        message: m,
                        transaction: txn,
                    });
                }
            }
        }
    }

    /// Whether the configuration asks for idempotence (by builder, flag or transactions).
    fn is_idempotent(&self) -> bool {
        let txn = self
            .get("transactional.id")
            .is_some_and(|id| !id.trim().is_empty());
        self.mode != ProducerMode::Plain
            || self.get("enable.idempotence").map(str::trim) == Some("true")
            || txn
    }

    /// Every rule of the validator with its verdict on this configuration, in order (what
    /// `idemq kafka check-config` prints).
    pub fn explain(&self) -> Vec<(Rule, RuleVerdict)> {
        let problems = self.problems();
        let idempotent = self.is_idempotent();
        let txn_id_set = self.get("transactional.id").is_some();
        let transactional = txn_id_set || self.mode == ProducerMode::Transactional;
        Rule::ALL
            .iter()
            .map(|&rule| {
                let broken: Vec<ConfigProblem> = problems
                    .iter()
                    .filter(|p| p.rule() == Some(rule))
                    .cloned()
                    .collect();
                if !broken.is_empty() {
                    return (rule, RuleVerdict::Broken(broken));
                }
                let not_applicable = match rule {
                    Rule::AcksAll | Rule::InFlight | Rule::Retries if !idempotent => {
                        Some("not an idempotent producer")
                    }
                    Rule::IdempotenceKept if self.mode == ProducerMode::Plain => {
                        Some("no idempotent or transactional builder")
                    }
                    Rule::TransactionsNeedIdempotence if !txn_id_set => Some("no transactional.id"),
                    Rule::TransactionalId | Rule::TransactionTimeout | Rule::MessageTimeout
                        if !transactional =>
                    {
                        Some("not a transactional producer")
                    }
                    _ => None,
                };
                (
                    rule,
                    not_applicable.map_or(RuleVerdict::Holds, RuleVerdict::NotApplicable),
                )
            })
            .collect()
    }

    /// Refuses an unsafe configuration, naming every problem and its fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let problems = self.problems();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError { problems })
        }
    }

    /// The validated librdkafka configuration.
    pub fn client_config(&self) -> Result<ClientConfig, ConfigError> {
        self.validate()?;
        let mut c = ClientConfig::new();
        for (k, v) in &self.props {
            c.set(k, v);
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builders_are_valid_as_built() {
        assert_eq!(KafkaProducerConfig::idempotent("b:1").problems(), vec![]);
        assert_eq!(
            KafkaProducerConfig::transactional("b:1", "app-0").problems(),
            vec![]
        );
    }

    #[test]
    fn a_properties_file_round_trips() {
        let c = KafkaProducerConfig::from_properties(
            "# producer\nbootstrap.servers=b:1\nenable.idempotence = true\nacks: 1\n",
        )
        .unwrap();
        assert_eq!(c.mode(), ProducerMode::Idempotent);
        assert_eq!(
            c.problems(),
            vec![ConfigProblem::AcksBreakIdempotence { acks: "1".into() }]
        );
    }
}
