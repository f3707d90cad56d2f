//! Slowing down online guesses of the cluster secret: per-source back-off on failed
//! handshakes, and a cap on the handshakes one source may have in progress.
//!
//! The handshake (`auth`) lets a stranger test exactly one guess per connection, and only
//! by sending a proof; without a limit a wordlist runs at the speed of the LAN (the review
//! of issue 61 measured 50–66 guesses a second). So a ring server counts, per source
//! address, handshakes that ended in a wrong proof. The first [`AuthBackoff::free_failures`]
//! are free (a person who mistyped, a node restarted with an old secret); after that the
//! source is refused for [`AuthBackoff::first`], doubling with each further failure up to
//! [`AuthBackoff::max`]: a few guesses an hour from one address. A refused connection is
//! told why and for how long in an error frame, and costs the server no key exchange. A
//! handshake that succeeds forgets the source's failures; one that fails for any other
//! reason (a timeout, garbage) counts as none, since it tested no guess.
//!
//! A source may also have at most [`MAX_PENDING_PER_SOURCE`] handshakes in progress, so one
//! host cannot use up the server's shared budget of waiting connections (`link`) and evict
//! everyone else's.
//!
//! Sources are addresses, the only thing a stranger cannot choose freely over TCP; a host
//! with many addresses gets a budget per address, which is why the back-off grows fast.
//! The table is bounded ([`MAX_SOURCES`]); when full, the source longest quiet is forgotten.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Handshakes one source may have in progress: a ring member opens a link and a control
/// connection or two at once; more than this from one host is not a ring member.
pub const MAX_PENDING_PER_SOURCE: u32 = 8;
/// Sources remembered: far more than a home has hosts, a few hundred KiB at most.
pub const MAX_SOURCES: usize = 4096;
/// A source whose last failure is this old starts afresh: a device fixed after a day of
/// running with the wrong secret is not still paying for it.
pub const FORGET_AFTER: Duration = Duration::from_secs(24 * 3600);

/// The back-off's settings, part of `LinkConfig`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthBackoff {
    /// Failed handshakes a source gets before it is refused.
    pub free_failures: u32,
    /// How long a source is refused after its first failure past the free ones.
    pub first: Duration,
    /// The longest refusal; each further failure doubles the last one up to this.
    pub max: Duration,
}

impl Default for AuthBackoff {
    /// Five free failures, then 2 s, 4 s, ... up to 10 minutes: a node that restarts with
    /// a wrong secret a few times is told "wrong cluster secret" each time, while a guesser
    /// gets about six guesses an hour per address once past the first few.
    fn default() -> Self {
        AuthBackoff { free_failures: 5, first: Duration::from_secs(2), max: Duration::from_secs(600) }
    }
}

impl AuthBackoff {
    /// No back-off at all: for tests that make many wrong handshakes on purpose.
    pub fn off() -> Self {
        AuthBackoff { free_failures: u32::MAX, ..AuthBackoff::default() }
    }

    /// How long a source with `failures` failures is refused after its last one.
    fn refusal(&self, failures: u32) -> Option<Duration> {
        let past = failures.checked_sub(self.free_failures)?.checked_sub(1)?;
        let doubled = self.first.checked_mul(1u32.checked_shl(past.min(31)).unwrap_or(u32::MAX)).unwrap_or(self.max);
        Some(doubled.min(self.max))
    }
}

#[derive(Debug)]
struct Source {
    failures: u32,
    last_failure: Option<Instant>,
    pending: u32,
    last_seen: Instant,
}

/// Whether a new connection from a source may run the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Go,
    /// Too many failed handshakes: refused for this much longer.
    Wait(Duration),
    /// [`MAX_PENDING_PER_SOURCE`] handshakes from it are in progress already.
    Busy,
}

/// How a handshake ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    /// A wrong proof: one guess tested.
    WrongSecret,
    /// Anything else (a timeout, an eviction, garbage): no guess tested.
    Other,
}

/// The failures and handshakes in progress of every recent source.
#[derive(Debug)]
pub struct Sources {
    settings: AuthBackoff,
    table: HashMap<IpAddr, Source>,
}

impl Sources {
    pub fn new(settings: AuthBackoff) -> Sources {
        Sources { settings, table: HashMap::new() }
    }

    /// Whether a connection from `ip` may start a handshake at `now`; on `Go` it counts as
    /// in progress until [`Sources::finish`].
    pub fn admit(&mut self, ip: IpAddr, now: Instant) -> Admission {
        if !self.table.contains_key(&ip) && self.table.len() >= MAX_SOURCES {
            self.make_room(now);
        }
        let settings = &self.settings;
        let source = self.table.entry(ip).or_insert(Source { failures: 0, last_failure: None, pending: 0, last_seen: now });
        source.last_seen = now;
        if let Some(last) = source.last_failure {
            if now.duration_since(last) >= FORGET_AFTER {
                (source.failures, source.last_failure) = (0, None);
            }
        }
        if let (Some(refusal), Some(last)) = (settings.refusal(source.failures), source.last_failure) {
            let until = last + refusal;
            if now < until {
                return Admission::Wait(until - now);
            }
        }
        if source.pending >= MAX_PENDING_PER_SOURCE {
            return Admission::Busy;
        }
        source.pending += 1;
        Admission::Go
    }

    /// A handshake admitted for `ip` ended with `outcome` at `now`.
    pub fn finish(&mut self, ip: IpAddr, outcome: Outcome, now: Instant) {
        let Some(source) = self.table.get_mut(&ip) else { return };
        source.pending = source.pending.saturating_sub(1);
        source.last_seen = now;
        match outcome {
            Outcome::Success => (source.failures, source.last_failure) = (0, None),
            Outcome::WrongSecret => {
                source.failures = source.failures.saturating_add(1);
                source.last_failure = Some(now);
            }
            Outcome::Other => {}
        }
    }

    /// How many wrong proofs `ip` has on record.
    pub fn failures(&self, ip: IpAddr) -> u32 {
        self.table.get(&ip).map_or(0, |s| s.failures)
    }

    /// Forgets clean, idle sources; if none, the one longest quiet with nothing in progress.
    fn make_room(&mut self, now: Instant) {
        let settings = &self.settings;
        self.table.retain(|_, s| {
            let refused = matches!((settings.refusal(s.failures), s.last_failure), (Some(r), Some(l)) if now < l + r);
            s.pending > 0 || refused || (s.failures > 0 && s.last_failure.is_some_and(|l| now.duration_since(l) < FORGET_AFTER))
        });
        if self.table.len() >= MAX_SOURCES {
            if let Some(oldest) = self.table.iter().filter(|(_, s)| s.pending == 0).min_by_key(|(_, s)| s.last_seen).map(|(ip, _)| *ip) {
                self.table.remove(&oldest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 66));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 7));

    fn fail(s: &mut Sources, ip: IpAddr, now: Instant) -> Admission {
        let admitted = s.admit(ip, now);
        if admitted == Admission::Go {
            s.finish(ip, Outcome::WrongSecret, now);
        }
        admitted
    }

    #[test]
    fn failures_past_the_free_ones_are_refused_for_longer_each_time() {
        let cfg = AuthBackoff::default();
        let mut s = Sources::new(cfg.clone());
        let t = Instant::now();
        for _ in 0..cfg.free_failures {
            assert_eq!(fail(&mut s, A, t), Admission::Go);
        }
        // The next one still runs (it is the one that earns the back-off) ...
        assert_eq!(fail(&mut s, A, t), Admission::Go);
        // ... then a guesser in a tight loop is refused, however often it tries.
        for _ in 0..1000 {
            assert_eq!(s.admit(A, t), Admission::Wait(cfg.first));
        }
        assert_eq!(s.failures(A), cfg.free_failures + 1);
        // Another source is not affected.
        assert_eq!(s.admit(B, t), Admission::Go);
        s.finish(B, Outcome::Success, t);
        // After the wait, one more guess; its failure doubles the wait.
        let t = t + cfg.first;
        assert_eq!(fail(&mut s, A, t), Admission::Go);
        assert_eq!(s.admit(A, t), Admission::Wait(cfg.first * 2));
        // Waits grow to the cap and stay there.
        let mut t = t;
        for _ in 0..40 {
            t += cfg.max;
            assert_eq!(fail(&mut s, A, t), Admission::Go);
        }
        assert_eq!(s.admit(A, t), Admission::Wait(cfg.max));
        // A day later the source starts afresh; a success forgets its failures too.
        assert_eq!(s.admit(A, t + FORGET_AFTER), Admission::Go);
        s.finish(A, Outcome::Other, t + FORGET_AFTER);
        assert_eq!(s.failures(A), 0);
        fail(&mut s, B, t);
        assert_eq!(s.failures(B), 1);
        assert_eq!(s.admit(B, t), Admission::Go);
        s.finish(B, Outcome::Success, t);
        assert_eq!(s.failures(B), 0);
    }

    #[test]
    fn a_source_has_few_handshakes_in_progress_and_others_are_not_counted() {
        let mut s = Sources::new(AuthBackoff::default());
        let t = Instant::now();
        for _ in 0..MAX_PENDING_PER_SOURCE {
            assert_eq!(s.admit(A, t), Admission::Go);
        }
        assert_eq!(s.admit(A, t), Admission::Busy);
        assert_eq!(s.admit(B, t), Admission::Go);
        s.finish(A, Outcome::Other, t);
        assert_eq!(s.admit(A, t), Admission::Go);
        // Timeouts and garbage test no guess: no back-off however many.
        for _ in 0..MAX_PENDING_PER_SOURCE {
            s.finish(A, Outcome::Other, t);
        }
        for _ in 0..100 {
            assert_eq!(s.admit(B, t), Admission::Go);
            s.finish(B, Outcome::Other, t);
        }
        assert_eq!(s.failures(B), 0);
    }

    #[test]
    fn the_table_is_bounded_and_keeps_refused_sources() {
        let mut s = Sources::new(AuthBackoff::default());
        let t = Instant::now();
        for _ in 0..=AuthBackoff::default().free_failures {
            fail(&mut s, A, t);
        }
        for i in 0..MAX_SOURCES as u32 + 100 {
            let ip = IpAddr::V4(std::net::Ipv4Addr::from(0x0a01_0000 + i));
            assert_eq!(s.admit(ip, t), Admission::Go);
            s.finish(ip, Outcome::Success, t);
        }
        assert!(s.table.len() <= MAX_SOURCES);
        assert!(matches!(s.admit(A, t), Admission::Wait(_)), "a flood of clean sources does not clear a guesser");
        assert!(AuthBackoff::off().refusal(1000).is_none());
    }
}
