//! `hearth serve`: the head node. It loads the model (fetching the default one on first
//! use), starts the batching loop on the local pipeline, and serves the OpenAI API until
//! SIGTERM or Ctrl-C; then it stops taking requests and lets running ones finish.

use std::net::SocketAddr;
use std::sync::Arc;

use engine::chat_template::ChatTemplate;
use engine::tokenizer::Tokenizer;
use engine::{LocalPipeline, ModelFile, Stage, StageConfig};

use crate::cli::ServeArgs;
use crate::generation::{Batcher, BatcherConfig, DraftModel, Proposer};
use crate::http::{self, AppState};
use crate::ring::board::PlanBoard;

pub fn run(args: ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    // Built before the runtime runs: forming a ring blocks on its own runtime.
    let (state, addr) = build(&args)?;
    let rt = http_runtime()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let signal = shutdown_signal()?;
        let shutdown = async move {
            signal.await;
            tracing::info!("shutting down: finishing running requests");
        };
        tracing::info!("hearth listening on http://{}", listener.local_addr()?);
        let batcher = state.batcher.clone();
        axum::serve(listener, http::router(state)).with_graceful_shutdown(shutdown).await?;
        tokio::task::spawn_blocking(move || batcher.shutdown()).await?;
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}

/// Everything `serve` needs before it listens; also used by the in-process tests.
pub fn build(args: &ServeArgs) -> Result<(Arc<AppState>, SocketAddr), Box<dyn std::error::Error>> {
    crate::metrics::install();
    let addr: SocketAddr = format!("{}:{}", args.host, args.port).parse().map_err(|e| format!("invalid --host/--port: {e}"))?;
    let path = args.model.resolve()?;
    let file = Arc::new(ModelFile::open(&path)?);
    let spec = file.spec.clone();
    let parallel = args.parallel.max(1);
    let max_batch = args.max_batch.max(parallel);
    let cfg = StageConfig {
        n_seq: parallel,
        n_ctx_seq: args.ctx_size.max(16),
        max_batch,
        threads: args.threads.unwrap_or_else(engine::stage::default_threads),
        ..StageConfig::whole(&spec)
    };
    let (n_ctx_seq, threads) = (cfg.n_ctx_seq, cfg.threads);
    // A ring's secret (or loopback-only without one); no ring, no secret needed.
    let mut secret = None;
    if !args.workers.is_empty() {
        for w in args.workers.iter().chain(std::iter::once(&args.ring_listen)) {
            secret = Some(crate::ring::cluster_secret(args.cluster_secret.as_deref(), w, false)?);
        }
    }
    let strategy: scheduler::Strategy = args.plan_strategy.parse()?;
    let (pipeline, board): (Box<dyn engine::Pipeline>, Arc<PlanBoard>) = match secret {
        Some(secret) => {
            let listen: std::net::SocketAddr = args.ring_listen.parse().map_err(|e| format!("invalid --ring-listen {}: {e}", args.ring_listen))?;
            let advertise = match args.ring_advertise.as_deref().filter(|a| !a.is_empty()) {
                Some(a) => Some(a.to_string()),
                None if listen.ip().is_unspecified() => {
                    return Err(format!("--ring-listen {listen} is every interface: say with --ring-advertise HOST:PORT which address the last worker dials").into())
                }
                None => None,
            };
            let windows = (!args.windows.is_empty()).then(|| scheduler::Plan::from_windows(spec.n_layer, &args.windows)).transpose()?;
            // A plan the user pinned stays unless they ask for another (POST /admin/replan).
            let replan_idle = (args.replan_idle > 0 && windows.is_none()).then(|| std::time::Duration::from_secs(args.replan_idle));
            let ring = crate::ring::head::RingConfig {
                workers: Vec::new(),
                secret: secret.clone(),
                plan: windows,
                listen,
                advertise,
                n_seq: cfg.n_seq,
                n_ctx_seq: cfg.n_ctx_seq,
                max_batch: cfg.max_batch,
                threads: cfg.threads,
                f16: args.f16_activations,
                step_timeout: std::time::Duration::from_secs(args.ring_timeout.max(1)),
                prefetch: !args.no_prefetch,
                startup_wait: std::time::Duration::from_secs(args.ring_wait),
                replan_idle,
                hop_delay: crate::ring::hop_delay(args.emulate_hop_ms),
                release: args.release_windows.then_some(true),
            };
            let planner = crate::ring::planning::Planner::new(file.clone(), path.clone(), args.workers.clone(), secret, cfg.threads, cfg.n_ctx_seq, strategy);
            let board = Arc::new(PlanBoard::ring());
            (Box::new(crate::ring::RingPipeline::connect(file, ring, planner, board.clone())?), board)
        }
        None => (Box::new(LocalPipeline::new(vec![Stage::new(file, cfg)?])?), Arc::new(PlanBoard::single(spec.n_layer))),
    };
    let tokenizer = Arc::new(Tokenizer::load(&path)?);
    let source = tokenizer.chat_template_source().ok_or("the model has no chat template (tokenizer.chat_template)")?;
    let template = ChatTemplate::new(&source, &tokenizer.bos_text(), &tokenizer.eos_text())?;
    let model_id = args.model_alias.clone().unwrap_or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into()));
    let proposer = match (args.spec_mode.as_deref(), &args.draft_model) {
        (Some("ngram"), _) => Some(Proposer::Ngram),
        (Some("draft") | None, Some(draft)) => {
            let model = DraftModel::load(draft, &tokenizer, parallel, n_ctx_seq, max_batch, threads)?;
            tracing::info!(draft = %draft.display(), "speculative decoding with a draft model");
            Some(Proposer::Model(Box::new(model)))
        }
        (Some("draft"), None) => return Err("--spec-mode draft needs --draft-model PATH".into()),
        _ => None,
    };
    let batcher = Arc::new(Batcher::start(pipeline, tokenizer.clone(), BatcherConfig { parallel, queue: args.queue_size, max_batch, spec_tokens: args.spec_tokens }, proposer));
    let limits = openapi::Limits { max_n: parallel as u32, ..Default::default() };
    let state = Arc::new(AppState {
        batcher,
        tokenizer,
        template_knows_tools: source.contains("tools"),
        template,
        fingerprint: format!("hearth-{}-{}", env!("CARGO_PKG_VERSION"), spec.arch_name),
        model_id,
        created: crate::http::now_secs(),
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        admin_key: args.admin_key.clone().filter(|k| !k.is_empty()),
        board,
        limits,
        body_limit: args.body_limit,
    });
    tracing::info!(model = %path.display(), layers = spec.n_layer, parallel, ctx = args.ctx_size, "model loaded");
    Ok((state, addr))
}

/// The runtime for HTTP work. Its threads run at a lower priority than the engine's: a
/// ggml step waits at a barrier for all its threads, so an HTTP task that preempts one of
/// them stalls the whole step for a scheduler time slice (measured on 2 cores: +34% time
/// per token for a single streaming client). At lower priority the HTTP work runs in the
/// gaps between steps and on cores the engine leaves idle.
pub fn http_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_start(|| lower_thread_priority(HTTP_NICE))
        .build()
}

/// The runtime that moves ring frames (the head's links, a worker's links and control
/// calls): normal priority, unlike `http_runtime`. A frame waiting to be written is the
/// whole ring waiting; at nice 10 its thread lost the cores for up to a millisecond to
/// the compute threads still spinning after a step.
pub fn ring_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("hearth-ring-io").build()
}

/// nice value of HTTP threads (0 is normal, 19 lowest): low enough to yield to the engine
/// under contention, high enough not to starve when the machine is busy elsewhere.
pub(crate) const HTTP_NICE: i32 = 10;

pub(crate) fn lower_thread_priority(nice: i32) {
    #[cfg(target_os = "linux")]
    // SAFETY: setpriority on this thread's own id; failure only leaves the priority as is.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, nice);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}

/// Resolves on SIGTERM or Ctrl-C. The handlers are registered when this is called, not
/// when the future is first polled: a signal that arrives right after "listening" (a
/// supervisor stopping us at once) must shut down gracefully, not kill the process.
pub(crate) fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}
