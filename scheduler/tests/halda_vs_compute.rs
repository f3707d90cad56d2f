//! A cluster the property test `halda_is_never_worse_than_a_baseline` found (CI, 2026-11-24):
//! two Android phones, a slow-disk Mac and a Mac with 0.5 GB free, a 41-layer model of
//! 800 MB layers: every device overloaded. Halda must not predict worse than the
//! compute-proportional baseline.

use scheduler::{schedule, DeviceProfile, ModelProfile, Options, Os, PerQuant, Strategy};

fn rates(q4k: f64, q5k: f64, q8: f64, f16: f64, f32: f64) -> PerQuant {
    PerQuant { q4k, q5k, q6k: q5k, q8_0: q8, f16, f32, ..PerQuant::default() }
}

fn dev(name: &str, os: Os, head: bool, flops: PerQuant, bw: f64, seq: f64, rand: f64, avail: f64) -> DeviceProfile {
    DeviceProfile {
        name: name.into(),
        os,
        head,
        cpu_flops: flops,
        cpu_read_bw: bw,
        kv_copy_cpu_s: 2e-6,
        disk_seq_read: seq,
        disk_rand_read: rand,
        ram_total: 16e9,
        ram_available: avail,
        swap_available: 0.0,
        bytes_can_swap: 0.0,
        gpu: None,
        comm_s: 0.0,
        prompt_token_share: 0.0, row_steps: Vec::new(), output_row_steps: Vec::new(), host: None,
    }
}

fn cluster() -> (Vec<DeviceProfile>, ModelProfile) {
    let devices = vec![
        dev("phone-1", Os::Android, true, rates(685398560310.0839, 587484480265.7861, 881226720398.6792, 489570400221.48846, 979140800442.9769), 37558114210.51666, 1633903977.601455, 1307123182.0811641, 9363034135.245867),
        dev("phone-2", Os::Android, false, rates(586933808018.5166, 503086121158.7285, 754629181738.0928, 419238434298.9404, 838476868597.8809), 76393882187.98033, 2509926136.5319614, 2007940909.2255692, 6410885675.265194),
        dev("mac-1", Os::Macos, false, rates(17500000000.0, 15000000000.0, 22500000000.0, 12500000000.0, 25000000000.0), 14856003297.319527, 200000000.0, 160000000.0, 15633116428.146685),
        dev("mac-2", Os::Macos, false, rates(70931823751.99544, 60798706073.13895, 91198059109.70842, 50665588394.282455, 101331176788.56491), 40792428173.71164, 2000000000.0, 2000000000.0, 500000000.0),
    ];
    let m = ModelProfile {
        name: "random".into(),
        n_layer: 41,
        layer_bytes: 800852886.0936078,
        input_bytes: 640682308.8748863,
        output_bytes: 961023463.3123293,
        n_vocab: 32000,
        n_embd: 512,
        n_head_k: 8,
        n_head_v: 8,
        head_dim_k: 128,
        head_dim_v: 128,
        n_kv: 0,
        n_head: 8,
        kv_element_bytes_k: 2.0,
        kv_element_bytes_v: 2.0,
        layer_flops: PerQuant { q4k: 1281364617.7497725, q6k: 400426443.0468039, f32: 5120.0, ..PerQuant::default() },
        output_flops: PerQuant { q6k: 32768000.0, ..PerQuant::default() },
        compute_buffer_cpu: 2e8,
        compute_buffer_gpu: 2e8,
        moe: None,
        state_bytes: 0.0,
    };
    (devices, m)
}

#[test]
fn halda_is_not_worse_than_the_compute_baseline_when_every_device_is_overloaded() {
    let (devices, m) = cluster();
    let h = schedule(&devices, &m, &Options::default()).unwrap();
    let c = schedule(&devices, &m, &Options { strategy: Strategy::Compute, ..Options::default() }).unwrap();
    // The program alone put 11 layers on the second phone (overloaded, k = 1) where the
    // ring re-reads about twice its excess: 5.85 s against the baseline's 5.44 s.
    assert!(h.prediction.tpot_s <= c.prediction.tpot_s * (1.0 + 1e-7), "halda {} > compute {}", h.prediction.tpot_s, c.prediction.tpot_s);
}
