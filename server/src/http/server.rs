//! The API port: HTTP/1.1 served by hyper directly, with a connection cap (a connection
//! idle, or still sending a request body, makes room for a new one), header and idle
//! timeouts, a pace every request body must keep, a cap of its own for endless streams
//! (the console's), and a graceful end that lets every request in progress finish.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::Response;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;
use tower_http::map_request_body::MapRequestBodyLayer;
use tower_http::timeout::RequestBodyTimeoutLayer;

/// How the API port treats connections (`--max-connections`, `--header-timeout`,
/// `--max-console-streams`).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    /// Connections serving an endless stream, on top of `max_connections` (the streams
    /// themselves are capped by [`EndlessStreams`]; this sizes the open-file limit).
    pub max_streams: usize,
    /// For a request's headers, between requests on a kept-alive connection, and between
    /// the pieces of a request body; also the grace before a body's pace is held to
    /// [`MIN_BODY_RATE`]. Never for responses.
    pub header_timeout: Duration,
}

/// The least average rate of a request body once the grace (`header_timeout`) is over:
/// a body of `n` bytes must have arrived within `header_timeout + n / MIN_BODY_RATE`.
/// 8 KiB/s is slower than any link in a home (a phone on bad Wi-Fi sends megabits), and a
/// body at the 4 MiB limit still has over eight minutes; a client that sends a byte every
/// few seconds to hold a connection is closed once the grace is over.
pub const MIN_BODY_RATE: u64 = 8 * 1024;

/// How long a new connection over the cap waits for the idle one it displaced to close.
/// Closing is immediate (the displaced connection's task just drops it); this only bounds
/// a connection that was busy again by the time it was told.
const DISPLACE_WAIT: Duration = Duration::from_millis(200);
/// Pause after an accept that failed for want of descriptors or memory, so the loop does
/// not spin while connections close.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The default of `--max-console-streams`: a console tab holds one stream, and a home has a
/// few people with a few tabs each; each stream costs a snapshot a second.
pub const DEFAULT_MAX_STREAMS: usize = 32;

/// Slots for endless streams (the console's live state), apart from the API's connections:
/// a stream holds one for as long as it runs, and its connection leaves the API's count
/// ([`endless`]), so open consoles can take neither each other's nor API clients' places.
/// Past the cap a new stream is refused (503) rather than an old one closed: the console
/// retries by itself, and tabs closing each other's streams would take turns for ever.
#[derive(Debug, Clone)]
pub struct EndlessStreams {
    slots: Arc<Semaphore>,
    cap: usize,
}

impl Default for EndlessStreams {
    fn default() -> Self {
        EndlessStreams::new(DEFAULT_MAX_STREAMS)
    }
}

impl EndlessStreams {
    pub fn new(cap: usize) -> EndlessStreams {
        EndlessStreams { slots: Arc::new(Semaphore::new(cap)), cap }
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    /// A slot for a new stream, or `None` when all are taken.
    pub fn take(&self) -> Option<EndlessSlot> {
        self.slots.clone().try_acquire_owned().ok().map(EndlessSlot)
    }
}

/// One endless stream's slot: kept by the stream, freed when it ends or its client goes.
pub struct EndlessSlot(#[allow(dead_code)] OwnedSemaphorePermit);

/// Response extension of an endless stream.
#[derive(Debug, Clone, Copy)]
struct Endless;

/// Marks `resp` as an endless stream: served by [`serve_api`], its connection stops
/// counting against `--max-connections` and is closed at shutdown (the stream would never
/// finish by itself), and it closes when the stream ends, having given its place back.
pub fn endless(mut resp: Response) -> Response {
    resp.extensions_mut().insert(Endless);
    resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// Serves `app` over HTTP/1.1 on `listener` until `shutdown` resolves; then stops
/// accepting, closes idle connections and endless streams, lets every request in progress
/// finish (generation streams included) and returns.
///
/// Unlike `axum::serve`, nothing a client does holds the port: a connection must send its
/// headers within the header timeout and may sit idle no longer than that (hyper's header
/// read timer also runs between kept-alive requests, never while a response is being
/// written); a request body must keep [`MIN_BODY_RATE`]; connections are capped, and at
/// the cap the connection idle the longest makes room for the new one, else the one that
/// has been sending a body the longest, so a crowd of slow, idle or trickling clients
/// cannot lock out real ones. Only a connection whose request is being answered is safe.
pub async fn serve_api(listener: TcpListener, app: Router, limits: ConnectionLimits, shutdown: impl Future<Output = ()>) {
    fit_open_files(limits.max_connections + limits.max_streams);
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
        let conn = open.add(permit);
        let service = hyper::service::service_fn({
            let (app, conn, open) = (app.clone(), conn.clone(), open.clone());
            move |req: hyper::Request<hyper::body::Incoming>| {
                let busy = Busy::start(&conn);
                let req = req.map(|body| Body::new(Paced::new(Body::new(body), &conn, limits.header_timeout)));
                let (app, conn, open) = (app.clone(), conn.clone(), open.clone());
                async move {
                    let resp = app.oneshot(req).await?;
                    if resp.extensions().get::<Endless>().is_some() {
                        open.to_endless(&conn);
                    }
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
                _ = conn.cut.notified() => {}
            }
            open.remove(conn.id);
            drop(conn.take_permit());
        });
    }
    drop(listener);
    open.cut_streams();
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

/// The open connections, for choosing one to close when the cap is reached, and those
/// serving endless streams, apart.
#[derive(Default)]
struct Connections {
    next_id: AtomicU64,
    all: Mutex<HashMap<u64, Arc<Conn>>>,
    streams: Mutex<HashMap<u64, Arc<Conn>>>,
    /// Shutdown began: a connection that turns endless now is cut at once.
    stopping: AtomicBool,
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
    /// Since when a request body has been arriving, while one is (HTTP/1.1: one request at
    /// a time per connection).
    body_since: Mutex<Option<Instant>>,
    /// Its place among `--max-connections`, until it closes or turns endless.
    permit: Mutex<Option<OwnedSemaphorePermit>>,
    /// Told to close: it serves an endless stream and the server is shutting down.
    cut: Notify,
}

impl Conn {
    fn take_permit(&self) -> Option<OwnedSemaphorePermit> {
        self.permit.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl Connections {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        // Each change is one map operation: consistent whatever panicked while it was held.
        self.all.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn streams(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        self.streams.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(&self, permit: OwnedSemaphorePermit) -> Arc<Conn> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            id,
            in_flight: AtomicUsize::new(0),
            idle_since: Mutex::new(Instant::now()),
            displaced: AtomicBool::new(false),
            displace: Notify::new(),
            body_since: Mutex::new(None),
            permit: Mutex::new(Some(permit)),
            cut: Notify::new(),
        });
        let mut all = self.lock();
        all.insert(id, conn.clone());
        crate::metrics::connections(all.len());
        conn
    }

    fn remove(&self, id: u64) {
        self.streams().remove(&id);
        let mut all = self.lock();
        all.remove(&id);
        crate::metrics::connections(all.len());
    }

    /// `conn` now serves an endless stream (which holds a slot of [`EndlessStreams`]): it
    /// gives its place among `--max-connections` back and is no longer a candidate to make
    /// room (its request is being answered). The stream's `Connection: close` ends it with
    /// the stream.
    fn to_endless(&self, conn: &Arc<Conn>) {
        let place = conn.take_permit();
        {
            let mut all = self.lock();
            all.remove(&conn.id);
            crate::metrics::connections(all.len());
        }
        self.streams().insert(conn.id, conn.clone());
        drop(place);
        // After the insert: either `cut_streams` sees it, or this sees `stopping`.
        if self.stopping.load(Ordering::SeqCst) {
            conn.cut.notify_one();
        }
    }

    /// Shutdown: every endless stream's connection is closed (a graceful end waits for
    /// responses to finish, and these never do).
    fn cut_streams(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        for conn in self.streams().values() {
            conn.cut.notify_one();
        }
    }

    /// A place for a new connection: a free one, or the one of the connection idle the
    /// longest, else of the one sending a request body the longest, told to close. `None`
    /// when every connection has a request being answered.
    async fn make_room(&self, permits: &Arc<Semaphore>) -> Option<OwnedSemaphorePermit> {
        if let Ok(p) = permits.clone().try_acquire_owned() {
            return Some(p);
        }
        let victim = {
            let all = self.lock();
            let candidates = || all.values().filter(|c| !c.displaced.load(Ordering::Acquire));
            let idle = candidates().filter(|c| c.in_flight.load(Ordering::Acquire) == 0).min_by_key(|c| *c.idle_since.lock().unwrap_or_else(|e| e.into_inner()));
            // A client still sending its body has cost nothing yet; one that holds a slot
            // by sending slowly goes before anyone being answered.
            let sending = || candidates().filter_map(|c| Some((*c.body_since.lock().unwrap_or_else(|e| e.into_inner()))?).map(|since| (since, c)));
            idle.or_else(|| sending().min_by_key(|(since, _)| *since).map(|(_, c)| c)).cloned()
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

/// A request body held to [`MIN_BODY_RATE`] after the grace, and counted as arriving on
/// its connection until it has (see [`Connections::make_room`]).
struct Paced {
    body: Body,
    conn: Option<Arc<Conn>>,
    started: Instant,
    grace: Duration,
    received: u64,
    deadline: Pin<Box<tokio::time::Sleep>>,
    /// Fell behind: the error was returned, nothing more comes.
    failed: bool,
}

impl Paced {
    fn new(body: Body, conn: &Arc<Conn>, grace: Duration) -> Paced {
        use http_body::Body as _;
        let started = Instant::now();
        let arriving = !body.is_end_stream();
        if arriving {
            *conn.body_since.lock().unwrap_or_else(|e| e.into_inner()) = Some(started);
        }
        let deadline = Box::pin(tokio::time::sleep(grace));
        Paced { body, conn: arriving.then(|| conn.clone()), started, grace, received: 0, deadline, failed: false }
    }

    /// When the body must have gone past what it has sent so far.
    fn due(&self) -> Instant {
        self.started + self.grace + Duration::from_secs_f64(self.received as f64 / MIN_BODY_RATE as f64)
    }

    /// The body has arrived, failed or been dropped: no longer arriving.
    fn done(&mut self) {
        if let Some(conn) = self.conn.take() {
            *conn.body_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
    }
}

impl Drop for Paced {
    fn drop(&mut self) {
        self.done();
    }
}

/// A request body that fell behind [`MIN_BODY_RATE`].
#[derive(Debug)]
struct TooSlow {
    received: u64,
    after: Duration,
}

impl std::fmt::Display for TooSlow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the request body arrived too slowly ({} bytes in {:.0?}; at least {} bytes/s after the first seconds)", self.received, self.after, MIN_BODY_RATE)
    }
}

impl std::error::Error for TooSlow {}

impl http_body::Body for Paced {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(None);
        }
        let late = match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let Some(data) = frame.data_ref() else { return Poll::Ready(Some(Ok(frame))) };
                this.received += data.len() as u64;
                // Checked here too: a trickle wakes this at every byte, and the timer
                // below is only looked at while nothing arrives.
                let due = this.due();
                if Instant::now() <= due {
                    this.deadline.as_mut().reset(due.into());
                    return Poll::Ready(Some(Ok(frame)));
                }
                true
            }
            Poll::Ready(other) => {
                this.done();
                return Poll::Ready(other);
            }
            Poll::Pending => this.deadline.as_mut().poll(cx).is_ready(),
        };
        if !late {
            return Poll::Pending;
        }
        let slow = TooSlow { received: this.received, after: this.started.elapsed() };
        this.done();
        this.failed = true;
        Poll::Ready(Some(Err(axum::Error::new(slow))))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
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
