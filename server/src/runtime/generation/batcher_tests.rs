//! The batching loop against a scripted pipeline (`scripted.rs`): admission, queueing,
//! chunking, prefix reuse, cancellation, stopping, speculation's accept and rollback, a
//! ring's failure and recovery, idle maintenance. Only the vocabulary is real (the default
//! model's, for text, end-of-generation tokens and the sampler); no weights are loaded.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use engine::sampler::SamplingParams;
use engine::tokenizer::Tokenizer;
use tokio::sync::mpsc;

use super::scripted::{Controls, Failure, Log, Script, Scripted};
use super::{Batcher, BatcherConfig, Event, Finish, GenerationRequest, Proposer, SubmitError};

/// Generous: these tests take milliseconds; the bound only turns a hang into a failure.
const DEADLINE: Duration = Duration::from_secs(30);

fn vocabulary() -> Arc<Tokenizer> {
    static VOCAB: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    VOCAB
        .get_or_init(|| Arc::new(Tokenizer::load(crate::models::vocabulary_fixture()).unwrap()))
        .clone()
}

/// The single token of `text` (asserts it is one).
fn token(text: &str) -> i32 {
    let t = vocabulary().tokenize(text, true);
    assert_eq!(t.len(), 1, "{text:?} is {t:?}");
    t[0]
}

/// Counts " one two three four" round and round after whatever came before.
fn counting() -> Script {
    let words: Vec<i32> = [" one", " two", " three", " four"].iter().map(|w| token(w)).collect();
    Box::new(move |history| {
        let last = *history.last().unwrap();
        words.iter().position(|&w| w == last).map_or(words[0], |i| words[(i + 1) % words.len()])
    })
}

struct Rig {
    batcher: Batcher,
    log: Arc<Mutex<Log>>,
    controls: Arc<Mutex<Controls>>,
}

impl Rig {
    fn start(pipeline: Scripted, parallel: usize, queue: usize, max_batch: usize, proposer: Option<Proposer>) -> Rig {
        crate::metrics::install();
        let (log, controls) = (pipeline.log.clone(), pipeline.controls.clone());
        let cfg = BatcherConfig { parallel, queue, max_batch, spec_tokens: 4, files: Vec::new(), prompt_cache: super::prefix_cache::PrefixCacheConfig::off(), compute: String::new() };
        Rig { batcher: Batcher::start(Box::new(pipeline), vocabulary(), cfg, proposer), log, controls }
    }

    /// [`Rig::start`] with a prompt cache in RAM.
    fn with_prompt_cache(pipeline: Scripted, parallel: usize, max_batch: usize) -> Rig {
        crate::metrics::install();
        let (log, controls) = (pipeline.log.clone(), pipeline.controls.clone());
        let prompt_cache = super::prefix_cache::PrefixCacheConfig { ram_bytes: 1 << 24, dir: None, disk_bytes: 0 };
        let cfg = BatcherConfig { parallel, queue: 4, max_batch, spec_tokens: 0, files: Vec::new(), prompt_cache, compute: String::new() };
        Rig { batcher: Batcher::start(Box::new(pipeline), vocabulary(), cfg, None), log, controls }
    }

    fn simple(script: Script) -> Rig {
        Rig::start(Scripted::new(vocabulary().n_vocab(), 1024, script), 2, 4, 64, None)
    }

    fn submit(&self, prompt: &[i32], max_tokens: usize, stop: &[&str]) -> mpsc::UnboundedReceiver<Event> {
        let (rx, req) = request(prompt, max_tokens, stop);
        self.batcher.submit(req).expect("submitted");
        rx
    }

    fn violations(&self) -> Vec<String> {
        self.log.lock().unwrap().violations.clone()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.batcher.shutdown();
    }
}

fn request(prompt: &[i32], max_tokens: usize, stop: &[&str]) -> (mpsc::UnboundedReceiver<Event>, GenerationRequest) {
    let (events, rx) = mpsc::unbounded_channel();
    let req = GenerationRequest {
        id: "test".into(),
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop: stop.iter().map(|s| s.to_string()).collect(),
        logprobs: None,
        events,
        enqueued: Instant::now(),
    };
    (rx, req)
}

fn next(rx: &mut mpsc::UnboundedReceiver<Event>) -> Option<Event> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        match rx.try_recv() {
            Ok(e) => return Some(e),
            Err(mpsc::error::TryRecvError::Disconnected) => return None,
            Err(mpsc::error::TryRecvError::Empty) => {
                assert!(Instant::now() < deadline, "no event within {DEADLINE:?}");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// A sequence's whole answer.
#[derive(Debug, Default, PartialEq)]
struct Answer {
    cached: Option<usize>,
    text: String,
    finish: Option<Finish>,
    completion_tokens: usize,
    failed: Option<String>,
    unavailable: Option<String>,
}

fn answer(mut rx: mpsc::UnboundedReceiver<Event>) -> Answer {
    let mut a = Answer::default();
    while let Some(e) = next(&mut rx) {
        match e {
            Event::Started { cached_tokens } => a.cached = Some(cached_tokens),
            Event::Token { text, .. } => a.text.push_str(&text),
            Event::Done { finish, completion_tokens } => {
                a.finish = Some(finish);
                a.completion_tokens = completion_tokens;
                return a;
            }
            Event::Failed(m) => {
                a.failed = Some(m);
                return a;
            }
            Event::Unavailable(m) => {
                a.unavailable = Some(m);
                return a;
            }
        }
    }
    a
}

fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {DEADLINE:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn prompt(words: &str) -> Vec<i32> {
    vocabulary().tokenize(words, false)
}

#[test]
fn an_answer_follows_the_script_to_max_tokens() {
    let rig = Rig::simple(counting());
    let a = answer(rig.submit(&prompt("Count with me:"), 6, &[]));
    assert_eq!(a.text, " one two three four one two");
    assert_eq!((a.finish, a.completion_tokens, a.cached), (Some(Finish::Length), 6, Some(0)));
    assert_eq!(rig.violations(), Vec::<String>::new());
}

#[test]
fn an_end_of_generation_token_stops_without_being_sent() {
    let eog = token("<|im_end|>");
    let three = token(" three");
    let count = counting();
    let rig = Rig::simple(Box::new(move |h| if *h.last().unwrap() == three { eog } else { count(h) }));
    let a = answer(rig.submit(&prompt("Count:"), 50, &[]));
    assert_eq!(a.text, " one two three");
    assert_eq!((a.finish, a.completion_tokens), (Some(Finish::Stop), 3));
}

#[test]
fn a_stop_string_cuts_the_text_before_it() {
    let rig = Rig::simple(counting());
    let a = answer(rig.submit(&prompt("Count:"), 50, &[" thr"]));
    assert_eq!(a.text, " one two");
    assert_eq!(a.finish, Some(Finish::StopString(0)));
    // Held back while it might have been the stop string, then released: " two" was sent.
    let a = answer(rig.submit(&prompt("Count:"), 3, &[" two fo", " onf"]));
    assert_eq!(a.text, " one two three");
    assert_eq!(a.finish, Some(Finish::Length));
}

#[test]
fn a_length_cut_inside_a_character_drops_its_first_bytes() {
    // Byte-level BPE writes the pin as several tokens; the script writes "x📌" over and
    // over, so every max_tokens cuts at another byte of it.
    let tokens = vocabulary().tokenize("x📌", false);
    assert!(tokens.len() >= 3, "the pin should take several tokens: {tokens:?}");
    let script_tokens = tokens.clone();
    let rig = Rig::simple(Box::new(move |h| {
        let last = *h.last().unwrap();
        script_tokens.iter().position(|&t| t == last).map_or(script_tokens[0], |i| script_tokens[(i + 1) % script_tokens.len()])
    }));
    for max_tokens in 1..=2 * tokens.len() {
        let a = answer(rig.submit(&prompt("Pins:"), max_tokens, &[]));
        assert_eq!(a.finish, Some(Finish::Length));
        let whole = max_tokens / tokens.len();
        let want = format!("{}{}", "x📌".repeat(whole), if max_tokens % tokens.len() > 0 { "x" } else { "" });
        assert_eq!(a.text, want, "max_tokens {max_tokens}: no U+FFFD for the cut character");
    }
}

#[test]
fn the_context_ends_an_answer_with_length() {
    let rig = Rig::start(Scripted::new(vocabulary().n_vocab(), 12, counting()), 1, 2, 64, None);
    let p = prompt("Count with me, please:");
    let a = answer(rig.submit(&p, 1000, &[]));
    assert_eq!(a.finish, Some(Finish::Length));
    assert_eq!(p.len() + a.completion_tokens, 12, "prompt plus answer fill the context exactly: {a:?}");
    assert_eq!(rig.violations(), Vec::<String>::new());
}

#[test]
fn a_long_prompt_is_fed_in_chunks_while_a_running_stream_keeps_going() {
    const MAX_BATCH: usize = 8;
    let pipeline = Scripted::new(vocabulary().n_vocab(), 4096, counting()).with_delay(Duration::from_millis(1));
    let rig = Rig::start(pipeline, 2, 4, MAX_BATCH, None);
    let mut running = rig.submit(&prompt("Go:"), 10_000, &[]);
    assert!(matches!(next(&mut running), Some(Event::Started { .. })));
    let long: Vec<i32> = prompt(&"the quick brown fox jumps over the lazy dog ".repeat(6));
    assert!(long.len() > 5 * MAX_BATCH, "{} tokens", long.len());
    let a = answer(rig.submit(&long, 2, &[]));
    assert_eq!(a.completion_tokens, 2);
    drop(running);
    let log = rig.log.lock().unwrap();
    assert!(log.batches.iter().all(|b| b.len() <= MAX_BATCH), "a batch over --max-batch");
    // Every batch that fed part of the long prompt (sequence 1) also advanced the running
    // stream (sequence 0) by one decode token.
    let feeding: Vec<_> = log.batches.iter().filter(|b| b.iter().filter(|t| t.0 == 1).count() > 1).collect();
    assert!(feeding.len() >= long.len() / MAX_BATCH, "{} batches fed the prompt", feeding.len());
    for b in &feeding {
        assert_eq!(b.iter().filter(|t| t.0 == 0).count(), 1, "the running stream stalled in {b:?}");
    }
    assert_eq!(log.violations, Vec::<String>::new());
}

/// Beside a running stream, a long prompt's pieces are cut to whole tiles of 64 query rows
/// (a part tile costs ggml's attention as much as a whole one), not to the room the decode
/// row leaves; only the prompt's last piece is what remains.
#[test]
fn a_prompt_piece_cut_by_the_batch_room_keeps_whole_tiles() {
    const MAX_BATCH: usize = 200;
    let pipeline = Scripted::new(vocabulary().n_vocab(), 4096, counting()).with_delay(Duration::from_millis(1));
    let rig = Rig::start(pipeline, 2, 4, MAX_BATCH, None);
    let mut running = rig.submit(&prompt("Go:"), 10_000, &[]);
    assert!(matches!(next(&mut running), Some(Event::Started { .. })));
    let long: Vec<i32> = prompt(&"the quick brown fox jumps over the lazy dog ".repeat(80));
    assert!(long.len() > 3 * MAX_BATCH, "{} tokens", long.len());
    assert_eq!(answer(rig.submit(&long, 2, &[])).completion_tokens, 2);
    drop(running);
    let log = rig.log.lock().unwrap();
    let pieces: Vec<usize> = log.batches.iter().map(|b| b.iter().filter(|t| t.0 == 1).count()).filter(|&n| n > 1).collect();
    let (last, rest) = pieces.split_last().expect("the prompt was fed");
    assert!(rest.len() >= 2 && rest.iter().all(|&n| n == 192), "pieces {pieces:?}");
    assert_eq!(rest.iter().sum::<usize>() + last, long.len());
    assert_eq!(log.violations, Vec::<String>::new());
}

/// No piece of a prompt leaves a rest under a tile of 64 query rows (ggml computes such a
/// rest one row at a time, which rounds otherwise): the rest joins the piece before it, or
/// gives it whole tiles of its rows where the batch has no room, so every cut of a prompt gives the
/// answer of any other.
#[test]
fn a_prompt_never_ends_in_a_piece_shorter_than_a_tile() {
    let long: Vec<i32> = prompt(&"the quick brown fox jumps over the lazy dog ".repeat(20));
    assert!(long.len() > 150, "{} tokens", long.len());
    // The batch holds all but 20 rows: the last 20 would be a piece of their own.
    let max_batch = long.len() - 20;
    let pipeline = Scripted::new(vocabulary().n_vocab(), 4096, counting());
    let rig = Rig::start(pipeline, 1, 4, max_batch, None);
    assert_eq!(answer(rig.submit(&long, 2, &[])).completion_tokens, 2);
    let log = rig.log.lock().unwrap();
    let pieces: Vec<usize> = log.batches.iter().map(Vec::len).filter(|&n| n > 1).collect();
    let first = (long.len() - 64) / 64 * 64;
    assert_eq!(pieces, vec![first, long.len() - first]);
    assert_eq!(log.violations, Vec::<String>::new());
    // Where the batch has room, the rest joins the piece; a prompt or stretch shorter than
    // a tile, or a piece already shorter (cut by the room), stays as it is.
    use super::batcher::no_short_rest;
    assert_eq!(no_short_rest(128, 150, 512, 64), 150);
    assert_eq!(no_short_rest(128, 150, 140, 64), 64);
    assert_eq!(no_short_rest(512, 530, 512, 64), 448);
    assert_eq!(no_short_rest(64, 100, 80, 64), 64);
    assert_eq!(no_short_rest(40, 50, 512, 64), 40);
    assert_eq!(no_short_rest(128, 128, 512, 64), 128);
    assert_eq!(no_short_rest(128, 200, 512, 64), 128);
}

/// A prompt sharing a prefix with what its slot holds reuses the shared rows a cold prompt
/// computes alike — whole tiles of them, a tile before its end, so the rest is grouped as a
/// cold prompt's rows are — and nothing else: not a conversation's generated rows (decoded
/// one at a time), not a prompt under two tiles, not one shared first token (a BOS). Any of
/// those would change how the rows after them round, and with them the answer.
#[test]
fn a_shared_prefix_is_reused_in_whole_tiles_of_exact_rows_only() {
    let tile = scheduler::pipelining::MIN_PROMPT_CHUNK;
    let rig = Rig::start(Scripted::new(vocabulary().n_vocab(), 4096, counting()), 1, 2, 512, None);
    let lcp = |a: &[i32], b: &[i32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let system = prompt(&"You are a counting assistant. Count with me, slowly and in order. ".repeat(16));
    let first = [system.clone(), prompt(" Start at one:")].concat();
    assert!(first.len() > 3 * tile, "{} tokens", first.len());
    assert_eq!(answer(rig.submit(&first, 3, &[])).cached, Some(0));
    // Same system text, another question: whole tiles of the shared tokens are reused.
    let second = [system.clone(), prompt(&" And now backwards, from the top.".repeat(6))].concat();
    let shared = lcp(&first, &second).min(second.len() - tile) / tile * tile;
    assert!(shared >= 2 * tile);
    let batches_before = rig.log.lock().unwrap().batches.len();
    let a = answer(rig.submit(&second, 3, &[]));
    assert_eq!(a.cached, Some(shared));
    let log = rig.log.lock().unwrap();
    assert!(log.truncates.contains(&(0, shared)), "{:?}", log.truncates);
    assert_eq!(log.batches[batches_before][0].1 as usize, shared, "feeding starts after the reused prefix");
    drop(log);
    // The whole prompt again: whole tiles, to a tile before its end.
    let again = (second.len() - tile) / tile * tile;
    assert_eq!(answer(rig.submit(&second, 3, &[])).cached, Some(again));
    // The conversation goes on after the answer: the prompt's rows are reused, the
    // answer's are computed again with the rest, as a cold prompt computes them.
    let continued = [second.clone(), prompt(" one two three"), prompt(&" And once more, the other way.".repeat(8))].concat();
    assert!(lcp(&continued, &second) == second.len() && lcp(&continued, &[second.clone(), prompt(" one two")].concat()) > second.len());
    assert_eq!(answer(rig.submit(&continued, 3, &[])).cached, Some(second.len() / tile * tile));
    // A prompt sharing only its first token with the slot: nothing reused.
    let other = [continued[..1].to_vec(), prompt(&" Something else entirely, about the sea.".repeat(10))].concat();
    assert_eq!(lcp(&other, &continued), 1);
    assert_eq!(answer(rig.submit(&other, 3, &[])).cached, Some(0));
    // A short prompt, sent twice: under two tiles, computed whole each time.
    let short = prompt("Count with me:");
    assert_eq!(answer(rig.submit(&short, 3, &[])).cached, Some(0));
    assert_eq!(answer(rig.submit(&short, 3, &[])).cached, Some(0));
    assert_eq!(rig.violations(), Vec::<String>::new());
}

/// A slot's rows past its exact ones (an answer's, decoded one at a time) are not copied
/// into another slot either: a conversation continuing in another slot while the first
/// still generates gets the prompt's rows, whole tiles of them, and computes the answer's
/// again.
#[test]
fn generated_rows_are_not_copied_into_another_slot() {
    let tile = scheduler::pipelining::MIN_PROMPT_CHUNK;
    let system = prompt(&"You are a careful assistant who answers in full sentences and counts. ".repeat(10));
    let first = [system.clone(), prompt(" Count with me:")].concat();
    let rig = Rig::start(Scripted::new(vocabulary().n_vocab(), 4096, counting()).with_delay(Duration::from_millis(2)), 2, 4, 512, None);
    let rx = rig.submit(&first, 400, &[]);
    // The first answer counts " one two three four ..."; once 80 of its tokens are in its
    // slot, a request with them and more arrives and lands in the other slot.
    let answered = prompt(&" one two three four".repeat(20));
    assert_eq!(answered.len(), 80);
    wait_until("80 tokens generated", || rig.log.lock().unwrap().batches.iter().flatten().any(|r| r.0 == 0 && r.1 as usize > first.len() + 80));
    let next_turn = [first.clone(), answered, prompt(&" And again, please, from one.".repeat(8))].concat();
    let b = answer(rig.submit(&next_turn, 3, &[]));
    assert_eq!(answer(rx).completion_tokens, 400);
    let expected = first.len() / tile * tile;
    assert!((first.len() + 80) / tile * tile > expected, "the generated rows would add a tile");
    assert_eq!(b.cached, Some(expected), "the prompt's whole tiles only");
    assert_eq!(rig.log.lock().unwrap().copies, vec![(0, 1, expected)]);
    assert_eq!(rig.violations(), Vec::<String>::new());
}

/// A prefix another slot holds (a system prompt two conversations share, the second
/// arriving while the first still runs) is copied into the new slot instead of computed
/// again: whole tiles of it, at least a tile before the prompt's end. A pipeline that
/// copies nothing (a model with a recurrent state) leaves the prompt computed whole.
#[test]
fn a_prefix_another_slot_holds_is_copied_not_computed() {
    let tile = scheduler::pipelining::MIN_PROMPT_CHUNK;
    let system = prompt(&"You are a careful assistant who answers in full sentences and counts. ".repeat(20));
    assert!(system.len() > 3 * tile, "{} tokens", system.len());
    let with = |question: &str| [system.clone(), prompt(question)].concat();
    let (first, second) = (with(" Count with me:"), with(&" Now count backwards, slowly, from the top, please.".repeat(8)));
    for recurrent in [false, true] {
        let mut pipeline = Scripted::new(vocabulary().n_vocab(), 4096, counting()).with_delay(Duration::from_millis(2));
        if recurrent {
            pipeline = pipeline.with_draft_snapshots();
        }
        let rig = Rig::start(pipeline, 2, 4, 512, None);
        let rx1 = rig.submit(&first, 200, &[]);
        // The first runs (its prompt computed, decoding) when the second arrives.
        wait_until("the first answer starts", || rig.log.lock().unwrap().batches.len() > 3);
        let b = answer(rig.submit(&second, 3, &[]));
        let a = answer(rx1);
        assert_eq!(a.completion_tokens, 200);
        let lcp = (0..first.len().min(second.len())).take_while(|&i| first[i] == second[i]).count();
        assert!(lcp >= system.len() - 1, "{lcp} of {} shared", system.len());
        let expected = lcp.min(second.len() - tile) / tile * tile;
        let log = rig.log.lock().unwrap();
        if recurrent {
            assert_eq!(b.cached, Some(0), "nothing copied, nothing reused");
            assert!(log.copies.is_empty(), "{:?}", log.copies);
        } else {
            assert_eq!(b.cached, Some(expected), "{lcp} tokens shared");
            assert_eq!(log.copies, vec![(0, 1, expected)]);
            let fed: Vec<u32> = log.batches.iter().flatten().filter(|r| r.0 == 1).map(|r| r.1).collect();
            assert_eq!(fed.first().copied(), Some(expected as u32), "feeding starts after the copied prefix");
        }
        assert_eq!(b.completion_tokens, 3);
        drop(log);
        assert_eq!(rig.violations(), Vec::<String>::new());
    }
}

/// Two prompts sharing a system prompt of more than two blocks and a tile (an agent's
/// turn, and the same agent asking again), and another conversation.
fn two_agents_and_another() -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let (block, tile) = (super::BLOCK_TOKENS, scheduler::pipelining::MIN_PROMPT_CHUNK);
    let system = prompt(&"You are a careful assistant who answers in full sentences and counts. ".repeat(60));
    assert!(system.len() > 2 * block + tile, "{} tokens", system.len());
    let with = |question: &str| [system.clone(), prompt(question)].concat();
    (with(" Count with me:"), with(&" Now count backwards, slowly, from the top, please.".repeat(8)), prompt(&" Something else entirely, about the weather and the sea.".repeat(30)))
}

/// The prompt cache: once a prompt has landed, the whole blocks of its rows are kept; a
/// later request starting with them, in a slot that served another conversation since,
/// has them written back — up to a block's end at least a tile before its own end — and
/// only the rest is fed. Rows after generated tokens (which a cold prompt would compute
/// as prompt rows, rounding otherwise) are never kept; prompt rows after kept exact ones
/// are.
#[test]
fn blocks_of_a_prompt_that_left_its_slot_are_written_back_and_only_the_rest_is_fed() {
    let block = super::BLOCK_TOKENS;
    let (first, again, other) = two_agents_and_another();
    let rig = Rig::with_prompt_cache(Scripted::new(vocabulary().n_vocab(), 4096, counting()).with_rows(), 1, 512);
    let kept = |rig: &Rig| rig.log.lock().unwrap().reads.iter().map(|&(_, at, n)| (at, n)).collect::<Vec<_>>();
    assert_eq!(answer(rig.submit(&first, 4, &[])).cached, Some(0));
    let first_blocks: Vec<(usize, usize)> = (0..first.len() / block).map(|i| (i * block, block)).collect();
    assert_eq!(kept(&rig), first_blocks, "the first prompt's whole blocks");
    // Another conversation takes the only slot.
    assert_eq!(answer(rig.submit(&other, 4, &[])).cached, Some(0));
    restored_after_another_conversation(&rig, &first, &again, &other);
    // A prompt continuing after the generated tokens: those rows are computed again as a
    // cold prompt's, so the rows after them are exact too and their new blocks are kept.
    let tile = scheduler::pipelining::MIN_PROMPT_CHUNK;
    let before = kept(&rig).len();
    let continued = [again.clone(), prompt(" one two three four"), prompt(&" And once more, the other way round.".repeat(30))].concat();
    let d = answer(rig.submit(&continued, 2, &[]));
    assert_eq!(d.cached, Some(again.len() / tile * tile));
    assert_eq!(kept(&rig).len(), before + continued.len() / block - again.len() / block, "the continued prompt's new blocks kept");
    assert_eq!(rig.violations(), Vec::<String>::new());
}

/// `again`, sharing a long prefix with `first`, sent after `other` took the rig's only slot
/// (each sent once before, in that order): the whole blocks of the shared prefix the prompt
/// cache kept, up to a tile before the prompt's end, are written back, only the rest is
/// fed, and the prompt's own new whole blocks are kept after it.
fn restored_after_another_conversation(rig: &Rig, first: &[i32], again: &[i32], other: &[i32]) {
    let (block, tile) = (super::BLOCK_TOKENS, scheduler::pipelining::MIN_PROMPT_CHUNK);
    let lcp = (0..first.len().min(again.len())).take_while(|&i| first[i] == again[i]).count();
    let expected = lcp.min(again.len() - tile) / block * block;
    assert!(expected >= 2 * block);
    let batches_before = rig.log.lock().unwrap().batches.len();
    let c = answer(rig.submit(again, 4, &[]));
    assert_eq!(c.cached, Some(expected), "{lcp} tokens shared");
    assert_eq!(c.completion_tokens, 4);
    let log = rig.log.lock().unwrap();
    let written: Vec<(usize, usize)> = log.writes.iter().map(|&(_, at, n)| (at, n)).collect();
    assert_eq!(written, (0..expected / block).map(|i| (i * block, block)).collect::<Vec<_>>());
    // The rest of the prompt, then 3 generated tokens (the 4th is not fed).
    let fed: Vec<u32> = log.batches[batches_before..].iter().flatten().map(|r| r.1).collect();
    assert_eq!(fed.len(), again.len() - expected + 3);
    assert_eq!(fed.iter().min().copied(), Some(expected as u32), "feeding starts after the restored prefix");
    // The prompt after the restored blocks was exact: its new whole blocks are kept too.
    let kept: Vec<(usize, usize)> = log.reads.iter().map(|&(_, at, n)| (at, n)).collect();
    let after_again: Vec<(usize, usize)> = (expected / block..again.len() / block).map(|i| (i * block, block)).collect();
    assert_eq!(kept[first.len() / block + other.len() / block..], after_again[..]);
}

/// A block whose rows a ring member no longer has (a worker restarted without its disk, or
/// evicted them): its write fails, the slot keeps what the pipeline says it holds (the
/// first blocks; nothing with a recurrent state), that block and those after it are
/// forgotten, the rest of the prompt is computed and its blocks kept again, and the next
/// request restores them all with the same answer.
#[test]
fn a_block_a_ring_member_lost_is_computed_and_kept_again_and_the_next_request_restores_it() {
    let (block, tile) = (super::BLOCK_TOKENS, scheduler::pipelining::MIN_PROMPT_CHUNK);
    let (first, again, other) = two_agents_and_another();
    let lcp = (0..first.len().min(again.len())).take_while(|&i| first[i] == again[i]).count();
    let expected = lcp.min(again.len() - tile) / block * block;
    assert!(expected >= 2 * block);
    for state in [false, true] {
        let pipeline = Scripted::new(vocabulary().n_vocab(), 4096, counting()).with_rows();
        let rig = Rig::with_prompt_cache(if state { pipeline.with_state() } else { pipeline }, 1, 512);
        answer(rig.submit(&first, 4, &[]));
        answer(rig.submit(&other, 4, &[]));
        let reads_before = rig.log.lock().unwrap().reads.len();
        rig.controls.lock().unwrap().lost_rows = vec![block];
        let lost = answer(rig.submit(&again, 4, &[]));
        assert_eq!(lost.cached, Some(if state { 0 } else { block }), "state {state}");
        assert_eq!(lost.completion_tokens, 4);
        let kept_again: Vec<usize> = rig.log.lock().unwrap().reads[reads_before..].iter().map(|&(_, at, _)| at).collect();
        // With a state, the last block a restore reaches with it as the prompt passes its
        // end, then the rows alone.
        let rows_again: Vec<usize> = (1..again.len() / block).map(|b| b * block).collect();
        let expected_reads = if state { [vec![(reached(&again) - 1) * block], rows_again].concat() } else { rows_again };
        assert_eq!(kept_again, expected_reads, "state {state}: the lost block and those after it kept again");
        answer(rig.submit(&other, 4, &[]));
        let restored = answer(rig.submit(&again, 4, &[]));
        assert_eq!((restored.cached, &restored.text), (Some(expected), &lost.text), "state {state}");
        assert_eq!(rig.violations(), Vec::<String>::new(), "state {state}");
    }
}

/// Whole blocks a restore of `prompt` reaches: to a tile before its end.
fn reached(prompt: &[i32]) -> usize {
    let tile = scheduler::pipelining::MIN_PROMPT_CHUNK;
    (prompt.len() - tile) / tile * tile / super::BLOCK_TOKENS
}

/// A model keeping a recurrent state (Qwen3.5): the prompt cache keeps the state with every
/// `STATE_EVERY_BLOCKS`th block and the last whole one a restore reaches, read as the prompt passes
/// their ends (a position's state exists only while the sequence ends there: the prompt's
/// pieces stop there and at no other block's end), and every block's rows alone once the
/// prompt has landed. A prompt sharing part of them, after another conversation took the
/// slot, gets rows alone up to the furthest block kept with the state and that block with
/// it (the pipeline records computing on a state rows alone left behind, or a state that is
/// not its tokens', as violations); the next turn of a conversation gets every block up to
/// the last one kept with the state in the turn before.
#[test]
fn a_recurrent_models_state_is_kept_every_few_blocks_and_a_restore_ends_on_a_block_with_it() {
    let (block, every) = (super::BLOCK_TOKENS, super::prefix_cache::STATE_EVERY_BLOCKS);
    let system = prompt(&"You are a careful assistant who answers in full sentences and counts. ".repeat(130));
    let first = [system.clone(), prompt(" Count with me:")].concat();
    let whole = first.len() / block;
    assert!(reached(&first) > every && reached(&first) < 2 * every && whole < 2 * every, "{} tokens", first.len());
    let rig = Rig::with_prompt_cache(Scripted::new(vocabulary().n_vocab(), 4096, counting()).with_rows().with_state(), 1, 512);
    assert_eq!(answer(rig.submit(&first, 4, &[])).cached, Some(0));
    {
        let log = rig.log.lock().unwrap();
        assert_eq!(log.state_reads, vec![every * block, reached(&first) * block], "the state with the {every}th block and the last a restore reaches");
        let rows_alone: Vec<usize> = log.reads[2..].iter().map(|&(_, at, _)| at).collect();
        assert_eq!(rows_alone, (0..whole).map(|b| b * block).collect::<Vec<_>>(), "every block's rows alone once the prompt landed");
        // The prompt's pieces stop where a state is kept and pass other blocks' ends.
        let prompt_batches = log.batches.iter().map(|b| (b.iter().map(|r| r.1 as usize).min().unwrap(), b.iter().map(|r| r.1 as usize).max().unwrap())).filter(|&(_, hi)| hi < first.len());
        let mut passed = 0;
        for (lo, hi) in prompt_batches {
            assert!(log.state_reads.iter().all(|&end| !(lo < end && hi >= end)), "a piece {lo}..={hi} crosses the end of a block kept with the state");
            passed += (1..whole).filter(|b| lo < b * block && hi >= b * block).count();
        }
        assert!(passed > 0, "the prompt stopped at every block's end");
        assert_eq!(log.checkpoints, vec![(0, first.len() - super::batcher::CHECKPOINT_TAIL)]);
    }
    let other = prompt(&" Something else entirely, about the weather and the sea.".repeat(30));
    assert_eq!(answer(rig.submit(&other, 4, &[])).cached, Some(0));
    // Sharing `every` + 1 blocks and more: the last block kept with the state before the
    // prompts part is the `every`th.
    let again = [system[..(every + 1) * block + 100].to_vec(), prompt(&" Now count backwards, slowly, from the top, please.".repeat(16))].concat();
    let (writes_before, state_reads_before) = {
        let log = rig.log.lock().unwrap();
        (log.writes.len(), log.state_reads.len())
    };
    let a = answer(rig.submit(&again, 4, &[]));
    assert_eq!(a.cached, Some(every * block));
    {
        let log = rig.log.lock().unwrap();
        let written: Vec<usize> = log.writes[writes_before..].iter().map(|&(_, at, _)| at).collect();
        assert_eq!(written, (0..every).map(|b| b * block).collect::<Vec<_>>());
        assert_eq!(log.state_writes, vec![every * block], "only the last block restored carries the state");
        assert!(reached(&again) > every && reached(&again) < 2 * every, "{} tokens", again.len());
        assert_eq!(log.state_reads[state_reads_before..], [reached(&again) * block], "the new prompt's last block a restore reaches kept with the state");
    }
    // The conversation's next turn, after another took the slot: every block up to the
    // last one the turn before kept with the state.
    answer(rig.submit(&other, 4, &[]));
    let next_turn = [again.clone(), prompt(" three four"), prompt(&" And once more, the other way round.".repeat(12))].concat();
    let b = answer(rig.submit(&next_turn, 4, &[]));
    assert_eq!(b.cached, Some(reached(&again) * block));
    assert_eq!(rig.log.lock().unwrap().state_writes.last().copied(), Some(reached(&again) * block));
    assert_eq!(rig.violations(), Vec::<String>::new());
}

/// Requests with one long prefix arriving together (the `n` choices of a request, agents
/// with one system prompt): the second waits until the first's prompt has been fed, then
/// copies it; the shared rows are computed once. One sharing less than a tile with a
/// prompt being computed does not wait for it.
#[test]
fn a_request_waits_for_a_prefix_being_computed_and_copies_it() {
    let tile = scheduler::pipelining::MIN_PROMPT_CHUNK;
    let system = prompt(&"You are a careful assistant who answers in full sentences and counts. ".repeat(20));
    let (first, second) = ([system.clone(), prompt(" Count with me:")].concat(), [system.clone(), prompt(&" And backwards, from the top.".repeat(12))].concat());
    // Steps of a few milliseconds: the first is still running when the second, submitted
    // right after it, is admitted (were it done, the second would take its slot instead).
    let rig = Rig::start(Scripted::new(vocabulary().n_vocab(), 4096, counting()).with_delay(Duration::from_millis(3)), 2, 4, 128, None);
    let (rx1, rx2) = (rig.submit(&first, 40, &[]), rig.submit(&second, 4, &[]));
    let (a, b) = (answer(rx1), answer(rx2));
    let lcp = (0..first.len().min(second.len())).take_while(|&i| first[i] == second[i]).count();
    let expected = lcp.min(second.len() - tile) / tile * tile;
    assert_eq!((a.cached, b.cached), (Some(0), Some(expected)), "{lcp} tokens shared");
    let log = rig.log.lock().unwrap();
    assert_eq!(log.copies, vec![(0, 1, expected)]);
    // Every shared row computed once: sequence 1's first row is the first after the copy.
    let rows_of = |seq: u64| log.batches.iter().flatten().filter(|r| r.0 == seq).map(|r| r.1).collect::<Vec<u32>>();
    assert_eq!(rows_of(1).first().copied(), Some(expected as u32));
    assert_eq!(rows_of(0).iter().filter(|&&p| (p as usize) < first.len()).count(), first.len());
    drop(log);
    assert_eq!(rig.violations(), Vec::<String>::new());
    // A long prompt fed in several pieces, and another sharing only its first words: the
    // second starts while the first is still being fed (pieces of both fly together, as
    // on a ring: a piece of the second comes before the first prompt's last row).
    let pipeline = Scripted::new(vocabulary().n_vocab(), 4096, counting()).with_delay(Duration::from_millis(5)).with_depth(2);
    let rig = Rig::start(pipeline, 2, 4, 256, None);
    let long = [prompt("Count with me: "), system.clone(), system.clone()].concat();
    let other = [prompt("Count with me: "), prompt(&"Something else entirely, and at length. ".repeat(16))].concat();
    assert!(other.len() > 2 * tile && long.len() > 8 * tile);
    let (rx1, rx2) = (rig.submit(&long, 4, &[]), rig.submit(&other, 4, &[]));
    let (a, b) = (answer(rx1), answer(rx2));
    assert_eq!((a.cached, b.cached), (Some(0), Some(0)));
    let log = rig.log.lock().unwrap();
    let last_of_long = log.batches.iter().position(|b| b.iter().any(|r| r.0 == 0 && r.1 as usize + 1 == long.len())).unwrap();
    let first_of_other = log.batches.iter().position(|b| b.iter().any(|r| r.0 == 1)).unwrap();
    assert!(first_of_other < last_of_long, "the second prompt waited for the first: its first rows in batch {first_of_other}, the first prompt's last in {last_of_long}");
    assert!(log.copies.is_empty(), "{:?}", log.copies);
}

#[test]
fn queueing_refusal_and_cancellation() {
    let pipeline = Scripted::new(vocabulary().n_vocab(), 1 << 20, counting()).with_delay(Duration::from_millis(1));
    let rig = Rig::start(pipeline, 1, 1, 64, None);
    let mut busy = rig.submit(&prompt("Go:"), usize::MAX, &[]);
    assert!(matches!(next(&mut busy), Some(Event::Started { .. })));
    let waiting = rig.submit(&prompt("Me next:"), 2, &[]);
    assert_eq!(rig.batcher.has_room(), Err(SubmitError::QueueFull));
    let (_rx, req) = request(&prompt("And me"), 2, &[]);
    assert_eq!(rig.batcher.submit(req), Err(SubmitError::QueueFull));
    // The running client goes away: its slot frees and the waiting one runs.
    drop(busy);
    let a = answer(waiting);
    assert_eq!(a.completion_tokens, 2);
    wait_until("the queue empties", || rig.batcher.has_room().is_ok());
}

/// Counting with a hiccup every seventh token, so n-gram drafts (which expect the count to
/// go on) are sometimes wrong.
fn counting_with_hiccups() -> Script {
    let hiccup = token(" five");
    let count = counting();
    Box::new(move |h| if h.len() % 7 == 0 { hiccup } else { count(h) })
}

#[test]
fn speculation_gives_the_same_answer_and_rolls_back_rejected_drafts() {
    let p = prompt("Count: one two three four one two three four one two three four");
    let plain = {
        let rig = Rig::start(Scripted::new(vocabulary().n_vocab(), 1024, counting_with_hiccups()), 2, 4, 64, None);
        answer(rig.submit(&p, 60, &[]))
    };
    let rig = Rig::start(Scripted::new(vocabulary().n_vocab(), 1024, counting_with_hiccups()), 2, 4, 64, Some(Proposer::Ngram));
    let spec = answer(rig.submit(&p, 60, &[]));
    assert_eq!(spec, plain, "speculation must not change the answer");
    assert_eq!(spec.completion_tokens, 60);
    let log = rig.log.lock().unwrap();
    let drafted = log.batches.iter().filter(|b| b.len() > 1 && b.iter().all(|t| t.2)).count();
    assert!(drafted > 0, "no step carried draft tokens");
    let steps_after_prompt = log.batches.len() - 1;
    assert!(steps_after_prompt < 60, "accepted drafts save steps: {steps_after_prompt} steps for 60 tokens");
    assert!(!log.truncates.is_empty(), "a rejected draft leaves the cache");
    assert_eq!(log.violations, Vec::<String>::new());
}

#[test]
fn a_lost_ring_member_degrades_the_head_until_it_recovers() {
    let pipeline = Scripted::new(vocabulary().n_vocab(), 1024, counting()).with_delay(Duration::from_millis(1));
    let rig = Rig::start(pipeline, 2, 4, 64, None);
    let p = prompt("Count:");
    assert_eq!(answer(rig.submit(&p, 3, &[])).cached, Some(0));
    {
        let mut c = rig.controls.lock().unwrap();
        c.failures.extend([None, Some(Failure::Ring("worker w1 closed the ring link".into()))]);
        c.recover_failures = 2;
    }
    let (a, b) = (rig.submit(&p, 100, &[]), rig.submit(&prompt("Another"), 100, &[]));
    let (a, b) = (answer(a), answer(b));
    for x in [&a, &b] {
        assert!(x.unavailable.as_deref().is_some_and(|m| m.contains("w1")), "{x:?}");
    }
    assert!(rig.batcher.degraded().is_some_and(|d| d.contains("w1") || d.contains("unreachable")));
    let (_rx, req) = request(&p, 3, &[]);
    assert!(matches!(rig.batcher.submit(req), Err(SubmitError::Unavailable(_))));
    // Two failed attempts, then the ring is whole: serving resumes, with nothing cached.
    wait_until("the ring recovers", || rig.batcher.degraded().is_none());
    assert!(rig.log.lock().unwrap().recovers >= 3);
    let again = answer(rig.submit(&p, 3, &[]));
    assert_eq!((again.cached, again.completion_tokens), (Some(0), 3), "caches were forgotten with the ring");
    assert_eq!(rig.violations(), Vec::<String>::new());
}

#[test]
fn a_local_engine_failure_fails_the_batch_but_not_the_head() {
    let rig = Rig::simple(counting());
    rig.controls.lock().unwrap().failures.push_back(Some(Failure::Local("ggml aborted".into())));
    let a = answer(rig.submit(&prompt("Count:"), 3, &[]));
    assert!(a.failed.is_some() && a.unavailable.is_none(), "{a:?}");
    assert!(rig.batcher.degraded().is_none());
    assert_eq!(answer(rig.submit(&prompt("Count:"), 3, &[])).completion_tokens, 3);
    assert!(rig.log.lock().unwrap().clears.contains(&0), "the failed sequence's cache is cleared");
}

#[test]
fn idle_maintenance_that_empties_caches_is_honoured() {
    let rig = Rig::start(Scripted::new(vocabulary().n_vocab(), 1024, counting()), 1, 2, 64, None);
    let p = prompt("Count with me:");
    answer(rig.submit(&p, 2, &[]));
    let idles = rig.log.lock().unwrap().idles;
    rig.controls.lock().unwrap().idle_empties = true;
    wait_until("the loop idles again", || rig.log.lock().unwrap().idles > idles + 1);
    let a = answer(rig.submit(&p, 2, &[]));
    assert_eq!(a.cached, Some(0), "nothing reused after the pipeline emptied its caches");
    assert_eq!(rig.violations(), Vec::<String>::new());
}

#[test]
fn shutdown_lets_running_answers_finish() {
    let pipeline = Scripted::new(vocabulary().n_vocab(), 1024, counting()).with_delay(Duration::from_millis(1));
    let rig = Rig::start(pipeline, 2, 4, 64, None);
    let (mut a, b) = (rig.submit(&prompt("Count:"), 40, &[]), rig.submit(&prompt("Count too:"), 40, &[]));
    assert!(matches!(next(&mut a), Some(Event::Started { .. })));
    rig.batcher.shutdown();
    let (_rx, req) = request(&prompt("Late"), 2, &[]);
    assert_eq!(rig.batcher.submit(req), Err(SubmitError::ShuttingDown));
    assert_eq!(answer(a).completion_tokens, 40);
    assert_eq!(answer(b).completion_tokens, 40);
}

/// An answer with how much of its prompt came from the cache left out. The scripted
/// pipeline computes instantly, so when the test thread is descheduled between two
/// submissions (CI, at depth 1) request 0 can finish its 20 tokens first and request 1 is
/// admitted into its freed slot, reusing "Count" of its prompt: a real reuse, but one
/// decided by thread timing, not by the depth these tests compare. Text, finish and
/// token counts stay compared exactly.
fn without_cache_hits(a: Answer) -> Answer {
    Answer { cached: a.cached.map(|_| 0), ..a }
}

/// Runs the same requests at once through pipelines of depth 1 and `depth`: their answers,
/// and the deeper pipeline's log.
fn at_depth(depth: usize, ngram: bool, requests: &[(Vec<i32>, usize)]) -> (Vec<Answer>, Vec<Answer>, Arc<Mutex<super::scripted::Log>>) {
    let run = |d: usize| {
        let pipeline = Scripted::new(vocabulary().n_vocab(), 4096, counting_with_hiccups()).with_depth(d);
        let rig = Rig::start(pipeline, requests.len(), 8, 64, ngram.then_some(Proposer::Ngram));
        let rxs: Vec<_> = requests.iter().map(|(p, n)| rig.submit(p, *n, &[])).collect();
        let answers: Vec<Answer> = rxs.into_iter().map(answer).map(without_cache_hits).collect();
        (answers, rig.log.clone())
    };
    let (alone, _) = run(1);
    let (deep, log) = run(depth);
    (alone, deep, log)
}

fn mixed_requests() -> Vec<(Vec<i32>, usize)> {
    let long = prompt(&"the quick brown fox jumps over the lazy dog ".repeat(30));
    assert!(long.len() > 250, "{} tokens", long.len());
    let mut r: Vec<(Vec<i32>, usize)> = (0..6).map(|i| (prompt(&format!("Count {i}:")), 20 + i)).collect();
    r.push((long, 12));
    r
}

#[test]
fn micro_batches_in_flight_give_every_sequence_the_answer_it_gets_alone() {
    let (alone, deep, log) = at_depth(3, false, &mixed_requests());
    assert_eq!(deep, alone);
    let log = log.lock().unwrap();
    assert_eq!(log.violations, Vec::<String>::new());
    assert_eq!(log.max_in_flight, 3, "three micro-batches flew at once");
    // Seven generating sequences over three places in flight: at most three decode
    // tokens per micro-batch.
    // (A sequence with one token in a micro-batch is decoding: every prompt here is longer.)
    let decoding = |b: &Vec<(u64, u32, bool, i32)>| b.iter().filter(|t| b.iter().filter(|u| u.0 == t.0).count() == 1).count();
    let most = log.batches.iter().map(decoding).max().unwrap();
    assert!(most <= 3, "{most} decode tokens in one micro-batch");
    // The long prompt (sequence 6) went in chunks well under --max-batch, several of them
    // one after another with no answer between (in flight together).
    let chunks: Vec<usize> = log.batches.iter().map(|b| b.iter().filter(|t| t.0 == 6).count()).filter(|&n| n > 1).collect();
    assert!(chunks.len() >= 4 && chunks.iter().all(|&n| n < 64), "prompt chunks {chunks:?}");
}

#[test]
fn prompts_arriving_together_follow_one_another_through_the_pipeline() {
    // Six short prompts at once, room for all of them in one batch: with three places in
    // flight they go as a few micro-batches one after another (every member busy), not as
    // one batch the ring carries alone; each prompt still goes in one piece.
    let requests: Vec<(Vec<i32>, usize)> = (0..6).map(|i| (prompt(&format!("Count {i}: {}", "one two three four ".repeat(6))), 12)).collect();
    assert!(requests.iter().all(|(p, _)| (20..40).contains(&p.len())), "prompt lengths");
    let run = |depth: usize| {
        // Steps of 10 ms: every request is in before the first can finish and free its
        // slot for a later one (which would then carry a second prompt on sequence 0; on
        // a loaded 2-core host the submitting thread once lost that race to thirteen
        // instant steps).
        let pipeline = Scripted::new(vocabulary().n_vocab(), 4096, counting_with_hiccups()).with_depth(depth).with_shortest_chunk(40).with_delay(Duration::from_millis(10));
        let rig = Rig::start(pipeline, requests.len(), 8, 256, None);
        let rxs: Vec<_> = requests.iter().map(|(p, n)| rig.submit(p, *n, &[])).collect();
        let answers: Vec<Answer> = rxs.into_iter().map(answer).map(without_cache_hits).collect();
        (answers, rig.log.clone())
    };
    let (alone, _) = run(1);
    let (deep, log) = run(3);
    assert_eq!(deep, alone);
    let log = log.lock().unwrap();
    assert_eq!(log.violations, Vec::<String>::new());
    // Prompt rows: a sequence's rows at positions before its prompt's end.
    let prompt_rows = |b: &Vec<(u64, u32, bool, i32)>| -> Vec<u64> {
        b.iter().filter(|t| (t.1 as usize) < requests[t.0 as usize].0.len()).map(|t| t.0).collect()
    };
    let carrying: Vec<Vec<u64>> = log.batches.iter().map(prompt_rows).filter(|r| !r.is_empty()).collect();
    assert!(carrying.len() >= 3, "the prompts went in {} micro-batches: {carrying:?}", carrying.len());
    for (seq, (p, _)) in requests.iter().enumerate() {
        let pieces: Vec<usize> = carrying.iter().map(|r| r.iter().filter(|&&s| s == seq as u64).count()).filter(|&n| n > 0).collect();
        assert_eq!(pieces, vec![p.len()], "sequence {seq}'s prompt went whole");
    }
    assert!(log.max_in_flight >= 2, "micro-batches flew together");
}

#[test]
fn speculation_with_micro_batches_in_flight_gives_the_same_answers() {
    let (alone, deep, log) = at_depth(2, true, &mixed_requests());
    assert_eq!(deep, alone);
    let log = log.lock().unwrap();
    assert_eq!(log.violations, Vec::<String>::new());
    assert!(!log.truncates.is_empty(), "rejected drafts left the cache");
}

/// A model keeping a recurrent state (Qwen3.5) takes rejected drafts back only to where
/// they began, and computes the accepted ones again ahead of the next decode token. With
/// micro-batches in flight and a small batch, every batch stays within `--max-batch`
/// (the batcher admits a sequence to a micro-batch only with room for its replayed rows;
/// a share could otherwise gather sequences whose drafts came from different batches),
/// and every answer is the one decoding without speculation gives.
#[test]
fn replayed_drafts_of_a_model_with_state_fit_the_batch_with_micro_batches_in_flight() {
    const SMALL_BATCH: usize = 6;
    // Answers ending at different steps, so the shares regroup.
    let requests: Vec<(Vec<i32>, usize)> = (0..5).map(|i| (prompt(&format!("Count {i}:")), 10 + (i * 7) % 23)).collect();
    let run = |depth: usize, proposer: Option<Proposer>| {
        let pipeline = Scripted::new(vocabulary().n_vocab(), 4096, counting_with_hiccups()).with_depth(depth).with_draft_snapshots().with_max_batch(SMALL_BATCH);
        let rig = Rig::start(pipeline, requests.len(), 8, SMALL_BATCH, proposer);
        let rxs: Vec<_> = requests.iter().map(|(p, n)| rig.submit(p, *n, &[])).collect();
        let answers: Vec<Answer> = rxs.into_iter().map(answer).map(without_cache_hits).collect();
        (answers, rig.log.clone())
    };
    let (plain, _) = run(1, None);
    for depth in [2, 3] {
        let (deep, log) = run(depth, Some(Proposer::Ngram));
        assert_eq!(deep, plain, "depth {depth}");
        let log = log.lock().unwrap();
        assert_eq!(log.violations, Vec::<String>::new(), "depth {depth}");
        // Drafts were rejected and accepted ones computed again: some batch holds a row
        // without logits at a position its sequence already had in an earlier batch.
        let mut seen: std::collections::HashSet<(u64, u32)> = Default::default();
        let mut replayed = 0;
        for b in &log.batches {
            replayed += b.iter().filter(|t| !t.2 && seen.contains(&(t.0, t.1))).count();
            seen.extend(b.iter().map(|t| (t.0, t.1)));
        }
        assert!(replayed > 0, "depth {depth}: no accepted draft was computed again");
    }
}

#[test]
fn a_failure_in_flight_clears_sequences_only_after_their_chunks_land() {
    let pipeline = Scripted::new(vocabulary().n_vocab(), 4096, counting()).with_depth(3);
    let rig = Rig::start(pipeline, 2, 4, 64, None);
    // The long prompt's second chunk fails while the third is in flight.
    rig.controls.lock().unwrap().failures.extend([None, Some(Failure::Local("ggml aborted".into()))]);
    let long = prompt(&"the quick brown fox jumps over the lazy dog ".repeat(30));
    let a = answer(rig.submit(&long, 3, &[]));
    assert!(a.failed.is_some(), "{a:?}");
    let again = answer(rig.submit(&long, 3, &[]));
    assert_eq!((again.cached, again.completion_tokens), (Some(0), 3), "{again:?}");
    let log = rig.log.lock().unwrap();
    assert!(log.clears.contains(&0), "the failed sequence was cleared");
    assert_eq!(log.violations, Vec::<String>::new());
}

#[test]
fn a_client_gone_while_its_chunks_fly_frees_its_slot_only_when_they_land() {
    let pipeline = Scripted::new(vocabulary().n_vocab(), 4096, counting()).with_depth(3).with_delay(Duration::from_millis(2));
    let rig = Rig::start(pipeline, 1, 4, 64, None);
    let long = prompt(&"the quick brown fox jumps over the lazy dog ".repeat(30));
    let rx = rig.submit(&long, 1000, &[]);
    wait_until("its chunks fly", || rig.log.lock().unwrap().max_in_flight >= 2);
    drop(rx);
    // The next request waits for the slot (the landed rows of a prompt given up are not
    // reused: they were never marked exact).
    let a = answer(rig.submit(&long, 3, &[]));
    assert_eq!(a.completion_tokens, 3, "{a:?}");
    assert_eq!(rig.violations(), Vec::<String>::new());
}

#[test]
fn a_lost_ring_member_fails_every_micro_batch_in_flight_and_recovers() {
    let pipeline = Scripted::new(vocabulary().n_vocab(), 4096, counting()).with_depth(3).with_delay(Duration::from_millis(1));
    let rig = Rig::start(pipeline, 4, 8, 64, None);
    rig.controls.lock().unwrap().failures.extend([None, None, None, None, Some(Failure::Ring("worker w1 closed the ring link".into()))]);
    let rxs: Vec<_> = (0..4).map(|i| rig.submit(&prompt(&format!("Count {i}:")), 100, &[])).collect();
    for a in rxs.into_iter().map(answer) {
        assert!(a.unavailable.as_deref().is_some_and(|m| m.contains("w1") || m.contains("broken")), "{a:?}");
    }
    wait_until("the ring recovers", || rig.batcher.degraded().is_none());
    assert_eq!(answer(rig.submit(&prompt("Count:"), 3, &[])).completion_tokens, 3);
    assert_eq!(rig.violations(), Vec::<String>::new());
}
