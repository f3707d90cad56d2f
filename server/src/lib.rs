//! hearth: one OpenAI-compatible server for 30–70B models across the devices of a
//! home. This crate holds the CLI, the HTTP API, continuous batching and (later) the ring
//! roles; the engine, scheduler, transport and wire types live in their own crates and
//! never depend on this one. It is a library so integration tests can run the server
//! in-process.

pub mod bench;
pub mod bench_serve;
pub mod cli;
pub mod generation;
pub mod http;
pub mod make_model;
pub mod metrics;
pub mod model_profile;
pub mod plan_command;
pub mod profile_command;
pub mod ring;
pub mod serve;
