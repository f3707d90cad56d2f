//! The head's side of the ring: an `engine::Pipeline` whose windows are partly local
//! (the head's own, plus the embedding `0..0` and the output layer `L..L`) and partly on
//! workers, reached over one authenticated link to the first worker and back from the
//! last. One micro-batch is in the ring at a time, as in prima.cpp.

use std::net::SocketAddr;
use std::sync::Arc;

use engine::{BatchToken, Logits, ModelFile, Pipeline, SeqId, Stage, StageConfig, StageInput, StageOutput};
use scheduler::Plan;
use transport::{Activations, ClusterSecret, ControlClient, Dtype, Frame, FrameSink, FrameStream, KvOp, Link, LinkConfig, LinkServer, TokenMeta};

use super::WorkerPlan;

pub struct RingPipeline {
    rt: tokio::runtime::Runtime,
    stage: Stage,
    /// Stage window index of the head's window in each round, if it has one.
    own: Vec<Option<usize>>,
    output_window: usize,
    /// Whether workers hold layers (a plan may give them none).
    workers_compute: bool,
    to_first: FrameSink,
    from_last: FrameStream,
    _server: LinkServer,
    step: u64,
    n_embd: usize,
    dtype: Dtype,
    n_ctx: usize,
}

pub struct RingConfig {
    pub workers: Vec<String>,
    pub secret: ClusterSecret,
    pub plan: Plan,
    /// Where the last worker connects back to; its host must be reachable from it.
    pub listen: SocketAddr,
    pub n_seq: usize,
    pub n_ctx_seq: usize,
    pub max_batch: usize,
    pub threads: usize,
    pub f16: bool,
}

fn ring_err(e: impl std::fmt::Display) -> engine::Error {
    engine::Error::Pipeline(e.to_string())
}

impl RingPipeline {
    pub fn connect(file: Arc<ModelFile>, cfg: RingConfig) -> Result<RingPipeline, Box<dyn std::error::Error>> {
        let n_layer = file.spec.n_layer;
        let plan = &cfg.plan;
        if plan.devices.len() != cfg.workers.len() + 1 {
            return Err(format!("the plan has {} devices but there are {} workers plus the head", plan.devices.len(), cfg.workers.len()).into());
        }
        let own_windows = plan.windows_of(0);
        let mut windows = vec![0..0];
        windows.extend(own_windows.iter().cloned());
        windows.push(n_layer..n_layer);
        let own: Vec<Option<usize>> = (0..plan.rounds()).map(|r| (!own_windows.is_empty()).then_some(r + 1)).collect();
        let output_window = windows.len() - 1;
        let stage = Stage::new(
            file.clone(),
            StageConfig { windows, n_seq: cfg.n_seq, n_ctx_seq: cfg.n_ctx_seq, max_batch: cfg.max_batch, threads: cfg.threads, accel_layers: 0, owns_output: true },
        )?;
        let fingerprint = file.fingerprint();
        let rt = crate::serve::http_runtime()?;
        let link_config = LinkConfig::default();
        let (to_first, from_last, server) = rt.block_on(async {
            let mut server = LinkServer::bind(cfg.listen, cfg.secret.clone(), link_config.clone(), None).await?;
            let back = server.local_addr().to_string();
            for (i, w) in cfg.workers.iter().enumerate() {
                let next = cfg.workers.get(i + 1).cloned().unwrap_or_else(|| back.clone());
                let wp = WorkerPlan {
                    fingerprint: fingerprint.clone(),
                    windows: plan.windows_of(i + 1).iter().map(|r| (r.start, r.end)).collect(),
                    next,
                    n_seq: cfg.n_seq,
                    n_ctx_seq: cfg.n_ctx_seq,
                    max_batch: cfg.max_batch,
                };
                let client = ControlClient::connect(w, &cfg.secret, &link_config).await.map_err(|e| format!("worker {w}: {e}"))?;
                client.call(transport::methods::LOAD_PLAN, &serde_json::to_value(&wp)?).await.map_err(|e| format!("worker {w} refused the plan: {e}"))?;
            }
            let first = Link::connect(&cfg.workers[0], &cfg.secret, &link_config).await?;
            // Connecting to the first worker makes each worker dial its successor; the
            // last one dials back here.
            let last = tokio::time::timeout(link_config.handshake_timeout * 4, server.accept())
                .await
                .map_err(|_| "the last worker did not connect back to the head (is --ring-listen reachable from it?)")?
                .ok_or("the head's ring listener closed")?;
            Ok::<_, Box<dyn std::error::Error>>((first.sink, last.stream, server))
        })?;
        tracing::info!(workers = ?cfg.workers, rounds = plan.rounds(), "ring formed");
        Ok(RingPipeline {
            rt,
            stage,
            own,
            output_window,
            workers_compute: plan.devices[1..].iter().any(|d| d.window > 0),
            to_first,
            from_last,
            _server: server,
            step: 0,
            n_embd: file.spec.n_embd,
            dtype: if cfg.f16 { Dtype::F16 } else { Dtype::F32 },
            n_ctx: cfg.n_ctx_seq,
        })
    }

    fn hidden(o: StageOutput) -> engine::Result<Vec<f32>> {
        match o {
            StageOutput::Hidden(h) => Ok(h),
            StageOutput::Logits(_) => Err(ring_err("a middle window returned logits")),
        }
    }

    /// Sends a frame round the ring and waits for it to come back.
    fn round_trip(&mut self, frame: Frame) -> engine::Result<Frame> {
        let (sink, stream) = (&mut self.to_first, &mut self.from_last);
        self.rt.block_on(async {
            sink.send(&frame).await.map_err(ring_err)?;
            match stream.recv().await.map_err(ring_err)? {
                Some(Frame::Error { message, .. }) => Err(ring_err(format!("a worker failed: {message}"))),
                Some(f) => Ok(f),
                None => Err(ring_err("the ring closed")),
            }
        })
    }

    fn forward_ring(&mut self, batch: &[BatchToken], tokens: &[i32]) -> engine::Result<Logits> {
        self.step += 1;
        let mut metas: Vec<TokenMeta> = batch.iter().map(|t| TokenMeta { seq: t.seq, pos: t.pos, wants_logits: t.logits }).collect();
        let mut h = Self::hidden(self.stage.forward(0, batch, StageInput::Tokens(tokens))?)?;
        for round in 0..self.own.len() {
            if let Some(w) = self.own[round] {
                h = Self::hidden(self.stage.forward(w, batch, StageInput::Hidden(&h))?)?;
            }
            if self.workers_compute {
                // The token list travels round and comes back: reuse it, no copy per round.
                let a = Activations { step: self.step, round: round as u32, n_embd: self.n_embd as u32, dtype: self.dtype, tokens: std::mem::take(&mut metas), hidden: h };
                h = match self.round_trip(Frame::Activations(a))? {
                    Frame::Activations(back) if back.step == self.step && back.round == round as u32 => {
                        metas = back.tokens;
                        back.hidden
                    }
                    other => return Err(ring_err(format!("out-of-order {} frame from the ring", other.kind_name()))),
                };
            }
        }
        match self.stage.forward(self.output_window, batch, StageInput::Hidden(&h))? {
            StageOutput::Logits(l) => Ok(l),
            StageOutput::Hidden(_) => Err(ring_err("the output window returned hidden states")),
        }
    }

    fn kv(&mut self, ops: Vec<KvOp>) {
        for op in &ops {
            match *op {
                KvOp::Clear { seq } => self.stage.clear_sequence(seq),
                KvOp::Truncate { seq, len } => self.stage.truncate_sequence(seq, len as usize),
            }
        }
        if self.workers_compute {
            self.step += 1;
            if let Err(e) = self.round_trip(Frame::KvOps { step: self.step, ops }) {
                tracing::error!("KV operation did not go round the ring: {e}");
            }
        }
    }
}

impl Pipeline for RingPipeline {
    fn forward(&mut self, batch: &[BatchToken], tokens: &[i32]) -> engine::Result<Logits> {
        let result = self.forward_ring(batch, tokens);
        if result.is_err() {
            // Some windows may hold part of this batch: roll every sequence back.
            let mut ops = Vec::new();
            for t in batch {
                let len = batch.iter().filter(|b| b.seq == t.seq).map(|b| b.pos).min().unwrap_or(0);
                if !ops.contains(&KvOp::Truncate { seq: t.seq, len }) {
                    ops.push(KvOp::Truncate { seq: t.seq, len });
                }
            }
            self.kv(ops);
        }
        result
    }

    fn clear_sequence(&mut self, seq: SeqId) {
        self.kv(vec![KvOp::Clear { seq }]);
    }

    fn truncate_sequence(&mut self, seq: SeqId, len: usize) {
        self.kv(vec![KvOp::Truncate { seq, len: len as u32 }]);
    }

    fn n_ctx_seq(&self) -> usize {
        self.n_ctx
    }
}
