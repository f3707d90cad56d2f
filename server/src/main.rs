//! The `hearth` command: parses the CLI and runs a role (see the library for the parts).

use clap::Parser;
use hearth::cli;

/// How long (in pause instructions) an idle OpenMP thread spins before it sleeps, unless
/// the user set `GOMP_SPINCOUNT`. libgomp's default (300,000, i.e. milliseconds on CPUs
/// whose pause takes ~100 cycles) keeps a ring member's threads burning cores after its
/// window is done, while the next member on the same machine needs them. Waits inside a
/// step (ggml's per-op barriers) last microseconds, well within this.
const OPENMP_SPIN_COUNT: &str = "10000";

/// libgomp reads its settings once, when it is loaded, before `main`: setting them means
/// starting over with the new environment. Returns only if that is not needed or fails.
#[cfg(unix)]
fn settle_openmp_environment() {
    use std::os::unix::process::CommandExt;
    if std::env::var_os("GOMP_SPINCOUNT").is_some() || std::env::var_os("OMP_WAIT_POLICY").is_some() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else { return };
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let err = std::process::Command::new(exe).args(args).env("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT).exec();
    eprintln!("hearth: could not restart with GOMP_SPINCOUNT set ({err}); continuing");
}

#[cfg(not(unix))]
fn settle_openmp_environment() {}

fn main() -> std::process::ExitCode {
    settle_openmp_environment();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("HEARTH_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,llama-cpp-2=warn,llama_cpp_2=warn")))
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, never in log files or `docker logs`.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = cli::run(cli::Cli::parse());
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hearth: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
