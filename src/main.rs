//! The binary: `ccci-run`, all of it in the library ([`ccci_run::main`]).
//!
//! Floor: entry (docs/architecture.md): the top floor, imported by nothing but the entry.

fn main() -> std::process::ExitCode {
    ccci_run::main()
}
