//! A small feedback-driven fuzz loop on stable Rust, shared by the fuzz tests of several
//! crates (each includes this file with `#[path]`; it depends on nothing but std, so no
//! crate needs a new dependency for it).
//!
//! Why not cargo-fuzz: it needs nightly in CI and rebuilds every dependency, llama.cpp
//! included, under sanitizer flags. Why not plain proptest: random inputs rarely get past a
//! parser's first checks. This loop keeps a corpus of inputs that reached an outcome not
//! seen before (each target names its outcome: an error's kind with the numbers stripped,
//! or a success's shape), so mutations build on inputs that already got deep.
//!
//! One test, two lengths: a few seconds by default (CI), or `HEARTH_FUZZ_SECS=600` for a
//! long run. `HEARTH_FUZZ_SEED` replays a run; the seed is printed at the end, as are the
//! cases run, the corpus size and every failure. `HEARTH_FUZZ_OUTCOMES=1` lists the distinct
//! outcomes reached, to see how deep a run got.
#![allow(dead_code)]

use std::collections::HashSet;
use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// CI's run per target: long enough for tens of thousands of parser cases, short enough
/// that five targets add seconds, not minutes, to the suite.
pub const DEFAULT_SECS: f64 = 3.0;
/// The same seed every CI run unless one is given, so a CI failure replays.
const DEFAULT_SEED: u64 = 0x4845_4152_5448; // "HEARTH"
/// Failures printed in full; the rest are only counted.
const MAX_REPORTED: usize = 5;
/// Characters of a failing input printed: enough to see its structure, not a megabyte of
/// tensor data. `HEARTH_FUZZ_SEED` replays the whole case.
const MAX_SHOWN_INPUT: usize = 4000;
/// Corpus entries kept: past this, new outcomes are still counted but old entries are
/// replaced at random, so memory stays flat in a long run.
const MAX_CORPUS: usize = 4096;

/// splitmix64: tiny, fast, and good enough to choose mutations.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`; 0 when `n` is 0.
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// True with probability 1/n.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// Values that break size arithmetic: zero, one, powers of two and their neighbours,
    /// sign bits, the maxima of every width, and now and then anything at all.
    pub fn interesting_u64(&mut self) -> u64 {
        const EDGES: [u64; 14] = [
            0,
            1,
            2,
            3,
            31,
            32,
            255,
            256,
            0x7FFF,
            0xFFFF,
            0x7FFF_FFFF,
            0xFFFF_FFFF,
            0x7FFF_FFFF_FFFF_FFFF,
            u64::MAX,
        ];
        match self.below(4) {
            0 => *self.pick(&EDGES),
            1 => 1u64 << self.below(64),
            2 => (1u64 << self.below(64)).wrapping_sub(1 + self.below(2) as u64),
            _ => self.next_u64() >> self.below(64),
        }
    }
}

/// Byte-level mutations every target uses on top of its structure-aware ones.
pub fn mutate_bytes(rng: &mut Rng, bytes: &mut Vec<u8>, donor: &[u8]) {
    let len = bytes.len();
    let at = rng.below(len + 1);
    match rng.below(9) {
        0 => {
            if let Some(b) = bytes.get_mut(at) {
                *b ^= 1 << rng.below(8);
            }
        }
        1 => {
            if let Some(b) = bytes.get_mut(at) {
                *b = rng.next_u64() as u8;
            }
        }
        2 => {
            // An integer field of 1, 2, 4 or 8 bytes overwritten with an edge value.
            let width = 1 << rng.below(4);
            let value = rng.interesting_u64().to_le_bytes();
            let end = (at + width).min(len);
            bytes[at.min(len)..end].copy_from_slice(&value[..end - at.min(len)]);
        }
        3 => bytes.truncate(at),
        4 => {
            let n = 1 + rng.below(16);
            let end = (at + n).min(len);
            bytes.drain(at.min(len)..end);
        }
        5 => {
            let n = 1 + rng.below(16);
            let ins: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            bytes.splice(at..at, ins);
        }
        6 => {
            // A run of the input repeated: duplicated entries, repeated headers.
            let start = rng.below(len + 1);
            let end = (start + 1 + rng.below(64)).min(len);
            let run = bytes[start..end].to_vec();
            bytes.splice(at..at, run);
        }
        7 if !donor.is_empty() => {
            // A piece of another corpus entry spliced in.
            let start = rng.below(donor.len());
            let end = (start + 1 + rng.below(256)).min(donor.len());
            bytes.splice(at..at, donor[start..end].iter().copied());
        }
        _ => {
            let n = 1 + rng.below(8);
            let end = (at + n).min(len);
            bytes[at.min(len)..end].fill(if rng.one_in(2) { 0 } else { 0xFF });
        }
    }
}

/// `text` with every number (decimal or hex) replaced by `#` and every double-quoted string by `"…"`:
/// error messages name offsets, counts and the offending text, and an outcome is "new" when
/// its kind is new, not its numbers or the text a mutant put in.
pub fn shape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    let mut in_digits = false;
    while let Some(c) = chars.next() {
        if c == '"' {
            out.push_str("\"…\"");
            // To the closing quote; a backslash escapes the character after it.
            while let Some(q) = chars.next() {
                match q {
                    '\\' => {
                        chars.next();
                    }
                    '"' => break,
                    _ => {}
                }
            }
            in_digits = false;
        } else if c.is_ascii_digit() || (in_digits && (c.is_ascii_hexdigit() || c == 'x')) {
            // A number, hex ones (0x4747) included.
            if !in_digits {
                out.push('#');
            }
            in_digits = true;
        } else {
            in_digits = false;
            out.push(c);
        }
    }
    out
}

/// What one run did.
#[derive(Debug)]
pub struct Report {
    pub name: String,
    pub seed: u64,
    pub cases: u64,
    pub outcomes: usize,
    pub corpus: usize,
    pub failures: u64,
    pub elapsed: Duration,
}

/// The run's length and seed, from the environment.
pub struct Budget {
    pub secs: f64,
    pub seed: u64,
}

impl Budget {
    /// `scale` shortens or lengthens the default run for targets whose cases are slow (a
    /// live server) or cheap.
    pub fn from_env(scale: f64) -> Budget {
        let long = std::env::var("HEARTH_FUZZ_SECS").ok().and_then(|s| s.parse::<f64>().ok());
        let secs = long.unwrap_or(DEFAULT_SECS * scale);
        let seed = std::env::var("HEARTH_FUZZ_SEED").ok().and_then(|s| s.parse().ok());
        let seed = seed.unwrap_or(if long.is_some() { random_seed() } else { DEFAULT_SEED });
        Budget { secs, seed }
    }
}

fn random_seed() -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    t.as_nanos() as u64 ^ u64::from(std::process::id()) << 32
}

/// Runs `check` on mutants of `seeds` until the budget is spent. `mutate` makes a new
/// input from a parent and a donor (another corpus entry); `check` returns the outcome's
/// shape and panics (an assertion) when the target broke a promise. A case slower than
/// `stall` counts as a failure too: nothing a peer sends may stall a node. Fails the test,
/// after the whole run, if any case failed.
pub fn run<I, M, C>(name: &str, budget: &Budget, seeds: Vec<I>, stall: Duration, mut mutate: M, mut check: C) -> Report
where
    I: Clone + Debug,
    M: FnMut(&mut Rng, &I, &I) -> I,
    C: FnMut(&I) -> String,
{
    assert!(!seeds.is_empty(), "{name}: no seed inputs");
    let mut rng = Rng::new(budget.seed);
    let mut corpus = seeds.clone();
    let mut seen = HashSet::new();
    let mut failures = 0u64;
    let mut cases = 0u64;
    let start = Instant::now();
    let deadline = Duration::from_secs_f64(budget.secs);
    // Seeds first, as they are: a target that fails on a valid input fails at once.
    let mut pending: Vec<I> = seeds;
    let trace = std::env::var_os("HEARTH_FUZZ_TRACE").is_some();
    loop {
        let input = match pending.pop() {
            Some(seed) => seed,
            None => {
                if start.elapsed() >= deadline {
                    break;
                }
                let parent = rng.pick(&corpus).clone();
                let donor = rng.pick(&corpus).clone();
                mutate(&mut rng, &parent, &donor)
            }
        };
        cases += 1;
        if trace {
            // A case that never returns cannot be reported after it: this names it before.
            eprintln!("fuzz {name}: case {cases}: {input:?}");
        }
        let case_start = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(|| check(&input)));
        let took = case_start.elapsed();
        let failed = match result {
            Ok(_) if took > stall => Some(format!("took {took:?} (limit {stall:?})")),
            Ok(outcome) => {
                if seen.insert(outcome) {
                    if corpus.len() < MAX_CORPUS {
                        corpus.push(input.clone());
                    } else {
                        let slot = rng.below(corpus.len());
                        corpus[slot] = input.clone();
                    }
                }
                None
            }
            Err(panic) => Some(
                panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic".into()),
            ),
        };
        if let Some(why) = failed {
            failures += 1;
            if failures <= MAX_REPORTED as u64 {
                let mut shown = format!("{input:?}");
                if shown.len() > MAX_SHOWN_INPUT {
                    let cut = (0..=MAX_SHOWN_INPUT).rev().find(|&i| shown.is_char_boundary(i)).unwrap_or(0);
                    shown.truncate(cut);
                    shown.push_str(" …");
                }
                eprintln!("fuzz {name}: FAILURE {failures}: {why}\n  input: {shown}");
            }
        }
    }
    let report = Report {
        name: name.to_string(),
        seed: budget.seed,
        cases,
        outcomes: seen.len(),
        corpus: corpus.len(),
        failures,
        elapsed: start.elapsed(),
    };
    eprintln!(
        "fuzz {name}: {} cases in {:.1} s, {} distinct outcomes, corpus {}, {} failures (HEARTH_FUZZ_SEED={})",
        report.cases,
        report.elapsed.as_secs_f64(),
        report.outcomes,
        report.corpus,
        report.failures,
        report.seed
    );
    if std::env::var_os("HEARTH_FUZZ_OUTCOMES").is_some() {
        let mut all: Vec<_> = seen.iter().collect();
        all.sort();
        all.iter().for_each(|o| eprintln!("fuzz {name} outcome: {o}"));
    }
    assert_eq!(report.failures, 0, "fuzz {name}: {} failing cases (seed {}), see above", report.failures, report.seed);
    report
}
