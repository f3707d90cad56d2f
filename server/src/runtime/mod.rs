//! What runs on a node, whatever asks it to: generation (the queue, continuous batching,
//! speculation), the ring (the head's pipeline, the worker, planning, paging) and device
//! profiling. Nothing here knows about HTTP or the command line: the HTTP side reaches a
//! head through the `Runtime` trait below, the CLI builds the configurations.

pub mod context;
pub mod embeddings;
pub mod generation;
pub mod gpu_layers;
pub mod head;
pub mod profiling;
pub mod ring;
pub mod views;

pub use gpu_layers::{GpuLayers, GpuPlacement};
pub use head::{Head, HeadConfig, Speculation};
pub use ring::RingSetup;

use crate::error::ReplanError;
use generation::{GenerationRequest, SubmitError};
use views::{ClusterView, PlanView};

/// A re-plan's outcome, when the ring gets to it (the next time the queue is idle).
pub type ReplanReply = tokio::sync::oneshot::Receiver<Result<PlanView, ReplanError>>;

/// What the HTTP side asks of a head node. `Head` is the real one; the HTTP tests use a
/// fake, so handlers are tested without a model.
pub trait Runtime: Send + Sync + 'static {
    /// Queues one sequence; its events arrive on the request's channel.
    fn submit(&self, req: GenerationRequest) -> Result<(), SubmitError>;
    /// Whether a request submitted now would be taken: lets the API refuse one before
    /// preparing it (it may still be refused at `submit` if others took the room).
    fn has_room(&self) -> Result<(), SubmitError>;
    /// Context cells per sequence: prompt plus generated tokens must fit.
    fn n_ctx(&self) -> usize;
    /// Sequences generated at once (`--parallel`): the most choices one request may ask.
    fn parallel(&self) -> usize;
    /// Why the head cannot serve now (a ring member is lost); `None` when it can.
    fn degraded(&self) -> Option<String>;
    /// The running plan with its predicted and measured TPOT.
    fn plan(&self) -> PlanView;
    /// The devices' profiles as last gathered.
    fn cluster(&self) -> ClusterView;
    /// Asks for a re-plan (with another strategy, if given) at the next idle moment.
    fn replan(&self, strategy: Option<scheduler::Strategy>) -> Result<ReplanReply, ReplanError>;
    /// What the scheduler would plan without the devices named in `without` and with a
    /// copy of each named in `copies` (another machine with its profile), on the profiles
    /// last gathered; nothing is adopted. Blocks while it solves.
    fn what_if(&self, without: &[String], copies: &[String], strategy: Option<scheduler::Strategy>) -> Result<views::WhatIf, ReplanError> {
        let _ = (without, copies, strategy);
        Err(ReplanError::NotARing)
    }
    /// Stops admitting requests, lets running and queued ones finish, and returns when
    /// they have. Blocks.
    fn shutdown(&self);
}
