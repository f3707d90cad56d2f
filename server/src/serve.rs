//! `hearth serve`: the head node. It loads the model (fetching the default one on first
//! use), builds the local pipeline, and serves HTTP until SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::routing::get;
use axum::{Json, Router};
use engine::{LocalPipeline, ModelFile, Stage, StageConfig};
use serde_json::json;

use crate::cli::ServeArgs;

struct Head {
    model_id: String,
    n_layer: usize,
    arch: String,
    // The batching loop of the OpenAI API drives this; for now it proves the model loads.
    _pipeline: std::sync::Mutex<LocalPipeline>,
}

pub fn run(args: ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let path = args.model.resolve()?;
    let file = Arc::new(ModelFile::open(&path)?);
    let spec = file.spec.clone();
    let cfg = StageConfig {
        windows: vec![0..spec.n_layer],
        n_seq: args.parallel.max(1),
        n_ctx_seq: args.ctx_size.max(1),
        max_batch: 512,
        threads: args.threads.unwrap_or_else(engine::stage::default_threads),
        accel_layers: 0,
    };
    let pipeline = LocalPipeline::new(vec![Stage::new(file, cfg)?])?;
    let model_id = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    let head = Arc::new(Head { model_id, n_layer: spec.n_layer, arch: spec.arch_name.clone(), _pipeline: std::sync::Mutex::new(pipeline) });

    let addr: SocketAddr = format!("{}:{}", args.host, args.port).parse().map_err(|e| format!("invalid --host/--port: {e}"))?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let app = Router::new().route("/health", get(health)).with_state(head);
        let listener = tokio::net::TcpListener::bind(addr).await?;
        tracing::info!("hearth listening on http://{}", listener.local_addr()?);
        axum::serve(listener, app).with_graceful_shutdown(shutdown_signal()).await?;
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}

async fn health(axum::extract::State(head): axum::extract::State<Arc<Head>>) -> Json<serde_json::Value> {
    Json(json!({ "status": "ok", "model": head.model_id, "architecture": head.arch, "layers": head.n_layer }))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down");
}
