//! What recycling received frames saves per hop, measured: the codec alone and a real
//! link over loopback, each with and without handing frames back, counting the process's
//! allocations. The ring recycles on its hot path (the head and each worker hand a frame
//! back once it is sent on), so every decode after the first reuses buffers. The figures
//! are printed (`--nocapture`); only the saving itself, which does not depend on the
//! machine's speed, is asserted.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use common::{config, secret};
use transport::{encode, Activations, Dtype, Frame, FrameDecoder, Link, LinkServer, TokenMeta};

/// Counts every allocation of the process (all threads: the link's runtime included).
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const FRAMES: usize = 10_000;
/// One decode token of a 70B-class model (n_embd 8192) in f32: 32 KiB per hop.
const N_EMBD: u32 = 8192;

fn decode_token(step: u64) -> Frame {
    Frame::Activations(Activations {
        step,
        round: 0,
        n_embd: N_EMBD,
        dtype: Dtype::F32,
        tokens: vec![TokenMeta { seq: 1, pos: step as u32, wants_logits: true }],
        hidden: (0..N_EMBD).map(|i| (i as f32 * 0.001).sin()).collect(),
        reports: Vec::new(),
    })
}

/// Allocations and bytes allocated over `FRAMES` frames, and the time they took.
struct Cost {
    allocs: u64,
    bytes: u64,
    time: Duration,
}

/// Starts counting; `Meter::stop` gives the cost since.
struct Meter(u64, u64, Instant);

impl Meter {
    fn start() -> Meter {
        Meter(ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst), Instant::now())
    }

    fn stop(self) -> Cost {
        let time = self.2.elapsed();
        Cost { allocs: ALLOCS.load(Ordering::SeqCst) - self.0, bytes: BYTES.load(Ordering::SeqCst) - self.1, time }
    }
}

fn print(what: &str, recycle: bool, c: &Cost) {
    let how = if recycle { "recycled" } else { "fresh   " };
    let n = FRAMES as f64;
    eprintln!("{what} {how}: {:.2} allocations, {:.0} bytes allocated, {:?} per frame", c.allocs as f64 / n, c.bytes as f64 / n, c.time / FRAMES as u32);
}

/// The decoder alone: the same encoded frame decoded `FRAMES` times.
fn codec(recycle: bool) -> Cost {
    let mut bytes = BytesMut::new();
    encode(&decode_token(0), &mut bytes).unwrap();
    let wire = bytes.freeze();
    let mut dec = FrameDecoder::new(transport::frame::DEFAULT_MAX_FRAME_BYTES);
    let mut buf = BytesMut::with_capacity(wire.len());
    let meter = Meter::start();
    for _ in 0..FRAMES {
        buf.extend_from_slice(&wire);
        let frame = dec.decode(&mut buf).unwrap().unwrap();
        if recycle {
            dec.recycle(frame);
        }
    }
    meter.stop()
}

/// A round trip through an echo member over loopback, both ends recycling or neither.
async fn link(recycle: bool) -> Cost {
    let s = secret("recycle");
    let mut server = LinkServer::bind("127.0.0.1:0".parse().unwrap(), s.clone(), config(), None).await.unwrap();
    let addr = server.local_addr();
    tokio::spawn(async move {
        let Some(Link { mut sink, mut stream }) = server.accept().await else { return };
        while let Ok(Some(frame)) = stream.recv().await {
            if sink.send(&frame).await.is_err() {
                break;
            }
            if recycle {
                stream.recycle(frame);
            }
        }
    });
    let Link { mut sink, mut stream } = Link::connect(&addr.to_string(), &s, &config()).await.unwrap();
    // Warm up: the connection's buffers grow to a frame's size once.
    let frame = decode_token(0);
    for _ in 0..100 {
        sink.send(&frame).await.unwrap();
        stream.recv().await.unwrap().unwrap();
    }
    let meter = Meter::start();
    let mut frame = decode_token(1);
    for _ in 0..FRAMES {
        sink.send(&frame).await.unwrap();
        let back = stream.recv().await.unwrap().unwrap();
        assert_eq!(back, frame);
        if recycle {
            // As the ring's head does: what went out is what the next frame decodes into.
            stream.recycle(std::mem::replace(&mut frame, back));
        } else {
            frame = back;
        }
    }
    meter.stop()
}

#[test]
fn recycling_saves_the_decoders_allocations() {
    let hidden_bytes = u64::from(N_EMBD) * 4;
    let frames = FRAMES as u64;
    let fresh = codec(false);
    let recycled = codec(true);
    print("codec", false, &fresh);
    print("codec", true, &recycled);
    // Without recycling every decode allocates its hidden state; with it only the first
    // does (a frame's buffers, a little more than its hidden state).
    assert!(fresh.bytes >= frames * hidden_bytes, "{} bytes for {FRAMES} fresh decodes", fresh.bytes);
    assert!(recycled.bytes < 2 * hidden_bytes, "{} bytes for {FRAMES} recycled decodes", recycled.bytes);

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let fresh = rt.block_on(link(false));
    let recycled = rt.block_on(link(true));
    print("loopback round trip", false, &fresh);
    print("loopback round trip", true, &recycled);
    // Two decodes per round trip (the echo's and ours); recycling spares both hidden
    // states. Half of that is the bar, so the link's own allocations cannot hide it.
    assert!(fresh.bytes.saturating_sub(recycled.bytes) >= frames * hidden_bytes, "{} vs {} bytes for {FRAMES} round trips", fresh.bytes, recycled.bytes);
}
