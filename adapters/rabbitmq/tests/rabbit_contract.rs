//! The source conformance kit against the real RabbitMQ broker, on classic and on quorum
//! queues: each fixture declares a fresh queue, and reads its `<queue>.dlq` with `basic.get`.

mod support;

use async_trait::async_trait;
use idemq_core::envelope::Envelope;
use idemq_core::publish::Publisher;
use idemq_core::source::Source;
use idemq_core::testkit::source::{SourceFixture, SourceHarness};
use idemq_rabbitmq::{QueueType, DLQ_REASON};
use std::sync::Arc;

struct Rabbit {
    url: String,
    kind: QueueType,
}

struct QueueFixture {
    url: String,
    kind: QueueType,
    queue: String,
    publisher: Arc<dyn Publisher>,
}

#[async_trait]
impl SourceHarness for Rabbit {
    async fn fixture(&self, scenario: &str) -> Box<dyn SourceFixture> {
        let queue = support::fresh_queue(&format!("kit-{scenario}"));
        // The first subscription declares the queue; declare it now so that messages
        // published before any subscription are kept.
        drop(support::source(support::config(&self.url, &queue, self.kind)).await);
        Box::new(QueueFixture {
            url: self.url.clone(),
            kind: self.kind,
            publisher: Arc::new(support::publisher(&self.url).await),
            queue,
        })
    }
}

#[async_trait]
impl SourceFixture for QueueFixture {
    fn publisher(&self) -> Arc<dyn Publisher> {
        self.publisher.clone()
    }
    fn destination(&self) -> String {
        self.queue.clone()
    }
    async fn subscribe(&self) -> Box<dyn Source> {
        Box::new(support::source(support::config(&self.url, &self.queue, self.kind)).await)
    }
    async fn subscribe_ordered(&self) -> Box<dyn Source> {
        let cfg = support::config(&self.url, &self.queue, self.kind).ordered();
        Box::new(support::source(cfg).await)
    }
    async fn dead_letters(&self) -> Vec<(Envelope, String)> {
        let dlq = format!("{}.dlq", self.queue);
        support::take_all(&self.url, &dlq)
            .await
            .into_iter()
            .map(|e| {
                let why = e
                    .headers
                    .get_str(DLQ_REASON)
                    .unwrap_or_default()
                    .to_string();
                (e, why)
            })
            .collect()
    }
}

fn harness(kind: QueueType) -> Option<Arc<dyn SourceHarness>> {
    let url = support::amqp_url()?;
    Some(Arc::new(Rabbit { url, kind }) as Arc<dyn SourceHarness>)
}

mod classic {
    use super::*;
    idemq_core::source_contract_tests!(async { harness(QueueType::Classic) });
}

mod quorum {
    use super::*;
    idemq_core::source_contract_tests!(async { harness(QueueType::Quorum) });
}
