//! [`StoreConn`]: the store's connection, one server or a Redis Cluster.

use crate::cluster::ClusterHandle;
use crate::errors::store_err;
use idemq_core::StoreError;
use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, Pipeline, RedisFuture, Value};
use std::sync::Arc;

/// The store's connection: one server (reconnecting) or a Redis Cluster (routing each
/// command by its key's slot, following `MOVED`/`ASK`, refreshing the slot map).
// Not boxed: the connection is cloned for every request, and a boxed manager would be an
// allocation per clone; one store holds one of these.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub(crate) enum StoreConn {
    Single(ConnectionManager),
    Cluster(Arc<ClusterHandle>),
}

impl ConnectionLike for StoreConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(h) => Box::pin(async move {
                h.call(|mut c| async move { c.req_packed_command(cmd).await })
                    .await
            }),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(h) => Box::pin(async move {
                h.call(|mut c| async move { c.req_packed_commands(cmd, offset, count).await })
                    .await
            }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(_) => 0,
        }
    }
}

impl StoreConn {
    /// A keyless command (`TIME`, `INFO`, `CONFIG GET`) answered by one node: on a cluster
    /// any node, not the aggregate of all of them.
    pub(crate) async fn query_one<T: redis::FromRedisValue>(
        &self,
        cmd: &Cmd,
    ) -> Result<T, StoreError> {
        let v = match self {
            Self::Single(c) => c.clone().req_packed_command(cmd).await,
            Self::Cluster(h) => {
                h.call(|mut c| async move {
                    c.route_command(cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random))
                        .await
                })
                .await
            }
        }
        .map_err(store_err)?;
        redis::from_owned_redis_value(v).map_err(store_err)
    }
}
