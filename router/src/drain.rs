//! Leaving a load balancer before stopping. On SIGTERM a server first drains: for the drain delay
//! it serves every route as before while `GET /ready` answers 503 `draining`, so that a load
//! balancer checking `/ready` marks it down and sends new requests elsewhere; only then does it
//! stop accepting connections and let the requests in flight (streams included) finish. The delay
//! must outlast the balancer's detection (its check interval times the failures it needs).
//!
//! Ctrl-C (SIGINT) skips the delay: whoever pressed it wants the server gone now. A second signal
//! during the delay cuts it short.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;

/// `--drain-delay-s` when not given: longer than a health check of 1 s needing 2 failures
/// (deploy/haproxy/haproxy.cfg) with room to spare, short enough for a rolling restart.
pub const DEFAULT_DRAIN_DELAY_S: u64 = 5;

/// Whether the server is draining; shared by the shutdown sequence (which sets it) and `/ready`
/// (which reads it). Once set it stays set: a draining server never becomes ready again.
#[derive(Debug, Clone, Default)]
pub struct Draining(Arc<AtomicBool>);

impl Draining {
    pub fn is_draining(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    fn begin(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopSignal {
    /// SIGINT, Ctrl-C.
    Interrupt,
    /// SIGTERM: what systemd, Kubernetes and `docker stop` send.
    Terminate,
}

impl fmt::Display for StopSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Interrupt => "SIGINT",
            Self::Terminate => "SIGTERM",
        })
    }
}

/// The signals that stop a server, in the order they arrive. The handlers are installed when this
/// is made, so a signal sent before the server is up is kept rather than killing the process.
pub struct StopSignals(mpsc::UnboundedReceiver<StopSignal>);

impl StopSignals {
    /// Listens for SIGINT and SIGTERM (Ctrl-C where there are no Unix signals). Within a Tokio
    /// runtime.
    pub fn install() -> std::io::Result<Self> {
        let (tx, signals) = Self::channel();
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let mut interrupt = signal(SignalKind::interrupt())?;
            let mut terminate = signal(SignalKind::terminate())?;
            tokio::spawn(async move {
                loop {
                    let received = tokio::select! {
                        _ = interrupt.recv() => StopSignal::Interrupt,
                        _ = terminate.recv() => StopSignal::Terminate,
                    };
                    if tx.send(received).is_err() {
                        return;
                    }
                }
            });
        }
        #[cfg(not(unix))]
        tokio::spawn(async move {
            while tokio::signal::ctrl_c().await.is_ok() {
                if tx.send(StopSignal::Interrupt).is_err() {
                    return;
                }
            }
        });
        Ok(signals)
    }

    /// Signals sent by hand on the returned sender, for tests.
    pub fn channel() -> (mpsc::UnboundedSender<StopSignal>, Self) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, Self(rx))
    }

    /// The next signal; never, once no more can come.
    async fn next(&mut self) -> StopSignal {
        match self.0.recv().await {
            Some(signal) => signal,
            None => std::future::pending().await,
        }
    }
}

/// Resolves when the server is to stop accepting connections: at once on SIGINT or with no
/// delay; on SIGTERM only after `delay`, with `draining` set from the signal on (or at a second
/// signal, whichever comes first).
pub async fn stop_after_drain(mut signals: StopSignals, draining: Draining, delay: Duration) {
    let first = signals.next().await;
    if first == StopSignal::Terminate && !delay.is_zero() {
        draining.begin();
        tracing::info!(
            "{first}: draining for {delay:?}: /ready answers 503 while every request is still served"
        );
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            again = signals.next() => tracing::info!("{again}: the drain delay is cut short"),
        }
    }
    tracing::info!("{first}: no new connections; finishing the requests in flight");
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    const DELAY: Duration = Duration::from_millis(300);

    /// Starts the shutdown sequence; the instant it resolved arrives on the returned channel.
    fn start(
        delay: Duration,
    ) -> (
        mpsc::UnboundedSender<StopSignal>,
        Draining,
        tokio::sync::oneshot::Receiver<Instant>,
    ) {
        let (tx, signals) = StopSignals::channel();
        let draining = Draining::default();
        let (done, stopped) = tokio::sync::oneshot::channel();
        let flag = draining.clone();
        tokio::spawn(async move {
            stop_after_drain(signals, flag, delay).await;
            let _ = done.send(Instant::now());
        });
        (tx, draining, stopped)
    }

    #[tokio::test]
    async fn sigterm_drains_for_the_delay_then_stops() {
        let (tx, draining, stopped) = start(DELAY);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!draining.is_draining(), "draining before any signal");
        let sent = Instant::now();
        tx.send(StopSignal::Terminate).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(draining.is_draining());
        let stopped = stopped.await.unwrap();
        assert!(
            stopped - sent >= DELAY,
            "stopped after {:?}",
            stopped - sent
        );
        assert!(draining.is_draining(), "a drained server stays unready");
    }

    #[tokio::test]
    async fn sigint_and_a_zero_delay_stop_at_once_without_draining() {
        for (signal, delay) in [
            (StopSignal::Interrupt, DELAY),
            (StopSignal::Terminate, Duration::ZERO),
        ] {
            let (tx, draining, stopped) = start(delay);
            let sent = Instant::now();
            tx.send(signal).unwrap();
            let stopped = stopped.await.unwrap();
            assert!(
                stopped - sent < DELAY,
                "{signal} waited {:?}",
                stopped - sent
            );
            assert!(!draining.is_draining(), "{signal} with {delay:?}");
        }
    }

    #[tokio::test]
    async fn a_second_signal_cuts_the_delay_short() {
        let (tx, draining, stopped) = start(Duration::from_secs(60));
        tx.send(StopSignal::Terminate).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(draining.is_draining());
        let sent = Instant::now();
        tx.send(StopSignal::Interrupt).unwrap();
        let stopped = stopped.await.unwrap();
        assert!(stopped - sent < DELAY, "waited {:?}", stopped - sent);
    }
}
