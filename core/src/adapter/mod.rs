//! The adapter kit: the pieces every broker adapter needs, written once.
//!
//! - [`ChannelSource`]: a cancel-safe [`Source`](crate::Source) over a channel, for clients
//!   that deliver through callbacks or their own runtime (RocketMQ's push consumer), with
//!   [`SettleRecorder`] to carry each delivery's settlement back to the callback thread.
//! - [`OffsetTracker`]: per-partition committable watermarks (commit only the contiguous
//!   prefix of settled offsets) with an assignment epoch, so settlements of a revoked
//!   partition do nothing; [`OffsetStore`], where a source starts an assigned partition when
//!   its consumed offsets live outside the broker (in the effects' database).
//! - [`DelayedRedelivery`]: a time-ordered buffer of nacked messages, redelivered locally after
//!   their delay by brokers that cannot delay natively (Kafka), keeping order per lane.
//! - [`SharedState`]: a source's state shared with its deliveries (a lock that does not
//!   poison, and a wake-up for `poll`), and [`HeldSettle`], the one mapping of ack / nack /
//!   reject onto sources that keep their own offsets and hold nacked messages locally
//!   ([`LocallyHeld`]).

mod channel;
mod delayed;
mod offsets;
mod shared;

pub use channel::{channel_source, ChannelSender, ChannelSource, SettleRecorder};
pub use delayed::DelayedRedelivery;
pub use offsets::{Epoch, OffsetStore, OffsetStoreError, OffsetTracker, PartitionId};
pub use shared::{HeldSettle, LocallyHeld, SharedState};
