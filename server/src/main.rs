//! The `hearth` command: parses the CLI and runs a role (see the library for the parts).

use clap::Parser;
use hearth::{bench, bench_serve, cli, serve};

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("HEARTH_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,llama-cpp-2=warn,llama_cpp_2=warn")))
        .with_writer(std::io::stderr)
        .init();
    let cli = cli::Cli::parse();
    let result = match cli.command {
        cli::Command::Serve(args) => serve::run(args),
        cli::Command::Worker(args) => hearth::ring::run_worker(args),
        cli::Command::Bench(args) => bench::run(args),
        cli::Command::BenchServe(args) => bench_serve::run(args),
        cli::Command::FetchModel(args) => cli::fetch_model(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hearth: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
