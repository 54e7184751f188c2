//! A cancel-safe source over a channel, and settlements carried back to a callback thread.

use crate::source::{Delivery, Settle, Settlement, Source, SourceError};
use async_trait::async_trait;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// The sending half of a [`ChannelSource`]: the broker client's callback pushes deliveries.
#[derive(Debug, Clone)]
pub struct ChannelSender {
    tx: mpsc::Sender<Delivery>,
}

impl ChannelSender {
    /// Sends from async code; waits while the buffer is full (back-pressure on the client).
    /// Fails when the source is gone; the delivery is then dropped, which abandons it.
    pub async fn send(&self, d: Delivery) -> Result<(), SourceError> {
        self.tx
            .send(d)
            .await
            .map_err(|_| SourceError::Disconnected("the consuming source was closed".into()))
    }
    /// Sends from a blocking thread (a client's listener pool). Must not run on a tokio
    /// worker thread.
    pub fn blocking_send(&self, d: Delivery) -> Result<(), SourceError> {
        self.tx
            .blocking_send(d)
            .map_err(|_| SourceError::Disconnected("the consuming source was closed".into()))
    }
    /// True once the source was dropped or closed.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

type Closer =
    Box<dyn FnOnce() -> futures::future::BoxFuture<'static, Result<(), SourceError>> + Send>;

/// A [`Source`] fed through a bounded channel by a client that delivers through callbacks.
///
/// `poll` is cancel-safe: a delivery is either still in the channel or returned, never held
/// by a dropped future. The source ends (`Ok(None)`) when every [`ChannelSender`] is gone.
///
/// ```
/// use idemq_core::adapter::channel_source;
/// use idemq_core::source::Source;
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let (tx, mut src) = channel_source(16);
/// drop(tx);
/// assert!(src.poll(10).await.unwrap().is_none());
/// # });
/// ```
pub struct ChannelSource {
    rx: mpsc::Receiver<Delivery>,
    closer: Option<Closer>,
}

/// A channel source buffering up to `capacity` deliveries, and its sender.
pub fn channel_source(capacity: usize) -> (ChannelSender, ChannelSource) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    (ChannelSender { tx }, ChannelSource { rx, closer: None })
}

impl ChannelSource {
    /// Runs `close` when the engine closes the source (shut the client down, leave the group).
    pub fn on_close<F, Fut>(mut self, close: F) -> Self
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<(), SourceError>> + Send + 'static,
    {
        self.closer = Some(Box::new(move || Box::pin(close())));
        self
    }
}

#[async_trait]
impl Source for ChannelSource {
    async fn poll(&mut self, max: usize) -> Result<Option<Vec<Delivery>>, SourceError> {
        // recv is cancel-safe; everything after it is synchronous.
        let Some(first) = self.rx.recv().await else {
            return Ok(None);
        };
        let mut out = vec![first];
        while out.len() < max.max(1) {
            match self.rx.try_recv() {
                Ok(d) => out.push(d),
                Err(_) => break,
            }
        }
        Ok(Some(out))
    }

    async fn close(&mut self) -> Result<(), SourceError> {
        self.rx.close();
        // Deliveries still buffered are dropped, which abandons them (redeliverable).
        while self.rx.try_recv().is_ok() {}
        match self.closer.take() {
            Some(c) => c().await,
            None => Ok(()),
        }
    }
}

/// A [`Settle`] that reports the settlement over a oneshot channel, for clients whose
/// callback must return a status (RocketMQ's listener returns one per batch): the callback
/// creates one recorder per message, sends the deliveries, and waits for the receivers.
///
/// ```
/// use idemq_core::adapter::SettleRecorder;
/// use idemq_core::{BrokerKind, Delivery, Envelope, Settlement};
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let (settle, outcome) = SettleRecorder::new();
/// let d = Delivery::new(Envelope::new(BrokerKind::MEMORY, "q", "x"), Box::new(settle));
/// d.ack().await.unwrap();
/// assert_eq!(outcome.await.unwrap(), Settlement::Ack);
/// # });
/// ```
#[derive(Debug)]
pub struct SettleRecorder {
    tx: Option<oneshot::Sender<Settlement>>,
}

impl SettleRecorder {
    /// A recorder and the receiver of its settlement (an error on the receiver means the
    /// recorder vanished without settling: treat it as abandoned).
    pub fn new() -> (Self, oneshot::Receiver<Settlement>) {
        let (tx, rx) = oneshot::channel();
        (Self { tx: Some(tx) }, rx)
    }

    fn send(&mut self, s: Settlement) -> Result<(), SourceError> {
        match self.tx.take() {
            // The receiver is gone when the client gave up waiting (shutdown): the broker
            // redelivers, which the dedup store makes harmless.
            Some(tx) => tx.send(s).map_err(|_| {
                SourceError::Disconnected("the client stopped waiting for this settlement".into())
            }),
            None => Ok(()),
        }
    }
}

#[async_trait]
impl Settle for SettleRecorder {
    async fn ack(&mut self) -> Result<(), SourceError> {
        self.send(Settlement::Ack)
    }
    async fn nack(&mut self, redeliver_after: Duration) -> Result<(), SourceError> {
        self.send(Settlement::Nack(redeliver_after))
    }
    async fn reject(&mut self, reason: &str) -> Result<(), SourceError> {
        self.send(Settlement::Reject(reason.to_string()))
    }
    fn abandon(&mut self) {
        let _ = self.send(Settlement::Abandoned);
    }
    fn is_stale(&self) -> bool {
        self.tx.as_ref().is_some_and(|t| t.is_closed())
    }
}
