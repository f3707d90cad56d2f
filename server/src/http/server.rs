//! The API port: HTTP/1.1 served by hyper directly, with a connection cap (the connection
//! idle longest makes room for a new one), header and idle timeouts, and a graceful end
//! that lets every request in progress finish.

use std::collections::HashMap;
use std::future::Future;
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

/// How the API port treats connections (`--max-connections`, `--header-timeout`).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    /// For a request's headers, between requests on a kept-alive connection, and between
    /// the pieces of a request body. Never for responses.
    pub header_timeout: Duration,
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
    fit_open_files(limits.max_connections);
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
