//! Structure-aware fuzzing of the frame codec: valid encoded frames (every kind) mutated
//! field by field (header length, kind, version, flags; activations' counts, dtype,
//! reserved bytes and token flags; kv-op counts and codes; error text), then fed to a
//! decoder in random chunks, as a hostile or broken peer's bytes arrive.
//!
//! Promises checked: the decoder never panics or stalls; it never buffers more than the
//! frame limit allows; cutting the same bytes into other chunks gives the same frames and
//! the same verdict; a frame it accepts re-encodes to exactly the bytes it came from (f32
//! payloads; f16 values are not bit-exact by design). `HEARTH_FUZZ_SECS=600` runs it for
//! ten minutes (see docs/robustness.md).

#[path = "../../tests/fuzz_driver.rs"]
mod fuzz;

use std::time::Duration;

use bytes::BytesMut;
use fuzz::{mutate_bytes, shape, Budget, Rng};
use transport::frame::{HEADER_LEN, MAGIC, VERSION};
use transport::{encode, Activations, Dtype, Frame, FrameDecoder, KvOp, StageReport, TokenMeta};

/// Decoding a few kilobytes takes microseconds.
const STALL: Duration = Duration::from_secs(5);
/// Small enough that mutants announcing bigger frames hit the limit, big enough for every
/// seed frame.
const LIMITS: [usize; 3] = [64, 4096, 1 << 20];
/// Frame kinds as the wire spells them (frame.rs's layout comment); 0 and 99 are unknown.
const KINDS: [u8; 11] = [1, 2, 3, 4, 5, 16, 17, 18, 19, 0, 99];
/// Offsets in an activations body (frame.rs's layout comment).
const ACT_N_TOKENS: usize = 12;
const ACT_N_EMBD: usize = 16;
const ACT_DTYPE: usize = 20;
const ACT_N_REPORTS: usize = 21;
const ACT_RESERVED: usize = 22;
const ACT_TOKENS: usize = 24;
const TOKEN_LEN: usize = 16;

#[derive(Clone, Debug)]
struct Case {
    wire: Vec<u8>,
    /// Bytes per read, as TCP might split them.
    chunk: usize,
    limit: usize,
}

fn seed_frames() -> Vec<Frame> {
    let acts = |dtype, n_tokens: usize, n_embd: u32, n_reports: usize| {
        Frame::Activations(Activations {
            step: 3,
            round: 1,
            n_embd,
            dtype,
            tokens: (0..n_tokens).map(|i| TokenMeta { seq: i as u64, pos: i as u32, wants_logits: i == 0 }).collect(),
            hidden: (0..n_tokens * n_embd as usize).map(|i| i as f32 - 2.5).collect(),
            reports: vec![StageReport { compute_us: 9, read_bytes: 1 << 20, prefetch_bytes: 5 }; n_reports],
        })
    };
    vec![
        acts(Dtype::F32, 2, 3, 1),
        acts(Dtype::F16, 3, 4, 0),
        acts(Dtype::F32, 1, 1, 2),
        Frame::KvOps { step: 7, ops: vec![KvOp::Clear { seq: 1 }, KvOp::Truncate { seq: 2, len: 5 }, KvOp::Copy { seq: 3, from: 1, len: 300 }] },
        Frame::KvOps { step: 0, ops: vec![] },
        Frame::Rows { step: 8, seq: 2, at: 256, n: 256, write: true, state: false, key: [7; 32], parts: vec![vec![1, 2, 3], vec![], vec![9; 40]] },
        Frame::Rows { step: 9, seq: 0, at: 0, n: 64, write: false, state: true, key: [0; 32], parts: vec![] },
        Frame::Error { step: 4, message: "stage failed: ünïcode".into() },
        Frame::Ping(11),
        Frame::Pong(12),
        Frame::AuthHello { share: [1; 33] },
        Frame::AuthProof { proof: [2; 32] },
        Frame::AuthWelcome { proof: [3; 32] },
    ]
}

fn encoded(frames: &[Frame]) -> Vec<u8> {
    let mut buf = BytesMut::new();
    frames.iter().for_each(|f| encode(f, &mut buf).expect("seed frame encodes"));
    buf.to_vec()
}

fn set_u32(bytes: &mut [u8], at: usize, v: u32) {
    if let Some(field) = bytes.get_mut(at..at + 4) {
        field.copy_from_slice(&v.to_le_bytes());
    }
}

fn body_len(wire: &[u8]) -> Option<u32> {
    wire.get(8..12).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Makes the first frame's header length match its body again, so a mutation inside the
/// body is judged by the body parser rather than refused for a length mismatch.
fn fix_len(wire: &mut [u8]) {
    if wire.len() >= HEADER_LEN {
        let body = (wire.len() - HEADER_LEN) as u32;
        set_u32(wire, 8, body);
    }
}

/// Mutates a field of the first frame, or its framing.
fn mutate_fields(rng: &mut Rng, wire: &mut Vec<u8>) {
    let kind = wire.get(6).copied();
    let body = HEADER_LEN;
    match rng.below(10) {
        0 => {
            if let Some(b) = wire.get_mut(6) {
                *b = *rng.pick(&KINDS);
            }
        }
        1 => {
            let len = body_len(wire).unwrap_or(0);
            let lie = match rng.below(3) {
                0 => len.wrapping_add(1),
                1 => len.wrapping_sub(1),
                _ => rng.interesting_u64() as u32,
            };
            set_u32(wire, 8, lie);
        }
        2 => {
            let v = *rng.pick(&[0, 1, VERSION - 1, VERSION + 1, u16::MAX]);
            if let Some(field) = wire.get_mut(4..6) {
                field.copy_from_slice(&v.to_le_bytes());
            }
        }
        3 => {
            if let Some(b) = wire.get_mut(7) {
                *b = 1 << rng.below(8);
            }
        }
        4 | 5 if kind == Some(1) => {
            // Activations: one count or code made to lie, the body length kept or fixed.
            let at = body + *rng.pick(&[ACT_N_TOKENS, ACT_N_EMBD, ACT_DTYPE, ACT_N_REPORTS, ACT_RESERVED]);
            match at - body {
                ACT_DTYPE | ACT_N_REPORTS | ACT_RESERVED => {
                    if let Some(b) = wire.get_mut(at) {
                        *b = *rng.pick(&[0, 1, 2, 3, 255]);
                    }
                }
                _ => set_u32(wire, at, rng.interesting_u64() as u32),
            }
            if rng.one_in(2) {
                // A token's flags given an unknown bit.
                set_u32(wire, body + ACT_TOKENS + 12, 1 << rng.below(32));
            }
        }
        4 | 5 if kind == Some(2) => {
            // KvOps: the count, or one op's code.
            if rng.one_in(2) {
                set_u32(wire, body + 8, rng.interesting_u64() as u32);
            } else if let Some(b) = wire.get_mut(body + 12) {
                *b = rng.below(4) as u8;
            }
        }
        4 | 5 if kind == Some(6) => {
            // Rows: the write or state flag, the part count, or the first part's length.
            match rng.below(3) {
                0 => {
                    if let Some(b) = wire.get_mut(body + 24 + rng.below(2)) {
                        *b = *rng.pick(&[2, 255]);
                    }
                }
                1 => set_u32(wire, body + 60, rng.interesting_u64() as u32),
                _ => {
                    if let Some(f) = wire.get_mut(body + 64..body + 72) {
                        f.copy_from_slice(&rng.interesting_u64().to_le_bytes());
                    }
                }
            }
        }
        4 | 5 if kind == Some(3) => {
            // Error text: invalid UTF-8 or cut inside a character.
            let end = wire.len();
            match rng.below(2) {
                0 => wire.push(0xFF),
                _ => wire.truncate(end - 1),
            }
            fix_len(wire);
        }
        6 => {
            // The body grown or shrunk with the header kept honest.
            let n = 1 + rng.below(TOKEN_LEN * 2);
            if rng.one_in(2) {
                let at = HEADER_LEN + rng.below(wire.len().saturating_sub(HEADER_LEN) + 1);
                let at = at.min(wire.len());
                wire.splice(at..at, std::iter::repeat_n(0u8, n));
            } else {
                wire.truncate(wire.len().saturating_sub(n).max(HEADER_LEN));
            }
            fix_len(wire);
        }
        _ => {
            mutate_bytes(rng, wire, &[]);
            if rng.one_in(2) {
                fix_len(wire);
            }
        }
    }
}

fn mutate(rng: &mut Rng, parent: &Case, donor: &Case) -> Case {
    let mut case = parent.clone();
    match rng.below(8) {
        0 => case.chunk = 1 + rng.below(64),
        1 => case.limit = *rng.pick(&LIMITS),
        2 => {
            // A valid frame first, then the mutant: the stream must yield the first intact.
            let mut first = encoded(&[rng.pick(&seed_frames()).clone()]);
            first.extend_from_slice(&donor.wire);
            case.wire = first;
        }
        3 => mutate_bytes(rng, &mut case.wire, &donor.wire),
        _ => {
            for _ in 0..1 + rng.below(2) {
                mutate_fields(rng, &mut case.wire);
            }
        }
    }
    case
}

/// What a decoder made of a byte stream: the frames, then how it stopped (an error's
/// kind, or waiting for more bytes), and the most the buffer ever held.
fn decode(wire: &[u8], chunk: usize, limit: usize) -> (Vec<Frame>, String, usize) {
    let mut decoder = FrameDecoder::new(limit);
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    let mut most = 0;
    for piece in wire.chunks(chunk.max(1)) {
        buf.extend_from_slice(piece);
        loop {
            let result = decoder.decode(&mut buf);
            most = most.max(buf.capacity());
            match result {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => break,
                // The variant only: garbage is refused at its first bytes, so which bytes a
                // bad-magic error quotes depends on how the stream was cut.
                Err(e) => return (frames, format!("error: {}", variant(&e)), most),
            }
        }
    }
    let end = if buf.is_empty() { "clean end".to_string() } else { "waiting for more".to_string() };
    (frames, end, most)
}

/// An error's kind. A malformed body is judged whole, so its reason is the same however
/// the stream was cut; header errors are judged on the bytes so far, so only their variant
/// is stable (a bad magic quotes however many bytes had arrived).
fn variant(e: &transport::Error) -> String {
    match e {
        transport::Error::Malformed { .. } => shape(&e.to_string()),
        other => format!("{other:?}").split(|c: char| !c.is_alphanumeric()).next().unwrap_or_default().to_string(),
    }
}

fn check(case: &Case) -> String {
    let (frames, end, most) = decode(&case.wire, case.chunk, case.limit);
    // Growth is bounded by the limit (a frame over it is refused from its header), plus what
    // the chunks themselves brought in.
    let bound = 2 * (case.limit + case.wire.len()) + 4096;
    assert!(most <= bound, "buffer grew to {most} bytes for {} input bytes, limit {}", case.wire.len(), case.limit);

    let (whole, whole_end, _) = decode(&case.wire, case.wire.len().max(1), case.limit);
    // As Debug text: a NaN hidden value is not equal to itself, but prints alike.
    assert_eq!(format!("{frames:?}"), format!("{whole:?}"), "chunking changed the frames");
    assert_eq!(end, whole_end, "chunking changed the verdict");

    // Every accepted frame re-encodes to its own bytes (f32 payloads are bit-exact).
    let mut at = 0;
    for frame in &frames {
        let mut again = BytesMut::new();
        encode(frame, &mut again).unwrap_or_else(|e| panic!("a decoded frame does not encode: {e}"));
        let half = matches!(frame, Frame::Activations(a) if a.dtype == Dtype::F16);
        if !half {
            assert_eq!(&again[..], &case.wire[at..at + again.len()], "re-encoding differs");
        }
        at += again.len();
    }
    // How the stream ended, after none, one or more frames of which the last is named: a
    // longer stream of the same frames is not a new outcome.
    let before = match frames.as_slice() {
        [] => "no frame".to_string(),
        [only] => format!("one {}", only.kind_name()),
        [.., last] => format!("frames, the last {}", last.kind_name()),
    };
    format!("{before}, then {end}")
}

#[test]
fn frame_decoder_survives_hostile_streams() {
    let seeds: Vec<Case> = seed_frames()
        .iter()
        .map(|f| Case { wire: encoded(std::slice::from_ref(f)), chunk: 7, limit: 4096 })
        .chain([Case { wire: encoded(&seed_frames()), chunk: 13, limit: 1 << 20 }])
        .collect();
    for s in &seeds {
        assert!(check(s).ends_with("clean end"), "a seed fails to decode: {}", check(s));
    }
    assert_eq!(&seeds[0].wire[..4], &MAGIC);
    let report = fuzz::run("frame", &Budget::from_env(1.0), seeds, STALL, mutate, check);
    assert!(report.outcomes > 20, "the fuzzer reached only {} outcomes: is it mutating?", report.outcomes);
}
