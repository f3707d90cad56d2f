//! `hearth serve`: the head node. It loads the model (fetching the default one on first
//! use), starts the batching loop on the local pipeline, and serves the OpenAI API until
//! SIGTERM or Ctrl-C; then it stops taking requests and lets running ones finish.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;
use tower_http::map_request_body::MapRequestBodyLayer;
use tower_http::timeout::RequestBodyTimeoutLayer;

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
        let limits = ConnectionLimits::from_args(&args);
        fit_open_files(limits.max_connections);
        serve_api(listener, http::router(state), limits, shutdown).await;
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
    // Speculation stays exact only if a verified draft computes as it would alone.
    let speculates = matches!((args.spec_mode.as_deref(), &args.draft_model), (Some("ngram"), _) | (Some("draft") | None, Some(_)));
    let batch_invariant = args.batch_invariant || speculates;
    let cfg = StageConfig {
        n_seq: parallel,
        n_ctx_seq: args.ctx_size.max(16),
        max_batch,
        threads: args.threads.unwrap_or_else(engine::stage::default_threads),
        batch_invariant,
        ..StageConfig::whole(&spec)
    };
    let (n_ctx_seq, threads) = (cfg.n_ctx_seq, cfg.threads);
    // A ring's secret (or loopback-only without one); no ring, no secret needed.
    let mut secret = None;
    if !args.workers.is_empty() {
        for w in args.workers.iter().chain(std::iter::once(&args.ring_listen)) {
            secret = Some(crate::ring::cluster_secret(args.cluster_secret.as_deref(), w, crate::ring::SecretUser::Head)?);
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
                batch_invariant,
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

/// How the API port treats connections (`--max-connections`, `--header-timeout`).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    /// For a request's headers, between requests on a kept-alive connection, and between
    /// the pieces of a request body. Never for responses.
    pub header_timeout: Duration,
}

impl ConnectionLimits {
    pub fn from_args(args: &ServeArgs) -> ConnectionLimits {
        ConnectionLimits { max_connections: args.max_connections.max(1), header_timeout: Duration::from_secs(args.header_timeout.max(1)) }
    }
}

/// How long a new connection over the cap waits for the idle one it displaced to close.
/// Closing is immediate (the displaced connection's task just drops it); this only bounds
/// a connection that was busy again by the time it was told.
const DISPLACE_WAIT: Duration = Duration::from_millis(200);
/// Pause after an accept that failed for want of descriptors or memory, so the loop does
/// not spin while connections close.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `app` over HTTP/1.1 on `listener` until `shutdown` resolves; then stops
/// accepting, closes idle connections, lets every request in progress finish (streams
/// included) and returns.
///
/// Unlike `axum::serve`, nothing a client does holds the port: a connection must send its
/// headers within the header timeout and may sit idle no longer than that (hyper's header
/// read timer also runs between kept-alive requests, never while a response is being
/// written); connections are capped, and at the cap the connection idle the longest makes
/// room for the new one, so a crowd of slow or idle clients cannot lock out real ones.
pub async fn serve_api(listener: TcpListener, app: Router, limits: ConnectionLimits, shutdown: impl Future<Output = ()>) {
    let app = app.layer(MapRequestBodyLayer::new(Body::new)).layer(RequestBodyTimeoutLayer::new(limits.header_timeout));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let open = Arc::new(Connections::default());
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
        };
        let Some(permit) = open.make_room(&permits).await else {
            // Every connection has a request in progress: this one is closed unanswered
            // (the client sees a reset and may retry) rather than left in the backlog.
            crate::metrics::connection_refused();
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = open.add();
        let service = hyper::service::service_fn({
            let (app, conn) = (app.clone(), conn.clone());
            move |req| {
                let busy = Busy::start(&conn);
                let app = app.clone();
                async move {
                    let resp = app.oneshot(req).await?;
                    Ok::<_, std::convert::Infallible>(resp.map(|body| Tracked { body, _busy: busy }))
                }
            }
        });
        let serving = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        let open = open.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = serving => {}
                _ = conn.displace.notified() => crate::metrics::connection_displaced(),
            }
            open.remove(conn.id);
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

async fn accept_failed(e: std::io::Error) {
    use std::io::ErrorKind::*;
    // The client gave up between the handshake and the accept: nothing to do.
    if matches!(e.kind(), ConnectionAborted | ConnectionReset | ConnectionRefused | Interrupted) {
        return;
    }
    tracing::warn!("cannot accept a connection: {e}");
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}

/// The open connections, for choosing one to close when the cap is reached.
#[derive(Default)]
struct Connections {
    next_id: AtomicU64,
    all: Mutex<HashMap<u64, Arc<Conn>>>,
}

struct Conn {
    id: u64,
    /// Requests whose response has not been sent in full.
    in_flight: AtomicUsize,
    /// When the last request ended, or the connection opened.
    idle_since: Mutex<Instant>,
    /// Told to close, to make room; it is no longer a candidate.
    displaced: AtomicBool,
    displace: Notify,
}

impl Connections {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        // Each change is one map operation: consistent whatever panicked while it was held.
        self.all.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(&self) -> Arc<Conn> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn { id, in_flight: AtomicUsize::new(0), idle_since: Mutex::new(Instant::now()), displaced: AtomicBool::new(false), displace: Notify::new() });
        let mut all = self.lock();
        all.insert(id, conn.clone());
        crate::metrics::connections(all.len());
        conn
    }

    fn remove(&self, id: u64) {
        let mut all = self.lock();
        all.remove(&id);
        crate::metrics::connections(all.len());
    }

    /// A place for a new connection: a free one, or the one of the connection idle the
    /// longest, told to close. `None` when every connection has a request in progress.
    async fn make_room(&self, permits: &Arc<Semaphore>) -> Option<OwnedSemaphorePermit> {
        if let Ok(p) = permits.clone().try_acquire_owned() {
            return Some(p);
        }
        let victim = {
            let all = self.lock();
            all.values()
                .filter(|c| !c.displaced.load(Ordering::Acquire) && c.in_flight.load(Ordering::Acquire) == 0)
                .min_by_key(|c| *c.idle_since.lock().unwrap_or_else(|e| e.into_inner()))
                .cloned()
        }?;
        victim.displaced.store(true, Ordering::Release);
        victim.displace.notify_one();
        tokio::time::timeout(DISPLACE_WAIT, permits.clone().acquire_owned()).await.ok()?.ok()
    }
}

/// A request in progress on a connection, until its response is sent in full (or dropped).
struct Busy(Arc<Conn>);

impl Busy {
    fn start(conn: &Arc<Conn>) -> Busy {
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        Busy(conn.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        *self.0.idle_since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its connection counted as busy until it is sent.
struct Tracked {
    body: Body,
    _busy: Busy,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Descriptors kept for what is not an API connection: the model and draft files, ring
/// links, the runtime's own, a margin.
const FD_RESERVE: u64 = 128;

/// Raises the soft limit on open files to fit `max_connections` when the hard limit
/// allows (a connection over the limit fails to accept, and while none closes, no one
/// gets in); warns when it cannot.
fn fit_open_files(max_connections: usize) {
    #[cfg(unix)]
    {
        let want = max_connections as u64 + FD_RESERVE;
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit/setrlimit on this process with a valid struct.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 || lim.rlim_cur as u64 >= want {
                return;
            }
            let max = lim.rlim_max;
            if max == libc::RLIM_INFINITY || max as u64 >= want {
                lim.rlim_cur = want as libc::rlim_t;
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) == 0 {
                    return;
                }
            }
        }
        tracing::warn!(
            "--max-connections {max_connections} needs about {want} open files but the limit is {}: connections past it wait until others close",
            lim.rlim_cur
        );
    }
    #[cfg(not(unix))]
    let _ = max_connections;
}
