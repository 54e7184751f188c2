//! The Prometheus example's exposition and the Grafana dashboard (docs/grafana-dashboard.json)
//! agree with the metric names idemq records: a renamed metric breaks this test, not a
//! production dashboard.

#[allow(dead_code)]
#[path = "../examples/prometheus.rs"]
mod prometheus;

use idemq::core::metrics as m;

/// Every series name idemq records.
const RECORDED: [&str; 10] = [
    m::MESSAGES,
    m::DUPLICATES,
    m::CLAIM_SECONDS,
    m::IN_FLIGHT_CONFLICTS,
    m::LEASE_TAKEOVERS,
    m::FENCED_COMPLETIONS,
    m::STORE_ERRORS,
    m::PAYLOAD_CONFLICTS,
    m::SETTLE_FAILURES,
    m::READY,
];

#[tokio::test]
async fn the_example_exports_the_engines_series() {
    let (handle, _broker, consumer) = prometheus::setup().await.expect("example setup");
    let stats = consumer.stats();
    assert!(stats.processed == 1000 && stats.duplicates > 0, "{stats:?}");
    let text = handle.render();
    for want in [
        "idemq_messages_total{outcome=\"processed\",broker=\"memory\",group=\"billing\"} 1000",
        "message_duplicate_count{topic=\"orders\",group=\"billing\"}",
        "idemq_claim_seconds_bucket{group=\"billing\",le=\"0.001\"}",
    ] {
        assert!(text.contains(want), "no `{want}` in:\n{text}");
    }
}

#[test]
fn the_dashboard_queries_only_recorded_series() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/grafana-dashboard.json");
    let text = std::fs::read_to_string(path).expect("read the dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut used = std::collections::BTreeSet::new();
    for expr in panels
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str())
    {
        // Series names: idemq_* and seed 002's message_duplicate_count, minus the suffixes
        // Prometheus adds to a histogram's series.
        for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if word.starts_with("idemq_") || word == m::DUPLICATES {
                used.insert(word.trim_end_matches("_bucket").to_string());
            }
        }
    }
    let recorded: std::collections::BTreeSet<String> =
        RECORDED.iter().map(|s| s.to_string()).collect();
    let unknown: Vec<_> = used.difference(&recorded).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard queries unrecorded series: {unknown:?}"
    );
    let unshown: Vec<_> = recorded.difference(&used).collect();
    assert!(
        unshown.is_empty(),
        "recorded series without a panel: {unshown:?}"
    );
}
