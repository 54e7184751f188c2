//! Exposing idemq's metrics to Prometheus: install a recorder, run consumers, serve
//! `/metrics`. The Grafana dashboard in `docs/grafana-dashboard.json` reads these series.
//!
//! Needs no server: it runs the in-memory broker (with producer duplicates and lost acks)
//! and the memory store, then prints the exposition text once. With `--serve ADDR` it keeps
//! serving `GET /metrics` on ADDR for a Prometheus scrape while a producer keeps sending.
//!
//! ```text
//! cargo run --example prometheus
//! cargo run --example prometheus -- --serve 127.0.0.1:9898   # then curl 127.0.0.1:9898/metrics
//! ```
//!
//! Any `metrics` recorder works (StatsD, OpenTelemetry…); idemq only calls the `metrics`
//! facade, which costs nothing until a recorder is installed.

use idemq::broker::{Faults, MemoryBroker};
use idemq::{
    BrokerKind, ClaimedMessage, ConsumerConfig, DedupStore, Envelope, HandlerError,
    IdempotentConsumer, KeyStrategy, MemoryStore,
};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn publish(broker: &MemoryBroker, from: usize, n: usize) {
    for i in from..from + n {
        broker.publish(
            Envelope::new(BrokerKind::MEMORY, "orders", format!("order {i}"))
                .with_header("order-id", format!("o-{i}")),
        );
    }
}

/// Serves the exposition text on every connection (a scrape is one `GET /metrics`).
async fn serve(addr: &str, handle: PrometheusHandle) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    eprintln!("serving http://{addr}/metrics");
    loop {
        let (mut conn, _) = listener.accept().await?;
        let body = handle.render();
        tokio::spawn(async move {
            let mut request = [0u8; 1024];
            // The request line is all we need to answer; its contents do not matter here.
            let _ = conn.read(&mut request).await;
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = conn.write_all(head.as_bytes()).await;
            let _ = conn.write_all(body.as_bytes()).await;
        });
    }
}

/// Installs the Prometheus recorder and runs 1000 orders (with producer duplicates and
/// lost acks) through an idempotent consumer: the series the dashboard shows now exist.
pub async fn setup() -> Result<
    (
        PrometheusHandle,
        MemoryBroker,
        IdempotentConsumer<impl idemq::Handler>,
    ),
    Box<dyn std::error::Error>,
> {
    // Claim latency as a histogram with buckets (a summary by default).
    let handle = PrometheusBuilder::new()
        .set_buckets(&[
            0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
        ])?
        .install_recorder()?;
    let broker = MemoryBroker::with_seed(7);
    broker.set_faults(Faults {
        duplicate_publish_rate: 0.2,
        lost_ack_rate: 0.05,
    });
    publish(&broker, 0, 1000);
    let store: Arc<dyn DedupStore> = Arc::new(MemoryStore::new());
    let consumer = IdempotentConsumer::new(
        store,
        KeyStrategy::header("billing", "order-id")?,
        |_m: ClaimedMessage| async move { Ok::<_, HandlerError>(None) },
    )
    .with_config(ConsumerConfig {
        max_batch: 64,
        ..ConsumerConfig::default()
    });
    consumer.run_until_idle(&mut broker.subscribe()).await?;
    Ok((handle, broker, consumer))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let serve_at = std::env::args().skip_while(|a| a != "--serve").nth(1);
    let (handle, broker, consumer) = setup().await?;
    let Some(addr) = serve_at else {
        print!("{}", handle.render());
        return Ok(());
    };
    let server = tokio::spawn(async move { serve(&addr, handle).await });
    let mut next = 1000;
    loop {
        publish(&broker, next, 100);
        next += 100;
        consumer.run_until_idle(&mut broker.subscribe()).await?;
        if server.is_finished() {
            return Err("the metrics server stopped".into());
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
