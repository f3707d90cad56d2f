//! `hearth worker-profile`: asks a worker for its per-window statistics (the `profile`
//! control method) and prints them as JSON.

use serde_json::json;

use crate::cli::WorkerProfileArgs;
use crate::runtime::ring::{cluster_secret, SecretUser};

/// `hearth worker-profile`: asks a worker for its `profile` and prints it.
pub fn run(args: WorkerProfileArgs) -> Result<(), Box<dyn std::error::Error>> {
    let secret = cluster_secret(args.cluster_secret.as_deref(), &args.worker, SecretUser::WorkerProfile { insecure: args.insecure })?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let answer = rt.block_on(async {
        let client = transport::ControlClient::connect(&args.worker, &secret, &transport::LinkConfig::default()).await?;
        client.call(transport::methods::PROFILE, &json!({})).await
    })?;
    println!("{}", serde_json::to_string_pretty(&answer)?);
    Ok(())
}
