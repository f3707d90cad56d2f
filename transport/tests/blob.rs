//! Blob calls (`/blob/<method>`): raw bytes back, signed over exactly those bytes, only for
//! peers that proved the cluster secret.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use common::{config, secret};
use serde_json::{json, Value};
use transport::{BlobHandler, ControlClient, ControlFailure, Error, LinkServer, MAX_BLOB_BYTES};

/// Answers `range {offset, len}` from a fixed buffer, counting the bytes it handed out.
fn ranges(data: Arc<Vec<u8>>, served: Arc<AtomicUsize>) -> Arc<dyn BlobHandler> {
    Arc::new(move |method: String, body: Value| {
        let (data, served) = (data.clone(), served.clone());
        async move {
            if method == "too_big" {
                return Ok(Bytes::from(vec![0u8; MAX_BLOB_BYTES + 1]));
            }
            let offset = body["offset"].as_u64().ok_or_else(|| ControlFailure::bad_request("offset"))? as usize;
            let len = body["len"].as_u64().ok_or_else(|| ControlFailure::bad_request("len"))? as usize;
            let piece = data.get(offset..offset.saturating_add(len)).ok_or_else(|| ControlFailure::bad_request("past the end"))?;
            served.fetch_add(piece.len(), Ordering::SeqCst);
            Ok(Bytes::copy_from_slice(piece))
        }
    })
}

async fn server(data: Arc<Vec<u8>>, served: Arc<AtomicUsize>) -> LinkServer {
    LinkServer::bind_with_blobs("127.0.0.1:0".parse().unwrap(), secret("blob secret"), config(), None, Some(ranges(data, served)))
        .await
        .unwrap()
}

#[tokio::test]
async fn blob_calls_return_the_bytes_asked_for() {
    let data: Arc<Vec<u8>> = Arc::new((0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect());
    let served = Arc::new(AtomicUsize::new(0));
    let server = server(data.clone(), served.clone()).await;
    let client = ControlClient::connect(&server.local_addr().to_string(), &secret("blob secret"), &config()).await.unwrap();
    let piece = client.fetch("range", &json!({"offset": 1_000_000, "len": 1_500_000})).await.unwrap();
    assert_eq!(&piece[..], &data[1_000_000..2_500_000]);
    // A refusal comes back as the handler's status and message.
    match client.fetch("range", &json!({"offset": 2_999_999, "len": 2})).await {
        Err(Error::Control { status: 400, message, .. }) => assert!(message.contains("past the end"), "{message}"),
        other => panic!("expected a 400, got {other:?}"),
    }
    // An answer over the limit is never sent.
    match client.fetch("too_big", &json!({})).await {
        Err(Error::Control { status: 500, .. }) => {}
        other => panic!("expected a 500, got {other:?}"),
    }
    // Control calls on a server without a control handler are unknown, blob calls known.
    match client.call("range", &json!({})).await {
        Err(Error::Control { status: 404, .. }) => {}
        other => panic!("expected a 404, got {other:?}"),
    }
}

#[tokio::test]
async fn a_peer_without_the_secret_gets_no_bytes() {
    let data: Arc<Vec<u8>> = Arc::new(vec![42u8; 1 << 20]);
    let served = Arc::new(AtomicUsize::new(0));
    let server = server(data, served.clone()).await;
    let refused = ControlClient::connect(&server.local_addr().to_string(), &secret("another secret"), &config()).await;
    assert!(refused.is_err(), "a client with another secret connected");
    // A raw request without a signature, on a connection that did prove the secret.
    let (mut member, _) = common::h2::<http_body_util::Full<Bytes>>(server.local_addr(), &secret("blob secret")).await;
    let request = hyper::Request::post(format!("http://{}/blob/range", server.local_addr()))
        .body(http_body_util::Full::new(Bytes::from_static(br#"{"offset":0,"len":10}"#)))
        .unwrap();
    let response = member.send_request(request).await.unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(served.load(Ordering::SeqCst), 0, "bytes were handed out to an unauthenticated call");
}
