//! The accelerator path of a GPU build (`--features vulkan`, `cuda` or `metal`): layers
//! placed on the accelerator, alone or sharing a window with CPU layers, compute what the
//! CPU computes, and the profiler measures the device. In the default CPU-only build there
//! is no accelerator and these tests only say so, unless `HEARTH_REQUIRE_ACCELERATOR` is
//! set (CI's Vulkan run sets it, with Mesa's lavapipe named by `GGML_VK_VISIBLE_DEVICES`).

mod common;

use std::sync::Arc;
use std::time::Duration;

use engine::gguf::GgmlType;
use engine::reference::argmax;
use engine::tokenizer::Tokenizer;
use engine::{AcceleratorInfo, BatchToken, LocalPipeline, ModelFile, Stage, StageConfig};

use common::{rel_rms, stage_config};

fn accelerator() -> Option<AcceleratorInfo> {
    let a = engine::accelerators().into_iter().next();
    if a.is_none() {
        assert!(std::env::var_os("HEARTH_REQUIRE_ACCELERATOR").is_none(), "HEARTH_REQUIRE_ACCELERATOR is set, but this build sees no accelerator");
        eprintln!("no accelerator in this build: nothing to test");
    }
    a
}

/// Prompt logits at the last position, then `n` greedy tokens.
fn greedy(p: &mut LocalPipeline, prompt: &[i32], n: usize) -> (Vec<f32>, Vec<i32>) {
    let batch: Vec<BatchToken> = (0..prompt.len()).map(|i| BatchToken { seq: 0, pos: i as u32, logits: i + 1 == prompt.len() }).collect();
    let first = p.forward(&batch, prompt).unwrap().row(0).to_vec();
    let mut tokens = vec![argmax(&first)];
    while tokens.len() < n {
        let pos = (prompt.len() + tokens.len() - 1) as u32;
        let l = p.forward(&[BatchToken { seq: 0, pos, logits: true }], &tokens[tokens.len() - 1..]).unwrap();
        tokens.push(argmax(l.row(0)));
    }
    (first, tokens)
}

/// Tokens decoded greedily and compared; the accelerator's kernels round differently from
/// the CPU's (other accumulation orders, F16 intermediates), so texts may part after a
/// while: the first `MUST_AGREE` must be equal and the prompt logits close.
const TOKENS: usize = 32;
const MUST_AGREE: usize = 8;
const MAX_REL_RMS: f64 = 0.05;

#[test]
fn layers_on_the_accelerator_compute_what_the_cpu_computes() {
    let Some(info) = accelerator() else { return };
    eprintln!("accelerator: {info:?}");
    let path = common::default_model();
    let file = Arc::new(ModelFile::open(&path).unwrap());
    let tok = Tokenizer::load(&path).unwrap();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
    let prompt = common::chat_prompt(&tok, &format!("Summarise this:\n{}", &text[..text.len().min(1500)]));
    let n = file.spec.n_layer;
    let run = |windows: Vec<std::ops::Range<usize>>, accel_layers: usize| {
        let cfg = StageConfig { accel_layers, ..stage_config(windows, 1) };
        let mut p = LocalPipeline::new(vec![Stage::new(file.clone(), cfg).unwrap()]).unwrap();
        greedy(&mut p, &prompt, TOKENS)
    };
    let (cpu_logits, cpu_tokens) = run(vec![0..n], 0);
    // Every layer on the accelerator; a third of them; and windows split between the
    // accelerator (the first 4 layers of each) and the CPU.
    for (windows, accel) in [(vec![0..n], n), (vec![0..n], n / 3), (vec![0..n / 3, n / 3..n], 4)] {
        let (logits, tokens) = run(windows.clone(), accel);
        let err = rel_rms(&logits, &cpu_logits);
        let agree = tokens.iter().zip(&cpu_tokens).take_while(|(a, b)| a == b).count();
        eprintln!("windows {windows:?}, {accel} layers each on {}: prompt logits rel. RMS {err:.2e}, greedy equal for {agree} of {TOKENS} tokens", info.name);
        assert!(err < MAX_REL_RMS, "relative RMS {err}");
        assert!(agree >= MUST_AGREE, "greedy tokens part after {agree}");
    }
}

#[test]
fn the_accelerator_is_profiled() {
    let Some(info) = accelerator() else { return };
    let acc = engine::Accelerator::open(info.index).unwrap();
    let types = [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::F16];
    let r = engine::profiler::accelerator_rates(&acc, &types, 4 * 576, 2 * 3 * 64 * 2, Duration::from_millis(100)).unwrap();
    eprintln!("{}: {r:?}", info.description);
    assert_eq!(r.flops.iter().map(|(t, _)| *t).collect::<Vec<_>>(), types.to_vec(), "every format timed");
    assert!(r.flops.iter().all(|(_, f)| *f > 1e6) && r.read_bw > 1e6, "{r:?}");
    assert!(r.host_to_device_s > 0.0 && r.device_to_host_s > 0.0 && r.kv_copy_s > 0.0, "{r:?}");
}
