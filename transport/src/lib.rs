//! Moves activations and control messages between ring neighbours: one persistent HTTP/2
//! connection per hop carrying length-prefixed binary frames (hidden states, in-band KV
//! operations, per-step errors), plus JSON control RPCs (health, load plan, profile) on the
//! same server. Every connection proves the cluster secret before HTTP/2 starts on it, and
//! every control call is MACed on its own, once, with that connection's session key: nothing
//! that crosses the LAN after a handshake is keyed by anything computable from the secret.
//!
//! It moves bytes and frames only: it must not depend on the engine or the server. Frames
//! hold plain f32 data and sequence ids; what they mean is the caller's business.
//!
//! - [`frame`]: the wire format and its codec; nothing a peer sends can make it panic or
//!   allocate beyond the configured frame limit.
//! - [`auth`]: the cluster secret and the SPAKE2 handshake every connection starts with,
//!   which gives the connection its session key.
//! - [`backoff`]: per-source back-off on failed handshakes (online guessing slowed down).
//! - [`link`]: the persistent HTTP/2 link, client ([`Link::connect`]) and server ([`LinkServer`]).
//! - [`control`]: session-MACed JSON control calls ([`ControlClient`], [`ControlHandler`]), and
//!   signed blob calls answered with raw bytes (model ranges: [`BlobHandler`]).
//! - [`discovery`]: UDP datagrams, MACed with a per-sender salted key, by which workers find
//!   a head on the LAN.
//! - [`throttle`]: warnings a stranger can cause (refused datagrams, connections, calls),
//!   logged a few a minute with a count of the rest.

pub mod auth;
pub mod backoff;
pub mod control;
pub mod discovery;
pub mod error;
pub mod frame;
mod freshness;
pub mod link;
pub mod throttle;

pub use auth::{ClusterSecret, PeerId, SessionKey};
pub use backoff::AuthBackoff;
pub use control::{methods, BlobHandler, ControlClient, ControlFailure, ControlHandler, MAX_BLOB_BYTES};
pub use error::{Error, Result};
pub use frame::{encode, Activations, Dtype, Frame, FrameDecoder, KvOp, StageReport, TokenMeta};
pub use link::{FrameSink, FrameStream, Link, LinkConfig, LinkServer};
