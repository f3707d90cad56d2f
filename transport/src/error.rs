//! The crate's one error type. Variants that involve a peer carry its address as text so
//! that the message alone tells an operator which ring member misbehaved.

use std::time::Duration;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("not a hearth ring frame: magic {found:?} instead of \"HRTH\"")]
    BadMagic { found: Vec<u8> },

    #[error(
        "peer speaks ring frame version {theirs}, this node speaks version {ours}: \
         run the same hearth version on every device"
    )]
    VersionMismatch { ours: u16, theirs: u16 },

    #[error("unknown frame kind {0}")]
    UnknownKind(u8),

    #[error("frame header has unknown flags {0:#04x}")]
    UnknownFlags(u8),

    #[error("frame of {size} bytes exceeds the limit of {limit} bytes")]
    FrameTooLarge { size: u64, limit: usize },

    #[error("malformed {kind} frame: {reason}")]
    Malformed { kind: &'static str, reason: String },

    /// The caller asked to send something the wire format cannot express.
    #[error("cannot encode frame: {0}")]
    Encode(String),

    #[error("invalid cluster secret: {0}")]
    Secret(&'static str),

    #[error("invalid peer address {addr:?}: {reason}")]
    Address { addr: String, reason: String },

    #[error("{peer}: authentication failed: {reason}")]
    Auth { peer: String, reason: String },

    #[error("{peer}: {what} timed out after {after:?}")]
    Timeout { peer: String, what: &'static str, after: Duration },

    #[error("{peer}: {what}: {error}")]
    Io { peer: String, what: &'static str, error: std::io::Error },

    #[error("{peer}: HTTP/2 {what}: {message}")]
    Http { peer: String, what: &'static str, message: String },

    /// The peer broke the frame protocol; its connection has been closed.
    #[error("{peer} sent a bad frame, connection closed: {detail}")]
    Protocol { peer: String, detail: Box<Error> },

    #[error("{peer}: link closed")]
    Closed { peer: String },

    #[error("{peer}: control call {method:?} failed with HTTP {status}: {message}")]
    Control { peer: String, method: String, status: u16, message: String },
}

impl Error {
    pub(crate) fn malformed(kind: &'static str, reason: impl Into<String>) -> Self {
        Error::Malformed { kind, reason: reason.into() }
    }

    pub(crate) fn auth(peer: &str, reason: impl Into<String>) -> Self {
        Error::Auth { peer: peer.to_owned(), reason: reason.into() }
    }

    pub(crate) fn timeout(peer: &str, what: &'static str, after: Duration) -> Self {
        Error::Timeout { peer: peer.to_owned(), what, after }
    }

    /// Keeps the whole source chain: hyper's own message ("error reading a body from
    /// connection") hides the cause ("keep-alive timed out") in its source.
    pub(crate) fn http(
        peer: &str,
        what: &'static str,
        error: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        let error = error.into();
        let mut message = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            message = format!("{message}: {cause}");
            source = cause.source();
        }
        Error::Http { peer: peer.to_owned(), what, message }
    }

    pub(crate) fn closed(peer: &str) -> Self {
        Error::Closed { peer: peer.to_owned() }
    }
}
