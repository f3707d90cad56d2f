//! The `hearth-lab` command: `hearth` with the settings tests and benchmarks use to emulate
//! a home cluster on one machine, and their tools (everything is in `hearth::cli`).

fn main() -> std::process::ExitCode {
    hearth::cli::lab_main()
}
