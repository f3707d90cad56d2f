//! The pipelined ring: the head (`serve --workers`) and its workers (`hearth worker`).
//! The head owns the embeddings, the output layer and sampling, so prompts and answers
//! never leave it; workers get hidden states only. One token step goes round the ring
//! k = L / W times, one window per device per round; KV operations travel in-band, in
//! step order, so every cache stays in step with the head's.

mod adoption;
pub mod board;
mod flights;
pub mod head;
mod links;
pub mod membership;
pub mod paging;
pub mod planning;
pub mod shipping;
mod worker;

pub use head::RingPipeline;
pub use worker::{run as run_worker, WorkerConfig, WorkerDiscovery};

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use transport::ClusterSecret;

use crate::error::Error;

/// A ring's settings (`serve --workers ...`).
#[derive(Debug, Clone)]
pub struct RingSetup {
    /// Candidate workers, in ring order; the plan may leave some out.
    pub workers: Vec<String>,
    pub secret: ClusterSecret,
    /// Where the last worker connects back to.
    pub listen: SocketAddr,
    /// What the last worker dials to reach `listen`; `None`: `listen` itself.
    pub advertise: Option<String>,
    /// Layers per device and round, pinned by the user (`--windows`); `None`: the
    /// scheduler plans.
    pub windows: Option<Vec<usize>>,
    pub strategy: scheduler::Strategy,
    /// Send hidden states as f16.
    pub f16: bool,
    pub step_timeout: Duration,
    /// How long a broken ring waits for a lost member before planning without it.
    pub member_grace: Duration,
    pub prefetch: bool,
    pub startup_wait: Duration,
    /// Re-plan by itself after the queue has been idle this long (never with pinned
    /// windows: a plan the user pinned stays unless they ask for another).
    pub replan_idle: Option<Duration>,
    /// Added to every frame the head sends (`--emulate-hop-ms`, benchmarks only).
    pub hop_delay: Duration,
    /// `Some(true)`: every device releases its windows after use.
    pub release: Option<bool>,
    /// Micro-batches in flight at once (`--micro-batches`); `None`: one per member that
    /// computes, or one when windows are paged from disk.
    pub micro_batches: Option<usize>,
    /// Tokens per prompt chunk with micro-batches in flight, pinned (`--prompt-chunk`,
    /// benchmarks only); `None`: planned per prompt.
    pub prompt_chunk: Option<usize>,
    /// Announce the head on the LAN and take workers that join, on this UDP port
    /// (`None`: `--no-discovery`, or no cluster secret).
    pub discovery: Option<u16>,
}

/// What the head tells a worker at ring formation (control method `load_plan`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerPlan {
    /// The head's model fingerprint: the worker refuses a different file.
    pub fingerprint: String,
    /// The worker's windows, one per round, in ring order.
    pub windows: Vec<(usize, usize)>,
    /// Of each window, the first this many layers run on the worker's accelerator (the
    /// plan's `n_m`; a worker's own `--gpu-layers N` overrides it).
    #[serde(default)]
    pub gpu_layers: usize,
    /// Of those, the first this many keep their routed experts in the worker's RAM (the
    /// plan's; a worker's own `--experts-in-ram N` overrides it).
    #[serde(default)]
    pub experts_in_ram: usize,
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
    /// Keep draft snapshots of a recurrent model's state (the head speculates: see
    /// `engine::StageConfig::draft_snapshots`).
    #[serde(default)]
    pub draft_snapshots: bool,
    /// The KV cache types every member uses (the head's `--cache-type-k/-v`); F16 from a
    /// head that does not say.
    #[serde(default)]
    pub kv: engine::CacheTypes,
    /// Threads to compute with, at most the worker's own (`--threads`); 0: its own. The
    /// head chooses fewer for members that share a machine and compute at once.
    #[serde(default)]
    pub threads: usize,
}

/// A control call to a worker failed: a 4xx answer or a bad secret is the worker saying no
/// (waiting does not help); anything else is silence, worth waiting for.
pub(crate) fn connecting(worker: &str, e: transport::Error) -> Error {
    match e {
        transport::Error::Auth { .. } | transport::Error::Secret(_) | transport::Error::Address { .. } => Error::RingRefused(format!("worker {worker} refused the head: {e}")),
        transport::Error::Control { status: 400..=499, .. } => Error::RingRefused(format!("worker {worker} refused the head: {e}")),
        e => Error::RingBroken(format!("worker {worker} is unreachable: {e}")),
    }
}

/// The address `peer` reaches a server listening at `listen` on: `listen` itself, or,
/// when that is every interface (`0.0.0.0`), this machine's address on the route to
/// `peer` (asked of the kernel by connecting a UDP socket: nothing is sent).
pub(crate) async fn reachable_at(listen: SocketAddr, peer: &str) -> String {
    if !listen.ip().is_unspecified() {
        return listen.to_string();
    }
    let route = async {
        let to = tokio::net::lookup_host(peer).await.ok()?.next()?;
        let probe = tokio::net::UdpSocket::bind(SocketAddr::new(listen.ip(), 0)).await.ok()?;
        probe.connect(to).await.ok()?;
        Some(probe.local_addr().ok()?.ip())
    };
    match route.await {
        Some(ip) => SocketAddr::new(ip, listen.port()).to_string(),
        None => listen.to_string(),
    }
}

/// Applies in-band KV operations to a stage, in order.
pub(crate) fn apply(stage: &mut engine::Stage, ops: &[transport::KvOp]) {
    for op in ops {
        match *op {
            transport::KvOp::Clear { seq } => stage.clear_sequence(seq),
            transport::KvOp::Truncate { seq, len } => {
                stage.truncate_sequence(seq, len as usize);
            }
            transport::KvOp::Checkpoint { seq } => stage.checkpoint_sequence(seq),
            transport::KvOp::Copy { seq, from, len } => {
                stage.copy_sequence(from, seq, len as usize);
            }
        }
    }
}

/// The command that asks for the cluster secret: what to say when one is missing depends
/// on the flags that command has.
#[derive(Debug, Clone, Copy)]
pub enum SecretUser {
    /// `hearth serve` with workers. It has no `--insecure`: a head always authenticates a
    /// ring that reaches beyond loopback.
    Head,
    /// `hearth worker`, with its `--insecure`.
    Worker { insecure: bool },
    /// `hearth worker-profile`, which calls a worker, with its `--insecure`.
    WorkerProfile { insecure: bool },
}

/// The cluster secret from the flags. Without one, only loopback addresses are allowed
/// (or a worker's `--insecure`), because anyone who can reach a worker could otherwise feed it.
pub fn cluster_secret(secret: Option<&str>, addr: &str, user: SecretUser) -> Result<transport::ClusterSecret, Error> {
    if let Some(s) = secret.filter(|s| !s.is_empty()) {
        if let Some(why) = transport::ClusterSecret::weakness(s) {
            tracing::warn!("{why}");
        }
        return Ok(transport::ClusterSecret::new(s)?);
    }
    let host = addr.trim_start_matches("http://");
    let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    match user {
        _ if loopback => Ok(transport::ClusterSecret::insecure()),
        SecretUser::Worker { insecure: true } | SecretUser::WorkerProfile { insecure: true } => Ok(transport::ClusterSecret::insecure()),
        SecretUser::Head => Err(Error::Config(format!("{addr} is not a loopback address: a ring beyond this machine needs --cluster-secret, the same on the head and on every worker"))),
        SecretUser::Worker { .. } => Err(Error::Config(format!("{addr} is not a loopback address: set --cluster-secret (or pass --insecure to accept anyone on the network)"))),
        SecretUser::WorkerProfile { .. } => Err(Error::Config(format!("{addr} is not a loopback address: set --cluster-secret to the worker's (or pass --insecure if the worker runs with --insecure)"))),
    }
}

/// `--emulate-hop-ms` as a delay (negative or non-finite: none).
pub fn hop_delay(ms: f64) -> Duration {
    Duration::try_from_secs_f64(ms / 1e3).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_secret_is_explained_with_the_flags_the_command_has() {
        let lan = "192.168.1.20:9090";
        let head = cluster_secret(None, lan, SecretUser::Head).err().unwrap().to_string();
        assert!(head.contains("--cluster-secret") && !head.contains("--insecure"), "{head}");
        let worker = cluster_secret(None, lan, SecretUser::Worker { insecure: false }).err().unwrap().to_string();
        assert!(worker.contains("--cluster-secret") && worker.contains("--insecure"), "{worker}");
        let profile = cluster_secret(Some(""), lan, SecretUser::WorkerProfile { insecure: false }).err().unwrap().to_string();
        assert!(profile.contains("--insecure"), "{profile}");

        assert!(cluster_secret(None, lan, SecretUser::Worker { insecure: true }).is_ok());
        assert!(cluster_secret(Some("s"), lan, SecretUser::Head).is_ok());
        for loopback in ["127.0.0.1:9090", "http://localhost:9090", "[::1]:9090"] {
            assert!(cluster_secret(None, loopback, SecretUser::Head).is_ok(), "{loopback}");
        }
    }
}
