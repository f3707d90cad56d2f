//! The embedding model beside the chat model: one thread owns it (`engine::embedder`), the
//! HTTP side queues token lists to it, and every input waiting when the thread turns to
//! the queue is computed in the same decodes, whichever requests they came from — a RAG
//! ingest of many small requests costs what one request of all its texts would.
//!
//! The embedding model runs whole on the head and never joins the ring: answers do not
//! depend on the plan, and embeddings keep working while the ring re-forms.

use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use engine::embedder::{Embedder, EmbedderConfig, MAX_SEQS_PER_DECODE};
use engine::tokenizer::Tokenizer;
use tokio::sync::oneshot;

/// Requests that may wait for the embedding thread; more are refused (HTTP 429) rather
/// than queued without bound.
pub const QUEUE_REQUESTS: usize = 64;

/// Inputs the thread takes from the queue for one round of decodes: enough to fill
/// several decodes, few enough that a request queued behind a large one waits one round.
const INPUTS_PER_ROUND: usize = 4 * MAX_SEQS_PER_DECODE;

/// Why an embedding request was not answered.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EmbedError {
    #[error("the embedding queue is full")]
    QueueFull,
    #[error("the embedding model stopped")]
    Stopped,
    #[error("{0}")]
    Engine(String),
}

struct Job {
    inputs: Vec<Vec<i32>>,
    reply: oneshot::Sender<Result<Vec<Vec<f32>>, EmbedError>>,
}

/// What the API tells of the embedding model and needs to prepare requests.
pub struct EmbeddingModel {
    /// The id clients name it by.
    pub id: String,
    pub tokenizer: Arc<Tokenizer>,
    /// Values per vector.
    pub dims: usize,
    /// Tokens one input may have.
    pub n_ctx: usize,
    pub pooling: engine::embedder::Pooling,
    pub arch: String,
}

/// The queue to the embedding thread; the thread ends when this is dropped.
pub struct EmbeddingService {
    pub model: EmbeddingModel,
    jobs: SyncSender<Job>,
}

impl EmbeddingService {
    /// Starts the thread that owns `embedder`.
    pub fn start(id: String, embedder: Embedder) -> std::io::Result<EmbeddingService> {
        let model = EmbeddingModel { id, tokenizer: embedder.tokenizer().clone(), dims: embedder.dims(), n_ctx: embedder.n_ctx(), pooling: embedder.pooling(), arch: embedder.arch().to_string() };
        let (jobs, rx) = mpsc::sync_channel(QUEUE_REQUESTS);
        std::thread::Builder::new().name("embeddings".into()).spawn(move || run(embedder, rx))?;
        Ok(EmbeddingService { model, jobs })
    }

    /// Loads the model at `path` and starts its thread.
    pub fn load(id: String, path: &std::path::Path, config: &EmbedderConfig) -> Result<EmbeddingService, Box<dyn std::error::Error>> {
        let embedder = Embedder::load(path, config)?;
        Ok(Self::start(id, embedder)?)
    }

    /// The pooled, not normalised, vector of each input. Inputs are checked by the caller
    /// (non-empty, within `n_ctx`, in the vocabulary).
    pub async fn embed(&self, inputs: Vec<Vec<i32>>) -> Result<Vec<Vec<f32>>, EmbedError> {
        let (reply, rx) = oneshot::channel();
        self.jobs.try_send(Job { inputs, reply }).map_err(|e| match e {
            TrySendError::Full(_) => EmbedError::QueueFull,
            TrySendError::Disconnected(_) => EmbedError::Stopped,
        })?;
        rx.await.map_err(|_| EmbedError::Stopped)?
    }
}

fn run(mut embedder: Embedder, rx: Receiver<Job>) {
    while let Ok(first) = rx.recv() {
        let mut round = vec![first];
        let mut inputs = round[0].inputs.len();
        while inputs < INPUTS_PER_ROUND {
            match rx.try_recv() {
                Ok(job) => {
                    inputs += job.inputs.len();
                    round.push(job);
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        // A client that went away needs no answer.
        round.retain(|j| !j.reply.is_closed());
        if round.is_empty() {
            continue;
        }
        let start = Instant::now();
        let all: Vec<&[i32]> = round.iter().flat_map(|j| j.inputs.iter().map(Vec::as_slice)).collect();
        let tokens: usize = all.iter().map(|i| i.len()).sum();
        match embedder.embed(&all) {
            Ok(vectors) => {
                crate::metrics::embedded(all.len(), tokens, start.elapsed());
                let mut vectors = vectors.into_iter();
                for job in round {
                    let mine: Vec<Vec<f32>> = vectors.by_ref().take(job.inputs.len()).collect();
                    let _ = job.reply.send(Ok(mine));
                }
            }
            // One request's failure must not fail the others it shared decodes with.
            Err(_) if round.len() > 1 => {
                for job in round {
                    let slices: Vec<&[i32]> = job.inputs.iter().map(Vec::as_slice).collect();
                    let _ = job.reply.send(embedder.embed(&slices).map_err(|e| EmbedError::Engine(e.to_string())));
                }
            }
            Err(e) => {
                let _ = round.pop().map(|job| job.reply.send(Err(EmbedError::Engine(e.to_string()))));
            }
        }
    }
}
