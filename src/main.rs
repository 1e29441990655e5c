//! The binary: `ccci-run`, all of it in the library ([`ccci_run::main`]).
//!
//! Floor: entry (docs/architecture.md): the top: dispatches the commands and wires them together.

fn main() -> std::process::ExitCode {
    ccci_run::main()
}
