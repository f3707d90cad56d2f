//! A ring worker's paging around its windows: with release on, the window it just ran
//! leaves memory; with prefetch on, its next window is read in behind its back. Runs a
//! real stage over the default model, on a private copy so the page cache can be dropped
//! without other tests' mappings keeping pages in.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use engine::{BatchToken, ModelFile, Stage, StageConfig, StageInput};
use hearth::runtime::ring::paging::WindowPager;

/// One test at a time: the pager counts the disk reads of the whole process
/// (`/proc/self/io`), so another test re-reading its copy meanwhile (after dropping its
/// pages) showed up as reads of this one's window, and the test failed on a busy host.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

fn private_copy(tag: &str) -> (PathBuf, Arc<ModelFile>) {
    let model = hearth::models::ensure_default_model(&hearth::models::models_dir()).unwrap();
    let dir = std::env::temp_dir().join(format!("hearth-paging-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.gguf");
    std::fs::copy(&model, &path).unwrap();
    // Dirty pages are not dropped until written back.
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    (dir, Arc::new(ModelFile::open(&path).unwrap()))
}

fn stage(file: &Arc<ModelFile>, windows: &[std::ops::Range<usize>]) -> Stage {
    stage_with(file, windows, false)
}

/// A worker-style stage (no output layer, weights in the mapping) for two sequences.
fn stage_with(file: &Arc<ModelFile>, windows: &[std::ops::Range<usize>], read_chosen_experts: bool) -> Stage {
    let cfg = StageConfig { windows: windows.to_vec(), n_seq: 2, n_ctx_seq: 64, max_batch: 8, threads: 1, accel_layers: 0, experts_in_ram: 0, owns_output: false, batch_invariant: false, repack: false, read_chosen_experts, kv: Default::default(), draft_snapshots: false };
    Stage::new(file.clone(), cfg).unwrap()
}

/// One worker-style step of window `r`: the pager's hooks around a forward pass.
fn step(stage: &mut Stage, pager: &mut WindowPager, r: usize, pos: u32) {
    let e = stage.spec().n_embd;
    let hidden = vec![0.01f32; e];
    pager.before(r, None);
    stage.forward(r, &[BatchToken { seq: 0, pos, logits: false }], StageInput::Hidden(&hidden)).unwrap();
    pager.after(r);
}

fn window_bytes(file: &ModelFile, layers: std::ops::Range<usize>) -> (Vec<std::ops::Range<usize>>, usize) {
    let ranges = file.layer_byte_ranges(layers);
    let total = ranges.iter().map(|r| r.len()).sum();
    (ranges, total)
}

#[test]
fn release_drops_the_window_run_and_prefetch_reads_the_next() {
    let _alone = alone();
    let (dir, file) = private_copy("on");
    let windows = [0..10, 10..20];
    let mut stage = stage(&file, &windows);
    let mut pager = WindowPager::new(file.clone(), windows.to_vec(), true, Some(true));
    assert!(pager.release() && pager.prefetch());
    let (r0, t0) = window_bytes(&file, 0..10);
    let (r1, t1) = window_bytes(&file, 10..20);
    file.release(&r0);
    file.release(&r1);
    assert!(file.resident_bytes(&r1) < t1 / 2, "could not drop the page cache");

    step(&mut stage, &mut pager, 0, 0);
    pager.wait_prefetch();
    let (after0, after1) = (file.resident_bytes(&r0), file.resident_bytes(&r1));
    eprintln!("window 0: {t0} bytes, {after0} resident after release; window 1: {t1} bytes, {after1} resident after prefetch");
    assert!(after0 < t0 / 2, "release left {after0} of {t0} bytes of window 0 resident");
    assert_eq!(after1, t1, "prefetch left pages of window 1 out");

    // Window 1 now runs from memory: the compute reads (almost) nothing from disk.
    step(&mut stage, &mut pager, 1, 0);
    pager.wait_prefetch();
    let s = &pager.stats()[1];
    assert_eq!(s.steps, 1);
    assert_eq!(s.resident_at_start_last as usize, t1);
    assert!(s.read_compute_last < (t1 / 10) as u64, "window 1 read {} bytes while computing", s.read_compute_last);
    let profile = pager.profile();
    assert_eq!(profile["windows"].as_array().unwrap().len(), 2);
    assert_eq!(profile["release"], true);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn without_release_or_prefetch_the_pages_stay_as_the_compute_left_them() {
    let _alone = alone();
    let (dir, file) = private_copy("off");
    let windows = [0..10, 10..20];
    let mut stage = stage(&file, &windows);
    let mut pager = WindowPager::new(file.clone(), windows.to_vec(), false, Some(false));
    let (r0, t0) = window_bytes(&file, 0..10);
    let (r1, t1) = window_bytes(&file, 10..20);
    file.release(&r0);
    file.release(&r1);
    step(&mut stage, &mut pager, 0, 0);
    pager.wait_prefetch();
    let (after0, after1) = (file.resident_bytes(&r0), file.resident_bytes(&r1));
    // Window 1 is not checked: the kernel's own readahead past window 0's end may have
    // brought in part of it (about half, here).
    eprintln!("window 0: {after0} of {t0} bytes resident; window 1: {after1} of {t1}");
    assert!(after0 > t0 * 9 / 10, "window 0 should stay resident, {after0} of {t0}");
    let s = &pager.stats()[0];
    assert!(s.read_compute_last > (t0 / 2) as u64, "the compute had to read window 0 from disk: {}", s.read_compute_last);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn one_window_never_releases_or_prefetches_and_the_hooks_are_cheap() {
    let _alone = alone();
    let (dir, file) = private_copy("one");
    let windows = [0..30];
    let mut stage = stage(&file, &windows);
    let mut pager = WindowPager::new(file.clone(), windows.to_vec(), true, None);
    assert!(!pager.release() && !pager.prefetch());
    step(&mut stage, &mut pager, 0, 0);
    // The per-step cost of the hooks (two /proc/self/io reads and a mincore of the
    // whole 30-layer window, ~66 MB, ~16k pages).
    let n = 200;
    let t = Instant::now();
    for _ in 0..n {
        pager.before(0, None);
        pager.after(0);
    }
    let per = t.elapsed() / n;
    eprintln!("pager hooks: {per:?} per step for a {} byte window", window_bytes(&file, 0..30).1);
    // Cheap means far below a step (tens of ms); the bound leaves room for a slow or busy host.
    assert!(per.as_millis() < 50, "{per:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A MoE window (measured: docs/benchmarks.md, "MoE larger than memory") is kept unless
/// the plan says to release it, and only its dense part is read ahead: the experts a token
/// does not use stay on disk.
#[test]
fn a_moe_window_is_kept_and_only_its_dense_part_is_read_ahead() {
    let _alone = alone();
    let dir = std::env::temp_dir().join(format!("hearth-paging-moe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("moe.gguf");
    let mut m = engine::random_model::RandomModel::new("qwen3moe", 4, 256, 512, 4, 2);
    m.n_expert = 16;
    m.n_ff_exp = 256;
    let model = hearth::models::ensure_default_model(&hearth::models::models_dir()).unwrap();
    m.write(&model, &path).unwrap();
    let file = Arc::new(ModelFile::open(&path).unwrap());
    let windows = [0..2, 2..4];
    let pager = WindowPager::new(file.clone(), windows.to_vec(), true, None);
    assert!(!pager.release(), "a MoE window is not released by default: {}", pager.describe());
    assert!(WindowPager::new(file.clone(), windows.to_vec(), true, Some(true)).release(), "the plan can still ask for it");
    let mut stage = stage(&file, &windows);
    let (r1, t1) = window_bytes(&file, 2..4);
    let dense: usize = file.layer_byte_ranges_without_experts(2..4).iter().map(|r| r.len()).sum();
    assert!(dense < t1 / 4, "the experts are most of the window: {dense} of {t1}");
    let mut pager = WindowPager::new(file.clone(), windows.to_vec(), true, None);
    file.release(&r1);
    step(&mut stage, &mut pager, 0, 0);
    pager.wait_prefetch();
    let resident = file.resident_bytes(&r1);
    eprintln!("window 1: {t1} bytes, {dense} dense, {resident} resident after read-ahead");
    // The dense part came in; the experts (3/4 of the window and more) did not, give or
    // take the kernel's own read-around of the dense ranges.
    assert!(resident >= dense && resident < t1 / 2, "{resident} of {t1} resident, {dense} dense");
    std::fs::remove_dir_all(&dir).ok();
}

/// A MoE stage paged from disk (`read_chosen_experts`) reads ahead exactly the experts
/// each layer's router chose, once it chose, and computes what the stage without it
/// computes (the graph now runs in pieces, stopping after each router).
#[test]
fn a_paged_moe_stage_reads_exactly_the_chosen_experts_and_computes_the_same() {
    let _alone = alone();
    let dir = std::env::temp_dir().join(format!("hearth-paging-experts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("moe.gguf");
    // Experts of 1,024 x 1,024 in Q8_0: 1.1 MB per expert and matrix, far more than a page,
    // so how much of them is read shows.
    let (n_layer, n_expert, used) = (2usize, 16usize, 2usize);
    let mut m = engine::random_model::RandomModel::new("qwen3moe", n_layer as u32, 1024, 2048, 8, 4);
    m.n_expert = n_expert as u32;
    m.n_expert_used = used as u32;
    m.n_ff_exp = 1024;
    m.ty = engine::gguf::GgmlType::Q8_0;
    let model = hearth::models::ensure_default_model(&hearth::models::models_dir()).unwrap();
    m.write(&model, &path).unwrap();
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    let file = Arc::new(ModelFile::open(&path).unwrap());
    let windows = [0..n_layer];
    let e = m.n_embd as usize;
    let hidden = |rows: usize| -> Vec<f32> { (0..rows * e).map(|i| ((i * 37 % 101) as f32 - 50.0) / 500.0).collect() };
    let forward = |stage: &mut Stage, batch: &[BatchToken], rows: usize| match stage.forward(0, batch, StageInput::Hidden(&hidden(rows))).unwrap() {
        engine::StageOutput::Hidden(h) => h,
        engine::StageOutput::Logits(_) => panic!("a middle window returned logits"),
    };
    // One token; then a batch mixing both sequences: a second token of the first and a
    // 5-token prompt of the second (its tokens choose many experts between them).
    let mixed: Vec<BatchToken> = std::iter::once(BatchToken { seq: 0, pos: 1, logits: false }).chain((0..5).map(|p| BatchToken { seq: 1, pos: p, logits: false })).collect();
    let run = |read_chosen_experts: bool| {
        let mut stage = stage_with(&file, &windows, read_chosen_experts);
        let (all, _) = window_bytes(&file, 0..n_layer);
        file.release(&all);
        let one = forward(&mut stage, &[BatchToken { seq: 0, pos: 0, logits: false }], 1);
        let dense = file.resident_bytes(&file.layer_byte_ranges_without_experts(0..n_layer));
        let experts_resident = file.resident_bytes(&all).saturating_sub(dense);
        let advised = stage.expert_bytes_read_ahead();
        let batch = forward(&mut stage, &mixed, mixed.len());
        (one, batch, advised, experts_resident)
    };
    let (plain, plain_batch, none, plain_resident) = run(false);
    let (chosen, chosen_batch, advised, chosen_resident) = run(true);
    assert_eq!(none, None);
    assert_eq!(chosen, plain, "reading the chosen experts ahead changed the result");
    assert_eq!(chosen_batch, plain_batch, "reading the chosen experts ahead changed a mixed batch's result");
    // One token chooses `used` distinct experts per layer; each has a slice in gate, up and down.
    let per_expert = 1024 * 1024 / 32 * 34;
    assert_eq!(advised, Some((n_layer * 3 * used * per_expert) as u64));
    let all_experts = n_layer * 3 * n_expert * per_expert;
    eprintln!("expert bytes resident after one token: {chosen_resident} reading the chosen ones, {plain_resident} left to the OS, of {all_experts}");
    // Left to the OS, faults read around themselves (read_ahead_kb); the chosen experts'
    // own reads never read more than that. (Dense faults may still read around into
    // neighbouring experts, hence no tighter bound.)
    assert!(chosen_resident <= plain_resident + (1 << 20), "{chosen_resident} > {plain_resident}");
    std::fs::remove_dir_all(&dir).ok();
}
