//! Halda, hearth's layer scheduler: device and model profiles in, a plan out (which
//! layer windows each device runs, how many of them on its GPU, which devices to leave
//! out), by solving integer programs with HiGHS over prima.cpp's latency model.
//!
//! Pure and synchronous: plain data in, plan out; no I/O, no engine, no network.
//!
//! - [`profile`]: what the profiler measures (`DeviceProfile`) and what the model
//!   profiler reads (`ModelProfile`), in the paper's symbols.
//! - [`cost`]: the LDA latency model; [`predict`] gives any plan's TPOT with a
//!   per-device breakdown (compute, memory, disk, network).
//! - [`halda`]: Algorithm 1 (one ILP per divisor k of L, set iteration, calibration,
//!   device selection) and the baselines, chosen by [`Strategy`]; entry point [`schedule`].
//! - [`pipelining`]: what a ring sustains with several micro-batches in flight
//!   (throughput of many streams, time to first token of a long prompt cut into chunks).
//! - [`context`]: the largest context per sequence the devices' memory holds beside the
//!   weights ([`largest_context`]), the default of `hearth serve`.
//! - [`replan`]: the online part: whether fresh profiles [`drift`]ed, and whether a new
//!   schedule predicts enough gain to [`decide`] on re-forming a running ring.
//!
//! The decisions the paper leaves open are in docs/scheduler.md.

pub mod context;
pub mod cost;
pub mod halda;
pub mod pipelining;
mod plan;
pub mod profile;
pub mod replan;

pub use context::{largest_context, ContextBound, ContextFit};
pub use cost::{measured_disk_share, predict, predict_ring, Breakdown, DeviceCost, DeviceSet, Prediction};
pub use halda::{schedule, Options, Schedule, ScheduleError, Strategy, DEFAULT_DISK_THRESHOLD};
pub use pipelining::{Forecast, Pipelining};
pub use plan::{DevicePlan, Plan, PlanError};
pub use profile::{share_host_memory, DeviceProfile, GpuBackend, GpuProfile, HostShare, ModelProfile, MoeProfile, Os, PerQuant};
pub use replan::{decide, drift, Current, Decision, ReplanPolicy, Trigger};
