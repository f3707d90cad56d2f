//! `hearth bench`: hearth's engine and llama.cpp on the same GGUF, same threads, same
//! prompt, run alternately in one process so both see the same machine. Prints tokens/s
//! for prompt processing and decoding, and hearth's ratio to llama.cpp.

use std::sync::Arc;
use std::time::Instant;

use engine::op_profile::{OpProfile, OpTime};
use engine::reference::{argmax, Reference, Timing};
use engine::tokenizer::Tokenizer;
use engine::{BatchToken, LocalPipeline, ModelFile, Stage, StageConfig};

use crate::cli::BenchArgs;

/// Each sequence's prompt in the batched decode test: about a chat turn (the streams of
/// `scripts/load.py` ask to continue a 300-character passage).
const BATCHED_PROMPT_TOKENS: usize = 64;

/// Decode steps of the untimed warm-up round on an accelerator.
const WARM_UP_TOKENS: usize = 4;

/// Text repeated to build a prompt of the requested length from real tokens.
const FILLER: &str = "The quick brown fox jumps over the lazy dog while the old clock in the hall counts the hours of a quiet afternoon. ";

pub fn run(args: BenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    let path = args.model.resolve()?;
    let tokenizer = Tokenizer::load(&path)?;
    let mut prompt: Vec<i32> = Vec::new();
    while prompt.len() < args.prompt_tokens {
        prompt.extend(tokenizer.tokenize(FILLER, false));
    }
    prompt.truncate(args.prompt_tokens.max(1));

    let file = Arc::new(ModelFile::open(&path)?);
    let spec = file.spec.clone();
    let gpu = crate::runtime::GpuPlacement { layers: crate::runtime::GpuLayers::Count(args.gpu_layers), experts_in_ram: crate::runtime::GpuLayers::Count(args.experts_in_ram) };
    gpu.check(spec.moe.is_some())?;
    let (n, e) = gpu.resolve(0, 0);
    // One more than the layers: the output layer goes to the device too, in both engines.
    let (accel_layers, experts_in_ram) = (n.min(spec.n_layer + 1), e.min(spec.n_layer));
    let cfg = StageConfig { n_ctx_seq: (prompt.len() + args.gen_tokens + 1).min(spec.n_ctx_train), max_batch: prompt.len(), threads: args.threads, accel_layers, experts_in_ram, repack: !args.no_repack, ..StageConfig::whole(&spec) };
    let mut hearth = LocalPipeline::new(vec![Stage::new(file.clone(), cfg.clone())?])?;
    let (file_for_drafts, cfg_for_drafts) = (file.clone(), cfg.clone());
    // The batched test: its own pipeline with a KV slot per sequence, sized as llama.cpp's streams.
    let n_seq = args.sequences;
    let short = &prompt[..prompt.len().min(BATCHED_PROMPT_TOKENS)];
    let prompts = vec![short.to_vec(); n_seq];
    let mut batched = if n_seq > 1 {
        let n_ctx_seq = (short.len() + args.gen_tokens + 1).min(spec.n_ctx_train);
        Some(LocalPipeline::new(vec![Stage::new(file, StageConfig { n_seq, n_ctx_seq, max_batch: short.len().max(n_seq), ..cfg })?])?)
    } else {
        None
    };
    // llama.cpp offloads the last N layers: the experts kept in RAM are the first of those.
    let first_gpu = spec.n_layer - accel_layers.min(spec.n_layer);
    let reference = Reference::load_placed(&path, args.threads, !args.no_repack, accel_layers, first_gpu..first_gpu + experts_in_ram)?;

    println!("model: {} ({} layers, {})", path.display(), spec.n_layer, spec.arch_name);
    println!("threads: {}, prompt: {} tokens, decode: {} tokens, rounds: {}", args.threads, prompt.len(), args.gen_tokens, args.reps);
    if accel_layers > 0 {
        let device = engine::accelerators().first().map_or_else(String::new, |a| a.description.clone());
        let output = if accel_layers > spec.n_layer { "on the device" } else { "on the CPU" };
        println!("accelerator: {device}, {} layers in both engines, of them {experts_in_ram} with their experts in RAM; the output layer {output}", accel_layers.min(spec.n_layer));
        // A GPU backend builds its kernels for each shape at first use (on an H100 under
        // Vulkan the first 512-token prompt ran 19x slower than the next): one untimed
        // round of every shape first, as llama-bench warms up.
        reference.bench(&prompt, WARM_UP_TOKENS)?;
        bench_hearth(&mut hearth, &prompt, WARM_UP_TOKENS)?;
        if let Some(p) = batched.as_mut() {
            reference.decode_together(&prompts, WARM_UP_TOKENS, false)?;
            p.decode_together(&prompts, WARM_UP_TOKENS, short.len())?;
        }
    }
    let mut best_ref: Option<Timing> = None;
    let mut best_hearth: Option<Timing> = None;
    let (mut pp_ratios, mut tg_ratios, mut batched_ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut best_ref_batched, mut best_hearth_batched): (Option<Timing>, Option<Timing>) = (None, None);
    for round in 0..args.reps.max(1) {
        // Alternate who goes first, so neither always runs on a warmer (or busier) machine.
        let (r, h) = if round % 2 == 0 {
            let r = reference.bench(&prompt, args.gen_tokens)?;
            (r, bench_hearth(&mut hearth, &prompt, args.gen_tokens)?)
        } else {
            let h = bench_hearth(&mut hearth, &prompt, args.gen_tokens)?;
            (reference.bench(&prompt, args.gen_tokens)?, h)
        };
        pp_ratios.push(h.prompt_tps() / r.prompt_tps());
        tg_ratios.push(h.gen_tps() / r.gen_tps());
        println!(
            "round {}: llama.cpp pp {:.1} tg {:.1} tok/s | hearth pp {:.1} tg {:.1} tok/s",
            round + 1,
            r.prompt_tps(),
            r.gen_tps(),
            h.prompt_tps(),
            h.gen_tps()
        );
        best_ref = Some(best(best_ref, r));
        best_hearth = Some(best(best_hearth, h));
        if let Some(p) = batched.as_mut() {
            // The first token comes from the prompt: gen_tokens decode steps follow it.
            let ((rt, r), (ht, h)) = if round % 2 == 0 {
                let r = reference.decode_together(&prompts, args.gen_tokens + 1, false)?;
                (r, p.decode_together(&prompts, args.gen_tokens + 1, short.len())?)
            } else {
                let h = p.decode_together(&prompts, args.gen_tokens + 1, short.len())?;
                (reference.decode_together(&prompts, args.gen_tokens + 1, false)?, h)
            };
            batched_ratios.push(h.gen_tps() / r.gen_tps());
            println!("round {}: {n_seq} sequences decoding together: llama.cpp {:.1} tok/s | hearth {:.1} tok/s; {}", round + 1, r.gen_tps(), h.gen_tps(), agreement(&rt, &ht));
            best_ref_batched = Some(best(best_ref_batched, r));
            best_hearth_batched = Some(best(best_hearth_batched, h));
        }
    }
    if let (true, Some(p)) = (args.ops, batched.as_mut()) {
        let (mut r, mut h) = (OpProfile::default(), OpProfile::default());
        reference.decode_together_with(&prompts, args.gen_tokens + 1, false, Some(&mut r))?;
        p.decode_together_with(&prompts, args.gen_tokens + 1, short.len(), Some(&mut h))?;
        print_ops(n_seq, args.gen_tokens, &r, &h);
    }
    if args.draft_state > 0 && spec.recurrent.is_some() {
        let cfg = StageConfig { n_ctx_seq: (prompt.len() + args.gen_tokens * (args.draft_state + 2) + 2).min(spec.n_ctx_train), max_batch: prompt.len().max(2 * args.draft_state + 2), batch_invariant: true, ..cfg_for_drafts };
        bench_draft_state(&file_for_drafts, &cfg, &prompt, args.draft_state, args.gen_tokens, args.reps.max(1))?;
    }
    let (r, h) = (best_ref.expect("one round"), best_hearth.expect("one round"));
    println!();
    println!("best round of each, and the median of the per-round ratios (each round runs both back to back):");
    println!("| test            | llama.cpp tok/s | hearth tok/s | best / best | median ratio |");
    println!("|-----------------|-----------------|--------------|-------------|--------------|");
    println!("| prompt (pp{:<4}) | {:>15.1} | {:>12.1} | {:>10.3}x | {:>11.3}x |", r.prompt_tokens, r.prompt_tps(), h.prompt_tps(), h.prompt_tps() / r.prompt_tps(), median(&mut pp_ratios));
    println!("| decode (tg{:<4}) | {:>15.1} | {:>12.1} | {:>10.3}x | {:>11.3}x |", r.gen_tokens, r.gen_tps(), h.gen_tps(), h.gen_tps() / r.gen_tps(), median(&mut tg_ratios));
    if let (Some(r), Some(h)) = (best_ref_batched, best_hearth_batched) {
        let label = format!("decode x{n_seq} seqs");
        println!("| {label:<15} | {:>15.1} | {:>12.1} | {:>10.3}x | {:>11.3}x |", r.gen_tps(), h.gen_tps(), h.gen_tps() / r.gen_tps(), median(&mut batched_ratios));
    }
    Ok(())
}

/// Slowest shapes listed per engine: enough to see where the time goes.
const OPS_SHAPES_LISTED: usize = 12;

/// Both engines' op times side by side (per op and weight type), then each engine's
/// slowest node shapes: the table that says which ops a batched step loses in.
fn print_ops(n_seq: usize, n_gen: usize, r: &OpProfile, h: &OpProfile) {
    let (rt, ht) = (r.by_op(), h.by_op());
    let mut keys: Vec<&String> = rt.iter().chain(&ht).map(|(k, _)| k).collect();
    let mut seen = std::collections::HashSet::new();
    keys.retain(|k| seen.insert(*k));
    let find = |v: &[(String, OpTime)], k: &str| v.iter().find(|(x, _)| x == k).map(|(_, t)| *t).unwrap_or_default();
    let per_step = |t: OpTime| t.secs * 1e3 / n_gen as f64;
    println!();
    println!("{n_seq} sequences decoding together, every op computed alone ({n_gen} steps), ms per step:");
    println!("| op                   | llama.cpp ms | nodes | hearth ms | nodes | hearth / llama.cpp |");
    println!("|----------------------|--------------|-------|-----------|-------|--------------------|");
    for k in keys {
        let (a, b) = (find(&rt, k), find(&ht, k));
        println!("| {k:<20} | {:>12.3} | {:>5} | {:>9.3} | {:>5} | {:>17.3}x |", per_step(a), a.count / n_gen as u64, per_step(b), b.count / n_gen as u64, b.secs / a.secs);
    }
    println!("| total                | {:>12.3} |       | {:>9.3} |       | {:>17.3}x |", r.total_secs() * 1e3 / n_gen as f64, h.total_secs() * 1e3 / n_gen as f64, h.total_secs() / r.total_secs());
    for (name, p) in [("llama.cpp", r), ("hearth", h)] {
        println!();
        println!("{name}'s slowest node shapes (ms per step, nodes per step):");
        for (k, t) in p.by_shape().into_iter().take(OPS_SHAPES_LISTED) {
            println!("  {:>8.3} {:>4}  {k}", per_step(t), t.count / n_gen as u64);
        }
    }
}

/// Whether both engines wrote the same greedy text: a speed figure is worth little if the
/// engines computed different things (on a GPU, the kernels differ from the CPU's).
fn agreement(reference: &[Vec<i32>], hearth: &[Vec<i32>]) -> String {
    let n: usize = reference.iter().map(Vec::len).sum();
    let first = reference.iter().zip(hearth).enumerate().find_map(|(s, (r, h))| r.iter().zip(h).position(|(a, b)| a != b).or((r.len() != h.len()).then(|| r.len().min(h.len()))).map(|k| (s, k)));
    match first {
        None => format!("greedy tokens identical ({n})"),
        Some((s, k)) => format!("greedy tokens differ: sequence {s} from step {k}"),
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

fn best(prev: Option<Timing>, t: Timing) -> Timing {
    match prev {
        None => t,
        Some(p) => Timing {
            prompt_tokens: t.prompt_tokens,
            prompt_secs: p.prompt_secs.min(t.prompt_secs),
            gen_tokens: t.gen_tokens,
            gen_secs: p.gen_secs.min(t.gen_secs),
        },
    }
}

fn bench_hearth(p: &mut LocalPipeline, prompt: &[i32], n_gen: usize) -> Result<Timing, engine::Error> {
    const SEQ: u64 = 0;
    p.clear_sequence(SEQ);
    let t0 = Instant::now();
    let logits = p.prefill(SEQ, prompt, prompt.len())?;
    let prompt_secs = t0.elapsed().as_secs_f64();
    let mut tok = argmax(&logits);
    let t1 = Instant::now();
    for i in 0..n_gen {
        let l = p.forward(&[BatchToken { seq: SEQ, pos: (prompt.len() + i) as u32, logits: true }], &[tok])?;
        tok = argmax(l.row(0));
    }
    Ok(Timing { prompt_tokens: prompt.len(), prompt_secs, gen_tokens: n_gen, gen_secs: t1.elapsed().as_secs_f64() })
}

/// Speculative verification on a model keeping a recurrent state, two ways to take back
/// rejected drafts: hearth's snapshot (the graph copies each sequence's state where its
/// drafts begin; a rejection restores that copy) against a host checkpoint of the state
/// before every verification step (a rejection restores it). Both then compute the
/// accepted drafts again: the snapshot ahead of the next step's token in its batch, the
/// checkpoint (with the step's first token) in a step of their own, as the next
/// checkpoint must come after them. `k` drafts per step, half accepted; speculation's
/// batch-invariant kernels on both.
fn bench_draft_state(file: &Arc<ModelFile>, cfg: &StageConfig, prompt: &[i32], k: usize, steps: usize, reps: usize) -> Result<(), Box<dyn std::error::Error>> {
    const SEQ: u64 = 0;
    let accepted = k / 2;
    let run = |snapshots: bool| -> Result<(f64, f64, usize), Box<dyn std::error::Error>> {
        let mut p = LocalPipeline::new(vec![Stage::new(file.clone(), StageConfig { draft_snapshots: snapshots, ..cfg.clone() })?])?;
        p.prefill(SEQ, prompt, prompt.len())?;
        let mut tok = prompt[0];
        // Tokens computed again before the next step's token (the accepted drafts, and
        // for the checkpoint the step's first token too).
        let mut again: Vec<i32> = Vec::new();
        let (mut state_secs, mut advanced) = (0.0, 0);
        let t0 = Instant::now();
        for _ in 0..steps {
            if !snapshots {
                // The checkpoint must hold the state after the tokens computed again, so
                // they go first, in a step of their own.
                if !again.is_empty() {
                    let len = p.sequence_len(SEQ);
                    let batch: Vec<BatchToken> = (0..again.len()).map(|i| BatchToken { seq: SEQ, pos: (len + i) as u32, logits: false }).collect();
                    p.forward(&batch, &again)?;
                    again.clear();
                }
                let t = Instant::now();
                p.checkpoint_sequence(SEQ);
                state_secs += t.elapsed().as_secs_f64();
            }
            let len = p.sequence_len(SEQ);
            let mut ids = again.clone();
            ids.push(tok);
            ids.extend(prompt.iter().cycle().skip(len % prompt.len()).take(k));
            let first = again.len();
            let batch: Vec<BatchToken> = (0..ids.len()).map(|i| BatchToken { seq: SEQ, pos: (len + i) as u32, logits: i >= first }).collect();
            let logits = p.forward(&batch, &ids)?;
            tok = argmax(logits.row(logits.rows.len() - 1));
            // The token and half the drafts are kept; the rest is rejected.
            let keep = len + first + 1 + accepted;
            let t = Instant::now();
            let kept = p.truncate_sequence(SEQ, keep);
            state_secs += t.elapsed().as_secs_f64();
            again = ids[kept - len..keep - len].to_vec();
            advanced += 1 + accepted;
        }
        Ok((t0.elapsed().as_secs_f64(), state_secs, advanced))
    };
    println!();
    println!("speculative verification on a model keeping a state, {k} drafts per step, {accepted} accepted, {steps} steps:");
    println!("| rejected drafts taken back by | tokens/s | of it, saving and restoring the state (ms per step) |");
    println!("|-------------------------------|----------|-----------------------------------------------------|");
    let (mut snap_best, mut ckpt_best) = (f64::MAX, f64::MAX);
    let (mut snap_state, mut ckpt_state, mut advanced) = (0.0, 0.0, 0);
    for round in 0..reps {
        let order = if round % 2 == 0 { [true, false] } else { [false, true] };
        for snapshots in order {
            let (secs, state, adv) = run(snapshots)?;
            advanced = adv;
            if snapshots && secs < snap_best {
                (snap_best, snap_state) = (secs, state);
            } else if !snapshots && secs < ckpt_best {
                (ckpt_best, ckpt_state) = (secs, state);
            }
        }
    }
    let per_step = |s: f64| s * 1e3 / steps as f64;
    println!("| in-graph snapshot (hearth)    | {:>8.1} | {:>51.3} |", advanced as f64 / snap_best, per_step(snap_state));
    println!("| host checkpoint before a step | {:>8.1} | {:>51.3} |", advanced as f64 / ckpt_best, per_step(ckpt_state));
    println!("snapshot / checkpoint: {:.3}x", ckpt_best / snap_best);
    Ok(())
}
