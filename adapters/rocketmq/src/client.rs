//! The process-wide RocketMQ client environment: the client's own runtime, and a small
//! bridge runtime of ours for work that must not run on a caller's (possibly ending) runtime.

use crate::RocketError;
use rocketmq_client_rust::{ClientConfig, ClientRuntime, ClientRuntimeConfig};
use rocketmq_observability::TelemetryRuntimeGuard;
use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// The client runtime and our bridge runtime, built once per process and kept for its life
/// (their owners are never dropped: a runtime dropped inside async code panics).
pub(crate) struct ClientEnv {
    pub(crate) client: Arc<ClientRuntime>,
    pub(crate) bridge: tokio::runtime::Handle,
}

/// The parallelism the client's blocking lanes are sized for (128 listener calls at once).
const LANE_PARALLELISM: usize = 64;

static ENV: OnceLock<Result<ClientEnv, String>> = OnceLock::new();

fn build() -> Result<ClientEnv, String> {
    // Listener calls run on the client's metadata-io blocking lane, whose default width is
    // 2 x cores (4 here, for every consumer of the process) and which they hold while the
    // engine settles: size the lanes as for 64 cores, keep few async workers.
    let mut config = RuntimeConfig::for_parallelism("idemq-rocketmq-client", LANE_PARALLELISM);
    // A listener call lasts as long as the engine keeps its message: a held nack's back-off
    // (minutes), a store outage (as long as it lasts). Past the lane's task budget (30 s by
    // default) the client stops waiting for the call while it still runs: it gives the
    // message back to the broker (a second copy, one reconsume spent) and frees the consume
    // thread's permit for the next message, so more calls than `consume_threads` wait at
    // once. The budget is the consumer's consume timeout instead.
    config.blocking_lane_policies.metadata_io.task_timeout = crate::source::CONSUME_TIMEOUT;
    config.worker_threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, 8);
    let owner = RuntimeOwner::plan(config)
        .map_err(|e| format!("client runtime plan: {e}"))?
        .build()
        .map_err(|e| format!("client runtime: {e}"))?;
    // No global subscriber of the client's own: the application's tracing setup stays.
    let telemetry = TelemetryRuntimeGuard::noop();
    let client = ClientRuntime::try_new(
        owner.root_context().component("idemq-rocketmq"),
        ClientRuntimeConfig::default(),
        telemetry.handle(),
    )
    .map_err(|e| format!("client runtime: {e}"))?;
    let bridge = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("idemq-rocketmq-bridge")
        .enable_all()
        .build()
        .map_err(|e| format!("bridge runtime: {e}"))?;
    let handle = bridge.handle().clone();
    std::mem::forget(bridge);
    std::mem::forget(owner);
    std::mem::forget(telemetry);
    Ok(ClientEnv {
        client,
        bridge: handle,
    })
}

/// The shared client environment, built on first use.
pub(crate) fn env() -> Result<&'static ClientEnv, RocketError> {
    ENV.get_or_init(build)
        .as_ref()
        .map_err(|e| RocketError::Client(e.clone()))
}

/// The process-wide RocketMQ client runtime the adapter's consumers and producers run on,
/// for clients of your own beside them (a hand-written consumer, a benchmark baseline):
/// `DefaultMQPushConsumer::builder(client_runtime()?)`.
pub fn client_runtime() -> Result<Arc<ClientRuntime>, RocketError> {
    Ok(env()?.client.clone())
}

/// A client config for `name_server` with an instance name of its own and offsets persisted
/// every second, as the adapter's own clients use.
pub fn client_config(name_server: &str) -> Result<ClientConfig, RocketError> {
    own_client(name_server)
}

static NEXT_INSTANCE: AtomicUsize = AtomicUsize::new(0);

/// A client config with an instance name of its own: two members of one group in one
/// process (a restart, a test) must not share a client id, or they rebalance as one and the
/// second registration of a group is refused. Offsets are persisted every second.
pub(crate) fn own_client(name_server: &str) -> Result<ClientConfig, RocketError> {
    let n = NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed);
    ClientConfig::builder()
        .namesrv_addr(name_server.to_string())
        .instance_name(format!("idemq-{}-{n}", std::process::id()))
        .persist_consumer_offset_interval(1_000)
        .build()
        .map_err(|e| RocketError::Config(format!("client config for {name_server}: {e}")))
}
