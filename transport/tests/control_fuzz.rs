//! Fuzzing a real ring server (`LinkServer` with a control handler, on loopback) through
//! the public API, as three kinds of peer:
//!
//! - a stranger: mutated handshake frames, HTTP/2 and HTTP/1.1 openings and garbage on a
//!   raw TCP connection. Promises: the connection is closed within the handshake deadline
//!   and the handler never runs.
//! - a member speaking raw HTTP/2 after a correct handshake: calls with mutated methods,
//!   paths, bodies, extra headers and `x-hearth-auth` values (valid, numbered 0, MACed with
//!   another connection's session key, replayed, mangled, missing). Promises: only a correctly signed call reaches
//!   the handler, and gets its answer; every other is refused with the status the protocol
//!   names; no 5xx; every answer is the control envelope.
//! - `ControlClient` itself, with fuzzed method names and JSON bodies: answers come back
//!   intact.
//!
//! After every case a standing `ControlClient` must still get an answer: nothing a peer
//! sends may take the server down or stall it for others. `HEARTH_FUZZ_SECS=600` runs it
//! for ten minutes (see docs/robustness.md).

#[path = "../../tests/fuzz_driver.rs"]
mod fuzz;
#[path = "../../tests/fuzz_json.rs"]
mod fuzz_json;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use fuzz::{mutate_bytes, Budget, Rng};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::runtime::Runtime;
use transport::control::{sign_request, AUTH_HEADER};
use transport::link::client_handshake;
use transport::{encode, AuthBackoff, ClusterSecret, ControlClient, ControlHandler, Frame, LinkConfig, LinkServer, SessionKey};

/// Short, so strangers that say nothing cost the fuzzer little time.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_millis(300);
/// How much later than the handshake deadline a stranger's connection may still be open:
/// scheduling on a loaded 2-core machine, not protocol time.
const CLOSE_SLACK: Duration = Duration::from_secs(3);
/// Any case, start to end; past this the server stalled.
const STALL: Duration = Duration::from_secs(10);
/// The server's body limit (control.rs); declared lengths around it are interesting.
const BODY_LIMIT: u64 = 4 << 20;
const SECRET: &str = "fuzz cluster secret";

#[derive(Clone, Debug)]
enum Auth {
    None,
    Valid,
    /// Signed correctly, then sent a second time: the replay must be refused.
    Replayed,
    /// Call number 0, which no client uses.
    Zero,
    /// MACed with the session key of another connection that proved the secret.
    OtherSession,
    /// Signed for this body, sent with another.
    OtherBody,
    /// A valid value mangled by these byte mutations (a no-op mangling stays valid).
    Mangled(Vec<u64>),
}

#[derive(Clone, Debug)]
enum Case {
    Stranger { bytes: Vec<u8> },
    Member { http_method: String, path: String, auth: Auth, body: Vec<u8>, headers: Vec<(String, String)> },
    Client { method: String, body: Vec<u8> },
}


fn frame_bytes(frames: &[Frame]) -> Vec<u8> {
    let mut buf = BytesMut::new();
    frames.iter().for_each(|f| encode(f, &mut buf).expect("encodes"));
    buf.to_vec()
}

const METHODS: &[&str] = &["health", "load_plan", "profile", "x", "", "Health", "../health", "a/b", "é", "%2e%2e"];
const HTTP_METHODS: &[&str] = &["POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"];

fn seeds() -> Vec<Case> {
    let hello = frame_bytes(&[Frame::AuthHello { share: [7; 33] }]);
    let hello_proof = frame_bytes(&[Frame::AuthHello { share: [7; 33] }, Frame::AuthProof { proof: [9; 32] }]);
    let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00".to_vec();
    let http1 = b"POST /control/health HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}".to_vec();
    let member = |path: &str, auth, body: &str| Case::Member {
        http_method: "POST".into(),
        path: path.into(),
        auth,
        body: body.as_bytes().to_vec(),
        headers: vec![],
    };
    let mut seeds = vec![
        Case::Stranger { bytes: hello },
        Case::Stranger { bytes: hello_proof },
        Case::Stranger { bytes: preface },
        Case::Stranger { bytes: http1 },
        member("/control/health", Auth::Valid, "{}"),
        member("/control/load_plan", Auth::Valid, r#"{"windows":[[0,10],[10,20]],"model":"m"}"#),
        member("/control/health", Auth::None, "{}"),
        member("/control/profile", Auth::Replayed, "null"),
        Case::Client { method: "load_plan".into(), body: br#"{"windows":[4,3,3]}"#.to_vec() },
    ];
    seeds.extend(fuzz_json::seeds("m").into_iter().take(2).map(|b| Case::Client { method: "health".into(), body: b.text }));
    seeds
}

fn mutate_auth(rng: &mut Rng) -> Auth {
    match rng.below(8) {
        0 => Auth::None,
        1 | 2 => Auth::Valid,
        3 => Auth::Replayed,
        4 => Auth::Zero,
        5 => Auth::OtherSession,
        6 => Auth::OtherBody,
        _ => {
            if rng.one_in(4) {
                Auth::OtherSession
            } else {
                Auth::Mangled((0..1 + rng.below(3)).map(|_| rng.next_u64()).collect())
            }
        }
    }
}

fn mutate_body(rng: &mut Rng, body: &[u8], donor: &[u8]) -> Vec<u8> {
    let parent = fuzz_json::Body { endpoint: fuzz_json::Endpoint::Chat, text: body.to_vec() };
    let donor = fuzz_json::Body { endpoint: fuzz_json::Endpoint::Chat, text: donor.to_vec() };
    fuzz_json::mutate(rng, &parent, &donor).text
}

fn case_body(case: &Case) -> &[u8] {
    match case {
        Case::Stranger { bytes } => bytes,
        Case::Member { body, .. } | Case::Client { body, .. } => body,
    }
}

fn mutate(rng: &mut Rng, parent: &Case, donor: &Case) -> Case {
    let mut case = parent.clone();
    match &mut case {
        Case::Stranger { bytes } => {
            if rng.one_in(4) {
                // A frame of another kind, or a correct hello followed by junk.
                let frames = [
                    Frame::AuthHello { share: [rng.next_u64() as u8; 33] },
                    Frame::AuthProof { proof: [0; 32] },
                    Frame::AuthWelcome { proof: [1; 32] },
                    Frame::Ping(1),
                    Frame::Error { step: 0, message: "x".repeat(rng.below(600)) },
                ];
                *bytes = frame_bytes(&[rng.pick(&frames).clone()]);
            }
            for _ in 0..1 + rng.below(3) {
                mutate_bytes(rng, bytes, case_body(donor));
            }
        }
        Case::Member { http_method, path, auth, body, headers } => match rng.below(6) {
            0 => *http_method = rng.pick(HTTP_METHODS).to_string(),
            1 => {
                *path = match rng.below(4) {
                    0 => format!("/control/{}", rng.pick(METHODS)),
                    1 => format!("/control/{}", "a".repeat(60 + rng.below(10))),
                    // Not /ring/link: that opens a link, which stays open until the server's
                    // owner accepts and reads it (this harness does not), so the call never
                    // ends; links are fuzzed by frame_fuzz and transport/tests/link.rs.
                    2 => rng.pick(&["/", "/control", "/control/", "/control//health", "/x"]).to_string(),
                    _ => format!("/control/health?{}", "q".repeat(rng.below(100))),
                }
            }
            2 => *auth = mutate_auth(rng),
            3 => {
                // Declared lengths that lie, and headers a proxy or attacker might add.
                let value = match rng.below(3) {
                    0 => (BODY_LIMIT + 1).to_string(),
                    1 => u64::MAX.to_string(),
                    _ => rng.below(10).to_string(),
                };
                let choices = [("content-length", value.clone()), ("content-type", "text/plain".into()), ("x-extra", value)];
                let (name, value) = rng.pick(&choices);
                headers.push((name.to_string(), value.clone()));
                headers.truncate(4);
            }
            _ => *body = mutate_body(rng, body, case_body(donor)),
        },
        Case::Client { method, body } => {
            if rng.one_in(3) {
                *method = rng.pick(METHODS).to_string();
            } else {
                *body = mutate_body(rng, body, case_body(donor));
            }
        }
    }
    if rng.one_in(16) {
        // Switch kind, keeping the body: the same bytes through another door.
        let body = case_body(&case).to_vec();
        case = match rng.below(3) {
            0 => Case::Stranger { bytes: body },
            1 => Case::Member { http_method: "POST".into(), path: "/control/health".into(), auth: mutate_auth(rng), body, headers: vec![] },
            _ => Case::Client { method: "health".into(), body },
        };
    }
    case
}

struct Target {
    rt: Runtime,
    addr: SocketAddr,
    secret: ClusterSecret,
    calls: Arc<AtomicU64>,
    /// A member's connection, reopened when a case kills it.
    member: Option<Member>,
    /// The session key of another connection (a member that MACs for the wrong one).
    other: SessionKey,
    /// A standing client: must keep getting answers whatever the cases do.
    witness: ControlClient,
    _server: LinkServer,
}

/// A connection that proved the secret: its session key and the last call number used.
struct Member {
    send: SendRequest<Full<Bytes>>,
    session: SessionKey,
    seq: u64,
}

fn config() -> LinkConfig {
    LinkConfig {
        handshake_timeout: HANDSHAKE_TIMEOUT,
        control_timeout: Duration::from_secs(5),
        // Mutated handshakes now and then hold a wrong proof; the member's connections
        // come from the same address and must not be backed off (tests/guessing.rs
        // covers the back-off).
        auth_backoff: AuthBackoff::off(),
        ..LinkConfig::default()
    }
}

fn handler(calls: Arc<AtomicU64>) -> Arc<dyn ControlHandler> {
    Arc::new(move |method: String, body: Value| {
        calls.fetch_add(1, Ordering::SeqCst);
        async move { Ok(json!({"method": method, "body": body})) }
    })
}

impl Target {
    fn start() -> Target {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let secret = ClusterSecret::new(SECRET).unwrap();
        let calls = Arc::new(AtomicU64::new(0));
        let (server, witness, other) = rt.block_on(async {
            let server =
                LinkServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone(), config(), Some(handler(calls.clone())))
                    .await
                    .unwrap();
            let witness = ControlClient::connect(&server.local_addr().to_string(), &secret, &config()).await.unwrap();
            let other = Target::open_member(server.local_addr(), &secret).await.session;
            (server, witness, other)
        });
        Target { rt, addr: server.local_addr(), secret, calls, member: None, other, witness, _server: server }
    }

    async fn open_member(addr: SocketAddr, secret: &ClusterSecret) -> Member {
        let mut tcp = TcpStream::connect(addr).await.expect("connect");
        let (_, session) = client_handshake(&mut tcp, secret, "fuzz").await.expect("handshake with the right secret");
        let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp)).await.expect("h2");
        tokio::spawn(conn);
        Member { send, session, seq: 0 }
    }
}

/// A stranger's bytes: must be closed on within the handshake deadline.
async fn stranger(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut tcp = TcpStream::connect(addr).await.expect("connect");
    let start = std::time::Instant::now();
    let _ = tcp.write_all(bytes).await;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    let limit = HANDSHAKE_TIMEOUT + CLOSE_SLACK;
    let closed = tokio::time::timeout(limit, async {
        loop {
            match tcp.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&chunk[..n.min(1024)]),
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "a stranger's connection still open after {limit:?}; it got {} bytes", answer.len());
    assert!(answer.len() < 1024, "a stranger got {} bytes of answers", answer.len());
    let fast = start.elapsed() < HANDSHAKE_TIMEOUT / 2;
    // What the server sent: a challenge (a hello got through), a refusal, or nothing.
    let kind = match answer.get(6) {
        Some(17) => "challenge",
        Some(3) => "error frame",
        Some(_) => "other bytes",
        None => "nothing",
    };
    format!("stranger: {kind}, closed {}", if fast { "at once" } else { "at the deadline" })
}

struct Sent {
    status: u16,
    body: Bytes,
}

/// One call on the member's connection. A server that never answers fails the case here
/// (a panic the driver counts) rather than hanging the whole run.
async fn send(member: &mut SendRequest<Full<Bytes>>, req: hyper::Request<Full<Bytes>>) -> Option<Sent> {
    let exchange = async {
        member.ready().await.ok()?;
        let response = member.send_request(req).await.ok()?;
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.ok()?.to_bytes();
        Some(Sent { status, body })
    };
    let limit = HANDSHAKE_TIMEOUT + CLOSE_SLACK;
    tokio::time::timeout(limit, exchange)
        .await
        .unwrap_or_else(|_| panic!("the server did not answer a member's call within {limit:?}"))
}

fn envelope(body: &[u8]) -> Value {
    let v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        // The echo of a body nested just under serde_json's limit, wrapped in the answer and
        // the envelope, is too deep to read back: check its shape, and that the sent body
        // was what made it so (the caller compares the echo only when it could be read).
        Err(e) if e.to_string().contains("recursion limit") && body.starts_with(b"{\"ok\":{") => return json!({"ok": null}),
        Err(e) => panic!("answer is not JSON ({e}): {:?}", String::from_utf8_lossy(body)),
    };
    let ok = v.get("ok").is_some() && v.as_object().is_some_and(|o| o.len() == 1);
    let err = v["error"]["message"].is_string();
    assert!(ok || err, "answer is not a control envelope: {v}");
    v
}

impl Target {
    /// The header value for `auth` on `member`'s connection, and whether it is a correct
    /// MAC of this call.
    fn auth_value(member: &mut Member, other: &SessionKey, auth: &Auth, http_method: &str, path: &str, body: &[u8]) -> (Option<String>, bool) {
        member.seq += 1;
        let seq = member.seq;
        let sign = |session: &SessionKey, seq: u64, body: &[u8]| sign_request(session, seq, http_method, path, body);
        let value = match auth {
            Auth::None => return (None, false),
            Auth::Valid | Auth::Replayed => return (Some(sign(&member.session, seq, body)), true),
            Auth::Zero => sign(&member.session, 0, body),
            Auth::OtherSession => sign(other, seq, body),
            Auth::OtherBody => sign(&member.session, seq, b"{\"other\":1}"),
            Auth::Mangled(edits) => {
                let valid = sign(&member.session, seq, body);
                let mut v = valid.clone().into_bytes();
                edits.iter().for_each(|&e| mutate_bytes(&mut Rng::new(e), &mut v, &[]));
                let v = String::from_utf8_lossy(&v).into_owned();
                let unchanged = v == valid;
                return (Some(v), unchanged);
            }
        };
        (Some(value), false)
    }

    fn member_case(&mut self, http_method: &str, path: &str, auth: &Auth, body: &[u8], headers: &[(String, String)]) -> String {
        let (addr, secret) = (self.addr, self.secret.clone());
        if self.member.is_none() {
            self.member = Some(self.rt.block_on(Target::open_member(addr, &secret)));
        }
        let member = self.member.as_mut().expect("opened");
        let (value, signed_ok) = Target::auth_value(member, &self.other, auth, http_method, path, body);
        let build = |value: &Option<String>| {
            let mut req = hyper::Request::builder().method(http_method).uri(format!("http://{}{path}", self.addr));
            for (k, v) in headers {
                req = req.header(k.as_str(), v.as_str());
            }
            if let Some(v) = value {
                req = req.header(AUTH_HEADER, v.as_str());
            }
            req.body(Full::new(Bytes::copy_from_slice(body))).ok()
        };
        let Some(req) = build(&value) else { return "member: the client refuses to build it".into() };
        let before = self.calls.load(Ordering::SeqCst);
        let sender = &mut member.send;
        let (first, replay) = self.rt.block_on(async {
            let first = send(sender, req).await;
            let replay = match (&first, build(&value)) {
                (Some(_), Some(again)) if matches!(auth, Auth::Replayed) => send(sender, again).await,
                _ => None,
            };
            (first, replay)
        });
        let Some(first) = first else {
            // The server (or hyper, for a header it will not send) ended the connection:
            // legitimate for a link path fed garbage or a lying length; the next case
            // reconnects, and the witness shows the server lives.
            self.member = None;
            assert_eq!(self.calls.load(Ordering::SeqCst), before, "a call on a dying connection reached the handler");
            return "member: connection ended".into();
        };
        assert!(first.status < 500, "status {} for {http_method} {path}: {:?}", first.status, first.body);
        let reached = self.calls.load(Ordering::SeqCst) - before;
        let declared_lie = headers.iter().any(|(k, _)| k == "content-length");
        let control_path = path.starts_with("/control/") && http_method == "POST";
        let method_ok = path.strip_prefix("/control/").is_some_and(|m| {
            (1..=64).contains(&m.len()) && m.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        });
        if signed_ok && control_path && method_ok && !declared_lie && serde_json::from_slice::<Value>(body).is_ok() {
            assert_eq!(first.status, 200, "a correctly signed call was refused: {:?}", first.body);
        }
        if !control_path {
            assert_eq!(reached, 0, "the handler ran for {http_method} {path}");
        }
        if control_path && first.status != 413 && !declared_lie {
            let answer = envelope(&first.body);
            if first.status == 200 {
                assert!(matches!(auth, Auth::Valid | Auth::Replayed | Auth::Mangled(_)), "{auth:?} got 200");
                assert_eq!(reached, 1, "a 200 without the handler");
                let sent: Value = serde_json::from_slice(body).expect("a 200 for a body that is not JSON");
                if answer["ok"].is_null() {
                    assert!(depth(&sent) + ECHO_LEVELS > SERDE_DEPTH, "an answer too deep to read for a body nested {} levels", depth(&sent));
                } else {
                    assert_eq!(answer["ok"]["body"], sent, "the echo differs from what was sent");
                }
            } else {
                assert_eq!(reached, 0, "the handler ran and the answer is {}", first.status);
            }
            if !signed_ok && !matches!(auth, Auth::Mangled(_)) && !declared_lie {
                assert_eq!(first.status, 401, "{auth:?} was not refused as unauthorized: {answer}");
            }
        }
        if let Some(replay) = &replay {
            if first.status == 200 {
                assert_eq!(replay.status, 401, "a replayed call was accepted");
            }
        }
        assert!(reached <= 1, "one call reached the handler {reached} times");
        let path_kind = if control_path { "control" } else { "other" };
        let auth_kind = format!("{auth:?}");
        let auth_kind = auth_kind.split('(').next().unwrap_or_default();
        format!("member {auth_kind} {path_kind} → {}", first.status)
    }

    fn client_case(&self, method: &str, body: &[u8]) -> String {
        let Ok(value) = serde_json::from_slice::<Value>(body) else { return "client: body not JSON".into() };
        let result = self.rt.block_on(self.witness.call(method, &value));
        match result {
            Ok(answer) => {
                assert_eq!(answer, json!({"method": method, "body": value}), "the answer came back changed");
                "client: ok".into()
            }
            Err(transport::Error::Encode(_)) => "client: refused to encode".into(),
            Err(transport::Error::Control { status, .. }) if status == 413 || status == 404 => format!("client: {status}"),
            // The echo wraps the body in two more levels (the answer and the envelope), so a
            // body nested near serde_json's limit comes back too deep to read: a clear error
            // for the caller, as a hostile worker's deep answer would be.
            Err(e @ transport::Error::Control { .. }) if depth(&value) + ECHO_LEVELS > SERDE_DEPTH && e.to_string().contains("recursion limit") => "client: answer too deep".into(),
            Err(e) => panic!("a ControlClient call failed: {e}"),
        }
    }

    fn alive(&self) {
        let answer = self.rt.block_on(self.witness.call("health", &json!({})));
        assert!(answer.is_ok(), "the standing client lost the server: {answer:?}");
    }
}

/// serde_json's nesting limit when reading, and the levels the echo handler and the control
/// envelope add around a body.
const SERDE_DEPTH: usize = 128;
const ECHO_LEVELS: usize = 3;

fn depth(v: &Value) -> usize {
    match v {
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

#[test]
fn ring_server_survives_hostile_peers() {
    let mut target = Target::start();
    // The harness's own sanity: a valid call is answered, a missing signature is refused.
    assert_eq!(target.member_case("POST", "/control/health", &Auth::Valid, b"{}", &[]), "member Valid control → 200");
    assert_eq!(target.member_case("POST", "/control/health", &Auth::None, b"{}", &[]), "member None control → 401");
    let target = std::cell::RefCell::new(target);
    let check = |case: &Case| {
        let mut t = target.borrow_mut();
        let outcome = match case {
            Case::Stranger { bytes } => {
                let before = t.calls.load(Ordering::SeqCst);
                let outcome = t.rt.block_on(stranger(t.addr, bytes));
                assert_eq!(t.calls.load(Ordering::SeqCst), before, "a stranger reached the handler");
                outcome
            }
            Case::Member { http_method, path, auth, body, headers } => t.member_case(http_method, path, auth, body, headers),
            Case::Client { method, body } => t.client_case(method, body),
        };
        t.alive();
        outcome
    };
    let report = fuzz::run("control", &Budget::from_env(1.0), seeds(), STALL, mutate, check);
    assert!(report.outcomes > 8, "the fuzzer reached only {} outcomes: is it mutating?", report.outcomes);
}
