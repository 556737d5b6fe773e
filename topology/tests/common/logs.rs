//! The tracing output of a test binary, captured so that a test can wait for a logged line.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

/// Everything logged at `level` or above by this test binary. The subscriber is global: the
/// first call installs it, later calls (from any test of the binary) share it and its level.
pub fn captured_logs(level: tracing::Level) -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || LogSink(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one subscriber");
        logs
    })
    .clone()
}

struct LogSink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits until a logged line contains every one of `parts`; fails the test after `within`.
pub async fn logged(logs: &Mutex<Vec<u8>>, parts: &[&str], within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let text = String::from_utf8_lossy(&logs.lock().unwrap_or_else(PoisonError::into_inner))
            .into_owned();
        if text
            .lines()
            .any(|line| parts.iter().all(|p| line.contains(p)))
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no log line with {parts:?} in:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
