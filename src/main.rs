fn main() -> std::process::ExitCode {
    ccci_run::main()
}
