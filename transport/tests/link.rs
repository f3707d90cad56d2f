//! End-to-end over loopback: a real server and client, authenticated, echoing frames.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use common::{config, echo_server, echo_server_with, eof_within, secret, Raw};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use transport::frame::{f16_round_trip, MAGIC, VERSION};
use transport::{Activations, Dtype, Error, Frame, KvOp, Link, TokenMeta};

/// SmolLM2's hidden size: one decode token of the default model.
const SMALL_EMBD: u32 = 576;
/// 256 tokens × 4096 in f32 = 4 MiB, a prompt chunk of a 7B-class model.
const BIG_TOKENS: usize = 256;
const BIG_EMBD: u32 = 4096;

fn activations(step: u64, n_tokens: usize, n_embd: u32, dtype: Dtype) -> Frame {
    Frame::Activations(Activations {
        step,
        round: (step % 3) as u32,
        n_embd,
        dtype,
        tokens: (0..n_tokens)
            .map(|i| TokenMeta { seq: i as u64 % 4, pos: i as u32, wants_logits: i + 1 == n_tokens })
            .collect(),
        hidden: (0..n_tokens * n_embd as usize).map(|i| ((i as u64 + step) as f32 * 0.001).sin() * 8.0).collect(),
        reports: Vec::new(),
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_round_trips_in_order() {
    let s = secret("correct horse battery staple");
    let echo = echo_server(s.clone(), None).await;
    let Link { mut sink, mut stream } = Link::connect(&format!("http://{}", echo.addr), &s, &config()).await.unwrap();

    // KV ops and errors travel in step order with the activations.
    let kv = Frame::KvOps { step: 0, ops: vec![KvOp::Clear { seq: 3 }, KvOp::Truncate { seq: 1, len: 17 }] };
    sink.send(&kv).await.unwrap();
    assert_eq!(stream.recv().await.unwrap(), Some(kv));
    let err = Frame::Error { step: 1, message: "window 2 failed: out of memory".into() };
    sink.send(&err).await.unwrap();
    assert_eq!(stream.recv().await.unwrap(), Some(err));

    const SMALL_FRAMES: u64 = 2000;
    let mut rtts = Vec::with_capacity(SMALL_FRAMES as usize);
    let started = Instant::now();
    for step in 0..SMALL_FRAMES {
        let frame = activations(step, 1, SMALL_EMBD, Dtype::F32);
        let sent = Instant::now();
        sink.send(&frame).await.unwrap();
        let back = stream.recv().await.unwrap().unwrap();
        rtts.push(sent.elapsed());
        assert_eq!(back, frame, "step {step}");
        stream.recycle(back);
    }
    let total = started.elapsed();
    rtts.sort();
    eprintln!(
        "small frame ({} B hidden) round trip over {SMALL_FRAMES} frames: mean {:?}, median {:?}, p99 {:?}, max {:?}",
        SMALL_EMBD * 4,
        total / SMALL_FRAMES as u32,
        percentile(&rtts, 0.5),
        percentile(&rtts, 0.99),
        rtts[rtts.len() - 1]
    );

    for (i, dtype) in [Dtype::F32, Dtype::F16, Dtype::F32, Dtype::F16].into_iter().enumerate() {
        let frame = activations(10_000 + i as u64, BIG_TOKENS, BIG_EMBD, dtype);
        let sent = Instant::now();
        sink.send(&frame).await.unwrap();
        let back = stream.recv().await.unwrap().unwrap();
        let rtt = sent.elapsed();
        let (Frame::Activations(a), Frame::Activations(b)) = (&frame, &back) else { panic!("{back:?}") };
        assert_eq!((a.step, a.round, a.n_embd, a.dtype, &a.tokens), (b.step, b.round, b.n_embd, b.dtype, &b.tokens));
        match dtype {
            Dtype::F32 => assert!(a.hidden == b.hidden, "f32 must be exact"),
            Dtype::F16 => assert!(a.hidden.iter().zip(&b.hidden).all(|(x, y)| f16_round_trip(*x) == *y)),
        }
        let wire_mib = (BIG_TOKENS * BIG_EMBD as usize * dtype.size()) as f64 / (1 << 20) as f64;
        eprintln!("{wire_mib:.0} MiB {dtype:?} frame round trip: {rtt:?}");
        stream.recycle(back);
    }
    assert_eq!(echo.links.load(Ordering::SeqCst), 1, "one connection for every step");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_is_refused_and_cannot_inject() {
    let echo = echo_server(secret("right"), None).await;

    let err = Link::connect(&echo.addr.to_string(), &secret("wrong"), &config()).await.err().unwrap();
    assert!(matches!(err, Error::Auth { .. }), "{err}");
    assert!(err.to_string().contains(&echo.addr.to_string()), "error names the peer: {err}");

    // A client that ignores its failed proof and speaks HTTP/2 anyway.
    let mut tcp = tokio::net::TcpStream::connect(echo.addr).await.unwrap();
    let mut handshake = transport::auth::ClientHandshake::new(&secret("wrong"));
    let hello = Frame::AuthHello { share: handshake.hello() };
    write_frame(&mut tcp, &hello).await;
    let Some(Frame::AuthChallenge { share, server }) = read_frame(&mut tcp).await else { panic!("no challenge") };
    assert_eq!(server, echo.id, "the challenge names the server");
    write_frame(&mut tcp, &Frame::AuthProof { proof: handshake.on_challenge(share, server).unwrap() }).await;
    let refusal = read_frame(&mut tcp).await;
    assert!(matches!(&refusal, Some(Frame::Error { message, .. }) if message.contains("wrong cluster secret")), "{refusal:?}");
    let _ = tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
    assert!(eof_within(&mut tcp, Duration::from_secs(3)).await, "connection closed");

    // One that skips the handshake and speaks HTTP/2 (or an older hearth) at once.
    let mut tcp = tokio::net::TcpStream::connect(echo.addr).await.unwrap();
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    assert!(eof_within(&mut tcp, Duration::from_secs(3)).await, "connection closed");

    // One that opens a connection and says nothing: the server says nothing either, and
    // gives up on it after the handshake timeout.
    let mut idle = tokio::net::TcpStream::connect(echo.addr).await.unwrap();
    assert!(eof_within(&mut idle, Duration::from_secs(5)).await, "unauthenticated idle connection closed");

    assert_eq!(echo.links.load(Ordering::SeqCst), 0, "the handler never saw a link");
    assert_eq!(echo.frames.load(Ordering::SeqCst), 0, "the handler never saw a frame");

    // And the server still serves the right secret.
    let mut link = Link::connect(&echo.addr.to_string(), &secret("right"), &config()).await.unwrap();
    link.sink.send(&Frame::Ping(7)).await.unwrap();
    assert_eq!(link.stream.recv().await.unwrap(), Some(Frame::Ping(7)));
}

async fn write_frame(tcp: &mut tokio::net::TcpStream, frame: &Frame) {
    let mut buf = BytesMut::new();
    transport::encode(frame, &mut buf).unwrap();
    tcp.write_all(&buf).await.unwrap();
}

/// One handshake frame off a raw socket, or `None` if the server closed it.
async fn read_frame(tcp: &mut tokio::net::TcpStream) -> Option<Frame> {
    let mut decoder = transport::FrameDecoder::new(1024);
    let mut buf = BytesMut::new();
    loop {
        if let Some(frame) = decoder.decode(&mut buf).unwrap() {
            return Some(frame);
        }
        let mut chunk = [0u8; 256];
        match tcp.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn header(version: u16, body_len: u32) -> Bytes {
    let mut b = BytesMut::new();
    b.put_slice(&MAGIC);
    b.put_u16_le(version);
    b.put_u8(1);
    b.put_u8(0);
    b.put_u32_le(body_len);
    b.freeze()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_peer_is_disconnected_while_others_keep_working() {
    let s = secret("right");
    let echo = echo_server(s.clone(), None).await;
    let mut good = Link::connect(&echo.addr.to_string(), &s, &config()).await.unwrap();

    let attacks: [(&str, Bytes); 4] = [
        ("garbage", Bytes::from_static(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")),
        ("a 3 GiB length", header(VERSION, 3 << 30)),
        ("a wrong version", header(VERSION + 1, 8)),
        ("a handshake frame after authentication", {
            let mut b = BytesMut::new();
            transport::encode(&Frame::AuthHello { share: [0; 33] }, &mut b).unwrap();
            b.freeze()
        }),
    ];
    for (step, (what, bytes)) in attacks.into_iter().enumerate() {
        let mut bad = Raw::authenticated(echo.addr, &s).await;
        bad.send(&Frame::Ping(1)).await;
        assert_eq!(bad.recv().await, Some(Frame::Ping(1)), "{what}: link works before the attack");
        bad.send_bytes(bytes).await;
        assert!(bad.closed_within(Duration::from_secs(3)).await, "{what}: connection closed");

        let frame = activations(step as u64, 2, SMALL_EMBD, Dtype::F16);
        good.sink.send(&frame).await.unwrap();
        let Some(Frame::Activations(back)) = good.stream.recv().await.unwrap() else { panic!("{what}: no echo") };
        assert_eq!(back.step, step as u64, "{what}: the good link keeps working");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_sees_the_link_end_when_the_client_goes() {
    let s = secret("right");
    let mut server =
        transport::LinkServer::bind("127.0.0.1:0".parse().unwrap(), s.clone(), config(), None).await.unwrap();
    let client = Link::connect(&server.local_addr().to_string(), &s, &config()).await.unwrap();
    let mut link = server.accept().await.unwrap();
    drop(client);
    let end = tokio::time::timeout(Duration::from_secs(3), link.stream.recv()).await.expect("noticed within 3 s");
    assert!(matches!(end, Ok(None) | Err(_)), "{end:?}");
    // Sends are queued, so the first may still be accepted; they must start failing soon.
    let deadline = Instant::now() + Duration::from_secs(3);
    while link.sink.send(&Frame::Ping(1)).await.is_ok() {
        assert!(Instant::now() < deadline, "sends keep succeeding to a gone peer");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failures_name_the_peer_and_time_out() {
    // Nothing listening.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let err = Link::connect(&format!("127.0.0.1:{port}"), &secret("s"), &config()).await.err().unwrap();
    assert!(err.to_string().contains(&format!("127.0.0.1:{port}")), "{err}");

    // A listener that accepts and never speaks.
    let mute = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = mute.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = mute.accept().await {
            held.push(tcp);
        }
    });
    let cfg = transport::LinkConfig { handshake_timeout: Duration::from_millis(500), ..config() };
    // The handshake gives up by itself (the outer bound only keeps a hang from stalling CI).
    let err = tokio::time::timeout(Duration::from_secs(60), Link::connect(&addr.to_string(), &secret("s"), &cfg)).await.expect("the handshake timed out by itself").err().unwrap();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(err.to_string().contains(&addr.to_string()), "{err}");

    let err = Link::connect("https://10.0.0.1:9000", &secret("s"), &config()).await.err().unwrap();
    assert!(matches!(err, Error::Address { .. }), "{err}");
}

/// Forwards one TCP connection to `upstream` until `frozen` is set, then goes silent in
/// both directions, like a worker stopped mid-step (SIGSTOP, a hung machine, a cut cable).
async fn freezable_proxy(upstream: std::net::SocketAddr) -> (std::net::SocketAddr, std::sync::Arc<AtomicBool>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let frozen = std::sync::Arc::new(AtomicBool::new(false));
    let flag = frozen.clone();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let server = tokio::net::TcpStream::connect(upstream).await.unwrap();
        let (cr, cw) = client.into_split();
        let (sr, sw) = server.into_split();
        let pump = |mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf| {
            let frozen = flag.clone();
            async move {
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(n) = from.read(&mut buf).await {
                    if n == 0 || frozen.load(Ordering::SeqCst) {
                        // Hold both halves open and say nothing.
                        std::future::pending::<()>().await;
                    }
                    if to.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        };
        tokio::spawn(pump(cr, sw));
        pump(sr, cw).await;
    });
    (addr, frozen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_peer_is_detected_by_keep_alive() {
    let s = secret("right");
    let echo = echo_server(s.clone(), None).await;
    let (via, frozen) = freezable_proxy(echo.addr).await;
    let cfg = transport::LinkConfig {
        keep_alive_interval: Duration::from_millis(200),
        keep_alive_timeout: Duration::from_millis(300),
        ..config()
    };
    let mut link = Link::connect(&via.to_string(), &s, &cfg).await.unwrap();
    link.sink.send(&Frame::Ping(1)).await.unwrap();
    assert_eq!(link.stream.recv().await.unwrap(), Some(Frame::Ping(1)));

    frozen.store(true, Ordering::SeqCst);
    let started = Instant::now();
    link.sink.send(&Frame::Ping(2)).await.unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(5), link.stream.recv()).await.expect("noticed within 5 s");
    let err = outcome.expect_err("a stalled peer is an error, not a clean end");
    eprintln!("stalled peer noticed after {:?}: {err}", started.elapsed());
    assert!(err.to_string().contains(&via.to_string()), "{err}");
    assert!(link.sink.send(&Frame::Ping(3)).await.is_err(), "sending to a dead link fails");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emulated_hop_delay_holds_every_frame_back() {
    let s = secret("correct horse battery staple");
    let echo = echo_server(s.clone(), None).await;
    let delay = Duration::from_millis(20);
    let slow = transport::LinkConfig { send_delay: delay, ..config() };
    let Link { mut sink, mut stream } = Link::connect(&format!("http://{}", echo.addr), &s, &slow).await.unwrap();
    for step in 0..5 {
        let frame = activations(step, 1, SMALL_EMBD, Dtype::F32);
        let sent = Instant::now();
        sink.send(&frame).await.unwrap();
        assert_eq!(stream.recv().await.unwrap().unwrap(), frame);
        // The echo side sends without delay: one delayed hop per round trip.
        assert!(sent.elapsed() >= delay, "round trip {:?} under the {delay:?} hop", sent.elapsed());
    }
}

/// A stranger's connection from its own loopback address: each address may have only a
/// few handshakes in progress (`transport::backoff`), so a crowd of strangers comes from
/// many (127.0.0.0/8 is all loopback on Linux).
async fn stranger_from(n: usize, server: std::net::SocketAddr) -> tokio::net::TcpStream {
    let per_source = transport::backoff::MAX_PENDING_PER_SOURCE as usize;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("127.0.1.{}:0", 1 + n / per_source).parse().unwrap()).unwrap();
    socket.connect(server).await.unwrap()
}

/// Strangers that connect and say nothing, or trickle a byte now and then, hold no slot that
/// a ring member needs: with more of them open than the server lets wait, a member still
/// authenticates and links, and the oldest stranger is the one turned away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_slow_strangers_do_not_lock_members_out() {
    const IDLE: usize = 64;
    const SLOW: usize = 64;
    let s = secret("right");
    // The server waits long for a handshake, so only eviction can make room during the test.
    let patient = transport::LinkConfig { handshake_timeout: Duration::from_secs(60), ..config() };
    let echo = echo_server_with(s.clone(), None, patient).await;

    let mut idle = Vec::new();
    for n in 0..IDLE {
        idle.push(stranger_from(n, echo.addr).await);
    }
    let mut slow = Vec::new();
    for n in IDLE..IDLE + SLOW {
        let mut tcp = stranger_from(n, echo.addr).await;
        tcp.write_all(b"HR").await.unwrap();
        slow.push(tcp);
    }
    let trickle = tokio::spawn(async move {
        // Each slow stranger sends one more byte of a valid header now and then, and never finishes.
        for byte in b"TH" {
            tokio::time::sleep(Duration::from_millis(300)).await;
            for tcp in &mut slow {
                let _ = tcp.write_all(&[*byte]).await;
            }
        }
        std::future::pending::<()>().await;
        drop(slow);
    });

    let member = async {
        let mut link = Link::connect(&echo.addr.to_string(), &s, &config()).await.unwrap();
        link.sink.send(&Frame::Ping(42)).await.unwrap();
        assert_eq!(link.stream.recv().await.unwrap(), Some(Frame::Ping(42)));
    };
    tokio::time::timeout(Duration::from_secs(10), member).await.expect("a member links within 10 s");

    // The first stranger was evicted to make room; it was never served.
    assert!(eof_within(&mut idle[0], Duration::from_secs(10)).await, "the oldest idle stranger is closed");
    assert_eq!(echo.links.load(Ordering::SeqCst), 1, "only the member's link got through");
    trickle.abort();
}
