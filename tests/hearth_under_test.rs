//! The `hearth` binary as the system tests run it: the same body as `server/src/main.rs`.

fn main() -> std::process::ExitCode {
    hearth::cli::main()
}
