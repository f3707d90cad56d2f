//! MoE with one GPU: a GPU too small for whole MoE layers takes their
//! every-token part (attention, norms, router, shared experts) while their routed experts
//! stay in RAM, as llama.cpp's `--n-cpu-moe` does by hand. Halda decides per device how
//! many GPU layers keep their experts in RAM; the cost model charges each part where it
//! runs.

use scheduler::{predict, schedule, DevicePlan, DeviceProfile, GpuBackend, GpuProfile, ModelProfile, MoeProfile, Options, Os, PerQuant, Plan, Strategy};

const GB: f64 = 1e9;

fn rates(peak: f64) -> PerQuant {
    PerQuant { q4k: peak, q6k: 0.8 * peak, q8_0: peak, f16: 0.5 * peak, f32: 0.5 * peak, ..PerQuant::default() }
}

/// A Qwen3-30B-A3B-shaped model at Q4_K: 48 layers of 365 MB, 345 MB of them 128 routed
/// experts of which a token uses 8.
fn moe_model() -> ModelProfile {
    let (layer, experts, share) = (365e6, 345e6, 8.0 / 128.0);
    // 2 FLOPs per weight read at ~4.5 bits a weight.
    let weights = |bytes: f64| 2.0 * bytes * 8.0 / 4.5;
    let dense_read = layer - experts;
    ModelProfile {
        name: "qwen3moe-30b-a3b".into(),
        n_layer: 48,
        layer_bytes: layer,
        input_bytes: 320e6,
        output_bytes: 320e6,
        n_vocab: 151_936,
        n_embd: 2048,
        n_head_k: 4,
        n_head_v: 4,
        head_dim_k: 128,
        head_dim_v: 128,
        n_kv: 4096,
        n_head: 32,
        kv_element_bytes_k: 2.0,
        kv_element_bytes_v: 2.0,
        layer_flops: PerQuant { q4k: weights(dense_read + experts * share), f16: 4.0 * 32.0 * 128.0 * 4096.0, f32: 1e5, ..PerQuant::default() },
        output_flops: PerQuant { q6k: 2.0 * 151_936.0 * 2048.0, ..PerQuant::default() },
        compute_buffer_cpu: 3e8,
        compute_buffer_gpu: 3e8,
        moe: Some(MoeProfile { expert_bytes: experts, read_share: share, disk_share: share, expert_flops: PerQuant { q4k: weights(experts * share), ..PerQuant::default() } }),
        state_bytes: 0.0,
    }
}

/// A gaming PC: 8 GB of VRAM on a discrete GPU, 32 GB of RAM.
fn gaming_pc(vram: f64) -> DeviceProfile {
    DeviceProfile {
        name: "gaming-pc".into(),
        os: Os::Linux,
        head: true,
        cpu_flops: rates(150e9),
        cpu_read_bw: 40.0 * GB,
        kv_copy_cpu_s: 2e-6,
        disk_seq_read: 3.0 * GB,
        disk_rand_read: 1.0 * GB,
        ram_total: 32.0 * GB,
        ram_available: 28.0 * GB,
        swap_available: 0.0,
        bytes_can_swap: 0.0,
        gpu: Some(GpuProfile { backend: GpuBackend::Cuda, flops: rates(8e12), read_bw: 400.0 * GB, memory_available: vram, kv_copy_s: 5e-6, ram_to_vram_s: 2e-5, vram_to_ram_s: 2e-5, uma: false }),
        comm_s: 0.0,
        prompt_token_share: 0.0, row_steps: Vec::new(), output_row_steps: Vec::new(), host: None,
    }
}

fn plan(window: usize, gpu_layers: usize, experts_in_ram: usize) -> Plan {
    let p = Plan { n_layer: 48, devices: vec![DevicePlan { window, gpu_layers, experts_in_ram, threads: 0 }] };
    p.check().unwrap();
    p
}

#[test]
fn each_part_is_charged_where_it_runs() {
    let (m, d) = (moe_model(), gaming_pc(8.0 * GB));
    let whole = predict(std::slice::from_ref(&d), &m, &plan(48, 48, 0), 0.0);
    let split = predict(std::slice::from_ref(&d), &m, &plan(48, 48, 10), 0.0);
    assert_eq!(split.devices[0].experts_in_ram, 10);
    // Per layer whose experts stay in RAM: the chosen experts' FLOPs and bytes on the CPU
    // instead of the GPU, and the hidden state down and up.
    let moe = m.moe.as_ref().unwrap();
    let flops = moe.expert_flops.q4k;
    let bytes = moe.expert_bytes * moe.read_share;
    let cpu = flops / 150e9 + bytes / (40.0 * GB);
    let gpu = flops / 8e12 + bytes / (400.0 * GB);
    let want = 10.0 * (cpu - gpu + 4e-5);
    let got = split.tpot_s - whole.tpot_s;
    assert!((got - want).abs() < 1e-9, "{got} vs {want}");
    // Dense layers and integrated GPUs: nothing changes (no experts to move; same memory).
    let mut dense = m.clone();
    dense.moe = None;
    let p = predict(std::slice::from_ref(&d), &dense, &plan(48, 48, 10), 0.0);
    assert_eq!(p.tpot_s, predict(std::slice::from_ref(&d), &dense, &plan(48, 48, 0), 0.0).tpot_s);
    assert_eq!(p.devices[0].experts_in_ram, 0);
}

#[test]
fn halda_keeps_experts_in_ram_to_put_every_layer_on_a_small_gpu() {
    let m = moe_model();
    for vram in [6.0 * GB, 8.0 * GB, 12.0 * GB] {
        let d = gaming_pc(vram);
        let s = schedule(std::slice::from_ref(&d), &m, &Options::default()).unwrap();
        let p = &s.plan.devices[0];
        // Whole layers of 365 MB: at most (vram − buffer) / 365 MB (+ KV) fit; with their
        // experts in RAM every layer's dense part does.
        let whole_fit = scheduler::cost::gpu_cap(&d, &m, true, 1);
        assert!(whole_fit < 48, "{vram}: the GPU must be too small for the model");
        assert_eq!((p.window, p.gpu_layers), (48, 48), "{vram}: {p:?}");
        assert!(p.experts_in_ram > 0 && p.experts_in_ram < 48, "{vram}: {p:?}");
        assert!(scheduler::cost::gpu_fits(&d, &m, true, 1, p.gpu_layers, p.experts_in_ram), "{vram}: {p:?} overflows");
        // As few as fit: one fewer expert layer in RAM would not fit the GPU.
        assert!(!scheduler::cost::gpu_fits(&d, &m, true, 1, p.gpu_layers, p.experts_in_ram - 1), "{vram}: {p:?} keeps more in RAM than needed");
        // And it beats the best plan without experts in RAM (whole layers up to VRAM).
        let without = predict(std::slice::from_ref(&d), &m, &plan(48, whole_fit, 0), 0.0).tpot_s;
        assert!(s.prediction.tpot_s < without, "{vram}: {} vs {without}", s.prediction.tpot_s);
        // The baselines place whole layers only.
        let b = schedule(std::slice::from_ref(&d), &m, &Options { strategy: Strategy::Memory, ..Options::default() }).unwrap();
        assert_eq!(b.plan.devices[0].experts_in_ram, 0);
    }
    // A GPU that holds the whole model keeps every expert on it.
    let s = schedule(&[gaming_pc(24.0 * GB)], &m, &Options::default()).unwrap();
    assert_eq!(s.plan.devices[0], DevicePlan { window: 48, gpu_layers: 48, experts_in_ram: 0, threads: 0 });
}

#[test]
fn experts_kept_in_ram_count_against_ram() {
    let m = moe_model();
    // Every layer on the 8 GB GPU: the fewest layers with experts in RAM that fit (30).
    let e = (0..=48).find(|&e| scheduler::cost::gpu_fits(&gaming_pc(8.0 * GB), &m, true, 1, 48, e)).unwrap();
    assert_eq!(e, 30);
    let fits = plan(48, 48, e);
    // With 28 GB of RAM the experts of 30 layers (10.4 GB) stay in memory ...
    let roomy = predict(&[gaming_pc(8.0 * GB)], &m, &fits, 0.0);
    assert!(!roomy.devices[0].overloaded && roomy.devices[0].breakdown.disk_s < 1e-3, "{:?}", roomy.devices[0]);
    // ... with 6 GB they do not: the device is overloaded and pages experts from disk.
    let mut small = gaming_pc(8.0 * GB);
    small.ram_available = 6.0 * GB;
    let short = predict(std::slice::from_ref(&small), &m, &fits, 0.0);
    assert!(short.devices[0].overloaded && short.devices[0].breakdown.disk_s > 1e-3, "{:?}", short.devices[0]);
    // Halda's plan there is no worse than that one: paging a token's few uncached experts
    // from a fast disk beats leaving 28 layers' attention on the CPU, so Halda keeps the
    // experts in RAM on an overloaded device too, and charges their paging.
    let s = schedule(std::slice::from_ref(&small), &m, &Options::default()).unwrap();
    let p = &s.plan.devices[0];
    assert!(s.prediction.tpot_s <= short.tpot_s * (1.0 + 1e-9), "{p:?}: {} vs {}", s.prediction.tpot_s, short.tpot_s);
    assert!(p.experts_in_ram > 0 && s.prediction.devices[0].overloaded, "{p:?}");
    // On a disk too slow to page experts from (50 MB/s: 0.8 GB/s per token's share, under
    // the 1.5 GB/s threshold), which Halda never lets overload, the model must fit in RAM
    // and VRAM together, and the experts kept in RAM count against RAM.
    small.disk_seq_read = 0.05 * GB;
    small.ram_available = 11.0 * GB;
    let s = schedule(std::slice::from_ref(&small), &m, &Options::default()).unwrap();
    let p = &s.plan.devices[0];
    assert!(!s.prediction.devices[0].overloaded, "{p:?}");
    let held = (p.window - p.gpu_layers) as f64 * m.layer_bytes_with_kv() + p.experts_in_ram as f64 * 345e6;
    assert!(held <= 11.0 * GB, "{p:?} holds {held} bytes in RAM");
    assert!(scheduler::cost::gpu_fits(&small, &m, true, 1, p.gpu_layers, p.experts_in_ram), "{p:?}");
    // A plan that keeps the experts of more layers in RAM than it has on the GPU is refused.
    let bad = Plan { n_layer: 48, devices: vec![DevicePlan { window: 48, gpu_layers: 4, experts_in_ram: 5, threads: 0 }] };
    assert!(bad.check().is_err());
}
