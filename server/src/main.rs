//! `hearth`: one OpenAI-compatible server for 30–70B models across the devices of a
//! home. This binary holds the CLI and the roles (head, worker); the engine, scheduler,
//! transport and wire types live in their own crates and never depend on this one.

mod bench;
mod cli;
mod serve;

use clap::Parser;

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("HEARTH_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,llama-cpp-2=warn,llama_cpp_2=warn")))
        .with_writer(std::io::stderr)
        .init();
    let cli = cli::Cli::parse();
    let result = match cli.command {
        cli::Command::Serve(args) => serve::run(args),
        cli::Command::Bench(args) => bench::run(args),
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
