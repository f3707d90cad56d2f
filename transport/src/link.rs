//! One persistent HTTP/2 connection per ring hop.
//!
//! The predecessor dials its successor once and opens a single long-lived stream on
//! `POST /ring/link`: the request body carries frames to the successor, the response body
//! frames back (handshake, acks, step errors). Frames are cut from the byte stream by the
//! codec, so HTTP/2's own DATA framing never has to line up with ours.
//!
//! Every connection, link or control, starts with the auth handshake (`auth`) on the raw
//! TCP socket, before HTTP/2: a peer that has not proved the cluster secret never reaches
//! the HTTP/2 server, so it cannot make it buffer a header or a body byte, nor hold one of
//! the slots that serve authenticated peers. The handshake also gives the connection its
//! session key, which MACs every control call on it (`control`). Connections still in the
//! handshake have a budget of their own, with a deadline; when it is full the oldest
//! waiting one makes room, so idle or slow strangers cannot lock a ring member out, and one
//! source may hold only a few places in it ([`crate::backoff`]). A source whose proofs keep
//! failing is refused for a while, told so in an error frame, before any key exchange
//! (online guessing slowed to a few guesses an hour). A peer that fails the handshake,
//! stalls, or breaks the frame protocol has its whole TCP connection shut down while the
//! server keeps serving everyone else.

use std::any::Any;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http_body_util::{Either, Full};
use hyper::body::{Body, Frame as BodyFrame, Incoming};
use hyper::client::conn::http2::SendRequest;
use hyper::header::CONTENT_TYPE;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify, Semaphore};
use tokio::time::timeout;
use tracing::{debug, info, warn};

use crate::auth::{fresh_peer_id, ClientHandshake, ClusterSecret, PeerId, ServerHandshake, SessionKey};
use crate::backoff::{Admission, AuthBackoff, Outcome, Sources};
use crate::control::{self, BlobHandler, ControlHandler};
use crate::throttle::WarnThrottle;
use crate::error::{Error, Result};
use crate::frame::{encode, Frame, FrameDecoder, DEFAULT_MAX_FRAME_BYTES, HEADER_LEN};

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
/// Authenticated connections: a ring has a handful of members, each with a link and a
/// control connection or two; the cap bounds what a member gone wrong can take.
const MAX_CONNECTIONS: usize = 64;
/// Connections still in the handshake. A real member needs one round trip in it, so a
/// small budget is plenty; a full one evicts its oldest (see the module docs).
const MAX_PENDING: usize = 64;
/// The largest handshake frame is 60 bytes: before a peer proves the secret it cannot make
/// us buffer more than this.
const HANDSHAKE_MAX_FRAME_BYTES: usize = 256;
/// Control calls carry a few short headers; hyper's default allows 16 MiB of them.
const MAX_HEADER_LIST_BYTES: u32 = 16 << 10;
/// What a server tells a client whose proof is wrong before closing: the client can then
/// say "wrong secret" rather than "connection closed". It reveals nothing about the secret.
const WRONG_SECRET: &str = "wrong cluster secret";
/// Encoded frames queued ahead of the socket: enough to overlap encoding with sending, few
/// enough that a peer that stops reading pushes back at once.
const SEND_QUEUE_FRAMES: usize = 4;
/// Authenticated links waiting for `LinkServer::accept`.
const ACCEPT_QUEUE: usize = 8;
/// Refused connections told why at once; past this a refused connection is just closed
/// (a flood from a backed-off source must not pile up tasks and sockets).
const MAX_REFUSING: usize = 64;
/// How long a refused source's connection may take to say hello and be told why before it
/// is closed.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// After a failed accept (out of file descriptors) retrying at once would spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
const OCTET_STREAM: &str = "application/octet-stream";

/// Timeouts and limits of a link; the same values serve both ends and the control RPCs.
#[derive(Clone, Debug)]
pub struct LinkConfig {
    /// Name resolution plus TCP connect.
    pub connect_timeout: Duration,
    /// The auth handshake plus HTTP/2 setup; also how long a server waits for a new
    /// connection to prove the secret, and for a control call's body.
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
    /// How a server slows down a source whose handshakes keep failing ([`crate::backoff`]).
    pub auth_backoff: AuthBackoff,
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
            auth_backoff: AuthBackoff::default(),
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
    /// Dials `peer` (`host:port` or `http://host:port`), runs the handshake and opens the
    /// link stream. Fails with an error naming the peer if any step fails or stalls.
    pub async fn connect(peer: &str, secret: &ClusterSecret, config: &LinkConfig) -> Result<Link> {
        // Link frames carry no MAC of their own: the session key only keys control calls.
        let (mut send, addr, killer, _, _) = open_h2::<ChannelBody>(peer, secret, config).await?;
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
            Ok(Link::new(label, response.into_body(), tx, config, guard))
        };
        let opened = timeout(config.handshake_timeout, opening)
            .await
            .unwrap_or_else(|_| Err(Error::timeout(peer, "opening the link", config.handshake_timeout)));
        let link = opened.inspect_err(|_| on_failure.kill())?;
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
                decoder: FrameDecoder::new(config.max_frame_bytes),
                peer,
                recv_timeout: config.recv_timeout,
                guard,
            },
        }
    }
}

fn unexpected(peer: &str, frame: Option<Frame>) -> Error {
    match frame {
        // Evicted, timed out or shut down: nothing was refused, a retry may get through.
        None => Error::closed(peer),
        Some(f) => Error::auth(peer, format!("expected the next handshake frame, got {}", f.kind_name())),
    }
}

/// Reads exactly one handshake frame off the socket (what follows it is HTTP/2's);
/// `None` at a clean end of the connection.
async fn read_handshake_frame(tcp: &mut TcpStream, peer: &str) -> Result<Option<Frame>> {
    let io = |error| Error::Io { peer: peer.to_owned(), what: "reading the handshake", error };
    let protocol = |detail| Error::Protocol { peer: peer.to_owned(), detail: Box::new(detail) };
    let mut decoder = FrameDecoder::new(HANDSHAKE_MAX_FRAME_BYTES);
    let mut buf = BytesMut::zeroed(HEADER_LEN);
    match tcp.read_exact(&mut buf).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(io(e)),
    }
    // Checks the header, its length against the handshake limit included.
    if let Some(frame) = decoder.decode(&mut buf).map_err(protocol)? {
        return Ok(Some(frame));
    }
    let body_len = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]) as usize;
    buf.resize(HEADER_LEN + body_len, 0);
    tcp.read_exact(&mut buf[HEADER_LEN..]).await.map_err(io)?;
    match decoder.decode(&mut buf).map_err(protocol)? {
        Some(frame) => Ok(Some(frame)),
        None => Err(protocol(Error::malformed("handshake", "incomplete after its announced length"))),
    }
}

async fn write_handshake_frame(tcp: &mut TcpStream, frame: &Frame, peer: &str) -> Result<()> {
    let mut buf = BytesMut::new();
    encode(frame, &mut buf)?;
    tcp.write_all(&buf).await.map_err(|error| Error::Io { peer: peer.to_owned(), what: "sending the handshake", error })
}

/// The client's side of the handshake on a freshly dialled socket; HTTP/2 may start on it
/// once this returns. Returns the server's id and the connection's session key, which MACs
/// its control calls. Public so tools and tests can speak to a ring port by hand.
pub async fn client_handshake(tcp: &mut TcpStream, secret: &ClusterSecret, peer: &str) -> Result<(PeerId, SessionKey)> {
    let mut handshake = ClientHandshake::new(secret);
    write_handshake_frame(tcp, &Frame::AuthHello { share: handshake.hello() }, peer).await?;
    let (share, server) = match read_handshake_frame(tcp, peer).await? {
        Some(Frame::AuthChallenge { share, server }) => (share, server),
        // Refused before the exchange (too many failures or handshakes from this address).
        Some(Frame::Error { message, .. }) => return Err(Error::auth(peer, format!("the peer refused us: {message}"))),
        other => return Err(unexpected(peer, other)),
    };
    let proof = handshake.on_challenge(share, server).ok_or_else(|| Error::auth(peer, "the peer's challenge is no key share (not a hearth ring server of this version?)"))?;
    write_handshake_frame(tcp, &Frame::AuthProof { proof }, peer).await?;
    match read_handshake_frame(tcp, peer).await? {
        Some(Frame::AuthWelcome { proof }) => {
            handshake.on_welcome(&proof).ok_or_else(|| Error::auth(peer, "the peer does not know the cluster secret"))
        }
        Some(Frame::Error { message, .. }) => Err(Error::auth(peer, format!("the peer refused us: {message}"))),
        other => Err(unexpected(peer, other)),
    }
}

/// The server's side; the session key once the client proved the secret. A wrong proof is
/// `Error::Auth` with [`WRONG_SECRET`] as its reason: a tested guess (see `backoff`).
async fn server_handshake(tcp: &mut TcpStream, secret: &ClusterSecret, id: PeerId, peer: &str) -> Result<SessionKey> {
    let share = match read_handshake_frame(tcp, peer).await? {
        Some(Frame::AuthHello { share }) => share,
        other => return Err(unexpected(peer, other)),
    };
    let handshake = ServerHandshake::new(secret, id, share);
    let (share, server) = handshake.challenge();
    write_handshake_frame(tcp, &Frame::AuthChallenge { share, server }, peer).await?;
    let proof = match read_handshake_frame(tcp, peer).await? {
        Some(Frame::AuthProof { proof }) => proof,
        other => return Err(unexpected(peer, other)),
    };
    match handshake.on_proof(&proof) {
        Some((welcome, session)) => {
            write_handshake_frame(tcp, &Frame::AuthWelcome { proof: welcome }, peer).await?;
            Ok(session)
        }
        None => {
            let refusal = Frame::Error { step: 0, message: WRONG_SECRET.into() };
            let _ = write_handshake_frame(tcp, &refusal, peer).await;
            Err(Error::auth(peer, WRONG_SECRET))
        }
    }
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

/// Dials `peer`, authenticates, and sets up an HTTP/2 client connection with the ring's
/// settings; also returns the server's id and the session key.
pub(crate) async fn open_h2<B>(
    peer: &str,
    secret: &ClusterSecret,
    config: &LinkConfig,
) -> Result<(SendRequest<B>, SocketAddr, Killer, PeerId, SessionKey)>
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (mut tcp, addr) = dial(peer, config).await?;
    let (server_id, session) = timeout(config.handshake_timeout, client_handshake(&mut tcp, secret, peer))
        .await
        .map_err(|_| Error::timeout(peer, "authenticating", config.handshake_timeout))??;
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
    Ok((send, addr, killer, server_id, session))
}

/// What every connection of one server shares.
struct Shared {
    secret: ClusterSecret,
    id: PeerId,
    config: LinkConfig,
    control: control::Receiver,
    links: mpsc::Sender<Link>,
    h2: hyper::server::conn::http2::Builder<TokioExecutor>,
    /// Slots of authenticated connections.
    slots: Arc<Semaphore>,
    pending: Arc<Mutex<Pending>>,
    /// Failed handshakes and handshakes in progress per source address.
    sources: Arc<Mutex<Sources>>,
    /// Refused connections being told why.
    refusing: Arc<Semaphore>,
    /// Connections refused for a wrong secret, a back-off or at a cap: a stranger can cause
    /// any number of them, so they are logged a few a minute, with a count of the rest.
    refusals: WarnThrottle,
}

/// One authenticated connection.
struct Conn {
    shared: Arc<Shared>,
    peer: Arc<str>,
    killer: Killer,
    session: control::Session,
}

/// A source's handshake in progress: reported to `Sources` when dropped, however it ended.
struct SourceSlot {
    sources: Arc<Mutex<Sources>>,
    ip: std::net::IpAddr,
    outcome: Outcome,
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        self.sources.lock().unwrap_or_else(|e| e.into_inner()).finish(self.ip, self.outcome, Instant::now());
    }
}

/// The connections still in the handshake, oldest first, each with the signal that evicts it.
#[derive(Default)]
struct Pending {
    next: u64,
    waiting: BTreeMap<u64, Arc<Notify>>,
}

/// A place in `Pending`, given up when dropped (the handshake ended, one way or another).
struct PendingSlot {
    registry: Arc<Mutex<Pending>>,
    key: u64,
    evicted: Arc<Notify>,
}

impl PendingSlot {
    /// Takes a place, evicting the oldest waiting connections if the budget is spent.
    fn admit(registry: &Arc<Mutex<Pending>>) -> PendingSlot {
        let mut pending = registry.lock().unwrap_or_else(|e| e.into_inner());
        while pending.waiting.len() >= MAX_PENDING {
            if let Some((_, oldest)) = pending.waiting.pop_first() {
                // Stores a permit if its task is not waiting yet, so the eviction is never lost.
                oldest.notify_one();
            }
        }
        let key = pending.next;
        pending.next += 1;
        let evicted = Arc::new(Notify::new());
        pending.waiting.insert(key, evicted.clone());
        PendingSlot { registry: registry.clone(), key, evicted }
    }
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        self.registry.lock().unwrap_or_else(|e| e.into_inner()).waiting.remove(&self.key);
    }
}

/// Listens for ring links and control calls on one port.
pub struct LinkServer {
    local_addr: SocketAddr,
    id: PeerId,
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
        Self::bind_with_blobs(addr, secret, config, control, None).await
    }

    /// `bind`, also answering blob calls (`/blob/<method>`) with `blobs`.
    pub async fn bind_with_blobs(
        addr: SocketAddr,
        secret: ClusterSecret,
        config: LinkConfig,
        control: Option<Arc<dyn ControlHandler>>,
        blobs: Option<Arc<dyn BlobHandler>>,
    ) -> Result<LinkServer> {
        Self::bind_inner(addr, secret, config, control::Receiver::new(control, blobs, Duration::ZERO)).await
    }

    /// Binds with `control` answering calls (its read timeout set from `config`).
    async fn bind_inner(
        addr: SocketAddr,
        secret: ClusterSecret,
        config: LinkConfig,
        mut control: control::Receiver,
    ) -> Result<LinkServer> {
        control.set_read_timeout(config.handshake_timeout);
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
            .max_header_list_size(MAX_HEADER_LIST_BYTES)
            .keep_alive_interval(config.keep_alive_interval)
            .keep_alive_timeout(config.keep_alive_timeout);
        let id = fresh_peer_id();
        let sources = Arc::new(Mutex::new(Sources::new(config.auth_backoff.clone())));
        let shared = Arc::new(Shared {
            secret,
            id,
            config,
            control,
            links: links_tx,
            h2,
            slots: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
            pending: Arc::default(),
            sources,
            refusing: Arc::new(Semaphore::new(MAX_REFUSING)),
            refusals: WarnThrottle::default(),
        });
        let accept_task = tokio::spawn(accept_loop(listener, shared, shutdown_rx));
        info!(%local_addr, "ring server listening");
        Ok(LinkServer { local_addr, id, links, accept_task, _shutdown: shutdown })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// This server's id (random per server): what clients learn in the handshake and sign
    /// their control calls for.
    pub fn id(&self) -> PeerId {
        self.id
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
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                warn!("ring server accept failed: {e}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let admission = shared.sources.lock().unwrap_or_else(|e| e.into_inner()).admit(peer.ip(), Instant::now());
        let why = match admission {
            Admission::Go => {
                let source = SourceSlot { sources: shared.sources.clone(), ip: peer.ip(), outcome: Outcome::Other };
                let pending = PendingSlot::admit(&shared.pending);
                tokio::spawn(serve_connection(tcp, peer, shared.clone(), pending, source, shutdown.clone()));
                continue;
            }
            Admission::Wait(left) => format!(
                "too many failed handshakes from {} (proofs of another secret): retry in {} s",
                peer.ip(),
                left.as_millis().div_ceil(1000)
            ),
            Admission::Busy => format!(
                "too many handshakes in progress from {}: retry once they end",
                peer.ip()
            ),
        };
        shared.refusals.warn(|| format!("refusing connection from {peer}: {why}"));
        // Telling why costs a task for up to a second; a flood is just closed.
        if let Ok(permit) = shared.refusing.clone().try_acquire_owned() {
            tokio::spawn(async move {
                refuse(tcp, why).await;
                drop(permit);
            });
        }
    }
}

/// Tells a refused connection why and closes it, running no key exchange. Its hello is
/// read first (one small frame, within a deadline): closing a socket with unread bytes
/// resets the connection, and the reset could reach the client before the reason does.
async fn refuse(mut tcp: TcpStream, why: String) {
    let label = tcp.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let refusal = Frame::Error { step: 0, message: why };
    let _ = timeout(REFUSAL_WRITE_TIMEOUT, async {
        let _ = read_handshake_frame(&mut tcp, &label).await;
        let _ = write_handshake_frame(&mut tcp, &refusal, &label).await;
        let _ = tcp.shutdown().await;
    })
    .await;
}

async fn serve_connection(
    mut tcp: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    pending: PendingSlot,
    mut source: SourceSlot,
    mut shutdown: watch::Receiver<()>,
) {
    if let Err(e) = tcp.set_nodelay(true) {
        debug!(%peer, "TCP_NODELAY: {e}");
    }
    let label = peer.to_string();
    let limit = shared.config.handshake_timeout;
    let handshake = tokio::select! {
        outcome = timeout(limit, server_handshake(&mut tcp, &shared.secret, shared.id, &label)) => {
            outcome.unwrap_or_else(|_| Err(Error::timeout(&label, "authentication", limit)))
        }
        _ = pending.evicted.notified() => {
            Err(Error::timeout(&label, "authentication (evicted: too many connections waiting)", limit))
        }
        _ = shutdown.changed() => return,
    };
    drop(pending);
    let session = match handshake {
        Ok(session) => {
            source.outcome = Outcome::Success;
            session
        }
        Err(e @ Error::Auth { .. }) => {
            if matches!(&e, Error::Auth { reason, .. } if reason == WRONG_SECRET) {
                source.outcome = Outcome::WrongSecret;
            }
            return shared.refusals.warn(|| format!("refused connection from {peer}: {e}"));
        }
        // Strangers and port scanners: not worth a warning each.
        Err(e) => return debug!(%peer, "dropped connection: {e}"),
    };
    // The handshake is over: the source's place is given back (and its outcome recorded).
    drop(source);
    let Ok(_slot) = shared.slots.clone().try_acquire_owned() else {
        return shared.refusals.warn(|| format!("refusing connection from {peer}: {MAX_CONNECTIONS} authenticated connections already open"));
    };
    let (tcp, killer) = match Killer::new(tcp) {
        Ok(pair) => pair,
        Err(e) => return warn!(%peer, "dropping connection: {e}"),
    };
    let conn = Arc::new(Conn { shared: shared.clone(), peer: label.into(), killer: killer.clone(), session: control::Session::new(session) });
    let service = {
        let conn = conn.clone();
        hyper::service::service_fn(move |req| route(req, conn.clone()))
    };
    let serving = shared.h2.serve_connection(TokioIo::new(tcp), service);
    tokio::select! {
        result = serving => {
            if let Err(e) = result {
                debug!(%peer, "ring connection ended: {e}");
            }
            killer.mark_closed();
        }
        _ = shutdown.changed() => killer.kill(),
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
    let call = match (path.strip_prefix(control::PATH_PREFIX), path.strip_prefix(control::BLOB_PREFIX)) {
        (Some(method), _) => Some((method, control::CallKind::Control)),
        (None, Some(method)) => Some((method, control::CallKind::Blob)),
        (None, None) => None,
    };
    let Some((method, kind)) = call else {
        return Ok(control::plain(StatusCode::NOT_FOUND, "no such path").map(Either::Right));
    };
    let response = conn.shared.control.serve(req, method, kind, &conn.peer, &conn.session).await;
    Ok(response.map(Either::Right))
}

/// Answers the link request at once with a streaming body; the connection has proved the
/// secret already, so the link is ready.
fn open_link(req: Request<Incoming>, conn: Arc<Conn>) -> Response<ChannelBody> {
    let (tx, rx) = mpsc::channel(SEND_QUEUE_FRAMES);
    let guard = Arc::new(ConnGuard::new(conn.killer.clone(), None));
    let link = Link::new(conn.peer.clone(), req.into_body(), tx, &conn.shared.config, guard);
    info!(peer = %conn.peer, "ring link opened");
    tokio::spawn(async move {
        if conn.shared.links.send(link).await.is_err() {
            debug!(peer = %conn.peer, "ring server gone; closing the new link");
        }
    });
    let mut response = Response::new(ChannelBody(rx));
    response.headers_mut().insert(CONTENT_TYPE, hyper::header::HeaderValue::from_static(OCTET_STREAM));
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::SALT_LEN;
    use crate::control::{ControlClient, ControlFailure, Tap};
    use serde_json::{json, Value};
    use sha2::Digest;

    /// Records what a passive observer of the LAN sees of real control and blob calls
    /// between a client and a ring server (method, path, MAC headers, bodies, both ways),
    /// and shows that with the RIGHT secret nothing in it verifies under any key computed
    /// from the secret alone — the password key a guesser stretches (fixed salt: one table
    /// for every cluster), the secret's raw bytes or hash, discovery keys — exactly as with
    /// a wrong secret: a recording is no oracle for guesses. Before issue 61 every call
    /// was MACed with the password key, and this check found the secret.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_recorded_exchange_tests_no_guess() {
        let right = "correct horse battery staple";
        let secret = ClusterSecret::new(right).unwrap();
        let handler: Arc<dyn ControlHandler> = Arc::new(|method: String, body: Value| async move {
            match method.as_str() {
                "health" => Ok(json!({"status": "ok"})),
                "load_plan" => Ok(json!({"loaded": body["windows"]})),
                _ => Err(ControlFailure::unknown_method(&method)),
            }
        });
        let blobs: Arc<dyn BlobHandler> =
            Arc::new(|_: String, _: Value| async move { Ok::<_, ControlFailure>(Bytes::from_static(b"layer bytes")) });
        let tap: Tap = Arc::default();
        let mut receiver = control::Receiver::new(Some(handler), Some(blobs), Duration::ZERO);
        receiver.tap = Some(tap.clone());
        let server = LinkServer::bind_inner("127.0.0.1:0".parse().unwrap(), secret.clone(), LinkConfig::default(), receiver)
            .await
            .unwrap();
        let client = ControlClient::connect(&server.local_addr().to_string(), &secret, &LinkConfig::default()).await.unwrap();
        client.call("health", &json!({})).await.unwrap();
        client.call("load_plan", &json!({"windows": [10, 10, 10]})).await.unwrap();
        assert!(client.call("nope", &json!({})).await.is_err());
        assert_eq!(&client.fetch("range", &json!({"offset": 0, "len": 11})).await.unwrap()[..], b"layer bytes");
        let recorded = tap.lock().unwrap().clone();
        assert_eq!(recorded.len(), 4, "{recorded:?}");

        let wrong = ClusterSecret::new("Tr0ub4dor&3").unwrap();
        let from_secret = |s: &ClusterSecret, text: &str| -> Vec<Vec<u8>> {
            vec![
                s.password_key().to_vec(),
                text.as_bytes().to_vec(),
                sha2::Sha256::digest(text.as_bytes()).to_vec(),
                s.salted(&[0; SALT_LEN]).unwrap().to_vec(),
            ]
        };
        let session = client.session_key_for_tests();
        for call in &recorded {
            assert!(call.verifies_under(&session), "the recording is of real, MACed calls: {call:?}");
            for key in from_secret(&secret, right) {
                assert!(!call.verifies_under(&key), "a key computed from the right secret verifies {call:?}");
            }
            for key in from_secret(&wrong, "Tr0ub4dor&3") {
                assert!(!call.verifies_under(&key));
            }
        }
        // Nor is any of those keys, or the session key, anywhere in the recording.
        let mut seen = Vec::new();
        for call in &recorded {
            for part in [call.auth.as_bytes(), &call.body, call.answer_auth.as_bytes(), &call.answer] {
                seen.extend_from_slice(part);
            }
        }
        for key in from_secret(&secret, right).into_iter().chain([session.to_vec()]) {
            let hexed = crate::freshness::hex(&key);
            assert!(!seen.windows(key.len()).any(|w| w == key.as_slice()));
            assert!(!seen.windows(hexed.len()).any(|w| w == hexed.as_bytes()));
        }
    }
}
