//! `hearth worker`: joins a ring; waits for a head and runs the windows it assigns.

use crate::cli::{WorkerArgs, DEFAULT_WORKER_LISTEN};
use crate::runtime::ring::{cluster_secret, hop_delay, run_worker, SecretUser, WorkerConfig};

pub fn run(args: WorkerArgs) -> Result<(), Box<dyn std::error::Error>> {
    let gpu = crate::runtime::GpuPlacement { layers: args.gpu_layers, experts_in_ram: args.experts_in_ram };
    gpu.layers.check()?;
    let discovery = args.discovery.port(args.cluster_secret.as_deref());
    let listen = match discovery {
        Some(_) if args.listen == DEFAULT_WORKER_LISTEN => "0.0.0.0:9090",
        _ => args.listen.as_str(),
    };
    let secret = cluster_secret(args.cluster_secret.as_deref(), listen, SecretUser::Worker { insecure: args.insecure })?;
    let listen = listen.parse().map_err(|e| format!("invalid --listen {listen}: {e}"))?;
    if args.head.is_some() && discovery.is_none() {
        return Err("--head needs a cluster secret (joins are signed with it) and no --no-discovery".into());
    }
    let cfg = WorkerConfig {
        model: args.model.clone(),
        model_dir: args.model_dir.clone().unwrap_or_else(|| crate::models::models_dir().join("shipped")),
        disk_budget: args.disk_budget,
        listen,
        secret,
        threads: args.threads.unwrap_or_else(engine::stage::default_threads),
        prefetch: !args.no_prefetch,
        repack: !args.no_repack,
        hop_delay: hop_delay(args.lab.emulate_hop_ms),
        gpu_layers: gpu,
        prompt_cache: args.prompt_cache.config(),
        discovery: discovery.map(|port| crate::runtime::ring::WorkerDiscovery { port, head: args.head.clone(), name: args.name.clone().or_else(crate::process::hostname).unwrap_or_else(|| "worker".into()) }),
    };
    Ok(run_worker(cfg)?)
}
