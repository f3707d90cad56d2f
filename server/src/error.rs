//! The server crate's one error type: what can go wrong while the head or a worker runs
//! (loading, the engine, the ring, planning, re-planning). The HTTP side maps it to status
//! codes in one place (`http::error`); the CLI prints it. A leaf: it names the other
//! crates' errors, nothing of this crate.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// This machine's engine failed (loading a model, a step, the sampler).
    #[error(transparent)]
    Engine(#[from] engine::Error),

    /// A ring member failed, closed its link or could not be reached: the ring is broken
    /// until it is formed again, and retrying later may work.
    #[error("{0}")]
    RingBroken(String),

    /// A ring member will not take part as asked (another model file, another head's ring,
    /// a plan it refuses): waiting does not help; the operator must act.
    #[error("{0}")]
    RingRefused(String),

    /// A model file changed under this node's mapping (a new version copied over it): what
    /// is computed from it can no longer be trusted; the operator restarts the node.
    #[error("{0}")]
    ModelChanged(String),

    /// The scheduler found no plan, or a plan does not fit the ring.
    #[error("planning: {0}")]
    Plan(String),

    /// A re-plan cannot be asked for now.
    #[error(transparent)]
    Replan(#[from] ReplanError),

    #[error(transparent)]
    Transport(#[from] transport::Error),

    #[error(transparent)]
    Schedule(#[from] scheduler::ScheduleError),

    #[error(transparent)]
    InvalidPlan(#[from] scheduler::PlanError),

    /// A setting that cannot work (an address that does not parse, a missing secret).
    #[error("{0}")]
    Config(String),

    /// Fetching the default model, or pulling one from the hub, failed.
    #[error("model fetch: {0}")]
    Fetch(String),

    /// Measuring this device failed.
    #[error("profiling: {0}")]
    Profile(String),

    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Why `POST /admin/replan` cannot be served.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum ReplanError {
    /// A head without workers has nothing to plan.
    #[error("this head has no workers: there is nothing to plan (start it with --workers)")]
    NotARing,
    /// The ring is broken; it re-forms by itself first.
    #[error("the ring is broken, so it cannot be re-planned now: {0}")]
    Broken(String),
    /// Gathering profiles, scheduling or adopting the new plan failed.
    #[error("re-planning failed: {0}")]
    Failed(String),
    /// The server stopped before the re-plan ran.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// A "what if" named a device the head does not know, or the head itself to leave out.
    #[error("{message}")]
    WhatIf { param: &'static str, message: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
