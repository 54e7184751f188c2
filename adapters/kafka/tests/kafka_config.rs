//! Every rule of the producer-config validator: the unsafe configuration is refused with a
//! message that names the key and the fix.

use idemq_kafka::{ConfigProblem, KafkaProducerConfig, ProducerMode};
use std::time::Duration;

const B: &str = "127.0.0.1:19092";

fn refused(cfg: &KafkaProducerConfig, expected: &str) {
    let err = cfg
        .validate()
        .expect_err("an unsafe configuration must be refused");
    let text = err.to_string();
    assert!(
        text.contains(expected),
        "message {text:?} must contain {expected:?}"
    );
    assert!(
        cfg.client_config().is_err(),
        "no client from a refused config"
    );
}

#[test]
fn acks_1_with_idempotence_is_refused_naming_acks_all() {
    refused(
        &KafkaProducerConfig::idempotent(B).set("acks", "1"),
        "acks=1 breaks idempotence: use acks=all",
    );
    refused(
        &KafkaProducerConfig::idempotent(B)
            .unset("acks")
            .set("request.required.acks", "0"),
        "acks=0 breaks idempotence: use acks=all",
    );
}

#[test]
fn more_than_five_in_flight_with_idempotence_is_refused() {
    refused(
        &KafkaProducerConfig::idempotent(B).set("max.in.flight.requests.per.connection", "6"),
        "max.in.flight.requests.per.connection=6 breaks idempotence",
    );
    refused(
        &KafkaProducerConfig::idempotent(B)
            .unset("max.in.flight.requests.per.connection")
            .set("max.in.flight", "10"),
        "use max.in.flight=5 or less",
    );
}

#[test]
fn retries_0_with_idempotence_is_refused() {
    refused(
        &KafkaProducerConfig::idempotent(B).set("retries", "0"),
        "retries=0 breaks idempotence",
    );
    refused(
        &KafkaProducerConfig::idempotent(B).set("message.send.max.retries", "0"),
        "message.send.max.retries=0 breaks idempotence",
    );
}

#[test]
fn transactional_id_with_idempotence_disabled_is_refused() {
    let plain = KafkaProducerConfig::new(B)
        .set("transactional.id", "billing-0")
        .set("enable.idempotence", "false");
    refused(
        &plain,
        "transactional.id=billing-0 with enable.idempotence=false: transactions require idempotence; remove enable.idempotence=false",
    );
}

#[test]
fn the_idempotent_builder_overridden_with_idempotence_off_is_refused() {
    refused(
        &KafkaProducerConfig::idempotent(B).set("enable.idempotence", "false"),
        "enable.idempotence=false contradicts the idempotent() builder",
    );
}

#[test]
fn a_transactional_config_without_an_id_is_refused() {
    refused(
        &KafkaProducerConfig::transactional(B, ""),
        "transactional.id is missing or empty",
    );
    refused(
        &KafkaProducerConfig::transactional(B, "x").unset("transactional.id"),
        "transactional.id is missing or empty",
    );
}

#[test]
fn a_transaction_timeout_above_the_brokers_max_is_refused() {
    refused(
        &KafkaProducerConfig::transactional(B, "t").set("transaction.timeout.ms", "900001"),
        "transaction.timeout.ms=900001 exceeds the broker's transaction.max.timeout.ms=900000",
    );
    let lowered = KafkaProducerConfig::transactional(B, "t")
        .set("transaction.timeout.ms", "120000")
        .broker_max_transaction_timeout(Duration::from_secs(60));
    refused(&lowered, "use transaction.timeout.ms=60000 or less");
}

#[test]
fn a_message_timeout_above_the_transaction_timeout_is_refused() {
    refused(
        &KafkaProducerConfig::transactional(B, "t")
            .set("transaction.timeout.ms", "30000")
            .set("message.timeout.ms", "60000"),
        "message.timeout.ms=60000 exceeds transaction.timeout.ms=30000",
    );
}

#[test]
fn a_missing_bootstrap_and_a_non_number_are_refused() {
    refused(
        &KafkaProducerConfig::idempotent(""),
        "bootstrap.servers is missing",
    );
    refused(
        &KafkaProducerConfig::idempotent(B).set("max.in.flight.requests.per.connection", "five"),
        "max.in.flight.requests.per.connection=five is not a number",
    );
}

#[test]
fn every_problem_is_reported_at_once() {
    let cfg = KafkaProducerConfig::idempotent(B)
        .set("acks", "1")
        .set("max.in.flight.requests.per.connection", "20")
        .set("retries", "0");
    let err = cfg.validate().unwrap_err();
    assert_eq!(err.problems.len(), 3, "{err}");
}

#[test]
fn a_properties_file_is_checked_by_what_it_enables() {
    let cfg = KafkaProducerConfig::from_properties(
        "bootstrap.servers=b:1\ntransactional.id=pay-1\nacks=1\n",
    )
    .unwrap();
    assert_eq!(cfg.mode(), ProducerMode::Transactional);
    assert_eq!(
        cfg.problems(),
        vec![ConfigProblem::AcksBreakIdempotence { acks: "1".into() }]
    );
    let bad = KafkaProducerConfig::from_properties("bootstrap.servers=b:1\nnonsense\n");
    assert!(bad
        .unwrap_err()
        .to_string()
        .contains("line 2 is not key=value"));
    // A plain producer that asks for nothing is not second-guessed.
    assert!(KafkaProducerConfig::new(B)
        .set("acks", "1")
        .validate()
        .is_ok());
}

#[test]
fn safe_configurations_pass() {
    assert!(KafkaProducerConfig::idempotent(B).validate().is_ok());
    assert!(KafkaProducerConfig::transactional(B, "billing-0")
        .set("transaction.timeout.ms", "60000")
        .set("message.timeout.ms", "30000")
        .validate()
        .is_ok());
    assert!(KafkaProducerConfig::idempotent(B)
        .set("acks", "-1")
        .set("max.in.flight", "1")
        .validate()
        .is_ok());
}

/// `explain` (what `idemq kafka check-config` prints) gives every rule a verdict: each bad
/// configuration breaks exactly its rule, with the same message `validate` gives.
#[test]
fn explain_gives_every_rule_a_verdict_and_blames_the_right_one() {
    use idemq_kafka::{Rule, RuleVerdict};
    let safe = KafkaProducerConfig::transactional(B, "app-0");
    let verdicts = safe.explain();
    assert_eq!(
        verdicts.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
        Rule::ALL.to_vec()
    );
    assert!(
        verdicts.iter().all(|(_, v)| *v == RuleVerdict::Holds),
        "{verdicts:?}"
    );
    let plain = KafkaProducerConfig::new(B).explain();
    assert_eq!(plain[0], (Rule::Bootstrap, RuleVerdict::Holds));
    assert!(plain[1..]
        .iter()
        .all(|(_, v)| matches!(v, RuleVerdict::NotApplicable(_))));

    let cases = [
        (KafkaProducerConfig::idempotent(""), Rule::Bootstrap),
        (
            KafkaProducerConfig::idempotent(B).set("acks", "1"),
            Rule::AcksAll,
        ),
        (
            KafkaProducerConfig::idempotent(B)
                .unset("max.in.flight.requests.per.connection")
                .set("max.in.flight", "9"),
            Rule::InFlight,
        ),
        (
            KafkaProducerConfig::idempotent(B).set("retries", "0"),
            Rule::Retries,
        ),
        (
            KafkaProducerConfig::idempotent(B).set("enable.idempotence", "false"),
            Rule::IdempotenceKept,
        ),
        (
            KafkaProducerConfig::new(B)
                .set("transactional.id", "x")
                .set("enable.idempotence", "false"),
            Rule::TransactionsNeedIdempotence,
        ),
        (
            KafkaProducerConfig::transactional(B, " "),
            Rule::TransactionalId,
        ),
        (
            KafkaProducerConfig::transactional(B, "a").set("transaction.timeout.ms", "900001"),
            Rule::TransactionTimeout,
        ),
        (
            KafkaProducerConfig::transactional(B, "a").set("message.timeout.ms", "60001"),
            Rule::MessageTimeout,
        ),
    ];
    for (cfg, rule) in cases {
        let err = cfg.validate().expect_err("unsafe");
        let broken: Vec<_> = cfg
            .explain()
            .into_iter()
            .filter_map(|(r, v)| match v {
                RuleVerdict::Broken(p) => Some((r, p)),
                _ => None,
            })
            .collect();
        assert_eq!(
            broken.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
            vec![rule],
            "{cfg:?}"
        );
        for p in &broken[0].1 {
            assert!(err.to_string().contains(&p.to_string()));
        }
    }
}
