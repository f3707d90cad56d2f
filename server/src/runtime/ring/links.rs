//! The head's two ring links — frames out to the first worker, frames back from the last —
//! and whether the ring is whole. The micro-batches in flight (`flights`) see the ring only
//! through [`RingLink`], so their ordering and failure handling are tested with an
//! in-memory ring; [`TcpRing`] is the real one, formed by [`form`].
//!
//! A failed hop breaks the ring: the link is dropped and every step fails fast with why,
//! until the head forms the ring again.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use transport::{ControlClient, Frame, FrameSink, FrameStream, Link, LinkConfig, LinkServer};

use super::board::PlanBoard;
use super::head::RingConfig;
use super::WorkerPlan;
use crate::error::{Error, Result};
use scheduler::Plan;

/// The ring as the head's micro-batches use it.
pub trait RingLink: Send {
    /// Sends a frame to the first worker. Frames that come back meanwhile are kept for
    /// `receive`: the last worker is never left waiting for the head to read while the
    /// head waits to send.
    fn send(&mut self, frame: Frame) -> std::result::Result<(), String>;
    /// The next frame from the last worker, waiting at most `timeout`.
    fn receive(&mut self, timeout: Duration) -> std::result::Result<Frame, String>;
    /// Without waiting: why the ring is lost, if a look at the link back tells (a worker
    /// died while nothing travelled), or that something came round unasked.
    fn lost(&mut self) -> Option<String>;
}

/// The ring's state on the head: a formed link, or why there is none.
#[derive(Default)]
pub struct Links {
    link: Option<Box<dyn RingLink>>,
    broken: Option<String>,
    /// Since when it is broken (the first failed attempt to form it again).
    broken_since: Option<Instant>,
}

impl Links {
    pub fn formed(&self) -> bool {
        self.link.is_some()
    }

    /// The ring carries frames (again).
    pub fn set(&mut self, link: Box<dyn RingLink>) {
        self.link = Some(link);
        self.broken = None;
        self.broken_since = None;
    }

    /// No link, and no failure to report: a plan without workers, or one being adopted.
    pub fn clear(&mut self) {
        self.link = None;
        self.broken = None;
        self.broken_since = None;
    }

    /// Why the ring carries nothing now.
    pub fn why(&self) -> String {
        self.broken.clone().unwrap_or_else(|| "the ring is not formed".into())
    }

    /// Keeps why the ring could not be formed (for /health), without counting another
    /// break.
    pub fn still_broken(&mut self, why: String) {
        self.broken = Some(why);
    }

    /// How long the ring has been broken, counting from the first call.
    pub fn broken_for(&mut self) -> Duration {
        self.broken_since.get_or_insert_with(Instant::now).elapsed()
    }

    /// The ring is broken: the link is gone until it is formed again; why is kept for
    /// /health and returned as the error every step gets meanwhile.
    pub fn break_ring(&mut self, why: String) -> Error {
        tracing::error!("ring broken: {why}");
        crate::metrics::ring_broke();
        self.link = None;
        self.broken = Some(why.clone());
        Error::RingBroken(why)
    }

    pub fn send(&mut self, frame: Frame) -> std::result::Result<(), String> {
        match self.link.as_mut() {
            Some(l) => l.send(frame),
            None => Err(self.why()),
        }
    }

    pub fn receive(&mut self, timeout: Duration) -> std::result::Result<Frame, String> {
        match self.link.as_mut() {
            Some(l) => l.receive(timeout),
            None => Err(self.why()),
        }
    }

    /// While idle nothing travels the ring, so a worker that died would go unnoticed until
    /// the next request: a look at the link back, without waiting, tells.
    pub fn watch(&mut self) -> Result<()> {
        match self.link.as_mut().and_then(|l| l.lost()) {
            None => Ok(()),
            Some(why) => Err(self.break_ring(format!("while idle: {why}"))),
        }
    }
}

/// The real ring: a link to the first worker and one back from the last, driven from the
/// head's serving thread on the ring's I/O runtime.
pub struct TcpRing {
    rt: Handle,
    to_first: FrameSink,
    from_last: FrameStream,
    /// Frames read from the ring while the head was sending, not yet taken.
    early: VecDeque<std::result::Result<Option<Frame>, String>>,
}

impl RingLink for TcpRing {
    fn send(&mut self, frame: Frame) -> std::result::Result<(), String> {
        let TcpRing { rt, to_first, from_last, early } = self;
        let sent = rt.block_on(async {
            let send = to_first.send(&frame);
            tokio::pin!(send);
            loop {
                tokio::select! {
                    biased;
                    r = &mut send => return r.map_err(|e| e.to_string()),
                    f = from_last.recv() => {
                        let end = !matches!(f, Ok(Some(_)));
                        early.push_back(f.map_err(|e| e.to_string()));
                        if end {
                            // The link back is gone: the send may never finish.
                            return Err(early.back().map(|r| match r { Err(e) => e.clone(), _ => format!("{} closed the ring link", from_last.peer()) }).unwrap_or_default());
                        }
                    }
                }
            }
        });
        if sent.is_ok() {
            // Sent means encoded: the frame coming back decodes into its buffers.
            from_last.recycle(frame);
        }
        sent
    }

    fn receive(&mut self, timeout: Duration) -> std::result::Result<Frame, String> {
        if let Some(f) = self.early.pop_front() {
            return f.and_then(|f| f.ok_or_else(|| "the ring link closed".to_string()));
        }
        let from_last = &mut self.from_last;
        match self.rt.block_on(from_last.recv_within(timeout)) {
            Ok(Some(f)) => Ok(f),
            Ok(None) => Err(format!("{} closed the ring link", from_last.peer())),
            Err(e) => Err(e.to_string()),
        }
    }

    fn lost(&mut self) -> Option<String> {
        // Any worker's death closes the link back to the head (each member ends its
        // outgoing link when its incoming one ends, and keep-alive pings end a link to a
        // frozen one).
        if let Some(f) = self.early.pop_front() {
            return Some(match f {
                Ok(Some(f)) => format!("an unexpected {} frame came round while idle", f.kind_name()),
                Ok(None) => format!("{} closed the ring link", self.from_last.peer()),
                Err(e) => e,
            });
        }
        let from_last = &mut self.from_last;
        self.rt.block_on(async {
            match tokio::time::timeout(Duration::ZERO, from_last.recv()).await {
                Err(_) => None,
                Ok(Ok(None)) => Some(format!("{} closed the ring link", from_last.peer())),
                Ok(Ok(Some(f))) => Some(format!("an unexpected {} frame came round while idle", f.kind_name())),
                Ok(Err(e)) => Some(e.to_string()),
            }
        })
    }
}

/// How long forming the ring may wait for the last worker to dial back, in units of the
/// link handshake timeout: every worker in between opens its own link first.
const FORM_WAIT_HANDSHAKES: u32 = 4;

/// What forming the ring needs from the head.
pub struct Formation<'a> {
    pub rt: &'a tokio::runtime::Runtime,
    pub cfg: &'a RingConfig,
    pub plan: &'a Plan,
    /// The workers after the head, in ring order, each with its control connection (from
    /// the check that it has its windows).
    pub workers: &'a [String],
    pub clients: Vec<ControlClient>,
    pub server: &'a mut LinkServer,
    pub link_config: &'a LinkConfig,
    pub fingerprint: &'a str,
    pub head_id: &'a str,
    pub board: &'a Arc<PlanBoard>,
    /// The step number of the probe frame sent round.
    pub probe: u64,
}

/// Sends every worker its plan, links head -> first worker, waits for the last worker to
/// link back, and sends a probe frame round to prove the whole ring carries frames.
pub fn form(f: Formation<'_>) -> Result<TcpRing> {
    let Formation { rt, cfg, plan, workers, clients, server, link_config, fingerprint, head_id, board, probe } = f;
    let (to_first, from_last) = rt.block_on(async {
        let back = match &cfg.setup.advertise {
            Some(a) => a.clone(),
            None => super::reachable_at(server.local_addr(), &workers[workers.len() - 1]).await,
        };
        for (i, (w, client)) in workers.iter().zip(&clients).enumerate() {
            let next = workers.get(i + 1).cloned().unwrap_or_else(|| back.clone());
            let wp = WorkerPlan {
                fingerprint: fingerprint.to_string(),
                windows: plan.windows_of(i + 1).iter().map(|r| (r.start, r.end)).collect(),
                gpu_layers: plan.devices.get(i + 1).map_or(0, |d| d.gpu_layers),
                experts_in_ram: plan.devices.get(i + 1).map_or(0, |d| d.experts_in_ram),
                next,
                n_seq: cfg.n_seq,
                n_ctx_seq: cfg.n_ctx_seq,
                max_batch: cfg.max_batch,
                release: cfg.setup.release,
                batch_invariant: cfg.batch_invariant,
                draft_snapshots: cfg.draft_snapshots,
                kv: cfg.kv,
                threads: plan.devices.get(i + 1).map_or(0, |d| d.threads),
                head: head_id.to_string(),
            };
            let body = serde_json::to_value(&wp).map_err(|e| Error::RingRefused(e.to_string()))?;
            let reply = client.call(transport::methods::LOAD_PLAN, &body).await.map_err(|e| Error::RingRefused(format!("worker {w} refused the plan: {e}")))?;
            // A worker's own --gpu-layers / --experts-in-ram override the plan on that
            // worker: /admin/plan and the metrics show what it placed.
            let placed = |key: &str, planned: usize| reply[key].as_u64().map_or(planned, |p| p as usize);
            let (n, e) = (placed("gpu_layers", wp.gpu_layers), placed("experts_in_ram", wp.experts_in_ram));
            if (n, e) != (wp.gpu_layers, wp.experts_in_ram) {
                tracing::warn!(worker = %w, planned_gpu_layers = wp.gpu_layers, gpu_layers = n, planned_experts_in_ram = wp.experts_in_ram, experts_in_ram = e, "the worker's own --gpu-layers/--experts-in-ram override the plan");
            }
            board.placed(i + 1, n, e);
        }
        // Links a half-formed earlier attempt left queued would carry nothing.
        while let Ok(Some(stale)) = tokio::time::timeout(Duration::ZERO, server.accept()).await {
            tracing::debug!(peer = %stale.peer(), "dropping a stale ring link");
        }
        // Connecting to the first worker makes each worker dial its successor; the last
        // one dials back here.
        let first = &workers[0];
        let mut to_first = Link::connect(first, &cfg.setup.secret, link_config).await.map_err(|e| super::connecting(first, e))?.sink;
        let mut from_last = tokio::time::timeout(link_config.handshake_timeout * FORM_WAIT_HANDSHAKES, server.accept())
            .await
            .map_err(|_| Error::RingRefused("the last worker did not connect back to the head (is --ring-listen reachable from it?)".into()))?
            .ok_or_else(|| Error::RingRefused("the head's ring listener closed".into()))?
            .stream;
        from_last.set_peer(workers.last().map_or("the last worker", String::as_str));
        to_first.send(&Frame::KvOps { step: probe, ops: Vec::new() }).await.map_err(|e| Error::RingBroken(e.to_string()))?;
        match from_last.recv_within(cfg.setup.step_timeout).await {
            Ok(Some(Frame::KvOps { step, .. })) if step == probe => Ok((to_first, from_last)),
            Ok(Some(Frame::Error { message, .. })) => Err(Error::RingBroken(format!("a worker failed the ring probe: {message}"))),
            Ok(other) => Err(Error::RingBroken(format!("the ring probe came back as {}", other.map_or("the end of the stream", |f| f.kind_name())))),
            Err(e) => Err(Error::RingBroken(format!("the ring probe did not come round: {e}"))),
        }
    })?;
    Ok(TcpRing { rt: rt.handle().clone(), to_first, from_last, early: VecDeque::new() })
}
