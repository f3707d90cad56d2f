//! Control RPCs on the ring server: MACed both ways with the connection's session key,
//! refused without the secret, on another connection, or a second time.

mod common;

use std::sync::Arc;
use std::time::Duration;

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

    // Concurrent calls on one connection (numbered in one order, arriving in another).
    let calls = (0..64).map(|i| {
        let client = client.clone();
        tokio::spawn(async move { client.call(methods::LOAD_PLAN, &json!({"windows": [i]})).await })
    });
    for (i, call) in calls.enumerate() {
        assert_eq!(call.await.unwrap().unwrap(), json!({"loaded": [i]}));
    }

    // A raw call MACed with the connection's session key gets 200 too.
    let path = "/control/health";
    let (mut send, session) = h2(echo.addr, &s).await;
    assert_eq!(post(&mut send, path, Some(&sign_request(&session, 1, "POST", path, b"{}")), b"{}").await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_missing_or_foreign_auth_is_refused() {
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

    let (mut send, session) = h2(echo.addr, &s).await;
    let (_, other) = h2::<Full<Bytes>>(echo.addr, &s).await;
    let auth = sign_request(&other, 1, "POST", path, b"{}");
    assert_eq!(post(&mut send, path, Some(&auth), b"{}").await, 401, "MACed with another connection's session key");
    let auth = sign_request(&session, 0, "POST", path, b"{}");
    assert_eq!(post(&mut send, path, Some(&auth), b"{}").await, 401, "call number 0");

    // MACed for another body or path: a captured MAC cannot be reused for a new call.
    let signed = sign_request(&session, 2, "POST", path, b"{}");
    assert_eq!(post(&mut send, path, Some(&signed), b"{\"windows\":[30]}").await, 401, "other body");
    let signed = sign_request(&session, 3, "POST", path, b"{}");
    assert_eq!(post(&mut send, "/control/profile", Some(&signed), b"{}").await, 401, "other path");
    // The connection still serves calls MACed right.
    let signed = sign_request(&session, 4, "POST", path, b"{}");
    assert_eq!(post(&mut send, path, Some(&signed), b"{}").await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_call_is_refused_when_replayed() {
    let s = secret("right");
    let echo = echo_server(s.clone(), Some(handler())).await;
    let path = "/control/load_plan";
    let body: &'static [u8] = b"{\"windows\":[4,3,3]}";

    let (mut send, session) = h2(echo.addr, &s).await;
    let captured = sign_request(&session, 1, "POST", path, body);
    assert_eq!(post(&mut send, path, Some(&captured), body).await, 200, "the original call");
    assert_eq!(post(&mut send, path, Some(&captured), body).await, 401, "replayed on the same connection");
    assert_eq!(raw_post(echo.addr, &s, path, Some(&captured), body).await, 401, "replayed on a new connection");
    // A new number for the very same call is fine; numbers may come out of order within
    // the window, each once; one that fell behind the window is refused.
    assert_eq!(post(&mut send, path, Some(&sign_request(&session, 5, "POST", path, body)), body).await, 200);
    assert_eq!(post(&mut send, path, Some(&sign_request(&session, 3, "POST", path, body)), body).await, 200);
    let far = 5 + transport::control::REPLAY_WINDOW;
    assert_eq!(post(&mut send, path, Some(&sign_request(&session, far, "POST", path, body)), body).await, 200);
    assert_eq!(post(&mut send, path, Some(&sign_request(&session, 4, "POST", path, body)), body).await, 401, "behind the window");
}

/// A session is one connection to one server process: a call MACed on a connection to
/// member A is refused by member B and by A on any other connection; a client whose
/// server restarted connects again and gets answers (a new handshake, a new session).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_maced_on_one_connection_is_refused_on_any_other() {
    let s = secret("right");
    let a = echo_server(s.clone(), Some(handler())).await;
    let b = echo_server(s.clone(), Some(handler())).await;
    assert_ne!(a.id, b.id);
    let path = "/control/load_plan";
    let (mut to_a, session) = h2(a.addr, &s).await;
    let for_a = sign_request(&session, 1, "POST", path, b"{}");
    assert_eq!(raw_post(b.addr, &s, path, Some(&for_a), b"{}").await, 401, "sent to B");
    assert_eq!(raw_post(a.addr, &s, path, Some(&for_a), b"{}").await, 401, "sent to A on another connection");
    assert_eq!(post(&mut to_a, path, Some(&for_a), b"{}").await, 200, "A takes it on its own connection");
}

/// Sends headers that announce `length` body bytes and then nothing; returns the status, which
/// must come from the headers alone.
enum Auth {
    None,
    OtherSession,
    Right,
}

async fn headers_only(addr: SocketAddr, s: &ClusterSecret, auth: Auth, length: u64) -> u16 {
    let (mut send, session) = h2::<ChannelBody>(addr, s).await;
    let auth = match auth {
        Auth::None => None,
        Auth::OtherSession => Some(sign_request(&h2::<ChannelBody>(addr, s).await.1, 1, "POST", "/control/load_plan", b"{}")),
        Auth::Right => Some(sign_request(&session, 1, "POST", "/control/load_plan", b"{}")),
    };
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
    assert_eq!(headers_only(echo.addr, &s, Auth::None, huge).await, 401, "unsigned");
    assert_eq!(headers_only(echo.addr, &s, Auth::OtherSession, huge).await, 401, "MACed with another session's key");
    assert_eq!(headers_only(echo.addr, &s, Auth::Right, huge).await, 413, "MACed right, but over the limit");

    // And a stranger who has not proved the secret gets no HTTP at all.
    let mut tcp = tokio::net::TcpStream::connect(echo.addr).await.unwrap();
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    tokio::io::AsyncWriteExt::write_all(&mut tcp, preface).await.unwrap();
    assert!(eof_within(&mut tcp, Duration::from_secs(10)).await, "closed without an answer");
}
