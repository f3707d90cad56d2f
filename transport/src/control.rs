//! JSON control RPCs (health, load plan, profile, ...) on the ring server's port.
//!
//! `POST /control/<method>` with a JSON body; the answer is the envelope
//! `{"ok": <value>}` or `{"error": {"message": "..."}}` with a matching HTTP status. What a
//! method means is the caller's business: this crate carries opaque JSON.
//!
//! Calls travel on connections that proved the cluster secret in their handshake (`link`),
//! and each call is MACed on its own as well, with that connection's session key (`auth`:
//! derived from the SPAKE2 exchange, known to the two ends only, never from the secret
//! alone): `x-hearth-auth` is `<sequence number>.<body SHA-256>.<HMAC>` (decimal, hex, hex),
//! the HMAC taken over these plus the HTTP method and path. The client numbers its calls
//! 1, 2, 3, ... on each connection; the server accepts each number once, within a window
//! of the highest it has seen (concurrent calls may arrive out of order). From the header
//! alone, before reading a byte of the body, the server refuses (401) a missing or wrong
//! MAC and a number it has accepted already or that fell behind the window; it refuses
//! (413) a declared length over the limit. Only then does it read the body, up to the limit,
//! and check it against the MACed digest. A captured call is thus refused on its own
//! connection (its number is spent) and on every other (another session key), and nothing
//! in it lets anyone test a guess of the secret: the MAC's key is no function of the secret
//! alone. The server MACs its answer over the request's MAC, status and body with the same
//! session key, so the caller knows the answer came from the member it authenticated and
//! belongs to its own request.
//!
//! No timestamps: a session lives as long as its connection, and a restart of either side
//! ends the connection (the next call reconnects and runs a new handshake), so home devices'
//! clocks do not matter here.

use std::future::Future;
use std::pin::Pin;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hmac::Mac;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::time::timeout;

use crate::auth::{ClusterSecret, HmacSha256, PeerId, SessionKey};
use crate::error::{Error, Result};
use crate::freshness::{hex, unhex};
use crate::link::{open_h2, ConnGuard, LinkConfig};
use crate::throttle::WarnThrottle;

pub const PATH_PREFIX: &str = "/control/";
/// Calls answered with raw bytes instead of a JSON envelope (model ranges): signed and
/// checked exactly as control calls, the answer signed over its bytes.
pub const BLOB_PREFIX: &str = "/blob/";
pub const AUTH_HEADER: &str = "x-hearth-auth";

/// Method names the ring uses; any `[a-z0-9_-]{1,64}` name is carried.
pub mod methods {
    pub const HEALTH: &str = "health";
    pub const LOAD_PLAN: &str = "load_plan";
    pub const PROFILE: &str = "profile";
}

/// Plans and profiles are kilobytes; this bounds what a signed call can make a node buffer.
const MAX_BODY_BYTES: usize = 4 << 20;
/// The largest answer of a blob call: a caller asks for pieces of at most this much, so a
/// piece lost with its connection costs little to fetch again.
pub const MAX_BLOB_BYTES: usize = 16 << 20;
const MAX_METHOD_LEN: usize = 64;
/// v3: keyed by the session, numbered per connection (v2 was keyed by the cluster key).
const REQUEST_LABEL: &[u8] = b"hearth control request v3";
const RESPONSE_LABEL: &[u8] = b"hearth control response v3";
/// How far behind the highest call number a call may arrive and still be taken: a
/// connection carries at most 16 calls at once, but a client may number many calls that
/// then wait for a stream; far more than that, and still a few KiB of numbers per
/// connection.
pub const REPLAY_WINDOW: u64 = 4096;
const JSON: &str = "application/json";
const OCTETS: &str = "application/octet-stream";

/// What a handler answered.
enum Answer {
    Json(Value),
    Bytes(Bytes),
}

/// The wire envelope of every control answer.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Envelope {
    Ok(Value),
    Error { message: String },
}

/// A handler's refusal; its status becomes the HTTP status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlFailure {
    pub status: u16,
    pub message: String,
}

impl ControlFailure {
    pub fn unknown_method(method: &str) -> Self {
        ControlFailure { status: 404, message: format!("unknown control method {method:?}") }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ControlFailure { status: 400, message: message.into() }
    }

    pub fn failed(message: impl Into<String>) -> Self {
        ControlFailure { status: 500, message: message.into() }
    }
}

pub type ControlFuture = Pin<Box<dyn Future<Output = Result<Value, ControlFailure>> + Send>>;

/// Answers authenticated control calls. Any `Fn(String, Value) -> impl Future` qualifies.
pub trait ControlHandler: Send + Sync + 'static {
    fn call(&self, method: &str, body: Value) -> ControlFuture;
}

impl<F, Fut> ControlHandler for F
where
    F: Fn(String, Value) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Value, ControlFailure>> + Send + 'static,
{
    fn call(&self, method: &str, body: Value) -> ControlFuture {
        Box::pin(self(method.to_owned(), body))
    }
}

pub type BlobFuture = Pin<Box<dyn Future<Output = Result<Bytes, ControlFailure>> + Send>>;

/// Answers authenticated blob calls (`/blob/<method>`, a JSON request, raw bytes back, at
/// most `MAX_BLOB_BYTES`). Any `Fn(String, Value) -> impl Future` qualifies.
pub trait BlobHandler: Send + Sync + 'static {
    fn call(&self, method: &str, body: Value) -> BlobFuture;
}

impl<F, Fut> BlobHandler for F
where
    F: Fn(String, Value) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Bytes, ControlFailure>> + Send + 'static,
{
    fn call(&self, method: &str, body: Value) -> BlobFuture {
        Box::pin(self(method.to_owned(), body))
    }
}

/// Which kind of call a request is, by its path.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum CallKind {
    Control,
    Blob,
}

fn valid_method(name: &str) -> bool {
    (1..=MAX_METHOD_LEN).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

type BodyDigest = [u8; 32];

/// What `x-hearth-auth` carries besides the MAC.
#[derive(Clone, Copy)]
struct Signed {
    seq: u64,
    digest: BodyDigest,
}

/// The request MAC under `mac` (a keyed HMAC: the session key in use; tests try others).
fn request_mac(mut mac: HmacSha256, signed: &Signed, method: &str, path: &str) -> HmacSha256 {
    mac.update(REQUEST_LABEL);
    // Fixed lengths first; NUL after each variable field, which none of them can contain,
    // so no two requests share an input.
    mac.update(&signed.seq.to_be_bytes());
    mac.update(&signed.digest);
    for part in [method.as_bytes(), path.as_bytes()] {
        mac.update(part);
        mac.update(&[0]);
    }
    mac
}

fn response_mac(mut mac: HmacSha256, request_tag: &[u8], status: u16, body: &[u8]) -> HmacSha256 {
    mac.update(RESPONSE_LABEL);
    mac.update(request_tag);
    mac.update(&status.to_be_bytes());
    mac.update(body);
    mac
}

fn auth_value(signed: &Signed, tag: &[u8]) -> String {
    format!("{}.{}.{}", signed.seq, hex(&signed.digest), hex(tag))
}

/// An `x-hearth-auth` value for call number `seq` on the connection whose session key is
/// `session`; public so tools and tests can craft calls.
pub fn sign_request(session: &SessionKey, seq: u64, method: &str, path: &str, body: &[u8]) -> String {
    let signed = Signed { seq, digest: Sha256::digest(body).into() };
    auth_value(&signed, &request_mac(session.mac(), &signed, method, path).finalize().into_bytes())
}

fn parse_auth(value: &str) -> Option<(Signed, Vec<u8>)> {
    let mut parts = value.split('.');
    let seq = parts.next()?.parse().ok()?;
    let digest = unhex(parts.next()?)?.try_into().ok()?;
    let tag = unhex(parts.next()?)?;
    if parts.next().is_some() {
        return None;
    }
    Some((Signed { seq, digest }, tag))
}

/// The call numbers a connection's server has accepted (see the module docs).
#[derive(Default)]
struct SeqWindow {
    highest: u64,
    seen: BTreeSet<u64>,
}

impl SeqWindow {
    /// Whether `seq` is new and not too old; remembers it if so.
    fn accept(&mut self, seq: u64) -> bool {
        if seq == 0 || seq.saturating_add(REPLAY_WINDOW) <= self.highest || !self.seen.insert(seq) {
            return false;
        }
        if seq > self.highest {
            self.highest = seq;
            // Numbers at or below this are refused as too old anyway: no need to keep them.
            let floor = self.highest.saturating_sub(REPLAY_WINDOW) + 1;
            self.seen = self.seen.split_off(&floor);
        }
        true
    }
}

/// One authenticated connection, as its server sees it: the session key and the call
/// numbers spent.
pub(crate) struct Session {
    key: SessionKey,
    window: Mutex<SeqWindow>,
}

impl Session {
    pub(crate) fn new(key: SessionKey) -> Session {
        Session { key, window: Mutex::default() }
    }
}

/// What a passive observer sees of one control call, for the test that shows none of it
/// can be checked against a guess of the secret.
#[cfg(test)]
#[derive(Clone, Debug)]
pub(crate) struct Recorded {
    pub http_method: String,
    pub path: String,
    pub auth: String,
    pub body: Bytes,
    pub status: u16,
    pub answer_auth: String,
    pub answer: Bytes,
}

#[cfg(test)]
impl Recorded {
    /// Whether this call's request or answer MAC verifies under `key`.
    pub(crate) fn verifies_under(&self, key: &[u8]) -> bool {
        let keyed = || HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
        let Some((signed, tag)) = parse_auth(&self.auth) else { return false };
        let request = request_mac(keyed(), &signed, &self.http_method, &self.path).verify_slice(&tag).is_ok();
        let answer = unhex(&self.answer_auth)
            .is_some_and(|sig| response_mac(keyed(), &tag, self.status, &self.answer).verify_slice(&sig).is_ok());
        request || answer
    }
}

/// Where tests collect recordings (`Receiver::tap`).
#[cfg(test)]
pub(crate) type Tap = Arc<Mutex<Vec<Recorded>>>;

fn envelope_bytes(envelope: &Envelope) -> Bytes {
    // Serialising a Value-bearing enum cannot fail (no non-string map keys exist in Value).
    Bytes::from(serde_json::to_vec(envelope).unwrap_or_default())
}

fn respond(status: StatusCode, body: Bytes, signature: Option<String>) -> Response<Full<Bytes>> {
    respond_as(status, body, signature, JSON)
}

fn respond_as(status: StatusCode, body: Bytes, signature: Option<String>, content_type: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Some(value) = signature.and_then(|s| HeaderValue::from_str(&s).ok()) {
        response.headers_mut().insert(AUTH_HEADER, value);
    }
    response
}

/// An unsigned error answer.
pub(crate) fn plain(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    respond(status, envelope_bytes(&Envelope::Error { message: message.to_owned() }), None)
}

/// The server side of control calls: what to answer with.
pub(crate) struct Receiver {
    handler: Option<Arc<dyn ControlHandler>>,
    blobs: Option<Arc<dyn BlobHandler>>,
    read_timeout: Duration,
    /// Refused calls come from authenticated connections only, but a misconfigured or
    /// compromised member can still send them in a loop: logged a few a minute.
    refusals: WarnThrottle,
    #[cfg(test)]
    pub(crate) tap: Option<Tap>,
}

impl Receiver {
    pub(crate) fn new(
        handler: Option<Arc<dyn ControlHandler>>,
        blobs: Option<Arc<dyn BlobHandler>>,
        read_timeout: Duration,
    ) -> Receiver {
        Receiver {
            handler,
            blobs,
            read_timeout,
            refusals: WarnThrottle::default(),
            #[cfg(test)]
            tap: None,
        }
    }

    pub(crate) fn set_read_timeout(&mut self, limit: Duration) {
        self.read_timeout = limit;
    }

    /// Serves one control or blob call on the connection of `session`, checking everything
    /// the headers say before reading the body.
    pub(crate) async fn serve(
        &self,
        req: Request<Incoming>,
        method: &str,
        kind: CallKind,
        peer: &str,
        session: &Session,
    ) -> Response<Full<Bytes>> {
        #[cfg(test)]
        let seen = (
            req.method().to_string(),
            req.uri().path().to_owned(),
            req.headers().get(AUTH_HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned(),
        );
        let (response, _body) = self.answer(req, method, kind, peer, session).await;
        #[cfg(test)]
        if let Some(tap) = &self.tap {
            let header = |r: &Response<Full<Bytes>>| {
                r.headers().get(AUTH_HEADER).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned()
            };
            let answer = response.body().clone().collect().await.map(|c| c.to_bytes()).unwrap_or_default();
            tap.lock().unwrap_or_else(|e| e.into_inner()).push(Recorded {
                http_method: seen.0,
                path: seen.1,
                auth: seen.2,
                body: _body,
                status: response.status().as_u16(),
                answer_auth: header(&response),
                answer,
            });
        }
        response
    }

    /// The answer, and the request body it read (empty when refused before reading).
    async fn answer(
        &self,
        req: Request<Incoming>,
        method: &str,
        kind: CallKind,
        peer: &str,
        session: &Session,
    ) -> (Response<Full<Bytes>>, Bytes) {
        let refuse = |reason: String| {
            self.refusals.warn(|| format!("refused control call {method} from {peer}: {reason}"));
            plain(StatusCode::UNAUTHORIZED, &format!("unauthorized: {reason}"))
        };
        let auth = req.headers().get(AUTH_HEADER).and_then(|v| v.to_str().ok()).and_then(parse_auth);
        let Some((signed, tag)) = auth else {
            return (refuse(format!("missing or malformed {AUTH_HEADER} header")), Bytes::new());
        };
        let path = req.uri().path().to_owned();
        if request_mac(session.key.mac(), &signed, req.method().as_str(), &path).verify_slice(&tag).is_err() {
            return (refuse("wrong MAC (not made with this connection's session key)".into()), Bytes::new());
        }
        let declared = req.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|len| len > MAX_BODY_BYTES as u64) {
            return (plain(StatusCode::PAYLOAD_TOO_LARGE, "control body too large"), Bytes::new());
        }
        if !session.window.lock().unwrap_or_else(|e| e.into_inner()).accept(signed.seq) {
            return (refuse(format!("call number {} was used already or is too old (a replay?)", signed.seq)), Bytes::new());
        }
        let read = Limited::new(req.into_body(), MAX_BODY_BYTES).collect();
        let body = match timeout(self.read_timeout, read).await {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
                return (plain(StatusCode::PAYLOAD_TOO_LARGE, "control body too large"), Bytes::new())
            }
            Ok(Err(e)) => return (plain(StatusCode::BAD_REQUEST, &format!("reading the body: {e}")), Bytes::new()),
            Err(_) => return (plain(StatusCode::REQUEST_TIMEOUT, "body did not arrive in time"), Bytes::new()),
        };
        if <[u8; 32]>::from(Sha256::digest(&body)) != signed.digest {
            return (refuse("the body is not the one MACed".into()), body);
        }

        let request = if !valid_method(method) {
            Err(ControlFailure::unknown_method(method))
        } else {
            serde_json::from_slice::<Value>(&body).map_err(|e| ControlFailure::bad_request(format!("body is not JSON: {e}")))
        };
        let unknown = || ControlFailure::unknown_method(method);
        let result = match (request, kind) {
            (Err(f), _) => Err(f),
            (Ok(value), CallKind::Control) => match &self.handler {
                Some(handler) => handler.call(method, value).await.map(Answer::Json),
                None => Err(unknown()),
            },
            (Ok(value), CallKind::Blob) => match &self.blobs {
                Some(blobs) => match blobs.call(method, value).await {
                    Ok(bytes) if bytes.len() > MAX_BLOB_BYTES => Err(ControlFailure::failed("the answer is over the blob limit")),
                    other => other.map(Answer::Bytes),
                },
                None => Err(unknown()),
            },
        };
        let sign = |status: StatusCode, bytes: &[u8]| {
            hex(&response_mac(session.key.mac(), &tag, status.as_u16(), bytes).finalize().into_bytes())
        };
        let response = match result {
            Ok(Answer::Bytes(bytes)) => {
                let signature = sign(StatusCode::OK, &bytes);
                respond_as(StatusCode::OK, bytes, Some(signature), OCTETS)
            }
            other => {
                let (status, envelope) = match other {
                    Ok(Answer::Json(value)) => (StatusCode::OK, Envelope::Ok(value)),
                    Ok(Answer::Bytes(_)) => unreachable!("answered above"),
                    Err(f) => (
                        StatusCode::from_u16(f.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                        Envelope::Error { message: f.message },
                    ),
                };
                let bytes = envelope_bytes(&envelope);
                let signature = sign(status, &bytes);
                respond(status, bytes, Some(signature))
            }
        };
        (response, body)
    }
}

/// Calls control methods on one ring member over its own HTTP/2 connection. Cheap to clone;
/// the connection closes when the last clone drops.
#[derive(Clone)]
pub struct ControlClient {
    send: SendRequest<Full<Bytes>>,
    authority: String,
    receiver: PeerId,
    peer: Arc<str>,
    session: SessionKey,
    /// The last call number used on this connection (shared by every clone).
    seq: Arc<AtomicU64>,
    timeout: Duration,
    _guard: Arc<ConnGuard>,
}

impl ControlClient {
    pub async fn connect(peer: &str, secret: &ClusterSecret, config: &LinkConfig) -> Result<ControlClient> {
        let (send, addr, killer, receiver, session) = open_h2(peer, secret, config).await?;
        Ok(ControlClient {
            send,
            authority: addr.to_string(),
            receiver,
            peer: peer.into(),
            session,
            seq: Arc::default(),
            timeout: config.control_timeout,
            _guard: Arc::new(ConnGuard::new(killer, None)),
        })
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    #[cfg(test)]
    pub(crate) fn session_key_for_tests(&self) -> [u8; 32] {
        self.session.bytes()
    }

    /// The id the server announced in the handshake (random per server process).
    pub fn receiver(&self) -> PeerId {
        self.receiver
    }

    /// Calls `method` with `body`; the peer's `ok` value, or an error naming the peer.
    pub async fn call(&self, method: &str, body: &Value) -> Result<Value> {
        let (status, bytes) = self.exchange(PATH_PREFIX, method, body, MAX_BODY_BYTES).await?;
        match serde_json::from_slice::<Envelope>(&bytes) {
            Ok(Envelope::Ok(value)) if status == 200 => Ok(value),
            Ok(Envelope::Error { message }) => Err(self.failure(method, status, message)),
            Ok(Envelope::Ok(_)) => Err(self.failure(method, status, "an ok envelope with a non-200 status".into())),
            Err(e) => Err(self.failure(method, status, format!("answer is not a control envelope: {e}"))),
        }
    }

    /// Calls the blob method `method` with `body`: the peer's bytes (at most
    /// `MAX_BLOB_BYTES`), signed by the peer over exactly these bytes, or an error.
    pub async fn fetch(&self, method: &str, body: &Value) -> Result<Bytes> {
        let (status, bytes) = self.exchange(BLOB_PREFIX, method, body, MAX_BLOB_BYTES).await?;
        if status == 200 {
            return Ok(bytes);
        }
        Err(self.failure(method, status, match serde_json::from_slice::<Envelope>(&bytes) {
            Ok(Envelope::Error { message }) => message,
            _ => "an answer that is not an error envelope".into(),
        }))
    }

    fn failure(&self, method: &str, status: u16, message: String) -> Error {
        Error::Control { peer: self.peer.to_string(), method: method.to_owned(), status, message }
    }

    /// Sends one signed call and checks the answer's signature: its status and bytes.
    async fn exchange(&self, prefix: &str, method: &str, body: &Value, limit: usize) -> Result<(u16, Bytes)> {
        if !valid_method(method) {
            return Err(Error::Encode(format!("control method {method:?} is not [a-z0-9_-]{{1,64}}")));
        }
        let path = format!("{prefix}{method}");
        let body = serde_json::to_vec(body).map_err(|e| Error::Encode(e.to_string()))?;
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let signed = Signed { seq, digest: Sha256::digest(&body).into() };
        let tag = request_mac(self.session.mac(), &signed, "POST", &path).finalize().into_bytes();
        let request = Request::post(format!("http://{}{path}", self.authority))
            .header(CONTENT_TYPE, JSON)
            .header(AUTH_HEADER, auth_value(&signed, &tag))
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| Error::http(&self.peer, "building a control request", e))?;
        let mut send = self.send.clone();
        let exchange = async {
            send.ready().await.map_err(|e| Error::http(&self.peer, "control connection", e))?;
            let response = send.send_request(request).await.map_err(|e| Error::http(&self.peer, "control call", e))?;
            let status = response.status().as_u16();
            let signature = response.headers().get(AUTH_HEADER).and_then(|v| v.to_str().ok()).and_then(unhex);
            let bytes = Limited::new(response.into_body(), limit)
                .collect()
                .await
                .map_err(|e| Error::http(&self.peer, "reading a control answer", e))?
                .to_bytes();
            Ok::<_, Error>((status, signature, bytes))
        };
        let (status, signature, bytes) = timeout(self.timeout, exchange)
            .await
            .map_err(|_| Error::timeout(&self.peer, "control call", self.timeout))??;

        // A 401 is not MACed: the peer could not tell which key we used.
        if status == 401 {
            return Err(self.failure(method, status, match serde_json::from_slice::<Envelope>(&bytes) {
                Ok(Envelope::Error { message }) => message,
                _ => "unauthorized".into(),
            }));
        }
        let signed =
            signature.is_some_and(|sig| response_mac(self.session.mac(), &tag, status, &bytes).verify_slice(&sig).is_ok());
        if !signed {
            return Err(Error::auth(&self.peer, "control answer not MACed with this connection's session key"));
        }
        Ok((status, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_rejects_junk() {
        assert_eq!(unhex(&hex(&[0, 1, 0xab, 0xff])), Some(vec![0, 1, 0xab, 0xff]));
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("zz"), None);
        assert_eq!(unhex("é1"), None);
    }

    fn key(byte: u8) -> HmacSha256 {
        HmacSha256::new_from_slice(&[byte; 32]).unwrap()
    }

    #[test]
    fn macs_bind_every_field() {
        let signed = Signed { seq: 1, digest: [3; 32] };
        let tag = |k: u8, signed: &Signed, method, path| -> Vec<u8> {
            request_mac(key(k), signed, method, path).finalize().into_bytes().to_vec()
        };
        let base = tag(1, &signed, "POST", "/control/health");
        assert_ne!(base, tag(1, &Signed { seq: 2, ..signed }, "POST", "/control/health"));
        assert_ne!(base, tag(1, &Signed { digest: [9; 32], ..signed }, "POST", "/control/health"));
        assert_ne!(base, tag(1, &signed, "GET", "/control/health"));
        assert_ne!(base, tag(1, &signed, "POST", "/control/profile"));
        assert_ne!(base, tag(2, &signed, "POST", "/control/health"));

        let value = auth_value(&signed, &base);
        let (parsed, parsed_tag) = parse_auth(&value).unwrap();
        assert_eq!((parsed.seq, parsed.digest, parsed_tag), (1, [3; 32], base));
        assert!(parse_auth("1.abcd").is_none());
        assert!(parse_auth(&format!("{value}.00")).is_none());
        assert!(parse_auth("x.00.00").is_none());
    }

    #[test]
    fn each_call_number_is_taken_once_within_the_window() {
        let mut w = SeqWindow::default();
        assert!(!w.accept(0), "numbers start at 1");
        assert!(w.accept(1) && !w.accept(1), "a replay");
        // Out of order within the window is fine; each once.
        assert!(w.accept(5) && w.accept(3) && w.accept(2) && !w.accept(3));
        let far = 5 + REPLAY_WINDOW;
        assert!(w.accept(far));
        assert!(!w.accept(4), "fell behind the window: refused, though never seen");
        assert!(w.accept(far - REPLAY_WINDOW + 1) && !w.accept(far - REPLAY_WINDOW + 1));
        assert!(w.seen.len() as u64 <= REPLAY_WINDOW, "bounded: {}", w.seen.len());
        for seq in far + 1..far + 3 * REPLAY_WINDOW {
            assert!(w.accept(seq));
        }
        assert!(w.seen.len() as u64 <= REPLAY_WINDOW, "bounded: {}", w.seen.len());
    }

    #[test]
    fn method_names() {
        assert!(valid_method(methods::LOAD_PLAN));
        assert!(!valid_method(""));
        assert!(!valid_method("../x"));
        assert!(!valid_method(&"a".repeat(65)));
    }
}
