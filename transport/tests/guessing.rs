//! Online guessing of the cluster secret against a real ring server on loopback: failed
//! handshakes from one address are refused after a few, with a reason and a wait, however
//! fast the guesser loops, and so are too many handshakes in progress from one address;
//! a member on another address still gets in at once. (127.0.0.2 is a second source on
//! Linux's loopback, no set-up needed.)

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{config, echo_server_with, secret};
use tokio::net::{TcpSocket, TcpStream};
use transport::backoff::MAX_PENDING_PER_SOURCE;
use transport::link::client_handshake;
use transport::{AuthBackoff, ClusterSecret, ControlClient, Error, Link, LinkConfig};

/// A first wait far longer than the test: refusals do not depend on how fast it runs.
fn backoff() -> AuthBackoff {
    AuthBackoff { first: Duration::from_secs(600), ..AuthBackoff::default() }
}

/// The handshake with `s` from `source`'s address: the server's answer.
async fn handshake_from(source: &str, server: SocketAddr, s: &ClusterSecret) -> Result<(), Error> {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    let mut tcp = socket.connect(server).await.unwrap();
    client_handshake(&mut tcp, s, source).await.map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_handshakes_from_one_source_are_backed_off_and_others_still_get_in() {
    let right = secret("right");
    let cfg = LinkConfig { auth_backoff: backoff(), ..config() };
    let echo = echo_server_with(right.clone(), None, cfg.clone()).await;
    let addr = echo.addr.to_string();

    // A guesser in a bounded loop, through both doors (control client and link).
    let (mut told_wrong, mut backed_off) = (0, 0);
    for i in 0..40 {
        let guess = secret(&format!("guess {}", i % 4));
        let err = if i % 2 == 0 {
            ControlClient::connect(&addr, &guess, &cfg).await.err().unwrap()
        } else {
            Link::connect(&addr, &guess, &cfg).await.err().unwrap()
        };
        let text = err.to_string();
        assert!(matches!(err, Error::Auth { .. }), "{text}");
        if text.contains("too many failed handshakes") && text.contains("retry in") {
            backed_off += 1;
        } else if text.contains("wrong cluster secret") {
            told_wrong += 1;
        } else {
            panic!("neither a wrong secret nor a back-off: {text}");
        }
    }
    let free = backoff().free_failures;
    assert_eq!(told_wrong, free + 1, "guesses tested before the back-off");
    assert_eq!(backed_off, 40 - free - 1);

    // The source is refused even with the right secret until its wait is over ...
    let err = ControlClient::connect(&addr, &right, &cfg).await.err().unwrap();
    assert!(err.to_string().contains("too many failed handshakes"), "{err}");
    // ... while a member on another address is accepted at once, link and control.
    handshake_from("127.0.0.2", echo.addr, &right).await.expect("a member on another address");
    assert!(matches!(handshake_from("127.0.0.2", echo.addr, &secret("guess")).await, Err(Error::Auth { .. })));
    handshake_from("127.0.0.2", echo.addr, &right).await.expect("one failure is free");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_source_holds_few_handshakes_in_progress() {
    let right = secret("right");
    let cfg = LinkConfig { handshake_timeout: Duration::from_secs(30), ..config() };
    let echo = echo_server_with(right.clone(), None, cfg.clone()).await;
    // Connections that say nothing hold their places until the handshake deadline.
    let mut silent = Vec::new();
    for _ in 0..MAX_PENDING_PER_SOURCE {
        silent.push(TcpStream::connect(echo.addr).await.unwrap());
    }
    // Give the server time to take them in (it admits in accept order).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let err = ControlClient::connect(&echo.addr.to_string(), &right, &cfg).await.err().unwrap();
    assert!(err.to_string().contains("too many handshakes in progress"), "{err}");
    handshake_from("127.0.0.2", echo.addr, &right).await.expect("another address is not held up");
    drop(silent);
    // Once they are gone the source is welcome again.
    let mut joined = false;
    for _ in 0..50 {
        if ControlClient::connect(&echo.addr.to_string(), &right, &cfg).await.is_ok() {
            joined = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(joined, "the source stayed refused after its connections closed");
}
