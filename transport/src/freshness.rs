//! Whether a signed discovery datagram is new: its timestamp within the clock skew
//! tolerated between home devices, and its nonce never accepted before. (Control calls need
//! neither: they are numbered per connection and MACed with its session key, `control`.)
//! Also the hex helpers the wire formats share.

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

/// Home devices' clocks drift and phones sync rarely; a minute tolerates that while a
/// captured message soon goes stale.
pub(crate) const MAX_CLOCK_SKEW_MS: u64 = 60_000;
/// Nonces remembered at once. Only messages with a valid MAC add one, so only a member of
/// the cluster can fill it (about 2 000 messages a second for the whole window, 3 MB); when
/// it is full, new messages are refused rather than let a replay through.
pub(crate) const MAX_REMEMBERED_NONCES: usize = 1 << 16;
/// 128 random bits: a nonce repeats by chance never, so a repeat is a replay.
pub const REQUEST_NONCE_LEN: usize = 16;
pub(crate) type RequestNonce = [u8; REQUEST_NONCE_LEN];

pub(crate) fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Why a message stamped `unix_ms` is too old (or too far ahead) at `now`, if it is.
pub(crate) fn stale(unix_ms: u64, now: u64) -> Option<String> {
    let skew = now.abs_diff(unix_ms);
    (skew > MAX_CLOCK_SKEW_MS).then(|| format!("timestamp is {} s off this node's clock (stale message, or clocks out of sync)", skew / 1000))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}

/// The nonces of accepted messages, each with the time after which its timestamp is
/// refused anyway (so it need not be remembered past then).
#[derive(Default)]
pub(crate) struct Replays {
    seen: HashMap<RequestNonce, u64>,
}

pub(crate) enum Fresh {
    Yes,
    Replayed,
    Full,
}

impl Replays {
    pub(crate) fn check_and_remember(&mut self, nonce: RequestNonce, unix_ms: u64, now: u64) -> Fresh {
        if self.seen.contains_key(&nonce) {
            return Fresh::Replayed;
        }
        if self.seen.len() >= MAX_REMEMBERED_NONCES {
            self.seen.retain(|_, forget_at| *forget_at >= now);
            if self.seen.len() >= MAX_REMEMBERED_NONCES {
                return Fresh::Full;
            }
        }
        self.seen.insert(nonce, unix_ms.saturating_add(MAX_CLOCK_SKEW_MS));
        Fresh::Yes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nonce_is_accepted_once_and_the_memory_is_bounded() {
        let mut replays = Replays::default();
        assert!(matches!(replays.check_and_remember([1; REQUEST_NONCE_LEN], 1_000, 1_000), Fresh::Yes));
        assert!(matches!(replays.check_and_remember([1; REQUEST_NONCE_LEN], 1_000, 1_000), Fresh::Replayed));
        for i in 0..MAX_REMEMBERED_NONCES as u32 - 1 {
            let mut nonce = [0; REQUEST_NONCE_LEN];
            nonce[..4].copy_from_slice(&i.to_le_bytes());
            nonce[15] = 2;
            assert!(matches!(replays.check_and_remember(nonce, 1_000, 1_000), Fresh::Yes));
        }
        // Full of nonces whose timestamps are still acceptable: refused, not forgotten.
        assert!(matches!(replays.check_and_remember([3; REQUEST_NONCE_LEN], 1_000, 1_000), Fresh::Full));
        // Once they are past the window they make room.
        let later = 1_000 + MAX_CLOCK_SKEW_MS + 1;
        assert!(matches!(replays.check_and_remember([3; REQUEST_NONCE_LEN], later, later), Fresh::Yes));
        assert_eq!(replays.seen.len(), 1);
    }

    #[test]
    fn timestamps_a_minute_off_are_stale() {
        assert!(stale(1_000_000, 1_000_000 + MAX_CLOCK_SKEW_MS).is_none());
        assert!(stale(1_000_000 + MAX_CLOCK_SKEW_MS, 1_000_000).is_none());
        assert!(stale(1_000_000, 1_000_001 + MAX_CLOCK_SKEW_MS).is_some());
        assert!(stale(1_000_001 + MAX_CLOCK_SKEW_MS, 1_000_000).is_some());
    }
}
