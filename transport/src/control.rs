//! JSON control RPCs (health, load plan, profile, ...) on the ring server's port.
//!
//! `POST /control/<method>` with a JSON body; the answer is the envelope
//! `{"ok": <value>}` or `{"error": {"message": "..."}}` with a matching HTTP status. What a
//! method means is the caller's business: this crate carries opaque JSON.
//!
//! Calls travel on connections that proved the cluster secret in their handshake (`link`),
//! and each call is signed on its own as well: `x-hearth-auth` is
//! `<receiver id>.<unix ms>.<nonce>.<body SHA-256>.<HMAC>` (hex, dot-separated), the HMAC
//! taken over all of these plus the HTTP method and path. The receiver id is the one the
//! server announced in the handshake (random per server process), the nonce 16 fresh random
//! bytes. From the header alone, before reading a byte of the body, the server refuses (401)
//! a missing or wrong MAC, a call addressed to another server, a timestamp more than a
//! minute off its clock and a nonce it has already accepted (it remembers nonces for as long
//! as their timestamp is acceptable); it refuses (413) a declared length over the limit.
//! Only then does it read the body, up to the limit, and check it against the signed digest.
//! A captured call is thus refused by every other server, by its own server again, and by
//! that server once restarted. The server signs its answer over the request's MAC, status
//! and body, so the caller knows the answer came from a member of the cluster and belongs
//! to its own request.

use std::future::Future;
use std::pin::Pin;
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

use crate::throttle::WarnThrottle;
use crate::auth::{random, ClusterSecret, HmacSha256, PeerId};
use crate::error::{Error, Result};
use crate::freshness::{hex, stale, unhex, unix_ms, Fresh, Replays, RequestNonce};
pub use crate::freshness::REQUEST_NONCE_LEN;
use crate::link::{open_h2, ConnGuard, LinkConfig};

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
const REQUEST_LABEL: &[u8] = b"hearth control request v2";
const RESPONSE_LABEL: &[u8] = b"hearth control response v2";
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
struct Signed {
    receiver: PeerId,
    unix_ms: u64,
    nonce: RequestNonce,
    digest: BodyDigest,
}

fn request_mac(secret: &ClusterSecret, signed: &Signed, method: &str, path: &str) -> HmacSha256 {
    let mut mac = secret.mac();
    mac.update(REQUEST_LABEL);
    // Fixed lengths first; NUL after each variable field, which none of them can contain,
    // so no two requests share an input.
    mac.update(&signed.receiver);
    mac.update(&signed.nonce);
    mac.update(&signed.digest);
    for part in [signed.unix_ms.to_string().as_bytes(), method.as_bytes(), path.as_bytes()] {
        mac.update(part);
        mac.update(&[0]);
    }
    mac
}

fn response_mac(secret: &ClusterSecret, request_tag: &[u8], status: u16, body: &[u8]) -> HmacSha256 {
    let mut mac = secret.mac();
    mac.update(RESPONSE_LABEL);
    mac.update(request_tag);
    mac.update(&status.to_be_bytes());
    mac.update(body);
    mac
}

fn auth_value(signed: &Signed, tag: &[u8]) -> String {
    format!(
        "{}.{}.{}.{}.{}",
        hex(&signed.receiver),
        signed.unix_ms,
        hex(&signed.nonce),
        hex(&signed.digest),
        hex(tag)
    )
}

/// An `x-hearth-auth` value for a call to the server `receiver`, with a fresh nonce; public
/// so tools and tests can craft calls.
pub fn sign_request(
    secret: &ClusterSecret,
    receiver: &PeerId,
    unix_ms: u64,
    method: &str,
    path: &str,
    body: &[u8],
) -> String {
    let signed = Signed { receiver: *receiver, unix_ms, nonce: random(), digest: Sha256::digest(body).into() };
    auth_value(&signed, &request_mac(secret, &signed, method, path).finalize().into_bytes())
}

fn parse_auth(value: &str) -> Option<(Signed, Vec<u8>)> {
    let mut parts = value.split('.');
    let mut next_hex = || unhex(parts.next()?);
    let receiver = next_hex()?.try_into().ok()?;
    let unix_ms = parts.next()?.parse().ok()?;
    let mut next_hex = || unhex(parts.next()?);
    let nonce = next_hex()?.try_into().ok()?;
    let digest = next_hex()?.try_into().ok()?;
    let tag = next_hex()?;
    if parts.next().is_some() {
        return None;
    }
    Some((Signed { receiver, unix_ms, nonce, digest }, tag))
}

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

/// The server side of control calls: who this server is, what it has accepted.
pub(crate) struct Receiver {
    secret: ClusterSecret,
    id: PeerId,
    handler: Option<Arc<dyn ControlHandler>>,
    blobs: Option<Arc<dyn BlobHandler>>,
    read_timeout: Duration,
    replays: Mutex<Replays>,
    /// Refused calls come from authenticated connections only, but a misconfigured or
    /// compromised member can still send them in a loop: logged a few a minute.
    refusals: WarnThrottle,
}

impl Receiver {
    pub(crate) fn new(
        secret: ClusterSecret,
        id: PeerId,
        handler: Option<Arc<dyn ControlHandler>>,
        blobs: Option<Arc<dyn BlobHandler>>,
        read_timeout: Duration,
    ) -> Receiver {
        Receiver { secret, id, handler, blobs, read_timeout, replays: Mutex::default(), refusals: WarnThrottle::default() }
    }

    /// Serves one control or blob call, checking everything the headers say before reading
    /// the body.
    pub(crate) async fn serve(&self, req: Request<Incoming>, method: &str, kind: CallKind, peer: &str) -> Response<Full<Bytes>> {
        let refuse = |reason: String| {
            self.refusals.warn(|| format!("refused control call {method} from {peer}: {reason}"));
            plain(StatusCode::UNAUTHORIZED, &format!("unauthorized: {reason}"))
        };
        let auth = req.headers().get(AUTH_HEADER).and_then(|v| v.to_str().ok()).and_then(parse_auth);
        let Some((signed, tag)) = auth else {
            return refuse(format!("missing or malformed {AUTH_HEADER} header"));
        };
        if signed.receiver != self.id {
            return refuse(format!(
                "the call is addressed to ring member {}, this is {}",
                hex(&signed.receiver),
                hex(&self.id)
            ));
        }
        let now = unix_ms();
        if let Some(why) = stale(signed.unix_ms, now) {
            return refuse(why);
        }
        let path = req.uri().path().to_owned();
        if request_mac(&self.secret, &signed, req.method().as_str(), &path).verify_slice(&tag).is_err() {
            return refuse("wrong signature (wrong cluster secret?)".into());
        }
        let declared = req.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|len| len > MAX_BODY_BYTES as u64) {
            return plain(StatusCode::PAYLOAD_TOO_LARGE, "control body too large");
        }
        let fresh = self.replays.lock().unwrap_or_else(|e| e.into_inner()).check_and_remember(signed.nonce, signed.unix_ms, now);
        match fresh {
            Fresh::Yes => {}
            Fresh::Replayed => return refuse("replayed request (its nonce was used already)".into()),
            Fresh::Full => {
                return plain(StatusCode::SERVICE_UNAVAILABLE, "too many control calls in the last minutes; retry later")
            }
        }
        let read = Limited::new(req.into_body(), MAX_BODY_BYTES).collect();
        let body = match timeout(self.read_timeout, read).await {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
                return plain(StatusCode::PAYLOAD_TOO_LARGE, "control body too large")
            }
            Ok(Err(e)) => return plain(StatusCode::BAD_REQUEST, &format!("reading the body: {e}")),
            Err(_) => return plain(StatusCode::REQUEST_TIMEOUT, "body did not arrive in time"),
        };
        if <[u8; 32]>::from(Sha256::digest(&body)) != signed.digest {
            return refuse("the body is not the one signed".into());
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
        let sign = |status: StatusCode, bytes: &[u8]| hex(&response_mac(&self.secret, &tag, status.as_u16(), bytes).finalize().into_bytes());
        match result {
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
        }
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
    secret: ClusterSecret,
    timeout: Duration,
    _guard: Arc<ConnGuard>,
}

impl ControlClient {
    pub async fn connect(peer: &str, secret: &ClusterSecret, config: &LinkConfig) -> Result<ControlClient> {
        let (send, addr, killer, receiver) = open_h2(peer, secret, config).await?;
        Ok(ControlClient {
            send,
            authority: addr.to_string(),
            receiver,
            peer: peer.into(),
            secret: secret.clone(),
            timeout: config.control_timeout,
            _guard: Arc::new(ConnGuard::new(killer, None)),
        })
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The id the server announced in the handshake; every call is signed for it.
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
        let signed =
            Signed { receiver: self.receiver, unix_ms: unix_ms(), nonce: random(), digest: Sha256::digest(&body).into() };
        let tag = request_mac(&self.secret, &signed, "POST", &path).finalize().into_bytes();
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

        // A 401 cannot be signed: the peer could not tell which secret we used.
        if status == 401 {
            return Err(self.failure(method, status, match serde_json::from_slice::<Envelope>(&bytes) {
                Ok(Envelope::Error { message }) => message,
                _ => "unauthorized".into(),
            }));
        }
        let signed =
            signature.is_some_and(|sig| response_mac(&self.secret, &tag, status, &bytes).verify_slice(&sig).is_ok());
        if !signed {
            return Err(Error::auth(&self.peer, "control answer not signed with the cluster secret"));
        }
        Ok((status, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::PEER_ID_LEN;

    #[test]
    fn hex_round_trips_and_rejects_junk() {
        assert_eq!(unhex(&hex(&[0, 1, 0xab, 0xff])), Some(vec![0, 1, 0xab, 0xff]));
        assert_eq!(unhex("abc"), None);
        assert_eq!(unhex("zz"), None);
        assert_eq!(unhex("é1"), None);
    }

    #[test]
    fn signatures_bind_every_field() {
        let s = ClusterSecret::new("k").unwrap();
        let signed = Signed { receiver: [1; PEER_ID_LEN], unix_ms: 1, nonce: [2; REQUEST_NONCE_LEN], digest: [3; 32] };
        let tag = |s: &ClusterSecret, signed: &Signed, method, path| -> Vec<u8> {
            request_mac(s, signed, method, path).finalize().into_bytes().to_vec()
        };
        let base = tag(&s, &signed, "POST", "/control/health");
        assert_ne!(base, tag(&s, &Signed { receiver: [9; PEER_ID_LEN], ..signed }, "POST", "/control/health"));
        assert_ne!(base, tag(&s, &Signed { unix_ms: 2, ..signed }, "POST", "/control/health"));
        assert_ne!(base, tag(&s, &Signed { nonce: [9; REQUEST_NONCE_LEN], ..signed }, "POST", "/control/health"));
        assert_ne!(base, tag(&s, &Signed { digest: [9; 32], ..signed }, "POST", "/control/health"));
        assert_ne!(base, tag(&s, &signed, "GET", "/control/health"));
        assert_ne!(base, tag(&s, &signed, "POST", "/control/profile"));
        assert_ne!(base, tag(&ClusterSecret::new("j").unwrap(), &signed, "POST", "/control/health"));

        let value = sign_request(&s, &[1; PEER_ID_LEN], 7, "POST", "/control/health", b"{}");
        let (parsed, tag) = parse_auth(&value).unwrap();
        assert_eq!((parsed.receiver, parsed.unix_ms, tag.len()), ([1; PEER_ID_LEN], 7, 32));
        assert_eq!(parsed.digest, <[u8; 32]>::from(Sha256::digest(b"{}")));
        // Two signatures of the same call differ: each has its own nonce.
        assert_ne!(value, sign_request(&s, &[1; PEER_ID_LEN], 7, "POST", "/control/health", b"{}"));
        assert!(parse_auth("1.abcd").is_none());
        assert!(parse_auth(&format!("{value}.00")).is_none());
    }

    #[test]
    fn method_names() {
        assert!(valid_method(methods::LOAD_PLAN));
        assert!(!valid_method(""));
        assert!(!valid_method("../x"));
        assert!(!valid_method(&"a".repeat(65)));
    }
}
