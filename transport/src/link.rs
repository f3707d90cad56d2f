//! One persistent HTTP/2 connection per ring hop.
//!
//! The predecessor dials its successor once and opens a single long-lived stream on
//! `POST /ring/link`: the request body carries frames to the successor, the response body
//! frames back (handshake, acks, step errors). Frames are cut from the byte stream by the
//! codec, so HTTP/2's own DATA framing never has to line up with ours. The auth handshake
//! runs first, in-band; until it succeeds the server accepts nothing but handshake frames of
//! a few bytes, and a peer that fails it, stalls, or breaks the frame protocol has its whole
//! TCP connection shut down while the server keeps serving everyone else.

use std::any::Any;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{Either, Full};
use hyper::body::{Body, Frame as BodyFrame, Incoming};
use hyper::client::conn::http2::SendRequest;
use hyper::header::CONTENT_TYPE;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::timeout;
use tracing::{debug, info, warn};

use crate::auth::{ClientHandshake, ClusterSecret, ServerHandshake};
use crate::control::{self, ControlHandler};
use crate::error::{Error, Result};
use crate::frame::{encode, Frame, FrameDecoder, DEFAULT_MAX_FRAME_BYTES};

pub const LINK_PATH: &str = "/ring/link";

/// A whole multi-MiB activation frame can be in flight without stalling on WINDOW_UPDATE
/// round trips (the HTTP/2 default window is 64 KiB).
const STREAM_WINDOW: u32 = 16 << 20;
/// Room for the link's stream plus control calls on the same connection.
const CONNECTION_WINDOW: u32 = 32 << 20;
/// Fewer DATA frames, headers and wakeups per activation frame than the 16 KiB default.
const MAX_H2_FRAME: u32 = 1 << 20;
/// How much outgoing data hyper buffers per stream; above one frame so the socket stays
/// busy while the next frame is encoded.
const SEND_BUFFER: usize = 8 << 20;
/// A hop needs one link stream and a few concurrent control calls.
const MAX_STREAMS_PER_CONNECTION: u32 = 16;
/// A ring has a handful of members; the cap bounds what a connection flood can take.
const MAX_CONNECTIONS: usize = 64;
/// The largest handshake frame is 44 bytes: before a peer proves the secret it cannot make
/// us buffer more than this.
const HANDSHAKE_MAX_FRAME_BYTES: usize = 256;
/// Encoded frames queued ahead of the socket: enough to overlap encoding with sending, few
/// enough that a peer that stops reading pushes back at once.
const SEND_QUEUE_FRAMES: usize = 4;
/// Authenticated links waiting for `LinkServer::accept`.
const ACCEPT_QUEUE: usize = 8;
/// After a failed accept (out of file descriptors) retrying at once would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
const OCTET_STREAM: &str = "application/octet-stream";

/// Timeouts and limits of a link; the same values serve both ends and the control RPCs.
#[derive(Clone, Debug)]
pub struct LinkConfig {
    /// Name resolution plus TCP connect.
    pub connect_timeout: Duration,
    /// HTTP/2 setup plus the auth handshake; also how long a server keeps a connection
    /// that has not authenticated anything.
    pub handshake_timeout: Duration,
    /// How long a frame may wait for room in the send queue, i.e. for the peer to read.
    pub send_timeout: Duration,
    /// Longest wait for the next frame in `FrameStream::recv`. `None` by default: a ring
    /// idles between requests, and keep-alive pings already catch a dead peer.
    pub recv_timeout: Option<Duration>,
    pub keep_alive_interval: Duration,
    /// A peer that does not answer a keep-alive ping within this is declared dead.
    pub keep_alive_timeout: Duration,
    /// One control call, request to response; profiling a device takes seconds.
    pub control_timeout: Duration,
    pub max_frame_bytes: usize,
    /// Added before every frame this side sends: emulates a slow link (Wi-Fi's few
    /// milliseconds a hop) on loopback for benchmarks. Zero by default.
    pub send_delay: Duration,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            send_timeout: Duration::from_secs(30),
            recv_timeout: None,
            keep_alive_interval: Duration::from_secs(5),
            keep_alive_timeout: Duration::from_secs(10),
            control_timeout: Duration::from_secs(60),
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            send_delay: Duration::ZERO,
        }
    }
}

/// A second handle on a connection's socket, so the connection can be shut down from
/// outside hyper (which owns the socket) the moment a peer misbehaves, and a record of
/// whether the connection is gone, so senders fail fast instead of queueing into the void.
#[derive(Clone)]
pub(crate) struct Killer(Arc<ConnState>);

struct ConnState {
    socket: std::net::TcpStream,
    closed: AtomicBool,
}

impl Killer {
    fn new(tcp: TcpStream) -> std::io::Result<(TcpStream, Killer)> {
        let std = tcp.into_std()?;
        let socket = std.try_clone()?;
        let state = ConnState { socket, closed: AtomicBool::new(false) };
        Ok((TcpStream::from_std(std)?, Killer(Arc::new(state))))
    }

    pub(crate) fn kill(&self) {
        self.mark_closed();
        // Both directions: hyper sees EOF and ends the connection, the peer sees FIN.
        let _ = self.0.socket.shutdown(std::net::Shutdown::Both);
    }

    fn mark_closed(&self) {
        self.0.closed.store(true, Ordering::Release);
    }

    fn is_closed(&self) -> bool {
        self.0.closed.load(Ordering::Acquire)
    }
}

/// Shuts its connection down when the last user of it (link halves, control client) drops.
pub(crate) struct ConnGuard {
    killer: Killer,
    /// The client's request sender: hyper starts closing a client connection once no
    /// sender is left, so it lives exactly as long as the connection's users.
    _sender: Option<Box<dyn Any + Send + Sync>>,
}

impl ConnGuard {
    pub(crate) fn new(killer: Killer, sender: Option<Box<dyn Any + Send + Sync>>) -> Self {
        ConnGuard { killer, _sender: sender }
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.killer.kill();
    }
}

/// A streaming HTTP body fed frame by frame from a `FrameSink`.
pub(crate) struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<BodyFrame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|chunk| chunk.map(|bytes| Ok(BodyFrame::data(bytes))))
    }
}

/// The sending half of a link.
pub struct FrameSink {
    tx: mpsc::Sender<Bytes>,
    /// Reused for every frame: once the previous frames have gone out, encoding the next
    /// one reclaims the same allocation.
    buf: BytesMut,
    peer: Arc<str>,
    send_timeout: Duration,
    send_delay: Duration,
    guard: Arc<ConnGuard>,
}

impl FrameSink {
    /// Queues one frame; success means queued, not delivered (a peer that dies is noticed
    /// by the next send or by the stream). An error means the link is broken (a timed-out
    /// frame is lost, so the connection is shut down): drop both halves and reconnect.
    pub async fn send(&mut self, frame: &Frame) -> Result<()> {
        if self.guard.killer.is_closed() {
            return Err(Error::closed(&self.peer));
        }
        if !self.send_delay.is_zero() {
            tokio::time::sleep(self.send_delay).await;
        }
        encode(frame, &mut self.buf)?;
        let bytes = self.buf.split().freeze();
        match timeout(self.send_timeout, self.tx.send(bytes)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Error::closed(&self.peer)),
            Err(_) => {
                self.guard.killer.kill();
                Err(Error::timeout(&self.peer, "sending a frame", self.send_timeout))
            }
        }
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }
}

/// The receiving half of a link.
pub struct FrameStream {
    body: Incoming,
    buf: BytesMut,
    decoder: FrameDecoder,
    peer: Arc<str>,
    recv_timeout: Option<Duration>,
    guard: Arc<ConnGuard>,
}

impl FrameStream {
    /// The next frame; `Ok(None)` when the peer ended the stream cleanly. Waits at most
    /// `LinkConfig::recv_timeout` if one is set.
    pub async fn recv(&mut self) -> Result<Option<Frame>> {
        match self.recv_timeout {
            Some(limit) => self.recv_within(limit).await,
            None => self.recv_frame().await,
        }
    }

    /// Names the peer in errors by what the receiver knows it to be: an accepted stream
    /// knows only the dialer's socket address, whose port is an ephemeral one.
    pub fn set_peer(&mut self, peer: &str) {
        self.peer = peer.into();
    }

    /// Like `recv` with an explicit limit, e.g. the head waiting for a step to come round.
    /// A timeout loses nothing: partial bytes stay buffered for the next call.
    pub async fn recv_within(&mut self, limit: Duration) -> Result<Option<Frame>> {
        match timeout(limit, self.recv_frame()).await {
            Ok(result) => result,
            Err(_) => Err(Error::timeout(&self.peer, "waiting for a frame", limit)),
        }
    }

    /// Returns a consumed frame's buffers for reuse by the next activations frame.
    pub fn recycle(&mut self, frame: Frame) {
        self.decoder.recycle(frame);
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    async fn recv_frame(&mut self) -> Result<Option<Frame>> {
        let frame = self.next_any().await?;
        match frame {
            Some(f) if f.is_handshake() => {
                Err(self.violation(Error::malformed(f.kind_name(), "handshake frame after authentication")))
            }
            other => Ok(other),
        }
    }

    /// The next frame including handshake frames.
    async fn next_any(&mut self) -> Result<Option<Frame>> {
        loop {
            match self.decoder.decode(&mut self.buf) {
                Ok(Some(frame)) => return Ok(Some(frame)),
                Ok(None) => {}
                Err(e) => return Err(self.violation(e)),
            }
            let body = &mut self.body;
            match std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await {
                Some(Ok(chunk)) => {
                    if let Ok(data) = chunk.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => {
                    self.guard.killer.mark_closed();
                    return Err(Error::http(&self.peer, "receiving", e));
                }
                None if self.buf.is_empty() => return Ok(None),
                None => {
                    let reason = format!("the stream ended {} bytes into a frame", self.buf.len());
                    return Err(self.violation(Error::Malformed { kind: "truncated", reason }));
                }
            }
        }
    }

    /// Nothing a peer sends after a protocol error can be trusted to line up with frames:
    /// close the connection rather than guess.
    fn violation(&self, detail: Error) -> Error {
        warn!(peer = %self.peer, "closing ring connection: {detail}");
        self.guard.killer.kill();
        Error::Protocol { peer: self.peer.to_string(), detail: Box::new(detail) }
    }
}

/// An authenticated, bidirectional frame stream to one ring neighbour.
pub struct Link {
    pub sink: FrameSink,
    pub stream: FrameStream,
}

impl Link {
    /// Dials `peer` (`host:port` or `http://host:port`), opens the link stream and runs the
    /// handshake. Fails with an error naming the peer if any step fails or stalls.
    pub async fn connect(peer: &str, secret: &ClusterSecret, config: &LinkConfig) -> Result<Link> {
        let (mut send, addr, killer) = open_h2::<ChannelBody>(peer, config).await?;
        let label: Arc<str> = peer.into();
        // Until the link exists nothing else shuts the connection down on failure.
        let on_failure = killer.clone();
        let opening = async {
            let (tx, rx) = mpsc::channel(SEND_QUEUE_FRAMES);
            let request = Request::post(format!("http://{addr}{LINK_PATH}"))
                .header(CONTENT_TYPE, OCTET_STREAM)
                .body(ChannelBody(rx))
                .map_err(|e| Error::http(peer, "building the link request", e))?;
            let response = send.send_request(request).await.map_err(|e| Error::http(peer, "opening the link", e))?;
            if response.status() != StatusCode::OK {
                let reason = format!("status {}", response.status());
                return Err(Error::http(peer, "opening the link", reason));
            }
            let guard = Arc::new(ConnGuard::new(killer, Some(Box::new(send))));
            let mut link = Link::new(label, response.into_body(), tx, config, guard);
            client_handshake(&mut link, secret).await?;
            Ok(link)
        };
        let opened = timeout(config.handshake_timeout, opening).await.unwrap_or_else(|_| {
            Err(Error::timeout(peer, "opening and authenticating the link", config.handshake_timeout))
        });
        let mut link = opened.inspect_err(|_| on_failure.kill())?;
        link.stream.decoder.set_max_frame_bytes(config.max_frame_bytes);
        debug!(%peer, "ring link open");
        Ok(link)
    }

    pub fn peer(&self) -> &str {
        self.sink.peer()
    }

    fn new(
        peer: Arc<str>,
        body: Incoming,
        tx: mpsc::Sender<Bytes>,
        config: &LinkConfig,
        guard: Arc<ConnGuard>,
    ) -> Link {
        Link {
            sink: FrameSink {
                tx,
                buf: BytesMut::new(),
                peer: peer.clone(),
                send_timeout: config.send_timeout,
                send_delay: config.send_delay,
                guard: guard.clone(),
            },
            stream: FrameStream {
                body,
                buf: BytesMut::new(),
                decoder: FrameDecoder::new(HANDSHAKE_MAX_FRAME_BYTES),
                peer,
                recv_timeout: config.recv_timeout,
                guard,
            },
        }
    }
}

fn unexpected(peer: &str, frame: Option<Frame>) -> Error {
    let got = frame.map_or("the end of the stream", |f| f.kind_name());
    Error::auth(peer, format!("expected the next handshake frame, got {got}"))
}

async fn client_handshake(link: &mut Link, secret: &ClusterSecret) -> Result<()> {
    let peer = link.peer().to_owned();
    let mut handshake = ClientHandshake::new(secret);
    link.sink.send(&Frame::AuthHello { nonce: handshake.hello() }).await?;
    let nonce = match link.stream.next_any().await? {
        Some(Frame::AuthChallenge { nonce }) => nonce,
        other => return Err(unexpected(&peer, other)),
    };
    link.sink.send(&Frame::AuthProof { proof: handshake.on_challenge(nonce) }).await?;
    match link.stream.next_any().await {
        Ok(Some(Frame::AuthWelcome { proof })) if handshake.on_welcome(&proof) => Ok(()),
        Ok(Some(Frame::AuthWelcome { .. })) => Err(Error::auth(&peer, "the peer does not know the cluster secret")),
        Ok(None) | Err(Error::Http { .. }) => {
            Err(Error::auth(&peer, "the peer closed the link after our proof (wrong cluster secret?)"))
        }
        Ok(other) => Err(unexpected(&peer, other)),
        Err(e) => Err(e),
    }
}

async fn server_handshake(link: &mut Link, secret: &ClusterSecret) -> Result<()> {
    let peer = link.peer().to_owned();
    let nonce = match link.stream.next_any().await? {
        Some(Frame::AuthHello { nonce }) => nonce,
        other => return Err(unexpected(&peer, other)),
    };
    let handshake = ServerHandshake::new(secret, nonce);
    link.sink.send(&Frame::AuthChallenge { nonce: handshake.challenge() }).await?;
    let proof = match link.stream.next_any().await? {
        Some(Frame::AuthProof { proof }) => proof,
        other => return Err(unexpected(&peer, other)),
    };
    let welcome = handshake.on_proof(&proof).ok_or_else(|| Error::auth(&peer, "wrong cluster secret"))?;
    link.sink.send(&Frame::AuthWelcome { proof: welcome }).await
}

fn host_port(peer: &str) -> Result<&str> {
    let bad = |reason: &str| Error::Address { addr: peer.to_owned(), reason: reason.to_owned() };
    let rest = match peer.split_once("://") {
        Some(("http", rest)) => rest,
        Some(_) => return Err(bad("only http:// is spoken (HTTP/2 without TLS)")),
        None => peer,
    };
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() || rest.contains('/') {
        return Err(bad("expected host:port"));
    }
    Ok(rest)
}

async fn dial(peer: &str, config: &LinkConfig) -> Result<(TcpStream, SocketAddr)> {
    let host_port = host_port(peer)?;
    let io = |what, error| Error::Io { peer: peer.to_owned(), what, error };
    let attempt = async {
        let mut last = None;
        for addr in tokio::net::lookup_host(host_port).await.map_err(|e| io("resolving", e))? {
            match TcpStream::connect(addr).await {
                Ok(tcp) => return Ok((tcp, addr)),
                Err(e) => last = Some(e),
            }
        }
        let none = || std::io::Error::new(std::io::ErrorKind::NotFound, "no address");
        Err(io("connecting", last.unwrap_or_else(none)))
    };
    let (tcp, addr) = timeout(config.connect_timeout, attempt)
        .await
        .map_err(|_| Error::timeout(peer, "connecting", config.connect_timeout))??;
    // Frames are latency-bound messages, not a bulk stream: never hold the tail back.
    tcp.set_nodelay(true).map_err(|e| io("setting TCP_NODELAY", e))?;
    Ok((tcp, addr))
}

/// Dials `peer` and sets up an HTTP/2 client connection with the ring's settings.
pub(crate) async fn open_h2<B>(peer: &str, config: &LinkConfig) -> Result<(SendRequest<B>, SocketAddr, Killer)>
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (tcp, addr) = dial(peer, config).await?;
    let (tcp, killer) =
        Killer::new(tcp).map_err(|error| Error::Io { peer: peer.to_owned(), what: "setting up the socket", error })?;
    let mut builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_H2_FRAME)
        .max_send_buf_size(SEND_BUFFER)
        .keep_alive_interval(config.keep_alive_interval)
        .keep_alive_timeout(config.keep_alive_timeout)
        .keep_alive_while_idle(true);
    let (send, conn) = timeout(config.handshake_timeout, builder.handshake(TokioIo::new(tcp)))
        .await
        .map_err(|_| Error::timeout(peer, "HTTP/2 setup", config.handshake_timeout))?
        .map_err(|e| Error::http(peer, "setup", e))?;
    let label = peer.to_owned();
    let state = killer.clone();
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            debug!(peer = %label, "ring connection ended: {e}");
        }
        state.mark_closed();
    });
    Ok((send, addr, killer))
}

/// What every connection of one server shares.
struct Shared {
    secret: ClusterSecret,
    config: LinkConfig,
    control: Option<Arc<dyn ControlHandler>>,
    links: mpsc::Sender<Link>,
    h2: hyper::server::conn::http2::Builder<TokioExecutor>,
}

/// One accepted connection.
struct Conn {
    shared: Arc<Shared>,
    peer: Arc<str>,
    killer: Killer,
    /// Set once anything on this connection has proved the secret; a connection still
    /// unauthenticated after the handshake timeout is shut down.
    authed: AtomicBool,
}

/// Listens for ring links and control calls on one port.
pub struct LinkServer {
    local_addr: SocketAddr,
    links: mpsc::Receiver<Link>,
    accept_task: tokio::task::JoinHandle<()>,
    /// Dropping it tells every connection task to shut its connection down.
    _shutdown: watch::Sender<()>,
}

impl LinkServer {
    /// Binds `addr` and starts serving. Control calls go to `control` (without one they are
    /// answered 404 after authentication). Dropping the server closes every connection it
    /// accepted, links already handed out included.
    pub async fn bind(
        addr: SocketAddr,
        secret: ClusterSecret,
        config: LinkConfig,
        control: Option<Arc<dyn ControlHandler>>,
    ) -> Result<LinkServer> {
        let io = |what, error| Error::Io { peer: addr.to_string(), what, error };
        let listener = TcpListener::bind(addr).await.map_err(|e| io("binding the ring listener", e))?;
        let local_addr = listener.local_addr().map_err(|e| io("reading the bound address", e))?;
        let (links_tx, links) = mpsc::channel(ACCEPT_QUEUE);
        let (shutdown, shutdown_rx) = watch::channel(());
        let mut h2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
        h2.timer(TokioTimer::new())
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_frame_size(MAX_H2_FRAME)
            .max_send_buf_size(SEND_BUFFER)
            .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
            .keep_alive_interval(config.keep_alive_interval)
            .keep_alive_timeout(config.keep_alive_timeout);
        let shared = Arc::new(Shared { secret, config, control, links: links_tx, h2 });
        let accept_task = tokio::spawn(accept_loop(listener, shared, shutdown_rx));
        info!(%local_addr, "ring server listening");
        Ok(LinkServer { local_addr, links, accept_task, _shutdown: shutdown })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The next authenticated link. Peers that fail authentication never show up here.
    pub async fn accept(&mut self) -> Option<Link> {
        self.links.recv().await
    }
}

impl Drop for LinkServer {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, shutdown: watch::Receiver<()>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!("ring server accept failed: {e}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            warn!(%peer, "refusing connection: {MAX_CONNECTIONS} connections already open");
            continue;
        };
        tokio::spawn(serve_connection(tcp, peer, shared.clone(), slot, shutdown.clone()));
    }
}

async fn serve_connection(
    tcp: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    _slot: OwnedSemaphorePermit,
    mut shutdown: watch::Receiver<()>,
) {
    if let Err(e) = tcp.set_nodelay(true) {
        debug!(%peer, "TCP_NODELAY: {e}");
    }
    let (tcp, killer) = match Killer::new(tcp) {
        Ok(pair) => pair,
        Err(e) => return warn!(%peer, "dropping connection: {e}"),
    };
    let conn = Arc::new(Conn {
        shared: shared.clone(),
        peer: peer.to_string().into(),
        killer: killer.clone(),
        authed: AtomicBool::new(false),
    });
    let service = {
        let conn = conn.clone();
        hyper::service::service_fn(move |req| route(req, conn.clone()))
    };
    let serving = shared.h2.serve_connection(TokioIo::new(tcp), service);
    tokio::pin!(serving);
    let deadline = tokio::time::sleep(shared.config.handshake_timeout);
    tokio::pin!(deadline);
    let mut deadline_checked = false;
    loop {
        tokio::select! {
            result = &mut serving => {
                if let Err(e) = result {
                    debug!(%peer, "ring connection ended: {e}");
                }
                killer.mark_closed();
                return;
            }
            _ = &mut deadline, if !deadline_checked => {
                deadline_checked = true;
                if !conn.authed.load(Ordering::Acquire) {
                    warn!(%peer, "closing connection: not authenticated within {:?}", shared.config.handshake_timeout);
                    killer.kill();
                }
            }
            _ = shutdown.changed() => {
                killer.kill();
                return;
            }
        }
    }
}

type ServerBody = Either<ChannelBody, Full<Bytes>>;

async fn route(req: Request<Incoming>, conn: Arc<Conn>) -> Result<Response<ServerBody>, Infallible> {
    if req.method() != Method::POST {
        return Ok(control::plain(StatusCode::METHOD_NOT_ALLOWED, "POST only").map(Either::Right));
    }
    let path = req.uri().path().to_owned();
    if path == LINK_PATH {
        return Ok(open_link(req, conn).map(Either::Left));
    }
    let Some(method) = path.strip_prefix(control::PATH_PREFIX) else {
        return Ok(control::plain(StatusCode::NOT_FOUND, "no such path").map(Either::Right));
    };
    let shared = &conn.shared;
    let (response, authed) = control::serve(
        req,
        method,
        &shared.secret,
        shared.control.as_deref(),
        &conn.peer,
        shared.config.handshake_timeout,
    )
    .await;
    if authed {
        conn.authed.store(true, Ordering::Release);
    }
    Ok(response.map(Either::Right))
}

/// Answers the link request at once with a streaming body, then runs the handshake on it.
fn open_link(req: Request<Incoming>, conn: Arc<Conn>) -> Response<ChannelBody> {
    let (tx, rx) = mpsc::channel(SEND_QUEUE_FRAMES);
    tokio::spawn(accept_link(req.into_body(), tx, conn));
    let mut response = Response::new(ChannelBody(rx));
    response.headers_mut().insert(CONTENT_TYPE, hyper::header::HeaderValue::from_static(OCTET_STREAM));
    response
}

async fn accept_link(body: Incoming, tx: mpsc::Sender<Bytes>, conn: Arc<Conn>) {
    let config = &conn.shared.config;
    let guard = Arc::new(ConnGuard::new(conn.killer.clone(), None));
    let mut link = Link::new(conn.peer.clone(), body, tx, config, guard);
    let outcome = timeout(config.handshake_timeout, server_handshake(&mut link, &conn.shared.secret))
        .await
        .unwrap_or_else(|_| Err(Error::timeout(&conn.peer, "authentication", config.handshake_timeout)));
    if let Err(e) = outcome {
        // Dropping the link drops the last guard, which shuts the connection down.
        warn!(peer = %conn.peer, "refused ring link: {e}");
        return;
    }
    conn.authed.store(true, Ordering::Release);
    link.stream.decoder.set_max_frame_bytes(config.max_frame_bytes);
    info!(peer = %conn.peer, "ring link authenticated");
    if conn.shared.links.send(link).await.is_err() {
        debug!(peer = %conn.peer, "ring server gone; closing the new link");
    }
}
