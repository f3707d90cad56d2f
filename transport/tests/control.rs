//! Control RPCs on the ring server: signed both ways, refused without the secret, for
//! another receiver, or a second time.

mod common;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use common::{config, echo_server, echo_server_with, eof_within, h2, secret, ChannelBody};
use http_body_util::Full;
use hyper::client::conn::http2::SendRequest;
use hyper::header::CONTENT_LENGTH;
use serde_json::{json, Value};
use std::net::SocketAddr;
use transport::control::{sign_request, AUTH_HEADER};
use transport::{methods, ClusterSecret, ControlClient, ControlFailure, ControlHandler, Error};

fn handler() -> Arc<dyn ControlHandler> {
    Arc::new(|method: String, body: Value| async move {
        match method.as_str() {
            methods::HEALTH => Ok(json!({"status": "ok"})),
            methods::LOAD_PLAN => Ok(json!({"loaded": body["windows"]})),
            methods::PROFILE => Err(ControlFailure::failed("profiler busy")),
            other => Err(ControlFailure::unknown_method(other)),
        }
    })
}

/// Posts `body` to `path` with an optional auth header on `send`; returns the status.
async fn post(send: &mut SendRequest<Full<Bytes>>, path: &str, auth: Option<&str>, body: &'static [u8]) -> u16 {
    let mut request = hyper::Request::post(format!("http://hearth{path}"));
    if let Some(auth) = auth {
        request = request.header(AUTH_HEADER, auth);
    }
    let response = send.send_request(request.body(Full::new(Bytes::from_static(body))).unwrap()).await.unwrap();
    response.status().as_u16()
}

/// Like `post` on a new connection that proved `secret`.
async fn raw_post(addr: SocketAddr, s: &ClusterSecret, path: &str, auth: Option<&str>, body: &'static [u8]) -> u16 {
    let (mut send, _) = h2(addr, s).await;
    post(&mut send, path, auth, body).await
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn right_secret_gets_answers() {
    let s = secret("right");
    let echo = echo_server(s.clone(), Some(handler())).await;
    let client = ControlClient::connect(&echo.addr.to_string(), &s, &config()).await.unwrap();
    assert_eq!(client.receiver(), echo.id, "the client learnt whom it talks to");

    assert_eq!(client.call(methods::HEALTH, &json!({})).await.unwrap(), json!({"status": "ok"}));
    let plan = json!({"windows": [4, 3, 3]});
    assert_eq!(client.call(methods::LOAD_PLAN, &plan).await.unwrap(), json!({"loaded": [4, 3, 3]}));

    let err = client.call(methods::PROFILE, &json!(null)).await.unwrap_err();
    assert!(matches!(&err, Error::Control { status: 500, message, .. } if message == "profiler busy"), "{err}");
    let err = client.call("nope", &json!({})).await.unwrap_err();
    assert!(matches!(err, Error::Control { status: 404, .. }), "{err}");

    // A raw call signed correctly gets 200 too.
    let path = "/control/health";
    let auth = sign_request(&s, &echo.id, now_ms(), "POST", path, b"{}");
    assert_eq!(raw_post(echo.addr, &s, path, Some(&auth), b"{}").await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_missing_or_stale_auth_is_refused() {
    let s = secret("right");
    let echo = echo_server(s.clone(), Some(handler())).await;

    // The wrong secret does not get as far as HTTP.
    let err = ControlClient::connect(&echo.addr.to_string(), &secret("wrong"), &config()).await.err().unwrap();
    assert!(matches!(err, Error::Auth { .. }), "{err}");
    assert!(err.to_string().contains(&echo.addr.to_string()), "names the peer: {err}");
    assert!(err.to_string().contains("wrong cluster secret"), "says why: {err}");

    let path = "/control/load_plan";
    assert_eq!(raw_post(echo.addr, &s, path, None, b"{}").await, 401, "missing");
    assert_eq!(raw_post(echo.addr, &s, path, Some("garbage"), b"{}").await, 401, "malformed");

    let stale = now_ms() - Duration::from_secs(5 * 60).as_millis() as u64;
    let auth = sign_request(&s, &echo.id, stale, "POST", path, b"{}");
    assert_eq!(raw_post(echo.addr, &s, path, Some(&auth), b"{}").await, 401, "stale");
    let future = now_ms() + Duration::from_secs(5 * 60).as_millis() as u64;
    let auth = sign_request(&s, &echo.id, future, "POST", path, b"{}");
    assert_eq!(raw_post(echo.addr, &s, path, Some(&auth), b"{}").await, 401, "future");
    let auth = sign_request(&secret("wrong"), &echo.id, now_ms(), "POST", path, b"{}");
    assert_eq!(raw_post(echo.addr, &s, path, Some(&auth), b"{}").await, 401, "signed with another secret");

    // Signed for another body or path: a captured signature cannot be reused for a new call.
    let signed = sign_request(&s, &echo.id, now_ms(), "POST", path, b"{}");
    assert_eq!(raw_post(echo.addr, &s, path, Some(&signed), b"{\"windows\":[30]}").await, 401, "other body");
    let signed = sign_request(&s, &echo.id, now_ms(), "POST", path, b"{}");
    assert_eq!(raw_post(echo.addr, &s, "/control/profile", Some(&signed), b"{}").await, 401, "other path");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_call_is_refused_when_replayed() {
    let s = secret("right");
    let echo = echo_server(s.clone(), Some(handler())).await;
    let path = "/control/load_plan";
    let body: &'static [u8] = b"{\"windows\":[4,3,3]}";
    let captured = sign_request(&s, &echo.id, now_ms(), "POST", path, body);

    let (mut send, _) = h2(echo.addr, &s).await;
    assert_eq!(post(&mut send, path, Some(&captured), body).await, 200, "the original call");
    assert_eq!(post(&mut send, path, Some(&captured), body).await, 401, "replayed on the same connection");
    assert_eq!(raw_post(echo.addr, &s, path, Some(&captured), body).await, 401, "replayed on a new connection");
    // A fresh signature of the very same call is fine.
    let fresh = sign_request(&s, &echo.id, now_ms(), "POST", path, body);
    assert_eq!(post(&mut send, path, Some(&fresh), body).await, 200, "a new call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_signed_for_one_member_is_refused_by_another() {
    let s = secret("right");
    let a = echo_server(s.clone(), Some(handler())).await;
    let b = echo_server(s.clone(), Some(handler())).await;
    assert_ne!(a.id, b.id);
    let path = "/control/load_plan";
    let for_a = sign_request(&s, &a.id, now_ms(), "POST", path, b"{}");
    assert_eq!(raw_post(b.addr, &s, path, Some(&for_a), b"{}").await, 401, "sent to B");
    assert_eq!(raw_post(a.addr, &s, path, Some(&for_a), b"{}").await, 200, "A takes it");
}

/// Sends headers that announce `length` body bytes and then nothing; returns the status, which
/// must come from the headers alone.
async fn headers_only(addr: SocketAddr, s: &ClusterSecret, auth: Option<&str>, length: u64) -> u16 {
    let (mut send, _) = h2::<ChannelBody>(addr, s).await;
    let (body_tx, body_rx) = tokio::sync::mpsc::channel(1);
    let mut request = hyper::Request::post("http://hearth/control/load_plan").header(CONTENT_LENGTH, length);
    if let Some(auth) = auth {
        request = request.header(AUTH_HEADER, auth);
    }
    let response = send.send_request(request.body(ChannelBody(body_rx)).unwrap());
    let status = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("answered within 10 s although the body never comes")
        .unwrap()
        .status()
        .as_u16();
    drop(body_tx);
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsigned_or_oversized_bodies_are_refused_before_they_are_read() {
    let s = secret("right");
    // Body reads wait up to the handshake timeout: a minute here, so a prompt answer shows
    // that nothing waited for the body.
    let patient = transport::LinkConfig { handshake_timeout: Duration::from_secs(60), ..config() };
    let echo = echo_server_with(s.clone(), Some(handler()), patient).await;
    let huge = 1 << 30;
    assert_eq!(headers_only(echo.addr, &s, None, huge).await, 401, "unsigned");
    let wrong = sign_request(&secret("wrong"), &echo.id, now_ms(), "POST", "/control/load_plan", b"{}");
    assert_eq!(headers_only(echo.addr, &s, Some(&wrong), huge).await, 401, "signed with another secret");
    let signed = sign_request(&s, &echo.id, now_ms(), "POST", "/control/load_plan", b"{}");
    assert_eq!(headers_only(echo.addr, &s, Some(&signed), huge).await, 413, "signed, but over the limit");

    // And a stranger who has not proved the secret gets no HTTP at all.
    let mut tcp = tokio::net::TcpStream::connect(echo.addr).await.unwrap();
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    tokio::io::AsyncWriteExt::write_all(&mut tcp, preface).await.unwrap();
    assert!(eof_within(&mut tcp, Duration::from_secs(10)).await, "closed without an answer");
}
