//! [`LeaseWatchdog`]: this crate's name for the core's lease keep-alive
//! ([`idemq_core::LeaseKeepAlive`]), kept so code written against it still reads the same.
//!
//! There is one implementation, in the core beside the consumer engine's heartbeat: every
//! extend is bounded by a timeout, and the lease is declared lost on this process's
//! monotonic clock when no extend has succeeded by (one interval before) its end, so a
//! store that hangs never leaves a lease looking held. See [`LeaseWatchdog::spawn`].

pub use idemq_core::engine::{LeaseKeepAlive as LeaseWatchdog, LeaseState, LossCause as LeaseLost};
