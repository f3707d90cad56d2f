//! The `hearth` command (everything it does is in the library, `hearth::cli`).

fn main() -> std::process::ExitCode {
    hearth::cli::main()
}
