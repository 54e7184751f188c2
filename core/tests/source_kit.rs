//! The in-memory broker passes the source conformance kit, like every adapter must on its
//! real broker.
#![cfg(feature = "testkit")]

use async_trait::async_trait;
use idemq_core::broker::MemoryBroker;
use idemq_core::testkit::source::{SourceFixture, SourceHarness};
use idemq_core::{DeliveryOrder, Envelope, Publisher, Source};
use std::sync::Arc;
use std::time::Duration;

struct Memory;

struct MemoryFixture {
    broker: MemoryBroker,
}

#[async_trait]
impl SourceHarness for Memory {
    async fn fixture(&self, _scenario: &str) -> Box<dyn SourceFixture> {
        Box::new(MemoryFixture {
            broker: MemoryBroker::new(),
        })
    }
}

#[async_trait]
impl SourceFixture for MemoryFixture {
    fn publisher(&self) -> Arc<dyn Publisher> {
        Arc::new(self.broker.clone())
    }
    fn destination(&self) -> String {
        "kit".into()
    }
    async fn subscribe(&self) -> Box<dyn Source> {
        Box::new(self.broker.subscribe())
    }
    async fn subscribe_ordered(&self) -> Box<dyn Source> {
        self.broker.set_ordering(DeliveryOrder::PerPartition);
        Box::new(self.broker.subscribe())
    }
    async fn dead_letters(&self) -> Vec<(Envelope, String)> {
        self.broker
            .dead_letters()
            .into_iter()
            .map(|d| (d.envelope, d.reason))
            .collect()
    }
    fn nack_delay(&self) -> Duration {
        Duration::from_millis(200)
    }
    fn patience(&self) -> Duration {
        Duration::from_secs(10)
    }
    fn quiet(&self) -> Duration {
        Duration::from_millis(300)
    }
}

idemq_core::source_contract_tests!(async { Some(Arc::new(Memory) as Arc<dyn SourceHarness>) });
