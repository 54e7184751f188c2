#![recursion_limit = "512"]
//! The source conformance kit against the real (rocketmq-rust) name server and broker, in
//! concurrent consumption (orderly for the ordered scenario): each fixture has its own topic and consumer group, and
//! reads `%DLQ%<group>` with a background consumer started at the first look.

mod support;

use async_trait::async_trait;
use idemq_core::envelope::Envelope;
use idemq_core::publish::Publisher;
use idemq_core::source::Source;
use idemq_core::testkit::source::{SourceFixture, SourceHarness};
use idemq_rocketmq::{RocketSourceConfig, DLQ_REASON, MIN_RECONSUME_DELAY};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OnceCell;

struct Rocket {
    namesrv: String,
}

struct TopicFixture {
    namesrv: String,
    topic: String,
    group: String,
    publisher: Arc<dyn Publisher>,
    dlq: OnceCell<support::Collector>,
}

impl TopicFixture {
    fn config(&self) -> RocketSourceConfig {
        RocketSourceConfig::new(&self.namesrv, &self.group, &self.topic)
    }
}

#[async_trait]
impl SourceHarness for Rocket {
    async fn fixture(&self, scenario: &str) -> Box<dyn SourceFixture> {
        let scenario = scenario.replace(|c: char| !c.is_ascii_alphanumeric(), "_");
        Box::new(TopicFixture {
            namesrv: self.namesrv.clone(),
            topic: support::unique(&format!("kit_{scenario}")),
            group: support::unique(&format!("kitcg_{scenario}")),
            publisher: Arc::new(support::publisher(&self.namesrv).await),
            dlq: OnceCell::new(),
        })
    }
}

#[async_trait]
impl SourceFixture for TopicFixture {
    async fn subscribe_ordered(&self) -> Box<dyn Source> {
        Box::new(support::source(self.config().orderly()).await)
    }
    async fn subscribe(&self) -> Box<dyn Source> {
        Box::new(support::source(self.config()).await)
    }
    fn destination(&self) -> String {
        self.topic.clone()
    }
    fn publisher(&self) -> Arc<dyn Publisher> {
        self.publisher.clone()
    }
    async fn dead_letters(&self) -> Vec<(Envelope, String)> {
        let topic = self.config().dead_letter_topic();
        let reader = self
            .dlq
            .get_or_init(|| support::Collector::start(&self.namesrv, &topic))
            .await;
        let mut dead = Vec::new();
        for e in reader.snapshot() {
            let reason = e.headers.get_str(DLQ_REASON).map(str::to_string);
            dead.push((e, reason.unwrap_or_default()));
        }
        dead
    }
    /// What the broker honours for a concurrently consumed nack: its first reconsume level.
    fn nack_delay(&self) -> Duration {
        MIN_RECONSUME_DELAY
    }
    /// Group joins and rebalances take seconds; reconsume levels 10 s, 30 s, 1 min.
    fn patience(&self) -> Duration {
        Duration::from_secs(90)
    }
    fn quiet(&self) -> Duration {
        Duration::from_secs(4)
    }
}

/// Concurrent consumption for the kit's scenarios, orderly for its ordered one.
async fn rocket() -> Option<Arc<dyn SourceHarness>> {
    let namesrv = support::namesrv()?;
    Some(Arc::new(Rocket { namesrv }) as Arc<dyn SourceHarness>)
}

idemq_core::source_contract_tests!(rocket());
