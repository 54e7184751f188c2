//! The source conformance kit against real RabbitMQ streams (feature `streams`): each
//! fixture creates a fresh stream and consumer name; its publisher is an unnamed stream
//! producer; dead letters are read from `<stream>.dlq`.

mod support;

use async_trait::async_trait;
use idemq_core::envelope::Envelope;
use idemq_core::publish::Publisher;
use idemq_core::source::Source;
use idemq_core::testkit::source::{SourceFixture, SourceHarness};
use idemq_rabbitmq::stream::{
    read_stream, StreamPublisher, StreamPublisherConfig, StreamSource, StreamSourceConfig,
};
use idemq_rabbitmq::DLQ_REASON;
use std::sync::Arc;
use std::time::Duration;

struct Streams {
    url: String,
}

struct StreamFixture {
    url: String,
    stream: String,
    consumer_name: String,
    publisher: Arc<dyn Publisher>,
}

#[async_trait]
impl SourceHarness for Streams {
    async fn fixture(&self, scenario: &str) -> Box<dyn SourceFixture> {
        let stream = support::fresh_queue(&format!("stream-kit-{scenario}"));
        let publisher = StreamPublisher::connect(StreamPublisherConfig::new(&self.url, &stream))
            .await
            .unwrap_or_else(|e| panic!("stream publisher for {stream}: {e}"));
        Box::new(StreamFixture {
            url: self.url.clone(),
            consumer_name: format!("{stream}.consumer"),
            publisher: Arc::new(publisher),
            stream,
        })
    }
}

#[async_trait]
impl SourceFixture for StreamFixture {
    fn publisher(&self) -> Arc<dyn Publisher> {
        self.publisher.clone()
    }
    fn destination(&self) -> String {
        self.stream.clone()
    }
    async fn subscribe(&self) -> Box<dyn Source> {
        let cfg = StreamSourceConfig::new(&self.url, &self.stream, &self.consumer_name);
        Box::new(
            StreamSource::connect(cfg)
                .await
                .unwrap_or_else(|e| panic!("stream source on {}: {e}", self.stream)),
        )
    }
    async fn dead_letters(&self) -> Vec<(Envelope, String)> {
        let dlq = format!("{}.dlq", self.stream);
        read_stream(&self.url, &dlq, Duration::from_millis(500))
            .await
            .unwrap_or_else(|e| panic!("read {dlq}: {e}"))
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

fn harness() -> Option<Arc<dyn SourceHarness>> {
    let url = support::stream_url()?;
    Some(Arc::new(Streams { url }) as Arc<dyn SourceHarness>)
}

idemq_core::source_contract_tests!(async { harness() });
