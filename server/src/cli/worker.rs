//! `hearth worker`: joins a ring; waits for a head and runs the windows it assigns.

use crate::cli::WorkerArgs;
use crate::runtime::ring::{cluster_secret, hop_delay, run_worker, SecretUser, WorkerConfig};

pub fn run(args: WorkerArgs) -> Result<(), Box<dyn std::error::Error>> {
    let gpu = crate::runtime::GpuPlacement { layers: args.gpu_layers, experts_in_ram: args.experts_in_ram };
    gpu.layers.check()?;
    let secret = cluster_secret(args.cluster_secret.as_deref(), &args.listen, SecretUser::Worker { insecure: args.insecure })?;
    let listen = args.listen.parse().map_err(|e| format!("invalid --listen {}: {e}", args.listen))?;
    let cfg = WorkerConfig {
        model: args.model.resolve()?,
        listen,
        secret,
        threads: args.threads.unwrap_or_else(engine::stage::default_threads),
        prefetch: !args.no_prefetch,
        repack: !args.no_repack,
        hop_delay: hop_delay(args.emulate_hop_ms),
        gpu_layers: gpu,
    };
    Ok(run_worker(cfg)?)
}
