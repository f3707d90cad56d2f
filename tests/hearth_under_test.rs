//! The server as the system tests run it: `hearth-lab`'s body (`hearth` and the settings
//! that emulate a home cluster on one machine).

fn main() -> std::process::ExitCode {
    hearth::cli::lab_main()
}
