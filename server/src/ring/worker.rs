//! `hearth worker`: a ring member. It waits for a head to send it a plan (its windows and
//! its successor), then runs its window of every round on the hidden states its
//! predecessor sends and passes the result on. Compute runs off the async runtime so
//! keep-alive pings are answered during long steps.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use engine::{BatchToken, ModelFile, Stage, StageConfig, StageInput, StageOutput};
use serde_json::{json, Value};
use transport::{Activations, ControlFailure, Frame, KvOp, Link, LinkConfig, LinkServer};

use super::WorkerPlan;
use crate::cli::WorkerArgs;

struct State {
    file: Arc<ModelFile>,
    fingerprint: String,
    stage: Option<Stage>,
    next: Option<String>,
}

pub fn run(args: WorkerArgs) -> Result<(), Box<dyn std::error::Error>> {
    let secret = super::cluster_secret(args.cluster_secret.as_deref(), &args.listen, args.insecure)?;
    let path = args.model.resolve()?;
    let file = Arc::new(ModelFile::open(&path)?);
    let fingerprint = file.fingerprint();
    let threads = args.threads.unwrap_or_else(engine::stage::default_threads);
    let state = Arc::new(Mutex::new(State { file, fingerprint, stage: None, next: None }));
    let addr: SocketAddr = args.listen.parse().map_err(|e| format!("invalid --listen {}: {e}", args.listen))?;
    let rt = crate::serve::http_runtime()?;
    rt.block_on(async move {
        let handler_state = state.clone();
        let handler = move |method: String, body: Value| {
            let state = handler_state.clone();
            async move { control(&state, &method, body, threads).await }
        };
        let config = LinkConfig::default();
        let mut server = LinkServer::bind(addr, secret.clone(), config.clone(), Some(Arc::new(handler))).await?;
        tracing::info!("hearth worker listening on {}", server.local_addr());
        while let Some(link) = server.accept().await {
            let (state, secret, config) = (state.clone(), secret.clone(), config.clone());
            tokio::spawn(async move {
                let peer = link.peer().to_string();
                if let Err(e) = serve_link(link, state, secret, config).await {
                    tracing::warn!(%peer, "ring link ended: {e}");
                }
            });
        }
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}

async fn control(state: &Arc<Mutex<State>>, method: &str, body: Value, threads: usize) -> Result<Value, ControlFailure> {
    match method {
        transport::methods::HEALTH => {
            let s = state.lock().expect("worker state");
            Ok(json!({"status": "ok", "fingerprint": s.fingerprint, "planned": s.stage.is_some()}))
        }
        transport::methods::LOAD_PLAN => {
            let plan: WorkerPlan = serde_json::from_value(body).map_err(|e| ControlFailure::bad_request(format!("invalid plan: {e}")))?;
            let (file, fingerprint) = {
                let s = state.lock().expect("worker state");
                (s.file.clone(), s.fingerprint.clone())
            };
            if plan.fingerprint != fingerprint {
                return Err(ControlFailure::bad_request(format!(
                    "this worker has a different model file (fingerprint {fingerprint}, the head's is {})",
                    plan.fingerprint
                )));
            }
            let cfg = StageConfig {
                windows: plan.windows.iter().map(|&(a, b)| a..b).collect(),
                n_seq: plan.n_seq,
                n_ctx_seq: plan.n_ctx_seq,
                max_batch: plan.max_batch,
                threads,
                accel_layers: 0,
                owns_output: false,
            };
            let stage = tokio::task::spawn_blocking(move || Stage::new(file, cfg))
                .await
                .map_err(|e| ControlFailure::failed(e.to_string()))?
                .map_err(|e| ControlFailure::bad_request(e.to_string()))?;
            tracing::info!(windows = ?plan.windows, next = %plan.next, "plan loaded");
            let mut s = state.lock().expect("worker state");
            s.stage = Some(stage);
            s.next = Some(plan.next);
            Ok(json!({"status": "ok"}))
        }
        other => Err(ControlFailure::unknown_method(other)),
    }
}

/// Frames from the predecessor: compute what is ours, pass everything on in order.
async fn serve_link(mut link: Link, state: Arc<Mutex<State>>, secret: transport::ClusterSecret, config: LinkConfig) -> Result<(), String> {
    let next = state.lock().expect("worker state").next.clone().ok_or("a head linked before sending a plan")?;
    let mut out = Link::connect(&next, &secret, &config).await.map_err(|e| e.to_string())?;
    while let Some(frame) = link.stream.recv().await.map_err(|e| e.to_string())? {
        let reply = match frame {
            Frame::Activations(a) => {
                let state = state.clone();
                tokio::task::spawn_blocking(move || compute(&state, a)).await.map_err(|e| e.to_string())?
            }
            Frame::KvOps { step, ops } => {
                if let Some(stage) = state.lock().expect("worker state").stage.as_mut() {
                    apply(stage, &ops);
                }
                Frame::KvOps { step, ops }
            }
            other => other,
        };
        out.sink.send(&reply).await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

pub(crate) fn apply(stage: &mut Stage, ops: &[KvOp]) {
    for op in ops {
        match *op {
            KvOp::Clear { seq } => stage.clear_sequence(seq),
            KvOp::Truncate { seq, len } => stage.truncate_sequence(seq, len as usize),
        }
    }
}

fn compute(state: &Mutex<State>, a: Activations) -> Frame {
    let mut s = state.lock().expect("worker state");
    let Some(stage) = s.stage.as_mut() else {
        return Frame::Error { step: a.step, message: "worker has no plan".into() };
    };
    let batch: Vec<BatchToken> = a.tokens.iter().map(|t| BatchToken { seq: t.seq, pos: t.pos, logits: t.wants_logits }).collect();
    match stage.forward(a.round as usize, &batch, StageInput::Hidden(&a.hidden)) {
        Ok(StageOutput::Hidden(hidden)) => Frame::Activations(Activations { hidden, ..a }),
        Ok(StageOutput::Logits(_)) => Frame::Error { step: a.step, message: "worker produced logits".into() },
        Err(e) => Frame::Error { step: a.step, message: e.to_string() },
    }
}
