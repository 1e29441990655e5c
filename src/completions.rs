//! Shell completion scripts: clap_complete's, with its bash script repaired so that every
//! subcommand completes its own options and values.
//!
//! clap_complete's bash generator names the completion state of a subcommand two ways when the
//! binary's name has a hyphen. The loop over the typed words sets `cmd` to
//! `ccci__run__subcmd__lock` (the binary's hyphen becomes `__`), while the arms of
//! `case "${cmd}"` that hold each subcommand's options are labelled
//! `ccci__subcmd__run__subcmd__lock` (every hyphen of the whole path becomes `__subcmd__`). No
//! arm matches once a subcommand is typed, so bash falls back to file names: only the
//! subcommands themselves ever complete (clap-rs/clap#6421 and #6386). The repair relabels those
//! arms with the names the loop assigns. Its invariant, tested: every state the loop can reach
//! has an arm, and a script that already has one for each is left as it is.
//!
//! The fish script decides "no subcommand typed yet" by parsing the words with `argparse`, and
//! answers no when that fails, which it does while a global option still lacks its value: so
//! `ccci-run --docker <TAB>` offered file names, not `auto off required`. `argparse -s` stops at
//! the first word that is not an option, so a failure means the words are all before any
//! subcommand: the repair answers yes then. And the fish generator completes named options
//! only, never a positional argument's values (`ccci-run completions <TAB>` offered file
//! names): the repair adds a line for each positional with a fixed set of values.
//!
//! What no static script knows is asked of ccci-run itself, through its hidden `__complete`
//! subcommand, at the moment Tab is pressed: the run ids after `runs`, the live ones after
//! `stop`, the named locks after `lock`. Each shell's script gets a few lines that do so, only
//! at that positional argument (not after an option that takes a value, not after `--`); each
//! passes on the `--config`, `--runs-dir` and `--lock-dir` typed on the line. The hidden
//! subcommands themselves are never offered.
//!
//! Floor: entry (docs/architecture.md): the top floor, imported by nothing but the entry.

use clap_complete::Shell;

/// The name the scripts complete, as installed.
const BIN_NAME: &str = "ccci-run";

/// The completion script for `shell`.
pub(crate) fn script(shell: Shell) -> Vec<u8> {
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut crate::cli::base(), BIN_NAME, &mut out);
    // The generator writes the help texts it was given, which are Rust strings: UTF-8.
    let text = String::from_utf8_lossy(&out);
    match shell {
        Shell::Bash => {
            let text = repair_bash(&without_hidden(&text, shell), BIN_NAME);
            bash_dynamic(&text, &value_options(&crate::cli::base())).into_bytes()
        }
        Shell::Fish => {
            let mut text = repair_fish(&without_hidden(&text, shell), BIN_NAME);
            text.push_str(&fish_positional_values(&crate::cli::base(), BIN_NAME));
            text.push_str(FISH_DYNAMIC);
            text.into_bytes()
        }
        Shell::Zsh => zsh_dynamic(&without_hidden(&text, shell)).into_bytes(),
        _ => out,
    }
}

/// The hidden subcommands (`__complete`), which clap_complete offers like any other.
fn hidden() -> Vec<String> {
    crate::cli::base()
        .get_subcommands()
        .filter(|s| s.is_hide_set())
        .map(|s| s.get_name().to_owned())
        .collect()
}

/// The script without an offer of a hidden subcommand: not in bash's word lists, not among
/// zsh's described commands, not as a fish candidate. (What completes after one, typed in
/// full, stays: nobody is offered it.)
fn without_hidden(script: &str, shell: Shell) -> String {
    let mut text = script.to_owned();
    for name in hidden() {
        text = match shell {
            // `opts="… config __complete doctor …"`: the word out of every list.
            Shell::Bash => text
                .lines()
                .map(|line| {
                    if line.trim_start().starts_with("opts=\"") {
                        line.replace(&format!(" {name} "), " ")
                            .replace(&format!("\"{name} "), "\"")
                            .replace(&format!(" {name}\""), "\"")
                    } else {
                        line.to_owned()
                    }
                })
                .map(|line| line + "\n")
                .collect(),
            // `'__complete:What a shell …' \` in each `commands=(…)` array.
            Shell::Zsh => text
                .lines()
                .filter(|line| !line.starts_with(&format!("'{name}:")))
                .map(|line| format!("{line}\n"))
                .collect(),
            // `complete -c ccci-run -n … -f -a "__complete" -d '…'`.
            Shell::Fish => text
                .lines()
                .filter(|line| !line.contains(&format!(" -a \"{name}\"")))
                .map(|line| format!("{line}\n"))
                .collect(),
            _ => text,
        };
    }
    text
}

/// Which `__complete` list each subcommand's first positional argument takes.
const DYNAMIC: [(&str, &str); 3] = [
    ("stop", "live-run-ids"),
    ("runs", "run-ids"),
    ("lock", "lock-names"),
];

/// Every option, of any subcommand, that takes a value: `--lock-dir`, `-w`, ...
fn value_options(cmd: &clap::Command) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![cmd];
    while let Some(cmd) = stack.pop() {
        for arg in cmd.get_arguments() {
            if arg.is_positional() || !arg.get_action().takes_values() {
                continue;
            }
            found.extend(arg.get_long().map(|l| format!("--{l}")));
            found.extend(arg.get_short().map(|c| format!("-{c}")));
            for alias in arg.get_all_aliases().into_iter().flatten() {
                found.push(format!("--{alias}"));
            }
        }
        stack.extend(cmd.get_subcommands());
    }
    found.sort();
    found.dedup();
    found
}

/// The bash script with a function in front of the generated one: at the first positional
/// argument of `stop`, `runs` or `lock` it offers what `ccci-run __complete` lists; anywhere
/// else it hands over to the generated function.
fn bash_dynamic(script: &str, value_options: &[String]) -> String {
    let generated = format!("_{}", BIN_NAME.replace('-', "__"));
    let cases: String = DYNAMIC
        .iter()
        .map(|(sub, what)| format!("{sub}) what={what} ;; "))
        .collect();
    let function = format!(
        r#"
# The run ids after `runs`, the live ones after `stop`, the named locks after `lock`: asked of
# ccci-run itself when Tab is pressed, with the --config, --runs-dir and --lock-dir typed so far.
_ccci_run_dynamic() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} sub= n=0 i w what=
    local -a given=()
    for (( i = 1; i < COMP_CWORD; i++ )); do
        w=${{COMP_WORDS[i]}}
        case $w in
            --) n=1; break ;;
            --config|--runs-dir|--lock-dir) given+=("$w" "${{COMP_WORDS[i+1]}}"); (( i++ )) ;;
            {values}) (( i++ )) ;;
            -*) ;;
            *) if [[ -z $sub ]]; then sub=$w; else (( n++ )); fi ;;
        esac
    done
    if (( i == COMP_CWORD && n == 0 )) && [[ $cur != -* ]]; then
        case $sub in {cases}esac
        if [[ -n $what ]]; then
            COMPREPLY=( $(compgen -W "$(command {bin} "${{given[@]}}" __complete "$what" 2>/dev/null)" -- "$cur") )
            return 0
        fi
    fi
    {generated} "$@"
}}
"#,
        values = value_options.join("|"),
        bin = BIN_NAME,
    );
    let registered = script.replace(
        &format!("complete -F {generated} "),
        "complete -F _ccci_run_dynamic ",
    );
    format!("{registered}{function}")
}

/// fish: the same lists at the same places (not after `--`).
const FISH_DYNAMIC: &str = r#"
# The run ids after `runs`, the live ones after `stop`, the named locks after `lock`: asked of
# ccci-run itself when Tab is pressed, with the --config, --runs-dir and --lock-dir typed so far.
function __fish_ccci_run_dynamic
    set -l words (commandline -opc)
    set -l given
    set -l i 2
    while test $i -le (count $words)
        switch $words[$i]
            case --
                break
            case --config --runs-dir --lock-dir
                set -l j (math $i + 1)
                if test $j -le (count $words)
                    set -a given $words[$i] $words[$j]
                end
                set i $j
            case '--config=*' '--runs-dir=*' '--lock-dir=*'
                set -a given $words[$i]
        end
        set i (math $i + 1)
    end
    command ccci-run $given __complete $argv[1] 2>/dev/null
end
complete -c ccci-run -n "__fish_ccci_run_using_subcommand stop" -f -a "(__fish_ccci_run_dynamic live-run-ids)"
complete -c ccci-run -n "__fish_ccci_run_using_subcommand runs" -f -a "(__fish_ccci_run_dynamic run-ids)"
complete -c ccci-run -n "__fish_ccci_run_using_subcommand lock; and not contains -- -- (commandline -opc)" -f -a "(__fish_ccci_run_dynamic lock-names)"
"#;

/// zsh: the positional arguments' `_default` actions become a function that adds what
/// `ccci-run __complete` lists.
fn zsh_dynamic(script: &str) -> String {
    const FUNCTION: &str = r#"
# The run ids after `runs`, the live ones after `stop`, the named locks after `lock`:
# asked of ccci-run itself when Tab is pressed, with the --config, --runs-dir and --lock-dir
# typed so far (read from the line itself: _arguments has cut the words before the subcommand).
# _arguments calls it with compadd's options first and the list's name last.
_ccci_run_dynamic() {
    local -a found given typed
    local i
    typed=(${(z)LBUFFER})
    for (( i = 2; i <= $#typed; i++ )); do
        case ${typed[i]} in
            (--) break ;;
            (--config|--runs-dir|--lock-dir)
                (( i < $#typed )) && given+=(${typed[i]} ${(Q)typed[i+1]})
                (( i++ )) ;;
            (--config=*|--runs-dir=*|--lock-dir=*) given+=(${(Q)typed[i]}) ;;
        esac
    done
    found=(${(f)"$(command ccci-run $given __complete ${@[-1]} 2>/dev/null)"})
    compadd "${@[1,-2]}" -a found
}
"#;
    let mut out = String::new();
    for line in script.lines() {
        let mut line = line.to_owned();
        for (prefix, what) in [
            ("':run_id -- ", "live-run-ids"),
            ("'::run_id -- ", "run-ids"),
            ("':name -- The lock", "lock-names"),
        ] {
            if line.starts_with(prefix) && line.contains(":_default'") {
                line = line.replace(":_default'", &format!(":_ccci_run_dynamic {what}'"));
            }
        }
        out.push_str(&line);
        out.push('\n');
        if line == "autoload -U is-at-least" {
            out.push_str(FUNCTION);
        }
    }
    out
}

/// Make the fish script's "needs a subcommand" test answer yes when the words before the cursor
/// fail to parse as global options (one still lacks its value).
fn repair_fish(script: &str, bin_name: &str) -> String {
    let function = format!(
        "function __fish_{}_needs_command\n",
        bin_name.replace('-', "_")
    );
    let Some(start) = script.find(&function) else {
        return script.to_owned();
    };
    let body = start + function.len();
    let end = script[body..]
        .find("\nend\n")
        .map_or(script.len(), |e| body + e);
    match script[body..end].find("\n    or return\n") {
        Some(at) => {
            let at = body + at + "\n    or return".len();
            format!("{} 0{}", &script[..at], &script[at..])
        }
        None => script.to_owned(),
    }
}

/// Relabel the per-subcommand arms of the generated bash function with the state names its
/// word loop assigns.
fn repair_bash(script: &str, bin_name: &str) -> String {
    const SEP: &str = "__subcmd__";
    let generated = bin_name.replace('-', SEP);
    let assigned = bin_name.replace('-', "__");
    if generated == assigned {
        return script.to_owned();
    }
    let mut out = String::with_capacity(script.len());
    for line in script.split_inclusive('\n') {
        let label = line.trim_start();
        let indent = &line[..line.len() - label.len()];
        match label.strip_prefix(&generated) {
            // An arm label: the state name alone, then `)`.
            Some(rest)
                if (rest.starts_with(')') || rest.starts_with(SEP))
                    && rest.trim_end().ends_with(')')
                    && !rest.contains([' ', ',', '"']) =>
            {
                out.push_str(indent);
                out.push_str(&assigned);
                out.push_str(rest);
            }
            _ => out.push_str(line),
        }
    }
    out
}

/// `complete` lines offering the values of every positional argument of a subcommand that
/// takes one of a fixed set, once that subcommand is typed.
fn fish_positional_values(cmd: &clap::Command, bin_name: &str) -> String {
    let condition = format!("__fish_{}_using_subcommand", bin_name.replace('-', "_"));
    let mut lines = String::new();
    for sub in cmd.get_subcommands() {
        for arg in sub.get_positionals().filter(|a| !a.is_hide_set()) {
            let possible = arg.get_possible_values();
            let values: Vec<&str> = possible
                .iter()
                .filter(|v| !v.is_hide_set())
                .map(|v| v.get_name())
                .collect();
            if !values.is_empty() {
                lines.push_str(&format!(
                    "complete -c {bin_name} -n \"{condition} {}\" -f -a \"{}\"\n",
                    sub.get_name(),
                    values.join(" ")
                ));
            }
        }
    }
    lines
}

/// `ccci-run __complete WHAT`: the names a shell completes, one a line; what cannot be read is
/// left out without a word (a completion must never print an error into the line).
pub(crate) fn complete(
    what: &str,
    global: &crate::config::Global,
) -> Result<u8, crate::error::Error> {
    let names: Vec<String> = match what {
        "run-ids" | "live-run-ids" => {
            let all = what == "run-ids";
            let mut listing =
                crate::runs::list::list(&global.runs_dir, all, std::time::SystemTime::now())
                    .unwrap_or_default();
            if !all {
                crate::runs::list::only_live(&mut listing);
            }
            listing.runs.into_iter().map(|r| r.run_id).collect()
        }
        _ => crate::lock::backend(global)
            .ok()
            .and_then(|b| {
                b.list(global.timings.value(crate::config::Timing::LongHeld))
                    .ok()
            })
            .unwrap_or_default()
            .into_iter()
            .filter(|l| l.kind == crate::lock::backend::LockKind::Named)
            .map(|l| l.name)
            .collect(),
    };
    let text: String = names
        .iter()
        .filter(|n| crate::names::RunId::parse(n).is_ok())
        .map(|n| format!("{n}\n"))
        .collect();
    crate::error::emit(text.as_bytes()).map(|()| 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The states the word loop assigns (`cmd="…"`) that no arm of `case "${cmd}"` handles.
    fn states_without_arm(script: &str) -> Vec<String> {
        let assigned = regex::Regex::new(r#"(?m)^\s*cmd="([A-Za-z0-9_]+)"$"#).unwrap();
        let arm = regex::Regex::new(r"(?m)^\s*([A-Za-z0-9_]+)\)$").unwrap();
        let arms: Vec<&str> = arm
            .captures_iter(script)
            .map(|c| c.get(1).unwrap().as_str())
            .collect();
        let mut missing: Vec<String> = assigned
            .captures_iter(script)
            .map(|c| c[1].to_owned())
            .filter(|state| !arms.contains(&state.as_str()))
            .collect();
        missing.sort();
        missing.dedup();
        missing
    }

    #[test]
    fn every_state_of_the_bash_script_has_its_arm() {
        let mut generated = Vec::new();
        clap_complete::generate(
            Shell::Bash,
            &mut crate::cli::base(),
            BIN_NAME,
            &mut generated,
        );
        let generated = String::from_utf8(generated).unwrap();
        let repaired = String::from_utf8(script(Shell::Bash)).unwrap();
        assert_eq!(states_without_arm(&repaired), Vec::<String>::new());
        // Once the generator names its states one way, the repair changes nothing.
        if states_without_arm(&generated).is_empty() {
            assert_eq!(repaired, generated);
        }
        // Every subcommand, and the top level, has its state.
        for sub in crate::cli::base().get_subcommands() {
            let state = format!(
                "ccci__run__subcmd__{}",
                sub.get_name().replace('-', "__subcmd__")
            );
            assert!(repaired.contains(&format!("cmd=\"{state}\"")), "{state}");
        }
    }

    #[test]
    fn the_fish_script_needs_a_subcommand_while_a_global_option_lacks_its_value() {
        let script = String::from_utf8(script(Shell::Fish)).unwrap();
        let function = script
            .split("function __fish_ccci_run_needs_command\n")
            .nth(1)
            .and_then(|rest| rest.split("\nend\n").next())
            .unwrap();
        assert!(function.contains("argparse -s"), "{function}");
        assert!(function.contains("\n    or return 0\n"), "{function}");
        assert!(!function.contains("\n    or return\n"), "{function}");
    }

    #[test]
    fn the_fish_script_offers_the_values_of_positional_arguments() {
        let script = String::from_utf8(script(Shell::Fish)).unwrap();
        assert!(
            script.contains(
                "complete -c ccci-run -n \"__fish_ccci_run_using_subcommand completions\" -f -a \"bash elvish fish powershell zsh\"\n"
            ),
            "{script}"
        );
    }

    #[test]
    fn a_name_without_a_hyphen_is_left_alone() {
        let text = "    case \"${cmd}\" in\n        tool__subcmd__run)\n";
        assert_eq!(repair_bash(text, "tool"), text);
    }

    #[test]
    fn only_arm_labels_are_relabelled() {
        let text = "        a__subcmd__b__subcmd__run)\n            opts=\"a__subcmd__b)\"\n        a__subcmd__b)\n";
        assert_eq!(
            repair_bash(text, "a-b"),
            "        a__b__subcmd__run)\n            opts=\"a__subcmd__b)\"\n        a__b)\n"
        );
    }
}
