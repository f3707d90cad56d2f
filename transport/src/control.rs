//! JSON control RPCs (health, load plan, profile, ...) on the ring server's port.
//!
//! `POST /control/<method>` with a JSON body; the answer is the envelope
//! `{"ok": <value>}` or `{"error": {"message": "..."}}` with a matching HTTP status. What a
//! method means is the caller's business: this crate carries opaque JSON.
//!
//! Every request carries `x-hearth-auth: <unix ms>.<hex HMAC>` over the timestamp, HTTP
//! method, path and body. The server refuses (401) a missing or wrong MAC and a timestamp
//! more than a minute off its clock, so a captured request stops working soon after. The
//! server signs its answer over the request's MAC, status and body, so the caller knows the
//! answer came from a member of the cluster and belongs to its own request.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hmac::Mac;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Request, Response, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::time::timeout;
use tracing::warn;

use crate::auth::{ClusterSecret, HmacSha256};
use crate::error::{Error, Result};
use crate::link::{open_h2, ConnGuard, LinkConfig};

pub const PATH_PREFIX: &str = "/control/";
pub const AUTH_HEADER: &str = "x-hearth-auth";

/// Method names the ring uses; any `[a-z0-9_-]{1,64}` name is carried.
pub mod methods {
    pub const HEALTH: &str = "health";
    pub const LOAD_PLAN: &str = "load_plan";
    pub const PROFILE: &str = "profile";
}

/// Home devices' clocks drift and phones sync rarely; a minute tolerates that while a
/// captured request soon goes stale.
const MAX_CLOCK_SKEW_MS: u64 = 60_000;
/// Plans and profiles are kilobytes; this bounds what an unauthenticated caller can make a
/// node buffer before its MAC is checked.
const MAX_BODY_BYTES: usize = 4 << 20;
const MAX_METHOD_LEN: usize = 64;
const REQUEST_LABEL: &[u8] = b"hearth control request v1";
const RESPONSE_LABEL: &[u8] = b"hearth control response v1";
const JSON: &str = "application/json";

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

fn valid_method(name: &str) -> bool {
    (1..=MAX_METHOD_LEN).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn request_mac(secret: &ClusterSecret, unix_ms: u64, method: &str, path: &str, body: &[u8]) -> HmacSha256 {
    let mut mac = secret.mac();
    // NUL separators: none of the fields can contain one, so no two requests share an input.
    for part in [REQUEST_LABEL, unix_ms.to_string().as_bytes(), method.as_bytes(), path.as_bytes()] {
        mac.update(part);
        mac.update(&[0]);
    }
    mac.update(body);
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

/// The `x-hearth-auth` value for a request; public so tools and tests can craft calls.
pub fn sign_request(secret: &ClusterSecret, unix_ms: u64, method: &str, path: &str, body: &[u8]) -> String {
    let tag = request_mac(secret, unix_ms, method, path, body).finalize().into_bytes();
    format!("{unix_ms}.{}", hex(&tag))
}

fn parse_auth(value: &str) -> Option<(u64, Vec<u8>)> {
    let (ts, tag) = value.split_once('.')?;
    Some((ts.parse().ok()?, unhex(tag)?))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}

fn envelope_bytes(envelope: &Envelope) -> Bytes {
    // Serialising a Value-bearing enum cannot fail (no non-string map keys exist in Value).
    Bytes::from(serde_json::to_vec(envelope).unwrap_or_default())
}

fn respond(status: StatusCode, envelope: &Envelope, signature: Option<String>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(envelope_bytes(envelope)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(JSON));
    if let Some(value) = signature.and_then(|s| HeaderValue::from_str(&s).ok()) {
        response.headers_mut().insert(AUTH_HEADER, value);
    }
    response
}

/// An unsigned error answer.
pub(crate) fn plain(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    respond(status, &Envelope::Error { message: message.to_owned() }, None)
}

/// Serves one control call; also says whether the caller proved the secret.
pub(crate) async fn serve(
    req: Request<Incoming>,
    method: &str,
    secret: &ClusterSecret,
    handler: Option<&dyn ControlHandler>,
    peer: &str,
    read_timeout: Duration,
) -> (Response<Full<Bytes>>, bool) {
    let refuse = |reason: String| {
        warn!(%peer, %method, "refused control call: {reason}");
        (plain(StatusCode::UNAUTHORIZED, &format!("unauthorized: {reason}")), false)
    };
    let auth = req.headers().get(AUTH_HEADER).and_then(|v| v.to_str().ok()).and_then(parse_auth);
    let Some((sent_at, tag)) = auth else {
        return refuse(format!("missing or malformed {AUTH_HEADER} header"));
    };
    let skew = unix_ms().abs_diff(sent_at);
    if skew > MAX_CLOCK_SKEW_MS {
        return refuse(format!(
            "timestamp is {} s off this node's clock (stale request, or clocks out of sync)",
            skew / 1000
        ));
    }
    let http_method = req.method().as_str().to_owned();
    let path = req.uri().path().to_owned();
    let body = match timeout(read_timeout, Limited::new(req.into_body(), MAX_BODY_BYTES).collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return (plain(StatusCode::PAYLOAD_TOO_LARGE, "control body too large"), false)
        }
        Ok(Err(e)) => return (plain(StatusCode::BAD_REQUEST, &format!("reading the body: {e}")), false),
        Err(_) => return (plain(StatusCode::REQUEST_TIMEOUT, "body did not arrive in time"), false),
    };
    if request_mac(secret, sent_at, &http_method, &path, &body).verify_slice(&tag).is_err() {
        return refuse("wrong signature (wrong cluster secret?)".into());
    }

    let result = if !valid_method(method) {
        Err(ControlFailure::unknown_method(method))
    } else {
        match (serde_json::from_slice::<Value>(&body), handler) {
            (Err(e), _) => Err(ControlFailure::bad_request(format!("body is not JSON: {e}"))),
            (Ok(_), None) => Err(ControlFailure::unknown_method(method)),
            (Ok(value), Some(handler)) => handler.call(method, value).await,
        }
    };
    let (status, envelope) = match result {
        Ok(value) => (StatusCode::OK, Envelope::Ok(value)),
        Err(f) => (
            StatusCode::from_u16(f.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            Envelope::Error { message: f.message },
        ),
    };
    let bytes = envelope_bytes(&envelope);
    let signature = hex(&response_mac(secret, &tag, status.as_u16(), &bytes).finalize().into_bytes());
    let mut response = Response::new(Full::new(bytes));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(JSON));
    if let Ok(value) = HeaderValue::from_str(&signature) {
        response.headers_mut().insert(AUTH_HEADER, value);
    }
    (response, true)
}

/// Calls control methods on one ring member over its own HTTP/2 connection. Cheap to clone;
/// the connection closes when the last clone drops.
#[derive(Clone)]
pub struct ControlClient {
    send: SendRequest<Full<Bytes>>,
    authority: String,
    peer: Arc<str>,
    secret: ClusterSecret,
    timeout: Duration,
    _guard: Arc<ConnGuard>,
}

impl ControlClient {
    pub async fn connect(peer: &str, secret: &ClusterSecret, config: &LinkConfig) -> Result<ControlClient> {
        let (send, addr, killer) = open_h2(peer, config).await?;
        Ok(ControlClient {
            send,
            authority: addr.to_string(),
            peer: peer.into(),
            secret: secret.clone(),
            timeout: config.control_timeout,
            _guard: Arc::new(ConnGuard::new(killer, None)),
        })
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Calls `method` with `body`; the peer's `ok` value, or an error naming the peer.
    pub async fn call(&self, method: &str, body: &Value) -> Result<Value> {
        if !valid_method(method) {
            return Err(Error::Encode(format!("control method {method:?} is not [a-z0-9_-]{{1,64}}")));
        }
        let path = format!("{PATH_PREFIX}{method}");
        let body = serde_json::to_vec(body).map_err(|e| Error::Encode(e.to_string()))?;
        let sent_at = unix_ms();
        let tag = request_mac(&self.secret, sent_at, "POST", &path, &body).finalize().into_bytes();
        let request = Request::post(format!("http://{}{path}", self.authority))
            .header(CONTENT_TYPE, JSON)
            .header(AUTH_HEADER, format!("{sent_at}.{}", hex(&tag)))
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| Error::http(&self.peer, "building a control request", e))?;
        let mut send = self.send.clone();
        let exchange = async {
            send.ready().await.map_err(|e| Error::http(&self.peer, "control connection", e))?;
            let response = send.send_request(request).await.map_err(|e| Error::http(&self.peer, "control call", e))?;
            let status = response.status().as_u16();
            let signature = response.headers().get(AUTH_HEADER).and_then(|v| v.to_str().ok()).and_then(unhex);
            let bytes = Limited::new(response.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
                .map_err(|e| Error::http(&self.peer, "reading a control answer", e))?
                .to_bytes();
            Ok::<_, Error>((status, signature, bytes))
        };
        let (status, signature, bytes) = timeout(self.timeout, exchange)
            .await
            .map_err(|_| Error::timeout(&self.peer, "control call", self.timeout))??;

        let envelope = serde_json::from_slice::<Envelope>(&bytes);
        let failure = |message: String| Error::Control {
            peer: self.peer.to_string(),
            method: method.to_owned(),
            status,
            message,
        };
        // A 401 cannot be signed: the peer could not tell which secret we used.
        if status == 401 {
            return Err(failure(match envelope {
                Ok(Envelope::Error { message }) => message,
                _ => "unauthorized".into(),
            }));
        }
        let signed =
            signature.is_some_and(|sig| response_mac(&self.secret, &tag, status, &bytes).verify_slice(&sig).is_ok());
        if !signed {
            return Err(Error::auth(&self.peer, "control answer not signed with the cluster secret"));
        }
        match envelope {
            Ok(Envelope::Ok(value)) if status == 200 => Ok(value),
            Ok(Envelope::Error { message }) => Err(failure(message)),
            Ok(Envelope::Ok(_)) => Err(failure("an ok envelope with a non-200 status".into())),
            Err(e) => Err(failure(format!("answer is not a control envelope: {e}"))),
        }
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

    #[test]
    fn signatures_bind_every_field() {
        let s = ClusterSecret::new("k").unwrap();
        let base = sign_request(&s, 1, "POST", "/control/health", b"{}");
        assert_ne!(base, sign_request(&s, 2, "POST", "/control/health", b"{}"));
        assert_ne!(base, sign_request(&s, 1, "GET", "/control/health", b"{}"));
        assert_ne!(base, sign_request(&s, 1, "POST", "/control/profile", b"{}"));
        assert_ne!(base, sign_request(&s, 1, "POST", "/control/health", b"[]"));
        assert_ne!(base, sign_request(&ClusterSecret::new("j").unwrap(), 1, "POST", "/control/health", b"{}"));
        let (ts, tag) = parse_auth(&base).unwrap();
        assert_eq!(ts, 1);
        assert_eq!(tag.len(), 32);
    }

    #[test]
    fn method_names() {
        assert!(valid_method(methods::LOAD_PLAN));
        assert!(!valid_method(""));
        assert!(!valid_method("../x"));
        assert!(!valid_method(&"a".repeat(65)));
    }
}
