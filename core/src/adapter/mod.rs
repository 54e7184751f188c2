//! The adapter kit: the pieces every broker adapter needs, written once.
//!
//! - [`ChannelSource`]: a cancel-safe [`Source`](crate::Source) over a channel, for clients
//!   that deliver through callbacks or their own runtime (RocketMQ's push consumer), with
//!   [`SettleRecorder`] to carry each delivery's settlement back to the callback thread.
//! - [`OffsetTracker`]: per-partition committable watermarks (commit only the contiguous
//!   prefix of settled offsets) with an assignment epoch, so settlements of a revoked
//!   partition do nothing.
//! - [`DelayedRedelivery`]: a time-ordered buffer of nacked messages, redelivered locally after
//!   their delay by brokers that cannot delay natively (Kafka), keeping order per lane.

mod channel;
mod delayed;
mod offsets;

pub use channel::{channel_source, ChannelSender, ChannelSource, SettleRecorder, Settlement};
pub use delayed::DelayedRedelivery;
pub use offsets::{Epoch, OffsetTracker, PartitionId};
