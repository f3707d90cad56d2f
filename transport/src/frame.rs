//! The ring's binary frame and its codec.
//!
//! Every frame is a fixed 12-byte header followed by a body; all integers are little-endian:
//!
//! ```text
//! header      magic "HRTH" | version u16 | kind u8 | flags u8 (reserved, 0) | body_len u32
//! Activations step u64 | round u32 | n_tokens u32 | n_embd u32 | dtype u8 | n_reports u8
//!             | 2 reserved bytes
//!             n_tokens × (seq u64 | pos u32 | token flags u32, bit 0 = wants logits)
//!             n_tokens × n_embd hidden values in dtype (f32 or f16), token-major
//!             n_reports × (compute_us u32 | read_bytes u64 | prefetch_bytes u64)
//! KvOps       step u64 | count u32 | count × (op u8 | seq u64 | len u32 | from u64)
//! Rows        step u64 | seq u64 | at u32 | n u32 | write u8 | state u8 | 2 reserved bytes
//!             | key: 32-byte block id | count u32 | count × (len u64 | len bytes)
//! Error       step u64 | UTF-8 message (the rest of the body)
//! Ping, Pong  u64
//! Auth*       Hello: 33-byte key share; Challenge: key share and 16-byte server id;
//!             Proof, Welcome: 32-byte proof (the connection's handshake before HTTP/2,
//!             see `auth`)
//! ```
//!
//! The header's length tells a reader the whole frame size before any body arrives, so a
//! frame over the limit is refused before a byte of it is buffered. Every count in a body is
//! checked against that length, so a frame can never make the decoder allocate more than it
//! announced and the limit allowed.

use bytes::{Buf, BufMut, BytesMut};
use half::{f16, slice::HalfFloatSliceExt};

use crate::auth::{KeyShare, PeerId, Proof, KEY_SHARE_LEN, PEER_ID_LEN};
use crate::error::{Error, Result};

pub const MAGIC: [u8; 4] = *b"HRTH";
/// Bumped on any change to the layout above, or to what a connection means after its
/// handshake; peers of different versions refuse each other. 9: control calls MACed with
/// the connection's session key (issue 61): an 8 would pass the handshake and then have
/// every call refused, so it is refused at its first frame, saying why.
pub const VERSION: u16 = 9;
pub const HEADER_LEN: usize = 12;
/// The biggest batch we expect is a 2048-token prompt chunk of a 70B-class model
/// (n_embd 8192) in f32: 64 MiB. Four times that leaves room without letting a buggy peer
/// make a node buffer gigabytes.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 256 << 20;

const ACTIVATIONS_FIXED_LEN: u64 = 24;
const TOKEN_LEN: u64 = 16;
const REPORT_LEN: u64 = 20;
/// One report per member a frame passes; a home ring has a handful.
pub const MAX_REPORTS: usize = u8::MAX as usize;
const KV_OPS_FIXED_LEN: u64 = 12;
const KV_OP_LEN: u64 = 21;
const ROWS_FIXED_LEN: u64 = 64;
const ROWS_PART_LEN: u64 = 8;
const WANTS_LOGITS: u32 = 1;

const KIND_ACTIVATIONS: u8 = 1;
const KIND_KV_OPS: u8 = 2;
const KIND_ERROR: u8 = 3;
const KIND_PING: u8 = 4;
const KIND_PONG: u8 = 5;
const KIND_ROWS: u8 = 6;
// Handshake kinds sit apart so application kinds can grow without renumbering.
const KIND_AUTH_HELLO: u8 = 16;
const KIND_AUTH_CHALLENGE: u8 = 17;
const KIND_AUTH_PROOF: u8 = 18;
const KIND_AUTH_WELCOME: u8 = 19;

const OP_CLEAR: u8 = 0;
const OP_TRUNCATE: u8 = 1;
const OP_CHECKPOINT: u8 = 2;
const OP_COPY: u8 = 3;

/// How hidden states travel on the wire; in memory they are always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Dtype {
    #[default]
    F32,
    /// Halves the bytes per hop at the cost of f16 precision (about 3 decimal digits).
    F16,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 => 2,
        }
    }

    fn code(self) -> u8 {
        match self {
            Dtype::F32 => 0,
            Dtype::F16 => 1,
        }
    }

    fn from_code(code: u8) -> Result<Self> {
        match code {
            0 => Ok(Dtype::F32),
            1 => Ok(Dtype::F16),
            other => Err(Error::malformed("activations", format!("unknown dtype {other}"))),
        }
    }
}

/// One token of a batch: which sequence it belongs to, where, and whether the head needs
/// its logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenMeta {
    pub seq: u64,
    pub pos: u32,
    pub wants_logits: bool,
}

/// One micro-batch's hidden states between two windows of the model.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Activations {
    pub step: u64,
    /// Which trip around the ring this is (0-based): a step goes round once per window.
    pub round: u32,
    pub n_embd: u32,
    pub dtype: Dtype,
    pub tokens: Vec<TokenMeta>,
    /// `tokens.len() × n_embd` values, token-major.
    pub hidden: Vec<f32>,
    /// One per worker the frame passed this round, in ring order (the head sends none):
    /// what the ring's own timing cannot tell the head, which sees only the round trip.
    pub reports: Vec<StageReport>,
}

/// What one ring member did with an activations frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct StageReport {
    /// Time its window computed (0 for a relay), in microseconds: the rest of the round
    /// trip is hops.
    pub compute_us: u32,
    /// Bytes it read from disk while computing: page faults on the critical path.
    pub read_bytes: u64,
    /// Bytes it read ahead while waiting for this frame, overlapped with other devices.
    pub prefetch_bytes: u64,
}

impl Activations {
    /// Adds this member's report; a frame already carrying `MAX_REPORTS` keeps its own.
    pub fn report(&mut self, r: StageReport) {
        if self.reports.len() < MAX_REPORTS {
            self.reports.push(r);
        }
    }
}

/// A KV-cache operation. They travel in-band so every device applies them at the same point
/// in the step order as the head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvOp {
    Clear {
        seq: u64,
    },
    /// Keep positions `0..len` of the sequence, drop the rest (a model with recurrent
    /// layers keeps less: back to its last checkpoint at or before `len`).
    Truncate {
        seq: u64,
        len: u32,
    },
    /// Copy the sequence's recurrent state at its current length (models with recurrent
    /// layers), for a later `Truncate` to return to.
    Checkpoint {
        seq: u64,
    },
    /// Give sequence `seq` the first `len` positions of sequence `from`, whatever `seq`
    /// held (a prompt starting with another sequence's prefix; models without recurrent
    /// layers: with them nothing is copied, on every member alike).
    Copy {
        seq: u64,
        from: u64,
        len: u32,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    Activations(Activations),
    KvOps {
        step: u64,
        ops: Vec<KvOp>,
    },
    /// K/V rows of positions `at..at + n` of a sequence as the head's prompt-cache block
    /// `key`: each worker keeps its own windows' rows of a block, so they never cross the
    /// network. Read (`write` false): a worker keeps its rows under `key` and appends a
    /// one-byte part (an empty part: it has no layers, or could not keep them). Write: a
    /// worker writes the rows it kept under `key` as those positions and appends a one-byte
    /// part, or an empty one when it no longer has them (its sequence then keeps its first
    /// `at`): a miss, not an error. The head sends no parts. In-band, like `KvOps`, so every
    /// member reads or writes at the same point in the step order. `state` (read): the rows
    /// with a recurrent model's state where they end, kept only every few blocks (a state
    /// is far bigger than a block's rows); a write tells by what was kept.
    Rows {
        step: u64,
        seq: u64,
        at: u32,
        n: u32,
        write: bool,
        state: bool,
        key: [u8; 32],
        parts: Vec<Vec<u8>>,
    },
    /// A member failed this step; the link stays up for the next one.
    Error {
        step: u64,
        message: String,
    },
    Ping(u64),
    Pong(u64),
    /// The link's handshake (`auth` says what each carries); never shown to link users.
    AuthHello {
        share: KeyShare,
    },
    AuthChallenge {
        share: KeyShare,
        server: PeerId,
    },
    AuthProof {
        proof: Proof,
    },
    AuthWelcome {
        proof: Proof,
    },
}

impl Frame {
    pub fn kind_name(&self) -> &'static str {
        kind_name(self.kind()).unwrap_or("unknown")
    }

    pub(crate) fn is_handshake(&self) -> bool {
        self.kind() >= KIND_AUTH_HELLO
    }

    fn kind(&self) -> u8 {
        match self {
            Frame::Activations(_) => KIND_ACTIVATIONS,
            Frame::KvOps { .. } => KIND_KV_OPS,
            Frame::Rows { .. } => KIND_ROWS,
            Frame::Error { .. } => KIND_ERROR,
            Frame::Ping(_) => KIND_PING,
            Frame::Pong(_) => KIND_PONG,
            Frame::AuthHello { .. } => KIND_AUTH_HELLO,
            Frame::AuthChallenge { .. } => KIND_AUTH_CHALLENGE,
            Frame::AuthProof { .. } => KIND_AUTH_PROOF,
            Frame::AuthWelcome { .. } => KIND_AUTH_WELCOME,
        }
    }
}

fn kind_name(kind: u8) -> Option<&'static str> {
    Some(match kind {
        KIND_ACTIVATIONS => "activations",
        KIND_KV_OPS => "kv-ops",
        KIND_ERROR => "error",
        KIND_PING => "ping",
        KIND_PONG => "pong",
        KIND_ROWS => "rows",
        KIND_AUTH_HELLO => "auth-hello",
        KIND_AUTH_CHALLENGE => "auth-challenge",
        KIND_AUTH_PROOF => "auth-proof",
        KIND_AUTH_WELCOME => "auth-welcome",
        _ => return None,
    })
}

/// Appends `frame` to `buf`. Writes nothing when the frame cannot be encoded, so a caller's
/// buffer never holds half a frame. Allocates only when `buf` must grow.
pub fn encode(frame: &Frame, buf: &mut BytesMut) -> Result<()> {
    let body_len = body_len(frame)?;
    buf.reserve(HEADER_LEN + body_len as usize);
    buf.put_slice(&MAGIC);
    buf.put_u16_le(VERSION);
    buf.put_u8(frame.kind());
    buf.put_u8(0);
    buf.put_u32_le(body_len);
    match frame {
        Frame::Activations(a) => {
            buf.put_u64_le(a.step);
            buf.put_u32_le(a.round);
            buf.put_u32_le(a.tokens.len() as u32);
            buf.put_u32_le(a.n_embd);
            buf.put_u8(a.dtype.code());
            buf.put_u8(a.reports.len() as u8);
            buf.put_bytes(0, 2);
            for t in &a.tokens {
                buf.put_u64_le(t.seq);
                buf.put_u32_le(t.pos);
                buf.put_u32_le(if t.wants_logits { WANTS_LOGITS } else { 0 });
            }
            put_hidden(buf, &a.hidden, a.dtype);
            for r in &a.reports {
                buf.put_u32_le(r.compute_us);
                buf.put_u64_le(r.read_bytes);
                buf.put_u64_le(r.prefetch_bytes);
            }
        }
        Frame::KvOps { step, ops } => {
            buf.put_u64_le(*step);
            buf.put_u32_le(ops.len() as u32);
            for op in ops {
                let (code, seq, len, from) = match *op {
                    KvOp::Clear { seq } => (OP_CLEAR, seq, 0, 0),
                    KvOp::Truncate { seq, len } => (OP_TRUNCATE, seq, len, 0),
                    KvOp::Checkpoint { seq } => (OP_CHECKPOINT, seq, 0, 0),
                    KvOp::Copy { seq, from, len } => (OP_COPY, seq, len, from),
                };
                buf.put_u8(code);
                buf.put_u64_le(seq);
                buf.put_u32_le(len);
                buf.put_u64_le(from);
            }
        }
        Frame::Rows { step, seq, at, n, write, state, key, parts } => {
            buf.put_u64_le(*step);
            buf.put_u64_le(*seq);
            buf.put_u32_le(*at);
            buf.put_u32_le(*n);
            buf.put_u8(u8::from(*write));
            buf.put_u8(u8::from(*state));
            buf.put_bytes(0, 2);
            buf.put_slice(key);
            buf.put_u32_le(parts.len() as u32);
            for p in parts {
                buf.put_u64_le(p.len() as u64);
                buf.put_slice(p);
            }
        }
        Frame::Error { step, message } => {
            buf.put_u64_le(*step);
            buf.put_slice(message.as_bytes());
        }
        Frame::Ping(v) | Frame::Pong(v) => buf.put_u64_le(*v),
        Frame::AuthChallenge { share, server } => {
            buf.put_slice(share);
            buf.put_slice(server);
        }
        Frame::AuthHello { share } => buf.put_slice(share),
        Frame::AuthProof { proof: b } | Frame::AuthWelcome { proof: b } => buf.put_slice(b),
    }
    Ok(())
}

/// Validates everything `encode` relies on and returns the body length.
fn body_len(frame: &Frame) -> Result<u32> {
    let len: u64 = match frame {
        Frame::Activations(a) => {
            if a.tokens.is_empty() || a.n_embd == 0 {
                return Err(Error::Encode("activations need at least one token and n_embd > 0".into()));
            }
            let n_tokens = u32::try_from(a.tokens.len())
                .map_err(|_| Error::Encode(format!("{} tokens do not fit a frame", a.tokens.len())))?;
            let expected = u64::from(n_tokens) * u64::from(a.n_embd);
            if a.hidden.len() as u64 != expected {
                return Err(Error::Encode(format!(
                    "{} hidden values for {n_tokens} tokens × n_embd {}",
                    a.hidden.len(),
                    a.n_embd
                )));
            }
            if a.reports.len() > MAX_REPORTS {
                return Err(Error::Encode(format!("{} stage reports do not fit a frame", a.reports.len())));
            }
            ACTIVATIONS_FIXED_LEN + u64::from(n_tokens) * TOKEN_LEN + expected * a.dtype.size() as u64 + a.reports.len() as u64 * REPORT_LEN
        }
        Frame::KvOps { ops, .. } => {
            if u32::try_from(ops.len()).is_err() {
                return Err(Error::Encode(format!("{} kv ops do not fit a frame", ops.len())));
            }
            KV_OPS_FIXED_LEN + ops.len() as u64 * KV_OP_LEN
        }
        Frame::Rows { parts, .. } => {
            if u32::try_from(parts.len()).is_err() {
                return Err(Error::Encode(format!("{} row parts do not fit a frame", parts.len())));
            }
            ROWS_FIXED_LEN + parts.iter().map(|p| ROWS_PART_LEN + p.len() as u64).sum::<u64>()
        }
        Frame::Error { message, .. } => 8 + message.len() as u64,
        Frame::Ping(_) | Frame::Pong(_) => 8,
        Frame::AuthChallenge { .. } => (KEY_SHARE_LEN + PEER_ID_LEN) as u64,
        Frame::AuthHello { .. } => KEY_SHARE_LEN as u64,
        Frame::AuthProof { .. } | Frame::AuthWelcome { .. } => 32,
    };
    u32::try_from(len).map_err(|_| Error::Encode(format!("a {}-byte body does not fit a frame", len)))
}

fn put_hidden(buf: &mut BytesMut, hidden: &[f32], dtype: Dtype) {
    // Writing into a pre-sized slice with fixed-size chunks lets the compiler vectorise the
    // conversion; per-value put_* calls would bounds-check every time.
    let start = buf.len();
    buf.resize(start + hidden.len() * dtype.size(), 0);
    let out = &mut buf[start..];
    match dtype {
        Dtype::F32 => {
            for (dst, v) in out.chunks_exact_mut(4).zip(hidden) {
                dst.copy_from_slice(&v.to_le_bytes());
            }
        }
        Dtype::F16 => {
            // Batches through stack buffers so `half` can use the CPU's conversion
            // instructions (F16C, NEON) instead of converting one value at a time.
            let mut clamped = [0f32; F16_BATCH];
            let mut halves = [f16::ZERO; F16_BATCH];
            for (src, dst) in hidden.chunks(F16_BATCH).zip(out.chunks_mut(F16_BATCH * 2)) {
                let n = src.len();
                for (c, v) in clamped.iter_mut().zip(src) {
                    *c = v.clamp(-F16_MAX, F16_MAX);
                }
                halves[..n].convert_from_f32_slice(&clamped[..n]);
                for (d, h) in dst.chunks_exact_mut(2).zip(&halves[..n]) {
                    d.copy_from_slice(&h.to_le_bytes());
                }
            }
        }
    }
}

fn get_hidden(hidden: &mut Vec<f32>, raw: &[u8], dtype: Dtype) {
    match dtype {
        Dtype::F32 => hidden.extend(raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        Dtype::F16 => {
            let start = hidden.len();
            hidden.resize(start + raw.len() / 2, 0.0);
            let mut halves = [f16::ZERO; F16_BATCH];
            for (src, dst) in raw.chunks(F16_BATCH * 2).zip(hidden[start..].chunks_mut(F16_BATCH)) {
                let n = dst.len();
                for (h, c) in halves.iter_mut().zip(src.chunks_exact(2)) {
                    *h = f16::from_le_bytes([c[0], c[1]]);
                }
                halves[..n].convert_to_f32_slice(dst);
            }
        }
    }
}

/// f16 tops out at 65504; a rare outlier activation becomes the largest finite value rather
/// than infinity, which the next layer's normalisation would turn into NaN.
const F16_MAX: f32 = 65504.0;
/// Values converted per batch: big enough for the SIMD conversion to pay off, small enough
/// for the stack.
const F16_BATCH: usize = 256;

/// The value a receiver sees for `v` sent as f16; exposed for precision checks.
pub fn f16_round_trip(v: f32) -> f32 {
    f16::from_f32(v.clamp(-F16_MAX, F16_MAX)).to_f32()
}

struct Header {
    kind: u8,
    body_len: usize,
}

/// Incremental decoder: feed it whatever bytes arrived, take frames out as they complete.
#[derive(Debug)]
pub struct FrameDecoder {
    max_frame_bytes: usize,
    /// Buffers of a recycled activations frame, reused by the next one.
    spare: Option<(Vec<TokenMeta>, Vec<f32>)>,
}

impl FrameDecoder {
    pub fn new(max_frame_bytes: usize) -> Self {
        FrameDecoder { max_frame_bytes, spare: None }
    }

    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    pub fn set_max_frame_bytes(&mut self, max_frame_bytes: usize) {
        self.max_frame_bytes = max_frame_bytes;
    }

    /// Hands a consumed frame back so the next activations frame reuses its buffers instead
    /// of allocating.
    pub fn recycle(&mut self, frame: Frame) {
        if let Frame::Activations(a) = frame {
            self.spare = Some((a.tokens, a.hidden));
        }
    }

    /// Takes one complete frame off the front of `buf`. `Ok(None)` means more bytes are
    /// needed; once the header is in, `buf` is grown to the whole frame's size so the rest
    /// arrives without reallocation. An error means the stream is unusable.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>> {
        let Some(header) = self.header(buf)? else {
            return Ok(None);
        };
        let total = HEADER_LEN + header.body_len;
        if buf.len() < total {
            buf.reserve(total - buf.len());
            return Ok(None);
        }
        let frame = self.body(header.kind, &buf[HEADER_LEN..total]);
        buf.advance(total);
        frame.map(Some)
    }

    /// Checks as much of the header as has arrived, so garbage is refused at its first bytes.
    fn header(&self, buf: &[u8]) -> Result<Option<Header>> {
        let seen = buf.len().min(MAGIC.len());
        if buf[..seen] != MAGIC[..seen] {
            return Err(Error::BadMagic { found: buf[..seen].to_vec() });
        }
        if buf.len() >= 6 {
            let theirs = u16::from_le_bytes([buf[4], buf[5]]);
            if theirs != VERSION {
                return Err(Error::VersionMismatch { ours: VERSION, theirs });
            }
        }
        if buf.len() >= 7 && kind_name(buf[6]).is_none() {
            return Err(Error::UnknownKind(buf[6]));
        }
        if buf.len() >= 8 && buf[7] != 0 {
            return Err(Error::UnknownFlags(buf[7]));
        }
        if buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let body_len = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]);
        let size = HEADER_LEN as u64 + u64::from(body_len);
        if size > self.max_frame_bytes as u64 {
            return Err(Error::FrameTooLarge { size, limit: self.max_frame_bytes });
        }
        Ok(Some(Header { kind: buf[6], body_len: body_len as usize }))
    }

    fn body(&mut self, kind: u8, body: &[u8]) -> Result<Frame> {
        let mut r = Reader { rest: body, kind: kind_name(kind).unwrap_or("unknown") };
        let frame = match kind {
            KIND_ACTIVATIONS => Frame::Activations(self.activations(&mut r)?),
            KIND_KV_OPS => {
                let step = r.u64()?;
                let count = r.u32()?;
                let expected = KV_OPS_FIXED_LEN + u64::from(count) * KV_OP_LEN;
                if expected != body.len() as u64 {
                    return Err(r.bad(format!("{count} ops need {expected} bytes, body has {}", body.len())));
                }
                let mut ops = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    let code = r.u8()?;
                    let seq = r.u64()?;
                    let len = r.u32()?;
                    let from = r.u64()?;
                    ops.push(match code {
                        OP_CLEAR if len == 0 && from == 0 => KvOp::Clear { seq },
                        OP_TRUNCATE if from == 0 => KvOp::Truncate { seq, len },
                        OP_CHECKPOINT if len == 0 && from == 0 => KvOp::Checkpoint { seq },
                        OP_COPY => KvOp::Copy { seq, from, len },
                        _ => return Err(r.bad(format!("bad op {code} (len {len}, from {from})"))),
                    });
                }
                Frame::KvOps { step, ops }
            }
            KIND_ROWS => {
                let (step, seq, at, n) = (r.u64()?, r.u64()?, r.u32()?, r.u32()?);
                let write = match r.u8()? {
                    0 => false,
                    1 => true,
                    other => return Err(r.bad(format!("write flag {other}"))),
                };
                let state = match r.u8()? {
                    0 => false,
                    1 => true,
                    other => return Err(r.bad(format!("state flag {other}"))),
                };
                if r.take(2)? != [0, 0] {
                    return Err(r.bad("reserved bytes are not zero"));
                }
                let key = r.array::<32>()?;
                let count = r.u32()?;
                // Each part takes at least its length's 8 bytes: the count cannot promise
                // more parts than the body holds.
                if u64::from(count) * ROWS_PART_LEN > r.rest.len() as u64 {
                    return Err(r.bad(format!("{count} parts in {} bytes", r.rest.len())));
                }
                let mut parts = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    let len = r.u64()?;
                    let len = usize::try_from(len).ok().filter(|&l| l <= r.rest.len()).ok_or_else(|| r.bad(format!("a part of {len} bytes past the body")))?;
                    parts.push(r.take(len)?.to_vec());
                }
                Frame::Rows { step, seq, at, n, write, state, key, parts }
            }
            KIND_ERROR => {
                let step = r.u64()?;
                let text = r.take(r.rest.len())?;
                let message = std::str::from_utf8(text).map_err(|_| r.bad("message is not UTF-8"))?;
                Frame::Error { step, message: message.to_owned() }
            }
            KIND_PING => Frame::Ping(r.u64()?),
            KIND_PONG => Frame::Pong(r.u64()?),
            KIND_AUTH_HELLO => Frame::AuthHello { share: r.array()? },
            KIND_AUTH_CHALLENGE => Frame::AuthChallenge { share: r.array()?, server: r.array()? },
            KIND_AUTH_PROOF => Frame::AuthProof { proof: r.array()? },
            KIND_AUTH_WELCOME => Frame::AuthWelcome { proof: r.array()? },
            other => return Err(Error::UnknownKind(other)),
        };
        r.finish()?;
        Ok(frame)
    }

    fn activations(&mut self, r: &mut Reader<'_>) -> Result<Activations> {
        let body_len = r.rest.len() as u64;
        let step = r.u64()?;
        let round = r.u32()?;
        let n_tokens = r.u32()?;
        let n_embd = r.u32()?;
        let dtype = Dtype::from_code(r.u8()?)?;
        let n_reports = r.u8()?;
        if r.take(2)? != [0, 0] {
            return Err(r.bad("reserved bytes are not zero"));
        }
        if n_tokens == 0 || n_embd == 0 {
            return Err(r.bad(format!("{n_tokens} tokens × n_embd {n_embd} is empty")));
        }
        // u32 × u32 × 4 fits u64, so these cannot overflow.
        let values = u64::from(n_tokens) * u64::from(n_embd);
        let expected = ACTIVATIONS_FIXED_LEN + u64::from(n_tokens) * TOKEN_LEN + values * dtype.size() as u64 + u64::from(n_reports) * REPORT_LEN;
        if expected != body_len {
            return Err(r.bad(format!(
                "{n_tokens} tokens × n_embd {n_embd} in {dtype:?} and {n_reports} reports need a {expected}-byte body, got {body_len}"
            )));
        }

        let (mut tokens, mut hidden) = self.spare.take().unwrap_or_default();
        tokens.clear();
        hidden.clear();
        tokens.reserve(n_tokens as usize);
        hidden.reserve(values as usize);
        for _ in 0..n_tokens {
            let seq = r.u64()?;
            let pos = r.u32()?;
            let flags = r.u32()?;
            if flags & !WANTS_LOGITS != 0 {
                return Err(r.bad(format!("unknown token flags {flags:#x}")));
            }
            tokens.push(TokenMeta { seq, pos, wants_logits: flags & WANTS_LOGITS != 0 });
        }
        let raw = r.take(values as usize * dtype.size())?;
        get_hidden(&mut hidden, raw, dtype);
        let mut reports = Vec::with_capacity(n_reports as usize);
        for _ in 0..n_reports {
            reports.push(StageReport { compute_us: r.u32()?, read_bytes: r.u64()?, prefetch_bytes: r.u64()? });
        }
        Ok(Activations { step, round, n_embd, dtype, tokens, hidden, reports })
    }
}

/// Bounds-checked reads over a frame body.
struct Reader<'a> {
    rest: &'a [u8],
    kind: &'static str,
}

impl<'a> Reader<'a> {
    fn bad(&self, reason: impl Into<String>) -> Error {
        Error::malformed(self.kind, reason)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.rest.len() < n {
            return Err(self.bad("body ends early"));
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64> {
        self.array().map(u64::from_le_bytes)
    }

    fn finish(self) -> Result<()> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(self.bad(format!("{} trailing bytes", self.rest.len())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn activations(dtype: Dtype, n_tokens: usize, n_embd: u32) -> Frame {
        Frame::Activations(Activations {
            step: 7,
            round: 2,
            n_embd,
            dtype,
            tokens: (0..n_tokens)
                .map(|i| TokenMeta { seq: i as u64 % 3, pos: i as u32, wants_logits: i % 2 == 0 })
                .collect(),
            hidden: (0..n_tokens * n_embd as usize).map(|i| (i as f32 * 0.37).sin() * 40.0).collect(),
            reports: vec![StageReport { compute_us: 1234, read_bytes: 1 << 33, prefetch_bytes: 7 }],
        })
    }

    fn encoded(frame: &Frame) -> BytesMut {
        let mut buf = BytesMut::new();
        encode(frame, &mut buf).unwrap();
        buf
    }

    fn decode_all(bytes: &[u8], max: usize) -> Result<Option<Frame>> {
        FrameDecoder::new(max).decode(&mut BytesMut::from(bytes))
    }

    #[test]
    fn f16_halves_the_payload() {
        let f32_len = encoded(&activations(Dtype::F32, 4, 576)).len();
        let f16_len = encoded(&activations(Dtype::F16, 4, 576)).len();
        assert_eq!(f32_len - f16_len, 4 * 576 * 2);
    }

    #[test]
    fn truncated_frames_wait_for_more() {
        let bytes = encoded(&activations(Dtype::F32, 3, 8));
        for cut in 0..bytes.len() {
            assert!(decode_all(&bytes[..cut], DEFAULT_MAX_FRAME_BYTES).unwrap().is_none(), "cut {cut}");
        }
    }

    #[test]
    fn byte_at_a_time_then_next_frame() {
        let frames = [activations(Dtype::F16, 2, 5), Frame::Ping(9), Frame::KvOps { step: 1, ops: vec![] }];
        let mut wire = BytesMut::new();
        for f in &frames {
            encode(f, &mut wire).unwrap();
        }
        let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME_BYTES);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for b in wire.iter() {
            buf.put_u8(*b);
            while let Some(f) = dec.decode(&mut buf).unwrap() {
                out.push(f);
            }
        }
        assert_eq!(out.len(), 3);
        assert_eq!(out[1], Frame::Ping(9));
        assert!(buf.is_empty());
    }

    #[test]
    fn oversized_is_refused_from_the_header_alone() {
        let mut header = BytesMut::new();
        header.put_slice(&MAGIC);
        header.put_u16_le(VERSION);
        header.put_u8(KIND_ACTIVATIONS);
        header.put_u8(0);
        header.put_u32_le(u32::MAX); // ~4 GiB announced, nothing sent
        let err = FrameDecoder::new(1 << 20).decode(&mut header).unwrap_err();
        assert!(matches!(err, Error::FrameTooLarge { limit: 1048576, .. }), "{err}");
        assert!(header.capacity() < 1 << 20, "must not reserve the announced size");
    }

    #[test]
    fn wrong_magic_version_kind_flags() {
        let good = encoded(&Frame::Ping(1));
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(matches!(decode_all(&bad[..1], 1024), Err(Error::BadMagic { .. })));
        let mut bad = good.clone();
        bad[4] = 1;
        let err = decode_all(&bad[..6], 1024).unwrap_err();
        assert!(matches!(err, Error::VersionMismatch { ours: VERSION, theirs: 1 }));
        assert!(err.to_string().contains(&format!("version {VERSION}")) && err.to_string().contains("version 1"), "{err}");
        let mut bad = good.clone();
        bad[6] = 99;
        assert!(matches!(decode_all(&bad, 1024), Err(Error::UnknownKind(99))));
        let mut bad = good;
        bad[7] = 1;
        assert!(matches!(decode_all(&bad, 1024), Err(Error::UnknownFlags(1))));
    }

    #[test]
    fn inconsistent_counts_are_malformed() {
        let mut bytes = encoded(&activations(Dtype::F32, 2, 4));
        bytes[HEADER_LEN + 16..HEADER_LEN + 20].copy_from_slice(&u32::MAX.to_le_bytes()); // n_embd
        assert!(matches!(decode_all(&bytes, 1 << 20), Err(Error::Malformed { .. })));

        let mut bytes = encoded(&activations(Dtype::F32, 2, 4));
        bytes[HEADER_LEN + 21] = 2; // n_reports: one more than the body holds
        assert!(matches!(decode_all(&bytes, 1 << 20), Err(Error::Malformed { .. })));

        let mut bytes = encoded(&Frame::KvOps { step: 1, ops: vec![KvOp::Clear { seq: 1 }] });
        bytes[HEADER_LEN + 8..HEADER_LEN + 12].copy_from_slice(&1_000_000u32.to_le_bytes());
        assert!(matches!(decode_all(&bytes, 1 << 20), Err(Error::Malformed { .. })));

        let mut bytes = encoded(&Frame::Error { step: 1, message: "ok".into() });
        let last = bytes.len() - 1;
        bytes[last] = 0xff;
        assert!(matches!(decode_all(&bytes, 1 << 20), Err(Error::Malformed { .. })));
    }

    #[test]
    fn encode_refuses_inconsistent_activations_and_writes_nothing() {
        let Frame::Activations(mut a) = activations(Dtype::F32, 2, 4) else { unreachable!() };
        a.hidden.pop();
        let mut buf = BytesMut::from(&b"keep"[..]);
        assert!(encode(&Frame::Activations(a), &mut buf).is_err());
        assert_eq!(&buf[..], b"keep");
    }

    #[test]
    fn recycled_buffers_are_reused() {
        let bytes = encoded(&activations(Dtype::F32, 4, 64));
        let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME_BYTES);
        let first = dec.decode(&mut BytesMut::from(&bytes[..])).unwrap().unwrap();
        let Frame::Activations(a) = &first else { unreachable!() };
        let ptr = a.hidden.as_ptr();
        dec.recycle(first);
        let second = dec.decode(&mut BytesMut::from(&bytes[..])).unwrap().unwrap();
        let Frame::Activations(b) = &second else { unreachable!() };
        assert_eq!(b.hidden.as_ptr(), ptr);
    }

    fn arb_frame() -> impl Strategy<Value = Frame> {
        let token = (any::<u64>(), any::<u32>(), any::<bool>()).prop_map(|(seq, pos, wants_logits)| TokenMeta {
            seq,
            pos,
            wants_logits,
        });
        let report = (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(compute_us, read_bytes, prefetch_bytes)| StageReport {
            compute_us,
            read_bytes,
            prefetch_bytes,
        });
        let acts = (1usize..6, 1u32..40, any::<u64>(), any::<u32>(), any::<bool>()).prop_flat_map(
            move |(n, e, step, round, half)| {
                (
                    proptest::collection::vec(token.clone(), n),
                    proptest::collection::vec(-1.0e5f32..1.0e5, n * e as usize),
                    proptest::collection::vec(report.clone(), 0..5),
                )
                    .prop_map(move |(tokens, hidden, reports)| {
                        let dtype = if half { Dtype::F16 } else { Dtype::F32 };
                        Frame::Activations(Activations { step, round, n_embd: e, dtype, tokens, hidden, reports })
                    })
            },
        );
        let op = prop_oneof![
            any::<u64>().prop_map(|seq| KvOp::Clear { seq }),
            (any::<u64>(), any::<u32>()).prop_map(|(seq, len)| KvOp::Truncate { seq, len }),
            any::<u64>().prop_map(|seq| KvOp::Checkpoint { seq }),
            (any::<u64>(), any::<u64>(), any::<u32>()).prop_map(|(seq, from, len)| KvOp::Copy { seq, from, len }),
        ];
        let nonce = any::<[u8; 32]>();
        let share = proptest::collection::vec(any::<u8>(), KEY_SHARE_LEN).prop_map(|v| <KeyShare>::try_from(v).unwrap());
        prop_oneof![
            acts,
            (any::<u64>(), proptest::collection::vec(op, 0..8)).prop_map(|(step, ops)| Frame::KvOps { step, ops }),
            (any::<u64>(), any::<u64>(), any::<u32>(), any::<u32>(), any::<(bool, bool)>(), any::<[u8; 32]>(), proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..4))
                .prop_map(|(step, seq, at, n, (write, state), key, parts)| Frame::Rows { step, seq, at, n, write, state, key, parts }),
            (any::<u64>(), ".{0,40}").prop_map(|(step, message)| Frame::Error { step, message }),
            any::<u64>().prop_map(Frame::Ping),
            any::<u64>().prop_map(Frame::Pong),
            share.clone().prop_map(|share| Frame::AuthHello { share }),
            (share, any::<PeerId>()).prop_map(|(share, server)| Frame::AuthChallenge { share, server }),
            nonce.prop_map(|proof| Frame::AuthProof { proof }),
            nonce.prop_map(|proof| Frame::AuthWelcome { proof }),
        ]
    }

    /// What the receiver must see: f32 exactly, f16 exactly the f16 rounding.
    fn as_received(frame: &Frame) -> Frame {
        let mut f = frame.clone();
        if let Frame::Activations(a) = &mut f {
            if a.dtype == Dtype::F16 {
                a.hidden.iter_mut().for_each(|v| *v = f16_round_trip(*v));
            }
        }
        f
    }

    proptest! {
        #[test]
        fn round_trip(frames in proptest::collection::vec(arb_frame(), 1..4), chunk in 1usize..64) {
            let mut wire = BytesMut::new();
            for f in &frames {
                encode(f, &mut wire).unwrap();
            }
            let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME_BYTES);
            let mut buf = BytesMut::new();
            let mut out = Vec::new();
            for piece in wire.chunks(chunk) {
                buf.extend_from_slice(piece);
                while let Some(f) = dec.decode(&mut buf).unwrap() {
                    out.push(f);
                }
            }
            prop_assert!(buf.is_empty());
            prop_assert_eq!(out.len(), frames.len());
            for (sent, got) in frames.iter().zip(&out) {
                prop_assert_eq!(&as_received(sent), got);
                if let (Frame::Activations(s), Frame::Activations(g)) = (sent, got) {
                    for (x, y) in s.hidden.iter().zip(&g.hidden) {
                        // f16 keeps 11 significant bits; subnormals keep an absolute 2^-24.
                        let tol = if s.dtype == Dtype::F16 { x.abs().min(65504.0) * 4.9e-4 + 6.0e-8 } else { 0.0 };
                        let exact_limit = x.abs() > 65504.0; // clamped outliers
                        prop_assert!(exact_limit || (x - y).abs() <= tol, "{} vs {}", x, y);
                    }
                }
            }
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512), magic in any::<bool>()) {
            let mut buf = BytesMut::new();
            if magic {
                // Steer past the magic/version checks so the body parsers see the garbage.
                buf.put_slice(&MAGIC);
                buf.put_u16_le(VERSION);
            }
            buf.extend_from_slice(&bytes);
            let mut dec = FrameDecoder::new(4096);
            while let Ok(Some(_)) = dec.decode(&mut buf) {}
        }

        #[test]
        fn corrupted_frames_never_panic(frame in arb_frame(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
            let mut bytes = encoded(&frame);
            let i = at.index(bytes.len());
            bytes[i] = byte;
            let _ = decode_all(&bytes, DEFAULT_MAX_FRAME_BYTES);
        }
    }
}
