//! Shared pieces of the loopback tests: an echo ring member and a raw HTTP/2 client that
//! can say things the real client never would.

#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper::body::{Body, Frame as BodyFrame, Incoming};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::mpsc;
use transport::frame::DEFAULT_MAX_FRAME_BYTES;
use transport::link::client_handshake;
use transport::{encode, ClusterSecret, ControlHandler, Frame, FrameDecoder, LinkConfig, LinkServer, PeerId, SessionKey};

pub fn secret(s: &str) -> ClusterSecret {
    ClusterSecret::new(s).unwrap()
}

/// Short timeouts so refusal paths finish quickly.
pub fn config() -> LinkConfig {
    LinkConfig { handshake_timeout: Duration::from_secs(2), ..LinkConfig::default() }
}

/// A server that echoes every frame of every authenticated link, counting what it saw.
pub struct Echo {
    pub addr: SocketAddr,
    pub id: PeerId,
    pub links: Arc<AtomicUsize>,
    pub frames: Arc<AtomicUsize>,
}

pub async fn echo_server(secret: ClusterSecret, control: Option<Arc<dyn ControlHandler>>) -> Echo {
    echo_server_with(secret, control, config()).await
}

pub async fn echo_server_with(
    secret: ClusterSecret,
    control: Option<Arc<dyn ControlHandler>>,
    config: LinkConfig,
) -> Echo {
    let mut server = LinkServer::bind("127.0.0.1:0".parse().unwrap(), secret, config, control).await.unwrap();
    let echo = Echo {
        addr: server.local_addr(),
        id: server.id(),
        links: Arc::new(AtomicUsize::new(0)),
        frames: Arc::new(AtomicUsize::new(0)),
    };
    let (links, frames) = (echo.links.clone(), echo.frames.clone());
    tokio::spawn(async move {
        while let Some(link) = server.accept().await {
            links.fetch_add(1, Ordering::SeqCst);
            let frames = frames.clone();
            tokio::spawn(async move {
                let (mut sink, mut stream) = (link.sink, link.stream);
                while let Ok(Some(frame)) = stream.recv().await {
                    frames.fetch_add(1, Ordering::SeqCst);
                    if sink.send(&frame).await.is_err() {
                        break;
                    }
                    stream.recycle(frame);
                }
            });
        }
    });
    echo
}

pub struct ChannelBody(pub mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<BodyFrame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|c| c.map(|b| Ok(BodyFrame::data(b))))
    }
}

/// A hand-driven link: raw bytes out, decoded frames in.
pub struct Raw {
    tx: mpsc::Sender<Bytes>,
    body: Incoming,
    buf: BytesMut,
    decoder: FrameDecoder,
}

/// A raw HTTP/2 connection after a real handshake with `secret`, and its session key.
pub async fn h2<B>(addr: SocketAddr, secret: &ClusterSecret) -> (SendRequest<B>, SessionKey)
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (_, session) = client_handshake(&mut tcp, secret, &addr.to_string()).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp)).await.unwrap();
    tokio::spawn(conn);
    (send, session)
}

/// Whether the server closes `tcp` within `limit` (whatever it sends first is ignored).
pub async fn eof_within(tcp: &mut tokio::net::TcpStream, limit: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    tokio::time::timeout(limit, async {
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

impl Raw {
    /// Opens a link stream by hand on a connection that proved `secret`.
    pub async fn authenticated(addr: SocketAddr, secret: &ClusterSecret) -> Raw {
        let (mut send, _) = h2(addr, secret).await;
        let (tx, rx) = mpsc::channel(16);
        let request = hyper::Request::post(format!("http://{addr}/ring/link")).body(ChannelBody(rx)).unwrap();
        let response = send.send_request(request).await.unwrap();
        Raw {
            tx,
            body: response.into_body(),
            buf: BytesMut::new(),
            decoder: FrameDecoder::new(DEFAULT_MAX_FRAME_BYTES),
        }
    }

    pub async fn send(&self, frame: &Frame) {
        let mut buf = BytesMut::new();
        encode(frame, &mut buf).unwrap();
        self.send_bytes(buf.freeze()).await;
    }

    pub async fn send_bytes(&self, bytes: Bytes) {
        let _ = self.tx.send(bytes).await;
    }

    /// The next frame, or `None` once the server has ended the stream or the connection.
    pub async fn recv(&mut self) -> Option<Frame> {
        loop {
            if let Some(frame) = self.decoder.decode(&mut self.buf).unwrap() {
                return Some(frame);
            }
            let body = &mut self.body;
            match std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk.into_data().unwrap_or_default()),
                _ => return None,
            }
        }
    }

    /// Whether the server closes this link within `limit`, frames still in flight aside.
    pub async fn closed_within(&mut self, limit: Duration) -> bool {
        tokio::time::timeout(limit, async { while self.recv().await.is_some() {} }).await.is_ok()
    }
}
