//! The micro-batches a head has in flight: each is launched (embedded and taken through
//! the head's first window), sent round the ring once per round, advanced through the
//! head's own window as it comes back, and landed with its logits or its error. Frames
//! come back in the order they left, so the head takes them back in that order; any
//! failure breaks the ring and fails every micro-batch in it, leaving no cache holding
//! half of one.
//!
//! The head's own compute is reached through [`HeadWindows`] and the ring through
//! [`super::links::RingLink`], so the tests below run many micro-batches round an
//! in-memory ring with a scripted head and inject failures anywhere.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use engine::{BatchToken, Logits, StageInput, StageOutput};
use transport::{Activations, Dtype, Frame, KvOp, StageReport, TokenMeta};

use super::board::PlanBoard;
use super::links::Links;
use crate::error::{Error, Result};
use crate::metrics::RingMeter;

/// The head's part of the running plan, as the flights use it.
pub trait HeadWindows {
    /// The head's stage window in each round of the plan, if it has one.
    fn own(&self) -> &[Option<usize>];
    /// The embedding-only window, when the head holds no layers.
    fn embed_window(&self) -> Option<usize>;
    /// The output-only window, when the head's last window does not end the model.
    fn output_window(&self) -> Option<usize>;
    /// Whether workers hold layers (otherwise the head computes everything).
    fn workers_compute(&self) -> bool;
    /// Whether the head counts what it reads from disk (it pages its windows, or has none).
    fn counts_reads(&self) -> bool;
    /// Runs stage window `window`. For the head's window of a round, `round` carries it and
    /// how long since the frame left the head (read-ahead uses it), and the answer carries
    /// what the head read meanwhile.
    fn forward(&mut self, window: usize, round: Option<(usize, Option<Duration>)>, batch: &[BatchToken], input: StageInput<'_>) -> (Result<StageOutput>, Option<StageReport>);
    /// Applies a KV operation to the head's own caches.
    fn apply(&mut self, op: &KvOp);
}

/// A failure of the ring (not of this machine's engine): the batching loop reports the ring
/// broken and recovers it.
pub fn ring_err(e: impl std::fmt::Display) -> Error {
    Error::RingBroken(e.to_string())
}

/// One micro-batch on its way round the ring.
struct Flight {
    ticket: u64,
    /// The ring's step number, which its frames carry.
    step: u64,
    batch: Vec<BatchToken>,
    tokens: Vec<i32>,
    /// The token list that travels with its frames (taken while a frame is out).
    metas: Vec<TokenMeta>,
    /// The round its frame is on.
    round: usize,
    /// When its frame last left for the ring: the head's wait for it starts then.
    sent: Option<Instant>,
    started: Instant,
    /// No other micro-batch shared the ring with it: its round trips time the hops.
    alone: bool,
    /// The hops of its round trips (seconds), for the board.
    hops: Vec<f64>,
    /// Bytes each member (the head first) read from disk while computing it, and whether
    /// every round trip brought every report.
    reads: Vec<u64>,
    reads_known: bool,
}

/// What the flights act on: the head's windows, the links, and where they report.
pub struct Ring<'a, H: HeadWindows> {
    pub head: &'a mut H,
    pub links: &'a mut Links,
    pub meter: &'a RingMeter,
    pub board: &'a PlanBoard,
    /// Members of the running plan, the head included.
    pub members: usize,
}

/// What a `Rows` frame asks of every worker (see [`Flights::rows`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowsOp {
    /// Keep its rows of the block.
    Keep,
    /// Keep its rows of the block with the recurrent state where they end (a model with one
    /// keeps that only every few blocks: a state is far bigger than a block's rows).
    KeepWithState,
    /// Write back the rows (and state) it kept.
    Write,
}

/// The micro-batches in flight and those done, in order.
pub struct Flights {
    /// In the ring, in the order they left (they come back in that order).
    in_ring: VecDeque<Flight>,
    /// Done (logits or error), waiting for `finish`.
    done: VecDeque<(u64, Result<Logits>)>,
    /// KV operations and rows for the workers, in order, sent in-band ahead of the next
    /// frame instead of a round trip of their own (consecutive operations as one frame).
    pending: Vec<Frame>,
    step: u64,
    n_embd: usize,
    dtype: Dtype,
    step_timeout: Duration,
}

impl Flights {
    pub fn new(n_embd: usize, dtype: Dtype, step_timeout: Duration) -> Flights {
        Flights { in_ring: VecDeque::new(), done: VecDeque::new(), pending: Vec::new(), step: 0, n_embd, dtype, step_timeout }
    }

    /// A fresh step number (the ring's probe frames take theirs from here too).
    pub fn next_step(&mut self) -> u64 {
        self.step += 1;
        self.step
    }

    /// The workers' caches start empty (a ring formed again or a new plan): nothing of
    /// the old ones is left to send them.
    pub fn forget_pending_kv(&mut self) {
        self.pending.clear();
    }

    /// Starts a micro-batch: the head embeds it and runs its own first window, then sends
    /// it round the ring (or, when the head holds every layer, it is done at once).
    pub fn launch<H: HeadWindows>(&mut self, ring: &mut Ring<'_, H>, ticket: u64, batch: &[BatchToken], tokens: &[i32]) {
        if ring.head.workers_compute() && !ring.links.formed() {
            self.done.push_back((ticket, Err(ring_err(ring.links.why()))));
            return;
        }
        let step = self.next_step();
        let alone = self.in_ring.is_empty();
        for f in &mut self.in_ring {
            f.alone = false;
        }
        let flight = Flight {
            ticket,
            step,
            batch: batch.to_vec(),
            tokens: tokens.to_vec(),
            metas: batch.iter().map(|t| TokenMeta { seq: t.seq, pos: t.pos, wants_logits: t.logits }).collect(),
            round: 0,
            sent: None,
            started: Instant::now(),
            alone,
            hops: Vec::new(),
            reads: vec![0; ring.members],
            reads_known: true,
        };
        // The hidden state so far; `None` until the tokens are embedded (by the head's
        // first window, or by the embedding-only window of a head without layers).
        let h = match ring.head.embed_window() {
            Some(w) => match ring.head.forward(w, None, &flight.batch, StageInput::Tokens(&flight.tokens)).0 {
                Ok(StageOutput::Hidden(h)) => Some(h),
                Ok(StageOutput::Logits(_)) => return self.land(ring, flight, Err(ring_err("the embedding window returned logits"))),
                Err(e) => return self.land(ring, flight, Err(e)),
            },
            None => None,
        };
        self.advance(ring, flight, h, 0);
    }

    /// Runs the head's windows of a micro-batch from round `from` on, until its frame
    /// leaves for the ring again or it is done.
    fn advance<H: HeadWindows>(&mut self, ring: &mut Ring<'_, H>, mut f: Flight, mut h: Option<Vec<f32>>, from: usize) {
        let rounds = ring.head.own().len();
        for round in from..rounds {
            if let Some(w) = ring.head.own()[round] {
                let input = h.as_deref().map_or(StageInput::Tokens(&f.tokens), StageInput::Hidden);
                let (out, report) = ring.head.forward(w, Some((round, f.sent.map(|t| t.elapsed()))), &f.batch, input);
                if let Some(report) = report {
                    ring.meter.head_step(&report);
                    f.reads[0] += report.read_bytes;
                }
                match out {
                    Ok(StageOutput::Hidden(x)) => h = Some(x),
                    // Its window ends with the model's last layer (every worker relays): done.
                    Ok(StageOutput::Logits(l)) => return self.land(ring, f, Ok(l)),
                    Err(e) => return self.land(ring, f, Err(e)),
                }
            }
            if ring.head.workers_compute() {
                let Some(hidden) = h.take() else { return self.land(ring, f, Err(ring_err("no hidden state to send round the ring"))) };
                // The token list travels round and comes back: reuse it, no copy per round.
                let a = Activations { step: f.step, round: round as u32, n_embd: self.n_embd as u32, dtype: self.dtype, tokens: std::mem::take(&mut f.metas), hidden, reports: Vec::new() };
                f.round = round;
                f.sent = Some(Instant::now());
                let sent = self.send(ring, Frame::Activations(a));
                self.in_ring.push_back(f);
                if let Err(why) = sent {
                    self.broke(ring, why);
                }
                return;
            }
        }
        let result = match (ring.head.output_window(), h) {
            (Some(w), Some(h)) => match ring.head.forward(w, None, &f.batch, StageInput::Hidden(&h)).0 {
                Ok(StageOutput::Logits(l)) => Ok(l),
                Ok(StageOutput::Hidden(_)) => Err(ring_err("the output window returned hidden states")),
                Err(e) => Err(e),
            },
            _ => Err(ring_err("the plan leaves the output layer unreached")),
        };
        self.land(ring, f, result);
    }

    /// Sends a frame to the first worker, after any pending KV operations.
    fn send<H: HeadWindows>(&mut self, ring: &mut Ring<'_, H>, frame: Frame) -> std::result::Result<(), String> {
        for pending in std::mem::take(&mut self.pending) {
            ring.links.send(pending)?;
        }
        ring.links.send(frame)
    }

    /// A micro-batch is done: its result waits for `finish`. A failed one leaves no window
    /// holding any of it, unless a later micro-batch of the same sequence is still in the
    /// ring (the batching loop clears such a sequence once that one lands).
    fn land<H: HeadWindows>(&mut self, ring: &mut Ring<'_, H>, f: Flight, result: Result<Logits>) {
        // One token of one sequence, alone in the ring: the step the cost model predicts.
        if result.is_ok() && f.batch.len() == 1 && f.alone {
            let hop = (!f.hops.is_empty()).then(|| f.hops.iter().sum::<f64>() / f.hops.len() as f64);
            let known = f.reads_known && ring.head.counts_reads();
            let reads = known.then_some(f.reads.as_slice());
            ring.board.decode_step(f.started.elapsed(), f.batch[0].pos as usize + 1, hop, reads);
        }
        if result.is_err() {
            let mut ops = Vec::new();
            for t in &f.batch {
                let still_flying = self.in_ring.iter().any(|g| g.batch.iter().any(|b| b.seq == t.seq));
                let len = f.batch.iter().filter(|b| b.seq == t.seq).map(|b| b.pos).min().unwrap_or(0);
                if !still_flying && !ops.contains(&KvOp::Truncate { seq: t.seq, len }) {
                    ops.push(KvOp::Truncate { seq: t.seq, len });
                }
            }
            self.kv(ring, ops);
        }
        self.done.push_back((f.ticket, result));
    }

    /// Waits for the micro-batch at the front of the ring to come back and takes it on
    /// through the head's windows. Any failure breaks the ring: every micro-batch in it
    /// fails, and the link is gone until the ring is formed again.
    fn take_back<H: HeadWindows>(&mut self, ring: &mut Ring<'_, H>) {
        let frame = loop {
            match ring.links.receive(self.step_timeout) {
                // The KV operations sent ahead, coming back: every worker applied them.
                Ok(Frame::KvOps { .. }) => continue,
                Ok(Frame::Error { message, .. }) => break Err(format!("a worker failed: {message}")),
                Ok(Frame::Activations(a)) => break Ok(a),
                Ok(other) => break Err(format!("out-of-order {} frame from the ring", other.kind_name())),
                Err(e) => break Err(e),
            }
        };
        let back = frame.and_then(|a| match self.in_ring.front() {
            // Frames come back in the order they left.
            Some(f) if f.step == a.step && f.round as u32 == a.round => Ok(a),
            _ => Err(format!("out-of-order activations (step {}, round {}) from the ring", a.step, a.round)),
        });
        let back = match back {
            Ok(a) => a,
            Err(why) => return self.broke(ring, why),
        };
        let Some(mut f) = self.in_ring.pop_front() else { return self.broke(ring, "activations came back with nothing in flight".into()) };
        let rtt = f.sent.map_or(Duration::ZERO, |t| t.elapsed());
        // Every round trip records the workers' compute; its hops mean something only for a
        // micro-batch that had the ring to itself.
        if let Some(hop) = ring.meter.round_trip(rtt, &back.reports) {
            if f.alone {
                f.hops.push(hop);
            }
        }
        if back.reports.len() + 1 == f.reads.len() {
            back.reports.iter().zip(&mut f.reads[1..]).for_each(|(r, total)| *total += r.read_bytes);
        } else {
            f.reads_known = false;
        }
        f.metas = back.tokens;
        self.advance(ring, f, Some(back.hidden), back.round as usize + 1);
    }

    /// The ring broke with micro-batches in it: every one of them fails.
    pub fn broke<H: HeadWindows>(&mut self, ring: &mut Ring<'_, H>, why: String) {
        let e = ring.links.break_ring(why).to_string();
        while let Some(f) = self.in_ring.pop_front() {
            self.land(ring, f, Err(ring_err(&e)));
        }
    }

    /// The next micro-batch done, in the order they were launched on the ring (waiting
    /// for the ring as needed).
    pub fn finish<H: HeadWindows>(&mut self, ring: &mut Ring<'_, H>, nothing_in_flight: u64) -> (u64, Result<Logits>) {
        loop {
            if let Some(done) = self.done.pop_front() {
                return done;
            }
            if self.in_ring.is_empty() {
                return (nothing_in_flight, Err(ring_err("no micro-batch is in flight")));
            }
            self.take_back(ring);
        }
    }

    /// Rows `at..at + n` of `seq` as prompt-cache block `key`, kept or written back (see
    /// [`RowsOp`]) by every worker from its own store, round the ring in-band:
    /// the micro-batches ahead of the frame are taken back first (and sent on), then the
    /// frame, after the KV operations queued before. Returns each worker's answer in ring
    /// order (an empty part: a worker without layers, or one that did not keep or write
    /// them). Only asked while nothing of `seq` is in flight. An error: the ring broke.
    pub fn rows<H: HeadWindows>(&mut self, ring: &mut Ring<'_, H>, seq: u64, at: usize, n: usize, op: RowsOp, key: [u8; 32]) -> std::result::Result<Vec<Vec<u8>>, String> {
        let step = self.send_rows(ring, seq, at, n, op, key)?;
        Ok(self.rows_back(ring, &[step])?.pop().unwrap_or_default())
    }

    /// Sends a `rows` frame round the ring without waiting for it: several go round one
    /// after another (a restore's blocks), each member working on its rows of one while the
    /// next member works on the one before, and `rows_back` collects their answers. Nothing
    /// else may be launched on the ring until it has. Returns the frame's step.
    pub fn send_rows<H: HeadWindows>(&mut self, ring: &mut Ring<'_, H>, seq: u64, at: usize, n: usize, op: RowsOp, key: [u8; 32]) -> std::result::Result<u64, String> {
        if !ring.links.formed() {
            return Err(ring.links.why());
        }
        let step = self.next_step();
        let (write, state) = (op == RowsOp::Write, op == RowsOp::KeepWithState);
        self.send(ring, Frame::Rows { step, seq, at: at as u32, n: n as u32, write, state, key, parts: Vec::new() })?;
        Ok(step)
    }

    /// The answers to the `rows` frames sent with these steps, in the order they were sent
    /// (each as `rows` returns it), once the micro-batches that were in the ring before the
    /// first have come back and gone on round. An error: the ring broke.
    pub fn rows_back<H: HeadWindows>(&mut self, ring: &mut Ring<'_, H>, steps: &[u64]) -> std::result::Result<Vec<Vec<Vec<u8>>>, String> {
        if steps.is_empty() {
            return Ok(Vec::new());
        }
        // Frames come back in the order they left: those of the micro-batches in the ring now
        // come first (their next rounds leave after the rows frames).
        for _ in 0..self.in_ring.len() {
            self.take_back(ring);
            if !ring.links.formed() {
                return Err(ring.links.why());
            }
        }
        let mut answers = Vec::with_capacity(steps.len());
        for &step in steps {
            let parts = loop {
                let why = match ring.links.receive(self.step_timeout) {
                    Ok(Frame::KvOps { .. }) => continue,
                    Ok(Frame::Rows { step: back, parts, .. }) if back == step => break parts,
                    Ok(Frame::Error { message, .. }) => format!("a worker failed: {message}"),
                    Ok(other) => format!("out-of-order {} frame from the ring while keeping rows", other.kind_name()),
                    Err(why) => why,
                };
                self.broke(ring, why.clone());
                return Err(why);
            };
            answers.push(parts);
        }
        Ok(answers)
    }

    /// Applies KV operations on the head now and queues them for the workers' next frame.
    pub fn kv<H: HeadWindows>(&mut self, ring: &mut Ring<'_, H>, ops: impl IntoIterator<Item = KvOp>) {
        for op in ops {
            ring.head.apply(&op);
            // A broken ring's workers start empty when it forms again.
            if ring.head.workers_compute() && ring.links.formed() {
                match self.pending.last_mut() {
                    Some(Frame::KvOps { ops, .. }) => ops.push(op),
                    _ => self.pending.push(Frame::KvOps { step: self.step, ops: vec![op] }),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::runtime::ring::links::RingLink;

    const N_EMBD: usize = 2;
    const WORKERS: usize = 2;
    /// The ticket `finish` answers when nothing is in flight.
    const NOTHING: u64 = u64::MAX;

    /// What the in-memory ring did and is told to do.
    #[derive(Default)]
    struct Wire {
        /// Frames on their way back, in order.
        queue: VecDeque<Frame>,
        /// Kinds of the frames the head sent, in order.
        sent: Vec<&'static str>,
        kv_seen: Vec<KvOp>,
        /// Each worker's kept rows of a block, by (worker, key).
        rows_kept: HashMap<(usize, [u8; 32]), Vec<u8>>,
        /// Rows written back, as (worker, sequence, at, rows).
        rows_written: Vec<(usize, u64, u32, Vec<u8>)>,
        receives: usize,
        /// The n-th receive (1-based) fails: a link reset mid-flight.
        fail_receive: Option<usize>,
        /// The n-th receive gets a worker's error frame instead: a member leaving.
        error_frame: Option<usize>,
        /// Frames come back in the opposite order.
        reorder: bool,
        /// The link back closed while idle.
        closed: bool,
    }

    /// A ring of `WORKERS` workers in memory: each adds 100 × (round + 1) to every hidden
    /// value, and reports one read byte.
    #[derive(Clone, Default)]
    struct MemoryRing(Arc<Mutex<Wire>>);

    impl MemoryRing {
        fn wire(&self) -> std::sync::MutexGuard<'_, Wire> {
            self.0.lock().unwrap()
        }
    }

    impl RingLink for MemoryRing {
        fn send(&mut self, frame: Frame) -> std::result::Result<(), String> {
            let mut w = self.wire();
            w.sent.push(frame.kind_name());
            match frame {
                Frame::Activations(mut a) => {
                    let add = 100.0 * (a.round as f32 + 1.0) * WORKERS as f32;
                    a.hidden.iter_mut().for_each(|x| *x += add);
                    a.reports = vec![StageReport { read_bytes: 1, ..StageReport::default() }; WORKERS];
                    w.queue.push_back(Frame::Activations(a));
                }
                Frame::KvOps { step, ops } => {
                    w.kv_seen.extend(ops.iter().cloned());
                    w.queue.push_back(Frame::KvOps { step, ops });
                }
                // Each worker keeps its rows (worker i's: bytes i + 1, `n` of them) or writes
                // back what it kept, and answers whether it did.
                Frame::Rows { step, seq, at, n, write, state, key, mut parts } => {
                    for i in 0..WORKERS {
                        let done = if write {
                            let rows = w.rows_kept.get(&(i, key)).cloned();
                            rows.map(|r| w.rows_written.push((i, seq, at, r))).is_some()
                        } else {
                            w.rows_kept.insert((i, key), vec![i as u8 + 1; n as usize]);
                            true
                        };
                        parts.push(if done { vec![1] } else { Vec::new() });
                    }
                    w.queue.push_back(Frame::Rows { step, seq, at, n, write, state, key, parts });
                }
                other => return Err(format!("unexpected {} frame", other.kind_name())),
            }
            Ok(())
        }

        fn receive(&mut self, _timeout: Duration) -> std::result::Result<Frame, String> {
            let mut w = self.wire();
            w.receives += 1;
            if w.fail_receive == Some(w.receives) {
                return Err("worker 10.0.0.7:9090 reset the ring link".into());
            }
            if w.error_frame == Some(w.receives) {
                return Ok(Frame::Error { step: 0, message: "worker leaving".into() });
            }
            let next = if w.reorder { w.queue.pop_back() } else { w.queue.pop_front() };
            next.ok_or_else(|| "nothing came round within the step timeout".into())
        }

        fn lost(&mut self) -> Option<String> {
            self.wire().closed.then(|| "10.0.0.7:9090 closed the ring link".into())
        }
    }

    /// A head whose window w adds 10 × (w + 1) to every value (tokens embed as their id):
    /// windows 0 and 1 in rounds 0 and 1, window 2 the output layer, logits = hidden.
    struct ScriptedHead {
        own: Vec<Option<usize>>,
        workers_compute: bool,
        applied: Vec<KvOp>,
        /// Window computations so far.
        computed: usize,
    }

    impl ScriptedHead {
        fn new() -> ScriptedHead {
            ScriptedHead { own: vec![Some(0), Some(1)], workers_compute: true, applied: Vec::new(), computed: 0 }
        }
    }

    impl HeadWindows for ScriptedHead {
        fn own(&self) -> &[Option<usize>] {
            &self.own
        }
        fn embed_window(&self) -> Option<usize> {
            None
        }
        fn output_window(&self) -> Option<usize> {
            Some(2)
        }
        fn workers_compute(&self) -> bool {
            self.workers_compute
        }
        fn counts_reads(&self) -> bool {
            true
        }
        fn forward(&mut self, window: usize, _round: Option<(usize, Option<Duration>)>, batch: &[BatchToken], input: StageInput<'_>) -> (Result<StageOutput>, Option<StageReport>) {
            self.computed += 1;
            let mut h: Vec<f32> = match input {
                StageInput::Tokens(t) => t.iter().flat_map(|&t| [t as f32; N_EMBD]).collect(),
                StageInput::Hidden(h) => h.to_vec(),
            };
            h.iter_mut().for_each(|x| *x += 10.0 * (window as f32 + 1.0));
            if window < 2 {
                return (Ok(StageOutput::Hidden(h)), None);
            }
            let rows: Vec<usize> = (0..batch.len()).filter(|&i| batch[i].logits).collect();
            let data = rows.iter().flat_map(|&i| h[i * N_EMBD..(i + 1) * N_EMBD].to_vec()).collect();
            (Ok(StageOutput::Logits(Logits { rows, n_vocab: N_EMBD, data })), None)
        }
        fn apply(&mut self, op: &KvOp) {
            self.applied.push(op.clone());
        }
    }

    /// What a token's logits are after the whole ring: head windows 0 and 1, both
    /// workers in both rounds, the output layer.
    fn expected(token: i32) -> f32 {
        token as f32 + 10.0 + 200.0 + 20.0 + 400.0 + 30.0
    }

    struct Rig {
        flights: Flights,
        head: ScriptedHead,
        links: Links,
        wire: MemoryRing,
        meter: RingMeter,
        board: PlanBoard,
    }

    impl Rig {
        fn new() -> Rig {
            let wire = MemoryRing::default();
            let mut links = Links::default();
            links.set(Box::new(wire.clone()));
            let workers: Vec<String> = (0..WORKERS).map(|i| format!("10.0.0.{i}:9090")).collect();
            Rig { flights: Flights::new(N_EMBD, Dtype::F32, Duration::from_secs(1)), head: ScriptedHead::new(), links, wire, meter: RingMeter::new("head", &workers), board: PlanBoard::ring() }
        }

        fn run<T>(&mut self, f: impl FnOnce(&mut Flights, &mut Ring<'_, ScriptedHead>) -> T) -> T {
            let mut ring = Ring { head: &mut self.head, links: &mut self.links, meter: &self.meter, board: &self.board, members: WORKERS + 1 };
            f(&mut self.flights, &mut ring)
        }

        /// Launches a micro-batch of `tokens` for `seq` from position `pos`, the last token
        /// wanting logits.
        fn launch(&mut self, ticket: u64, seq: SeqIdT, pos: u32, tokens: &[i32]) {
            let batch: Vec<BatchToken> = (0..tokens.len()).map(|i| BatchToken { seq, pos: pos + i as u32, logits: i + 1 == tokens.len() }).collect();
            self.run(|f, r| f.launch(r, ticket, &batch, tokens));
        }

        fn finish(&mut self) -> (u64, Result<Logits>) {
            self.run(|f, r| f.finish(r, NOTHING))
        }
    }

    type SeqIdT = engine::SeqId;

    #[test]
    fn micro_batches_come_back_in_the_order_they_left_with_every_round_computed() {
        let mut rig = Rig::new();
        rig.launch(0, 0, 0, &[5, 6, 7]);
        rig.launch(1, 1, 0, &[8]);
        rig.launch(2, 2, 0, &[9, 1]);
        // Each left for round 0 before any came back: three frames in the ring at once.
        assert_eq!(rig.wire.wire().queue.len(), 3);
        for (ticket, last) in [(0, 7), (1, 8), (2, 1)] {
            let (t, logits) = rig.finish();
            assert_eq!(t, ticket);
            let logits = logits.unwrap();
            assert_eq!(logits.data, vec![expected(last); N_EMBD], "ticket {t}");
        }
        let (t, e) = rig.finish();
        assert!(t == NOTHING && e.is_err(), "nothing left in flight");
        // Two rounds each: six activations frames, nothing else.
        assert_eq!(rig.wire.wire().sent, vec!["activations"; 6]);
    }

    #[test]
    fn rows_kept_round_a_ring_with_micro_batches_in_the_air_come_back_after_them_and_leave_them_whole() {
        let mut rig = Rig::new();
        rig.launch(0, 0, 0, &[5, 6, 7]);
        rig.launch(1, 1, 0, &[8]);
        // Rows of another sequence, kept while both are in the ring: the answers come back
        // after the frames ahead of them, which go on round.
        let parts = rig.run(|f, r| f.rows(r, 2, 64, 3, RowsOp::Keep, [5; 32])).unwrap();
        assert_eq!(parts, vec![vec![1], vec![1]]);
        assert_eq!(rig.wire.wire().sent, vec!["activations", "activations", "rows", "activations", "activations"]);
        for (ticket, last) in [(0, 7), (1, 8)] {
            let (t, logits) = rig.finish();
            assert_eq!((t, logits.unwrap().data), (ticket, vec![expected(last); N_EMBD]));
        }
        // Written back after the KV operations queued before, each worker from its own
        // store; a block a worker never kept is a miss in its answer, not an error.
        let parts = rig.run(|f, r| {
            f.kv(r, [KvOp::Truncate { seq: 2, len: 0 }]);
            f.rows(r, 2, 0, 3, RowsOp::Write, [5; 32]).unwrap()
        });
        assert_eq!(parts, vec![vec![1], vec![1]]);
        rig.wire.wire().rows_kept.remove(&(1, [5; 32]));
        assert_eq!(rig.run(|f, r| f.rows(r, 2, 0, 3, RowsOp::Write, [5; 32])).unwrap(), vec![vec![1], Vec::new()]);
        rig.launch(2, 2, 3, &[4]);
        let (t, r) = rig.finish();
        assert_eq!((t, r.unwrap().data), (2, vec![expected(4); N_EMBD]));
        let w = rig.wire.wire();
        assert_eq!(w.rows_written, vec![(0, 2, 0, vec![1; 3]), (1, 2, 0, vec![2; 3]), (0, 2, 0, vec![1; 3])]);
        assert_eq!(w.sent[5..], ["kv-ops", "rows", "rows", "activations", "activations"]);
        drop(w);
        // A broken ring keeps nothing.
        let next = rig.wire.wire().receives + 1;
        rig.wire.wire().fail_receive = Some(next);
        assert!(rig.run(|f, r| f.rows(r, 2, 0, 3, RowsOp::Keep, [6; 32])).is_err());
        assert!(!rig.links.formed());
        assert!(rig.run(|f, r| f.rows(r, 2, 0, 3, RowsOp::Write, [5; 32])).is_err());
    }

    #[test]
    fn a_restores_rows_frames_go_round_together_and_their_answers_come_back_in_order_after_the_micro_batches() {
        let mut rig = Rig::new();
        for key in [[1; 32], [2; 32], [3; 32]] {
            rig.run(|f, r| f.rows(r, 4, 0, 2, RowsOp::Keep, key)).unwrap();
        }
        // Worker 1 lost the middle block.
        rig.wire.wire().rows_kept.remove(&(1, [2; 32]));
        rig.launch(0, 0, 0, &[5, 6]);
        let before = rig.wire.wire().sent.len();
        let answers = rig
            .run(|f, r| {
                let steps: Vec<u64> = [[1; 32], [2; 32], [3; 32]].iter().enumerate().map(|(b, key)| f.send_rows(r, 4, 2 * b, 2, RowsOp::Write, *key).unwrap()).collect();
                f.rows_back(r, &steps)
            })
            .unwrap();
        assert_eq!(answers, vec![vec![vec![1], vec![1]], vec![vec![1], Vec::new()], vec![vec![1], vec![1]]]);
        // Three frames left one after another; the micro-batch ahead of them came back first
        // and went round again after them.
        assert_eq!(rig.wire.wire().sent[before..], ["rows", "rows", "rows", "activations"]);
        let (t, logits) = rig.finish();
        assert_eq!((t, logits.unwrap().data), (0, vec![expected(6); N_EMBD]));
        let written: Vec<(usize, u32)> = rig.wire.wire().rows_written.iter().map(|&(w, _, at, _)| (w, at)).collect();
        assert_eq!(written, vec![(0, 0), (1, 0), (0, 2), (0, 4), (1, 4)]);
        // Nothing sent: nothing to wait for; a broken ring answers none.
        assert_eq!(rig.run(|f, r| f.rows_back(r, &[])).unwrap(), Vec::<Vec<Vec<u8>>>::new());
        let next = rig.wire.wire().receives + 1;
        rig.wire.wire().fail_receive = Some(next);
        assert!(rig.run(|f, r| {
            let step = f.send_rows(r, 4, 0, 2, RowsOp::Write, [1; 32]).unwrap();
            f.rows_back(r, &[step])
        })
        .is_err());
        assert!(!rig.links.formed());
    }

    #[test]
    fn a_ring_that_breaks_with_micro_batches_in_the_air_fails_each_and_truncates_their_caches() {
        let mut rig = Rig::new();
        rig.launch(0, 0, 0, &[5, 6]);
        rig.launch(1, 1, 3, &[8]);
        rig.launch(2, 2, 0, &[9]);
        // The first comes back and goes round again; then the link resets.
        rig.wire.wire().fail_receive = Some(2);
        let mut failed = Vec::new();
        for _ in 0..3 {
            let (t, r) = rig.finish();
            let e = r.expect_err("the ring broke");
            assert!(matches!(&e, Error::RingBroken(m) if m.contains("reset the ring link")), "{e}");
            failed.push(t);
        }
        failed.sort();
        assert_eq!(failed, vec![0, 1, 2]);
        assert!(!rig.links.formed());
        // No cache keeps half of a failed micro-batch: each sequence goes back to where
        // its micro-batch started.
        let mut applied = rig.head.applied.clone();
        applied.sort_by_key(|op| format!("{op:?}"));
        assert_eq!(applied, vec![KvOp::Truncate { seq: 0, len: 0 }, KvOp::Truncate { seq: 1, len: 3 }, KvOp::Truncate { seq: 2, len: 0 }]);
        // A broken ring fails the next step at once, with why, and computes nothing.
        let computed = rig.head.computed;
        rig.launch(3, 0, 0, &[4]);
        let (t, r) = rig.finish();
        assert_eq!(t, 3);
        assert!(r.is_err_and(|e| e.to_string().contains("reset the ring link")));
        assert_eq!(rig.head.computed, computed);
        // Formed again (the workers start empty): the KV operations of the broken ring were
        // never queued for the new one, and steps run again.
        let fresh = MemoryRing::default();
        rig.links.set(Box::new(fresh.clone()));
        rig.launch(4, 0, 0, &[4]);
        let (t, r) = rig.finish();
        assert_eq!((t, r.unwrap().data), (4, vec![expected(4); N_EMBD]));
        assert!(fresh.wire().kv_seen.is_empty());
    }

    #[test]
    fn a_member_leaving_mid_flight_fails_what_is_in_the_ring_and_nothing_else() {
        let mut rig = Rig::new();
        rig.launch(0, 0, 0, &[5]);
        let (t, r) = rig.finish();
        assert_eq!((t, r.unwrap().data), (0, vec![expected(5); N_EMBD]));
        rig.launch(1, 1, 0, &[6]);
        rig.launch(2, 2, 0, &[7]);
        let receives = rig.wire.wire().receives;
        rig.wire.wire().error_frame = Some(receives + 1);
        for _ in 0..2 {
            let (_, r) = rig.finish();
            assert!(r.is_err_and(|e| matches!(&e, Error::RingBroken(m) if m.contains("a worker failed: worker leaving"))));
        }
        // The micro-batch that had landed keeps its cache.
        assert!(!rig.head.applied.contains(&KvOp::Truncate { seq: 0, len: 0 }), "{:?}", rig.head.applied);
    }

    #[test]
    fn frames_out_of_order_break_the_ring() {
        let mut rig = Rig::new();
        rig.wire.wire().reorder = true;
        rig.launch(0, 0, 0, &[5]);
        rig.launch(1, 1, 0, &[6]);
        let (_, r) = rig.finish();
        assert!(r.is_err_and(|e| e.to_string().contains("out-of-order activations")));
        assert!(!rig.links.formed());
    }

    #[test]
    fn kv_operations_go_ahead_of_the_next_frame_and_their_echo_is_skipped() {
        let mut rig = Rig::new();
        rig.run(|f, r| f.kv(r, [KvOp::Clear { seq: 3 }]));
        assert_eq!(rig.head.applied, vec![KvOp::Clear { seq: 3 }], "applied on the head at once");
        assert!(rig.wire.wire().sent.is_empty(), "no round trip of their own");
        rig.launch(0, 0, 0, &[5]);
        assert_eq!(rig.wire.wire().sent, vec!["kv-ops", "activations"]);
        let (_, r) = rig.finish();
        assert_eq!(r.unwrap().data, vec![expected(5); N_EMBD]);
        assert_eq!(rig.wire.wire().kv_seen, vec![KvOp::Clear { seq: 3 }]);
    }

    #[test]
    fn a_sequence_still_in_the_ring_is_not_truncated_under_a_later_micro_batch() {
        let mut rig = Rig::new();
        // Two micro-batches of one sequence in flight (a prompt cut into chunks).
        rig.launch(0, 0, 0, &[1, 2, 3, 4]);
        rig.launch(1, 0, 4, &[5, 6]);
        rig.wire.wire().fail_receive = Some(1);
        assert!(rig.finish().1.is_err() && rig.finish().1.is_err());
        // The first landed while the second was still in the ring: only the second's
        // truncation is applied (the batching loop clears the sequence once it lands).
        assert_eq!(rig.head.applied, vec![KvOp::Truncate { seq: 0, len: 4 }]);
    }

    #[test]
    fn a_lost_link_is_seen_while_idle() {
        let mut rig = Rig::new();
        assert!(rig.links.watch().is_ok());
        rig.wire.wire().closed = true;
        let e = rig.links.watch().unwrap_err();
        assert!(e.to_string().contains("while idle") && e.to_string().contains("closed the ring link"), "{e}");
        assert!(!rig.links.formed());
        assert!(rig.links.why().contains("closed the ring link"));
    }

    #[test]
    fn a_head_holding_every_layer_needs_no_ring() {
        let mut rig = Rig::new();
        rig.head.workers_compute = false;
        rig.links.clear();
        rig.launch(0, 0, 0, &[5]);
        let (t, r) = rig.finish();
        // Windows 0, 1 and the output layer, no worker.
        assert_eq!((t, r.unwrap().data), (0, vec![5.0 + 10.0 + 20.0 + 30.0; N_EMBD]));
        assert!(rig.wire.wire().sent.is_empty());
    }
}
