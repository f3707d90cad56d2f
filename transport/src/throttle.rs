//! Warnings a stranger can cause, kept to a few lines a minute: a refused datagram, frame or
//! connection is worth telling the operator about, but 10,000 of them must not become
//! 10,000 log lines (a flood would fill the disk and bury everything else).
//!
//! Each kind of refusal gets a [`WarnThrottle`]: the first [`BURST`] in an interval are
//! logged as they come; the rest are counted, and the next one after the interval is logged
//! with that count, so the log still says how many there were.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines logged as they come in each interval: enough to see what is happening (a
/// misconfigured neighbour shows its reason at once), few enough that a flood costs a few
/// hundred bytes.
pub const BURST: u32 = 5;
/// The interval: an operator reading the log sees a count at least this often while a
/// flood lasts.
pub const INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct State {
    since: Instant,
    logged: u32,
    held_back: u64,
}

/// Decides which of a kind of warning are logged (see the module docs).
#[derive(Debug)]
pub struct WarnThrottle {
    state: Mutex<State>,
}

impl Default for WarnThrottle {
    fn default() -> Self {
        WarnThrottle { state: Mutex::new(State { since: Instant::now(), logged: 0, held_back: 0 }) }
    }
}

/// What to do with one warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Log it; `held_back` warnings like it were not logged before it.
    Log { held_back: u64 },
    /// Count it only.
    Hold,
}

impl WarnThrottle {
    pub fn note(&self) -> Verdict {
        self.note_at(Instant::now())
    }

    fn note_at(&self, now: Instant) -> Verdict {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if now.duration_since(s.since) >= INTERVAL {
            s.since = now;
            s.logged = 0;
        }
        if s.logged < BURST {
            s.logged += 1;
            Verdict::Log { held_back: std::mem::take(&mut s.held_back) }
        } else {
            s.held_back += 1;
            Verdict::Hold
        }
    }

    /// Logs `line` as a warning unless the throttle holds it back.
    pub fn warn(&self, line: impl FnOnce() -> String) {
        match self.note() {
            Verdict::Log { held_back: 0 } => tracing::warn!("{}", line()),
            Verdict::Log { held_back } => tracing::warn!("{} (and {held_back} more like it not logged)", line()),
            Verdict::Hold => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_logs_a_burst_per_interval_and_counts_the_rest() {
        let t = WarnThrottle::default();
        let start = Instant::now();
        let verdicts: Vec<Verdict> = (0..10_000).map(|_| t.note_at(start)).collect();
        assert_eq!(verdicts.iter().filter(|v| matches!(v, Verdict::Log { .. })).count(), BURST as usize);
        assert!(verdicts[BURST as usize..].iter().all(|v| *v == Verdict::Hold));
        // The next interval's first line carries the count of what was held back.
        assert_eq!(t.note_at(start + INTERVAL), Verdict::Log { held_back: 10_000 - BURST as u64 });
        assert_eq!(t.note_at(start + INTERVAL), Verdict::Log { held_back: 0 });
    }
}
