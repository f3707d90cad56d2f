//! Moves activations and control messages between ring neighbours: one persistent HTTP/2
//! connection per hop carrying length-prefixed binary frames (hidden states, in-band KV
//! operations, per-step errors), plus JSON control RPCs (health, load plan, profile) on the
//! same server. Every connection proves the cluster secret before HTTP/2 starts on it, and
//! every control call is signed on its own, for one receiver, once.
//!
//! It moves bytes and frames only: it must not depend on the engine or the server. Frames
//! hold plain f32 data and sequence ids; what they mean is the caller's business.
//!
//! - [`frame`]: the wire format and its codec; nothing a peer sends can make it panic or
//!   allocate beyond the configured frame limit.
//! - [`auth`]: the cluster secret and the HMAC challenge-response every connection starts with.
//! - [`link`]: the persistent HTTP/2 link, client ([`Link::connect`]) and server ([`LinkServer`]).
//! - [`control`]: signed JSON control calls ([`ControlClient`], [`ControlHandler`]), and
//!   signed blob calls answered with raw bytes (model ranges: [`BlobHandler`]).
//! - [`discovery`]: signed UDP datagrams by which workers find a head on the LAN.
//! - [`throttle`]: warnings a stranger can cause (refused datagrams, connections, calls),
//!   logged a few a minute with a count of the rest.

pub mod auth;
pub mod control;
pub mod discovery;
pub mod error;
pub mod frame;
mod freshness;
pub mod link;
pub mod throttle;

pub use auth::{ClusterSecret, PeerId};
pub use control::{methods, BlobHandler, ControlClient, ControlFailure, ControlHandler, MAX_BLOB_BYTES};
pub use error::{Error, Result};
pub use frame::{encode, Activations, Dtype, Frame, FrameDecoder, KvOp, StageReport, TokenMeta};
pub use link::{FrameSink, FrameStream, Link, LinkConfig, LinkServer};
