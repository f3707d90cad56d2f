//! The CPU image's entrypoint (docker/cpu-variant.sh): of the llama.cpp CPU builds the
//! image carries, it runs the best one the CPU has; a build the CPU cannot run is never
//! picked (an AVX2 build on a pre-2013 desktop dies with SIGILL).
//! Fake builds and fake /proc/cpuinfo files; no Docker needed.

use std::path::Path;
use std::process::Command;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docker/cpu-variant.sh");

/// Real flag lines (trimmed) of four generations of home CPUs.
const CORE2_DUO: &str = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht syscall nx lm constant_tsc pni monitor ssse3 cx16 sse4_1 lahf_lm";
const SANDY_BRIDGE: &str = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht syscall nx rdtscp lm constant_tsc pni pclmulqdq ssse3 cx16 sse4_1 sse4_2 x2apic popcnt aes xsave avx lahf_lm";
const ZEN2: &str = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand lahf_lm abm sse4a bmi1 avx2 bmi2 sha_ni";
const ZEN4: &str = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx lm pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c bmi1 avx2 bmi2 avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512vbmi avx512_vnni";

fn cpuinfo(dir: &Path, name: &str, flags: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("processor\t: 0\nvendor_id\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")).unwrap();
    p
}

/// A fake build that prints its name and its arguments.
fn build(dir: &Path, file: &str) {
    let p = dir.join(file);
    std::fs::write(&p, format!("#!/bin/bash\necho \"{file} args=$*\"\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn run(builds: &Path, cpu: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new("bash").arg(SCRIPT).args(args).env("HEARTH_VARIANTS_DIR", builds).env("HEARTH_CPUINFO", cpu).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).trim().to_string(), String::from_utf8_lossy(&out.stderr).to_string())
}

#[test]
fn the_best_build_the_cpu_runs_is_picked() {
    let dir = std::env::temp_dir().join(format!("hearth-cpu-variant-{}", std::process::id()));
    let builds = dir.join("lib");
    std::fs::create_dir_all(&builds).unwrap();
    for v in ["skylakex", "haswell", "sandybridge", "sse42"] {
        build(&builds, &format!("hearth-{v}"));
    }
    for (cpu, flags, want) in [("zen4", ZEN4, "skylakex"), ("zen2", ZEN2, "haswell"), ("sandy", SANDY_BRIDGE, "sandybridge")] {
        let info = cpuinfo(&dir, cpu, flags);
        assert_eq!(run(&builds, &info, &["pick"]).1, want, "{cpu}");
        // The entrypoint runs it with the arguments.
        let (ok, out, err) = run(&builds, &info, &["exec", "serve", "--port", "8080"]);
        assert!(ok, "{err}");
        assert_eq!(out, format!("hearth-{want} args=serve --port 8080"), "{cpu}");
    }
    // Fewer builds in the image: the best of those it has that the CPU runs.
    std::fs::remove_file(builds.join("hearth-skylakex")).unwrap();
    assert_eq!(run(&builds, &cpuinfo(&dir, "zen4", ZEN4), &["pick"]).1, "haswell");
    std::fs::remove_file(builds.join("hearth-sse42")).unwrap();
    std::fs::remove_file(builds.join("hearth-sandybridge")).unwrap();
    // A CPU none of them runs (no AVX2 for an AVX2-only image): a clear error, not SIGILL.
    let (ok, _, err) = run(&builds, &cpuinfo(&dir, "sandy", SANDY_BRIDGE), &["exec", "serve"]);
    assert!(!ok && err.contains("none of this image's CPU builds runs on this CPU"), "{err}");
    let (ok, _, err) = run(&builds, &cpuinfo(&dir, "core2", CORE2_DUO), &["pick"]);
    assert!(!ok && err.contains("no build"), "{err}");
    // A single build (GPU images, ARM) is run whatever the CPU.
    build(&builds, "hearth");
    let (ok, out, _) = run(&builds, &cpuinfo(&dir, "core2", CORE2_DUO), &["exec", "--version"]);
    assert!(ok && out == "hearth args=--version", "{out}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The build settings of each variant turn every level above it off explicitly: ggml's
/// CMake turns AVX2, FMA and F16C on by default when GGML_NATIVE is off.
#[test]
fn each_variant_builds_exactly_its_instruction_sets() {
    let env = |v: &str| {
        let out = Command::new("bash").arg(SCRIPT).args(["env", v]).output().unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert!(env("sse42").contains("GGML_AVX=OFF") && env("sse42").contains("GGML_AVX2=OFF") && env("sse42").contains("GGML_FMA=OFF"));
    assert!(env("sandybridge").contains("GGML_AVX=ON") && env("sandybridge").contains("GGML_AVX2=OFF") && env("sandybridge").contains("GGML_F16C=OFF"));
    assert!(env("haswell").contains("GGML_AVX2=ON") && env("haswell").contains("GGML_AVX512=OFF"));
    assert!(env("skylakex").contains("GGML_AVX512=ON"));
    let out = Command::new("bash").arg(SCRIPT).args(["env", "pentium"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("unknown variant"));
}
