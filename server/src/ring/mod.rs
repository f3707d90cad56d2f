//! The pipelined ring: the head (`serve --workers`) and its workers (`hearth worker`).
//! The head owns the embeddings, the output layer and sampling, so prompts and answers
//! never leave it; workers get hidden states only. One token step goes round the ring
//! k = L / W times, one window per device per round; KV operations travel in-band, in
//! step order, so every cache stays in step with the head's.

pub mod board;
pub mod head;
pub mod paging;
pub mod planning;
mod worker;

pub use head::RingPipeline;
pub use worker::run as run_worker;

use serde::{Deserialize, Serialize};

/// What the head tells a worker at ring formation (control method `load_plan`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerPlan {
    /// The head's model fingerprint: the worker refuses a different file.
    pub fingerprint: String,
    /// The worker's windows, one per round, in ring order.
    pub windows: Vec<(usize, usize)>,
    /// Where this worker sends its output: the next worker, or the head.
    pub next: String,
    pub n_seq: usize,
    pub n_ctx_seq: usize,
    pub max_batch: usize,
    /// Who sends the plan: one id per head process. A worker in one head's ring refuses
    /// another head's plan while the first head's links are open.
    #[serde(default)]
    pub head: String,
    /// Release each window after use (the device is overloaded); `None`: the worker
    /// decides from the memory it may use.
    #[serde(default)]
    pub release: Option<bool>,
    /// Compute with batch-invariant kernels (the head speculates: see
    /// `engine::StageConfig::batch_invariant`).
    #[serde(default)]
    pub batch_invariant: bool,
}

/// Applies in-band KV operations to a stage, in order.
pub(crate) fn apply(stage: &mut engine::Stage, ops: &[transport::KvOp]) {
    for op in ops {
        match *op {
            transport::KvOp::Clear { seq } => stage.clear_sequence(seq),
            transport::KvOp::Truncate { seq, len } => stage.truncate_sequence(seq, len as usize),
        }
    }
}

/// The cluster secret from the flags. Without one, only loopback addresses are allowed
/// (or `--insecure`), because anyone who can reach a worker could otherwise feed it.
pub fn cluster_secret(secret: Option<&str>, addr: &str, insecure: bool) -> Result<transport::ClusterSecret, String> {
    match secret.filter(|s| !s.is_empty()) {
        Some(s) => transport::ClusterSecret::new(s).map_err(|e| e.to_string()),
        None => {
            let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).trim_start_matches("http://");
            let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
            if loopback || insecure {
                Ok(transport::ClusterSecret::insecure())
            } else {
                Err(format!("{addr} is not a loopback address: set --cluster-secret (or pass --insecure to accept anyone on the network)"))
            }
        }
    }
}

/// `--emulate-hop-ms` as a delay (negative or non-finite: none).
pub fn hop_delay(ms: f64) -> std::time::Duration {
    std::time::Duration::try_from_secs_f64(ms / 1e3).unwrap_or_default()
}
