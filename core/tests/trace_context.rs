//! W3C trace context through the engine: the handler's span and a duplicate's span carry
//! the message's `traceparent`, so a producer resend shows up in the original's trace.

use idemq_core::broker::MemoryBroker;
use idemq_core::{
    BrokerKind, ClaimedMessage, DedupStore, Envelope, HandlerError, IdempotentConsumer,
    KeyStrategy, MemoryStore, TRACEPARENT_HEADER,
};
use std::sync::{Arc, Mutex};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

/// (span name, traceparent) of every idemq span that recorded one.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<(String, String)>>>);

struct TraceparentOf<'a>(&'a mut Option<String>);

impl Visit for TraceparentOf<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "traceparent" {
            *self.0 = Some(value.to_string());
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "traceparent" {
            *self.0 = Some(format!("{value:?}"));
        }
    }
}

impl<S> Layer<S> for Spans
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut tp = None;
        attrs.record(&mut TraceparentOf(&mut tp));
        self.note(ctx.span(id).map(|s| s.name()), tp);
    }
    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let mut tp = None;
        values.record(&mut TraceparentOf(&mut tp));
        self.note(ctx.span(id).map(|s| s.name()), tp);
    }
}

impl Spans {
    fn note(&self, name: Option<&str>, tp: Option<String>) {
        if let (Some(name), Some(tp)) = (name, tp) {
            if let Ok(mut v) = self.0.lock() {
                v.push((name.to_string(), tp));
            }
        }
    }
    fn of(&self, name: &str) -> Vec<String> {
        self.0
            .lock()
            .map(|v| {
                v.iter()
                    .filter(|(n, _)| n == name)
                    .map(|(_, t)| t.clone())
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[tokio::test]
async fn the_handler_and_duplicate_spans_carry_the_messages_trace_context() {
    let spans = Spans::default();
    let subscriber = tracing_subscriber::registry().with(spans.clone());
    let _guard = tracing::subscriber::set_default(subscriber);

    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let broker = MemoryBroker::new();
    let message = || {
        Envelope::new(BrokerKind::MEMORY, "payments", "{}")
            .with_header("k", "pay-1")
            .with_header(TRACEPARENT_HEADER, tp)
    };
    broker.publish(message());
    // A malformed context is not recorded (nor passed on as if it were one).
    broker.publish(
        Envelope::new(BrokerKind::MEMORY, "payments", "{}")
            .with_header("k", "pay-2")
            .with_header(TRACEPARENT_HEADER, "00-not-a-trace-01"),
    );
    let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    let consumer = IdempotentConsumer::new(
        store,
        KeyStrategy::header("billing", "k").expect("strategy"),
        |_m: ClaimedMessage| async move { Ok::<_, HandlerError>(None) },
    );
    consumer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("first run");
    // The provider resends pay-1 with the same trace context.
    broker.publish(message());
    consumer
        .run_until_idle(&mut broker.subscribe())
        .await
        .expect("second run");

    assert_eq!(consumer.stats().processed, 2);
    assert_eq!(consumer.stats().duplicates, 1);
    assert_eq!(
        spans.of("idemq.handle"),
        vec![tp.to_string()],
        "only pay-1's is well-formed"
    );
    assert_eq!(spans.of("idemq.duplicate"), vec![tp.to_string()]);
}
