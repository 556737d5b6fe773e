//! Giving freed heap back after a burst. glibc's allocator keeps what a burst of large requests
//! freed (prompt text, token ids, rendered conversations) in its arenas, so a server's resident
//! memory stayed near its peak long after the burst. When the last running generation ends, the
//! server asks the allocator to return what it can (`malloc_trim`), at most once a second and on
//! a blocking thread, never on the request path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The shortest time between two trims.
const PERIOD: Duration = Duration::from_secs(1);

/// Trims the heap when the server goes idle, rate-limited.
#[derive(Debug)]
pub struct IdleTrim {
    started: Instant,
    /// Milliseconds after `started` of the last trim asked for (`u64::MAX`: none yet).
    last_ms: AtomicU64,
}

impl Default for IdleTrim {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            last_ms: AtomicU64::new(u64::MAX),
        }
    }
}

impl IdleTrim {
    /// The server has just gone idle: trim, unless a trim was asked for within [`PERIOD`].
    /// Returns whether one was started.
    pub fn idle(&self) -> bool {
        let now = self.started.elapsed().as_millis() as u64;
        let last = self.last_ms.load(Ordering::Relaxed);
        if last != u64::MAX && now.saturating_sub(last) < PERIOD.as_millis() as u64 {
            return false;
        }
        if self
            .last_ms
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn_blocking(trim);
                true
            }
            Err(_) => false,
        }
    }
}

/// Returns free heap memory to the operating system where the allocator can (glibc).
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn trims_at_most_once_a_period() {
        let trim = IdleTrim::default();
        assert!(trim.idle(), "the first idle moment trims");
        assert!(!trim.idle(), "a second within the period does not");
        trim.last_ms.store(0, Ordering::Relaxed);
        tokio::time::sleep(PERIOD + Duration::from_millis(20)).await;
        assert!(trim.idle(), "after the period it trims again");
    }

    #[test]
    fn outside_a_runtime_nothing_is_spawned() {
        assert!(!IdleTrim::default().idle());
    }
}
