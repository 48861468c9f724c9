//! Process signals: the one cancellation root, and SIGHUP as events.
//!
//! [`Signals::install`] takes over SIGTERM, SIGINT and SIGHUP at once (so
//! none of them keeps its default disposition, which kills the process,
//! once the gateway is starting) and listens on one supervised task:
//! - SIGTERM and SIGINT cancel [`Signals::shutdown`], the token
//!   [`crate::server::Server::run`] drains on. Later ones are logged only.
//! - SIGHUP never stops anything: it bumps a counter that
//!   [`Signals::hangups`] subscribers watch (`serve` reloads its
//!   configuration, see [`crate::server::reload`]). With no subscriber (the demo) it
//!   is logged as ignored.
//!
//! The token is cancelled before anything is logged, so the drain never
//! depends on the log (see [`crate::telemetry::logging`]).

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

#[derive(Debug, thiserror::Error)]
#[error("cannot install the {signal} handler: {source}")]
pub struct SignalError {
    signal: &'static str,
    source: std::io::Error,
}

/// The process's signal handling; dropping it stops the listening task (the
/// handlers stay installed, so a late SIGHUP still does not kill).
#[derive(Debug)]
pub struct Signals {
    shutdown: CancellationToken,
    /// How many SIGHUPs arrived so far.
    hangups: watch::Sender<u64>,
    _task: AbortOnDropHandle<()>,
}

impl Signals {
    /// Installs the handlers and starts listening. Call it inside a Tokio
    /// runtime with its I/O driver enabled, before the slow part of start-up.
    pub fn install() -> Result<Signals, SignalError> {
        let handler = |kind: SignalKind, name: &'static str| signal(kind).map_err(|source| SignalError { signal: name, source });
        let term = handler(SignalKind::terminate(), "SIGTERM")?;
        let int = handler(SignalKind::interrupt(), "SIGINT")?;
        let hup = handler(SignalKind::hangup(), "SIGHUP")?;
        let shutdown = CancellationToken::new();
        let (hangups, _) = watch::channel(0);
        let task = tokio::spawn(listen(term, int, hup, shutdown.clone(), hangups.clone()));
        Ok(Signals { shutdown, hangups, _task: AbortOnDropHandle::new(task) })
    }

    /// The cancellation root: cancelled on the first SIGTERM or SIGINT.
    pub fn shutdown(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// SIGHUP events: the value is the number received so far and changes
    /// with each one. Holding a receiver marks SIGHUP as handled, so it is no
    /// longer logged as ignored.
    pub fn hangups(&self) -> watch::Receiver<u64> {
        self.hangups.subscribe()
    }
}

async fn listen(mut term: Signal, mut int: Signal, mut hup: Signal, shutdown: CancellationToken, hangups: watch::Sender<u64>) {
    loop {
        let name = tokio::select! {
            Some(()) = term.recv() => "SIGTERM",
            Some(()) = int.recv() => "SIGINT",
            Some(()) = hup.recv() => {
                hangup(&hangups);
                continue;
            }
            // The runtime is shutting down.
            else => return,
        };
        let first = !shutdown.is_cancelled();
        shutdown.cancel();
        if first {
            tracing::info!(signal = name, "shutting down");
        } else {
            tracing::info!(signal = name, "already shutting down");
        }
    }
}

fn hangup(hangups: &watch::Sender<u64>) {
    hangups.send_modify(|n| *n += 1);
    if hangups.receiver_count() == 0 {
        tracing::warn!(signal = "SIGHUP", "SIGHUP ignored: this command does not reload; configuration unchanged");
    } else {
        tracing::info!(signal = "SIGHUP", "SIGHUP received");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    // These send signals to the test process itself, which is safe only
    // because `install` has taken them over first. They run serially in one
    // test so that no other test in this binary sees a signal without a
    // handler.
    #[tokio::test]
    async fn hup_is_an_event_and_term_cancels() {
        let signals = Signals::install().unwrap();
        let mut hups = signals.hangups();
        let shutdown = signals.shutdown();
        let pid = std::process::id().to_string();
        let kill = |sig: &str| assert!(std::process::Command::new("kill").arg(sig).arg(&pid).status().unwrap().success());

        kill("-HUP");
        tokio::time::timeout(Duration::from_secs(10), hups.changed()).await.expect("a SIGHUP event").unwrap();
        assert_eq!(*hups.borrow_and_update(), 1);
        assert!(!shutdown.is_cancelled(), "SIGHUP does not shut down");

        kill("-TERM");
        tokio::time::timeout(Duration::from_secs(10), shutdown.cancelled()).await.expect("SIGTERM cancels the root");
    }
}
