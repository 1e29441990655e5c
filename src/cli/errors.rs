//! A command line clap refused, said as every error of ccci-run is: under one prefix, in the
//! log format the command line would have chosen.

use std::process::ExitCode;

use crate::config::{self, LogFormat};
use crate::{exit, report};

/// `run` and `lock` take their command after `--`: a command given without it is an unknown
/// argument to clap, and the error says where it goes.
pub(crate) fn with_dash_dash_tip(mut err: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if err.kind() != ErrorKind::UnknownArgument {
        return err;
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--") {
        return err;
    }
    let Some(sub) = args.iter().find(|a| *a == "run" || *a == "lock") else {
        return err;
    };
    let usage = if sub == "run" {
        "ccci-run run [OPTIONS] --recipe R -- COMMAND [ARGS]..."
    } else {
        "ccci-run lock [OPTIONS] NAME -- COMMAND [ARGS]..."
    };
    err.insert(
        ContextKind::Suggested,
        ContextValue::StyledStrs(vec![
            format!("the command to run goes after `--`: {usage}").into(),
        ]),
    );
    err
}

/// A command line clap refused. In the log format the command line would have chosen, though
/// it could not be parsed ([`super::log_format_before_parsing`], [`config::log_format_for_errors`]):
/// one JSON error event, or clap's own text. `--help` and `--version` print as always.
pub(crate) fn command_line_error(err: &clap::Error) -> ExitCode {
    let (flag, config_flag) = super::log_format_before_parsing(std::env::args_os().skip(1));
    let given = flag.or_else(config::log_format_from_env);
    let config = config_flag.or_else(|| {
        config::env::var_os("CCCI_CONFIG")
            .filter(|v| !v.is_empty())
            .map(std::path::PathBuf::from)
    });
    if !err.use_stderr() {
        err.exit();
    }
    let code = u8::try_from(err.exit_code()).unwrap_or(exit::USAGE);
    if config::log_format_for_errors(given, config) == LogFormat::Json {
        report::init_logging(0, 0, LogFormat::Json);
        report::failure(
            &prefixed(&err.render().to_string()),
            &kebab(&format!("{:?}", err.kind())),
            code,
        );
        return ExitCode::from(code);
    }
    // clap's text, styled as clap would style it, under the one prefix every error has.
    let colour = report::stderr_is_terminal() && !config::env::no_color();
    let rendered = err.render();
    let text = if colour {
        rendered.ansi().to_string()
    } else {
        rendered.to_string()
    };
    report::failure(&prefixed(&text), "usage", code);
    ExitCode::from(code)
}

/// clap's error text under the prefix of every error of ccci-run: `ccci-run: error: …`.
fn prefixed(text: &str) -> String {
    format!("ccci-run: {}", text.trim_end())
}

/// `UnknownArgument` → `unknown-argument`.
fn kebab(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if c.is_ascii_uppercase() && !out.is_empty() {
            out.push('-');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}
