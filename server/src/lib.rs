//! hearth: one OpenAI-compatible server for 30–70B models across the devices of a
//! home. The engine, scheduler, transport and wire types live in their own crates and
//! never depend on this one. This crate holds three rooms over four leaves, with arrows
//! one way only (`tests/module_arrows.rs` holds them; `docs/architecture.md` maps the rooms):
//!
//! ```text
//!   cli ──► http ──► runtime ──► (engine, scheduler, transport)
//!    └──────────────────┘
//!   every room may use the leaves: error, metrics, models, process
//! ```
//!
//! - `runtime`: what runs on a node whatever asks it to: generation (queue, continuous
//!   batching, speculation), the ring (head, worker, planning, paging) and device
//!   profiling. It knows nothing of HTTP or the command line.
//! - `http`: the OpenAI API and the admin endpoints over a `runtime::Runtime` (a trait,
//!   so handlers are tested against a fake runtime), errors mapped to status codes in one
//!   place, and the API port itself.
//! - `cli`: the `hearth` commands; each parses its flags into the runtime's and the HTTP
//!   side's configuration and calls them.
//!
//! It is a library so tests can run the server in-process.

pub mod cli;
pub mod error;
pub mod http;
pub mod hub;
pub mod metrics;
pub mod models;
pub mod process;
pub mod runtime;

pub use error::{Error, Result};
