//! Halda, hearth's layer scheduler: device and model profiles in, a plan out (which
//! layer windows each device runs, how many of them on its GPU, which devices to leave
//! out), by solving integer programs with HiGHS over prima.cpp's latency model.
//!
//! Pure and synchronous: plain data in, plan out; no I/O, no engine, no network.
//! So far it holds the plan itself and the hand-made plans (`--windows`); the profiles,
//! the cost model and the solver come with the scheduler issue.

mod plan;

pub use plan::{DevicePlan, Plan, PlanError};
