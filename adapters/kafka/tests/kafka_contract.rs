//! The source conformance kit against the real Kafka broker.

mod support;

use async_trait::async_trait;
use idemq_core::envelope::Envelope;
use idemq_core::publish::Publisher;
use idemq_core::source::Source;
use idemq_core::testkit::source::{SourceFixture, SourceHarness};
use std::sync::Arc;
use std::time::Duration;

struct Kafka {
    brokers: String,
}

struct Fixture {
    brokers: String,
    topic: String,
    group: String,
    publisher: Arc<dyn Publisher>,
}

#[async_trait]
impl SourceHarness for Kafka {
    async fn fixture(&self, scenario: &str) -> Box<dyn SourceFixture> {
        let topic = support::unique(&format!("kit-{scenario}"));
        support::create_topic(&self.brokers, &topic, 1).await;
        support::create_topic(&self.brokers, &format!("{topic}.dlq"), 1).await;
        Box::new(Fixture {
            brokers: self.brokers.clone(),
            group: format!("{topic}-group"),
            publisher: Arc::new(support::publisher(&self.brokers).await),
            topic,
        })
    }
}

#[async_trait]
impl SourceFixture for Fixture {
    fn publisher(&self) -> Arc<dyn Publisher> {
        self.publisher.clone()
    }
    fn destination(&self) -> String {
        self.topic.clone()
    }
    async fn subscribe(&self) -> Box<dyn Source> {
        Box::new(support::subscribe(&self.brokers, &self.group, &self.topic).await)
    }
    async fn dead_letters(&self) -> Vec<(Envelope, String)> {
        let dlq = format!("{}.dlq", self.topic);
        support::read_all(&self.brokers, &dlq, Duration::from_millis(1500))
            .await
            .into_iter()
            .map(|e| {
                let why = e
                    .headers
                    .get_str(idemq_kafka::DLQ_REASON)
                    .unwrap_or_default()
                    .to_string();
                (e, why)
            })
            .collect()
    }
    fn quiet(&self) -> Duration {
        Duration::from_secs(3)
    }
}

idemq_core::source_contract_tests!(async {
    let brokers = idemq_core::testkit::servers::server_url("IDEMQ_TEST_KAFKA_BROKERS")?;
    Some(Arc::new(Kafka { brokers }) as Arc<dyn SourceHarness>)
});
