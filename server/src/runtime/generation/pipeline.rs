//! What the batching loop drives: every layer of the model behind one call. The engine's
//! `LocalPipeline` runs every window on this machine; the ring's head
//! (`runtime::ring::RingPipeline`) runs some on other devices, which is why this trait
//! lives here and not in the engine: a pipeline that can lose a member needs `recover`,
//! one that re-plans needs `idle`, and one whose devices can work on different batches at
//! once (a ring) takes several micro-batches in flight (`depth`, `start`, `finish`).
//! Tests drive the batcher through a scripted one.

use std::sync::Arc;
use std::time::Duration;

use engine::{BatchToken, LocalPipeline, Logits, SeqId};

use super::prefix_cache::BlockId;
use crate::error::Result;

pub trait Pipeline: Send {
    /// Runs `batch` (token ids in `tokens`) through every layer; returns the logits of the
    /// tokens that asked for them. On error no window keeps any of the batch.
    /// `Error::RingBroken`: a member failed (the requests may be retried once the ring is
    /// whole); any other error: this machine failed.
    fn forward(&mut self, batch: &[BatchToken], tokens: &[i32]) -> Result<Logits>;
    /// How many micro-batches may be in flight at once (`start`ed and not yet
    /// `finish`ed). 1: every batch goes through `forward`.
    fn depth(&self) -> usize {
        1
    }
    /// Tokens per prompt chunk when a prompt of `prompt` tokens is cut for `depth()`
    /// micro-batches in flight: chunks follow one another through the devices, so a
    /// smaller chunk starts the next device sooner but costs each device more per token.
    fn prompt_chunk(&self, prompt: usize, max_batch: usize) -> usize {
        let _ = prompt;
        max_batch
    }
    /// Sends a micro-batch on its way (only when `depth() > 1`); `ticket` names it when it
    /// finishes. Micro-batches reach every device in the order they were started, so a
    /// sequence's prompt chunks may follow one another in flight. An error: nothing of it
    /// was computed anywhere.
    fn start(&mut self, ticket: u64, batch: &[BatchToken], tokens: &[i32]) -> Result<()> {
        let _ = (ticket, batch, tokens);
        Err(crate::Error::Config("this pipeline holds one batch at a time".into()))
    }
    /// Waits for the next micro-batch in flight to finish: its ticket and what `forward`
    /// would have returned for it. Only called while one is in flight.
    fn finish(&mut self) -> (u64, Result<Logits>) {
        (0, Err(crate::Error::Config("this pipeline holds one batch at a time".into())))
    }
    /// Forgets a sequence everywhere.
    fn clear_sequence(&mut self, seq: SeqId);
    /// Keeps positions [0, len) of a sequence everywhere; returns the length kept, which
    /// is less for a model with recurrent layers (see `keeps_state`) unless a checkpoint
    /// was taken at `len`.
    fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> usize;
    /// Gives sequence `to` the first `len` positions of sequence `from` everywhere,
    /// whatever `to` held; returns the positions copied (0 where the pipeline cannot: a
    /// model with recurrent layers). Only called when nothing of either is in flight.
    fn copy_sequence(&mut self, from: SeqId, to: SeqId, len: usize) -> usize {
        let _ = (from, to, len);
        0
    }
    /// What a block of rows read by `read_rows` holds (layers, K/V types and widths, the
    /// recurrent state's), for the prompt cache's namespace; `None`: this pipeline keeps no
    /// blocks (a ring not formed).
    fn row_layout(&self) -> Option<String> {
        None
    }
    /// Positions `[at, at + n)` of a sequence's K/V rows as prompt-cache block `key`, for
    /// the prompt cache; `with_state`, a model that keeps a recurrent state adds the state
    /// where they end, had only where they end the sequence. A ring's workers keep their
    /// own rows of the block under `key` (what comes back holds the head's). Only called
    /// when nothing of the sequence is in flight.
    fn read_rows(&mut self, seq: SeqId, at: usize, n: usize, key: &BlockId, with_state: bool) -> Option<Vec<u8>> {
        let _ = (seq, at, n, key, with_state);
        None
    }
    /// Puts block `key` from `read_rows` back as positions `[at, at + n)` of `seq`, which
    /// keeps its first `at`; a block read without the state leaves a recurrent state behind
    /// (a restore ends on one read with it). `Err(len)` where it cannot (a block that does
    /// not fit, a ring member that no longer has its rows of it): `seq` keeps its first
    /// `len` positions then, `at` or fewer, or holds a stale state if rows alone came
    /// before (the caller clears it). Only called when nothing of the sequence is in flight.
    fn write_rows(&mut self, seq: SeqId, at: usize, n: usize, key: &BlockId, block: &[u8]) -> std::result::Result<(), usize> {
        let _ = (seq, n, key, block);
        Err(at)
    }
    /// Blocks from `read_rows` put back one after another, the first as positions
    /// `[at, at + n)` of `seq` (which keeps its first `at`), each `n` long: `next` gives
    /// the next block's id and bytes, `None` when there are no more (it is asked only once
    /// the block before went in, so one block at a time is in memory). Returns how many
    /// went in; where one could not (see `write_rows`), `Err((written, len))`: the
    /// `written` before it stand and `seq` keeps its first `len` positions. A ring sends
    /// them round one after another and waits for every answer at the end: one trip for a
    /// prefix, not one per block, each member reading its rows of a block while the next
    /// reads its rows of the block before.
    fn write_blocks(&mut self, seq: SeqId, at: usize, n: usize, next: &mut dyn FnMut() -> Option<(BlockId, Arc<Vec<u8>>)>) -> std::result::Result<usize, (usize, usize)> {
        let mut written = 0;
        while let Some((key, block)) = next() {
            self.write_rows(seq, at + written * n, n, &key, &block).map_err(|len| (written, len))?;
            written += 1;
        }
        Ok(written)
    }
    /// Whether the model keeps a recurrent state per sequence (Qwen3.5): then a sequence
    /// goes back only to a checkpoint (`checkpoint_sequence`), not to any length.
    fn keeps_state(&self) -> bool {
        false
    }
    /// Copies a sequence's recurrent state at its current length everywhere, for a later
    /// `truncate_sequence` to return to. Only called when nothing of the sequence is in
    /// flight. No effect without recurrent layers.
    fn checkpoint_sequence(&mut self, seq: SeqId) {
        let _ = seq;
    }
    /// Context cells per sequence.
    fn n_ctx_seq(&self) -> usize;
    /// Tries to make a pipeline whole again after a step failed because a part of it
    /// (a ring member) did. `Ok(true)`: it was broken and is whole now, and every
    /// sequence's cache is empty. `Ok(false)`: nothing was broken. An error says why it is
    /// still broken. A pipeline on one machine never breaks this way.
    fn recover(&mut self) -> Result<bool> {
        Ok(false)
    }
    /// Called by the batching loop while no sequence runs and nothing is queued, about
    /// every 100 ms, with how long that has lasted: the moment for maintenance that would
    /// stall a step (a ring re-plans then). `Ok(true)`: every sequence's cache was emptied.
    /// An error says the pipeline is broken now (as a failed step would).
    fn idle(&mut self, idle_for: Duration) -> Result<bool> {
        let _ = idle_for;
        Ok(false)
    }
}

impl Pipeline for LocalPipeline {
    fn forward(&mut self, batch: &[BatchToken], tokens: &[i32]) -> Result<Logits> {
        Ok(LocalPipeline::forward(self, batch, tokens)?)
    }

    fn clear_sequence(&mut self, seq: SeqId) {
        LocalPipeline::clear_sequence(self, seq)
    }

    fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> usize {
        LocalPipeline::truncate_sequence(self, seq, len)
    }

    fn copy_sequence(&mut self, from: SeqId, to: SeqId, len: usize) -> usize {
        LocalPipeline::copy_sequence(self, from, to, len)
    }

    fn row_layout(&self) -> Option<String> {
        LocalPipeline::row_layout(self)
    }

    fn read_rows(&mut self, seq: SeqId, at: usize, n: usize, _key: &BlockId, with_state: bool) -> Option<Vec<u8>> {
        LocalPipeline::read_rows(self, seq, at, n, with_state)
    }

    fn write_rows(&mut self, seq: SeqId, at: usize, n: usize, _key: &BlockId, block: &[u8]) -> std::result::Result<(), usize> {
        // A block that does not fit leaves the sequence its first `at` (as the engine says).
        LocalPipeline::write_rows(self, seq, at, n, block).then_some(()).ok_or(at)
    }

    fn keeps_state(&self) -> bool {
        LocalPipeline::keeps_state(self)
    }

    fn checkpoint_sequence(&mut self, seq: SeqId) {
        LocalPipeline::checkpoint_sequence(self, seq)
    }

    fn n_ctx_seq(&self) -> usize {
        LocalPipeline::n_ctx_seq(self)
    }
}
