//! Control RPCs on the ring server: signed both ways, refused without the secret.

mod common;

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use common::{config, echo_server, secret};
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use transport::control::{sign_request, AUTH_HEADER};
use transport::{methods, ControlClient, ControlFailure, ControlHandler, Error};

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

/// Posts `body` to `path` with an optional auth header; returns the status.
async fn raw_post(addr: std::net::SocketAddr, path: &str, auth: Option<String>, body: &'static [u8]) -> u16 {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp)).await.unwrap();
    tokio::spawn(conn);
    let mut request = hyper::Request::post(format!("http://{addr}{path}"));
    if let Some(auth) = auth {
        request = request.header(AUTH_HEADER, auth);
    }
    let response = send.send_request(request.body(Full::new(Bytes::from_static(body))).unwrap()).await.unwrap();
    response.status().as_u16()
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn right_secret_gets_answers() {
    let s = secret("right");
    let echo = echo_server(s.clone(), Some(handler())).await;
    let client = ControlClient::connect(&echo.addr.to_string(), &s, &config()).await.unwrap();

    assert_eq!(client.call(methods::HEALTH, &json!({})).await.unwrap(), json!({"status": "ok"}));
    let plan = json!({"windows": [4, 3, 3]});
    assert_eq!(client.call(methods::LOAD_PLAN, &plan).await.unwrap(), json!({"loaded": [4, 3, 3]}));

    let err = client.call(methods::PROFILE, &json!(null)).await.unwrap_err();
    assert!(matches!(&err, Error::Control { status: 500, message, .. } if message == "profiler busy"), "{err}");
    let err = client.call("nope", &json!({})).await.unwrap_err();
    assert!(matches!(err, Error::Control { status: 404, .. }), "{err}");

    // A raw call signed correctly gets 200 too.
    let path = "/control/health";
    let auth = sign_request(&s, now_ms(), "POST", path, b"{}");
    assert_eq!(raw_post(echo.addr, path, Some(auth), b"{}").await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_missing_or_stale_auth_is_401() {
    let s = secret("right");
    let echo = echo_server(s.clone(), Some(handler())).await;

    let wrong = ControlClient::connect(&echo.addr.to_string(), &secret("wrong"), &config()).await.unwrap();
    let err = wrong.call(methods::HEALTH, &json!({})).await.unwrap_err();
    assert!(matches!(err, Error::Control { status: 401, .. }), "{err}");
    assert!(err.to_string().contains(&echo.addr.to_string()), "names the peer: {err}");

    let path = "/control/load_plan";
    assert_eq!(raw_post(echo.addr, path, None, b"{}").await, 401, "missing");
    assert_eq!(raw_post(echo.addr, path, Some("garbage".into()), b"{}").await, 401, "malformed");

    let stale = now_ms() - Duration::from_secs(5 * 60).as_millis() as u64;
    assert_eq!(
        raw_post(echo.addr, path, Some(sign_request(&s, stale, "POST", path, b"{}")), b"{}").await,
        401,
        "stale"
    );
    let future = now_ms() + Duration::from_secs(5 * 60).as_millis() as u64;
    assert_eq!(
        raw_post(echo.addr, path, Some(sign_request(&s, future, "POST", path, b"{}")), b"{}").await,
        401,
        "future"
    );

    // Signed for another body or path: a captured signature cannot be reused for a new call.
    let signed = sign_request(&s, now_ms(), "POST", path, b"{}");
    assert_eq!(raw_post(echo.addr, path, Some(signed.clone()), b"{\"windows\":[30]}").await, 401, "other body");
    assert_eq!(raw_post(echo.addr, "/control/profile", Some(signed), b"{}").await, 401, "other path");
}
