//! What the binary does before its subcommand runs, whatever the subcommand: the allocator
//! tuned for I/O buffers, the personality taken from `argv[0]`, secrets taken out of the
//! command line, the line parsed with the personality's shape, and the global options
//! (locks, the untrusted rules) set for every image opened after.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use super::{malloc_tuning, prog, secrets, settings};

/// Prepares the process and reads the command line into `command`'s matches and the `T`
/// they make. An error has been printed when this returns one; the caller exits with it.
pub fn parse<T: clap::FromArgMatches>(
    command: clap::Command,
) -> Result<(clap::ArgMatches, T), ExitCode> {
    malloc_tuning::tune_for_io_buffers();
    let args: Vec<OsString> = std::env::args_os().collect();
    let personality = prog::Personality::from_argv0(args.first());
    prog::set(personality);
    if personality != prog::Personality::Native {
        // QEMU's tools print what the repair of a dirty image on open finds, as `check -r
        // all` prints it; our own name keeps it in the log.
        qcow2::check::report_repairs_to(|f| match f.kind {
            qcow2::check::FindingKind::Reported => {
                eprintln!("{}: {}", prog::name(), f.message)
            }
            _ => eprintln!("{}", f.message),
        });
    }
    let name = personality.name();
    let argv0 = args
        .first()
        .map_or_else(|| name.to_owned(), |a| a.to_string_lossy().into_owned());
    let args = match secrets::take_from_args(personality.native_args(args)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{name}: {e}");
            return Err(ExitCode::FAILURE);
        }
    };
    // As with QEMU's tools (getopt), an option given twice takes its last value.
    let parsed = personality
        .shape(command, &argv0)
        .args_override_self(true)
        .name(name)
        .bin_name(name)
        .try_get_matches_from(args)
        .and_then(|m| T::from_arg_matches(&m).map(|t| (m, t)));
    match parsed {
        Ok(m) => Ok(m),
        // QEMU's tools exit 1 on a bad command line; ours, as clap does, 2.
        Err(e) if e.use_stderr() && personality != prog::Personality::Native => {
            let _ = e.print();
            Err(ExitCode::FAILURE)
        }
        Err(e) => e.exit(),
    }
}

/// The options every subcommand shares, as the command line gives them.
pub struct Globals<'a> {
    /// Image locks (QEMU's `locking=`).
    pub locking: storage::Locking,
    /// `--untrusted`.
    pub untrusted: bool,
    /// `--allow-dir`.
    pub allow_dir: &'a [PathBuf],
    /// What an untrusted image may declare.
    pub caps: qcow2::declared::Caps,
}

/// Sets the global options for every image opened after; an error has been printed when
/// this returns one.
pub fn apply(globals: Globals<'_>) -> Result<(), ExitCode> {
    settings::set_locking(globals.locking);
    settings::set_untrusted(globals.untrusted, globals.allow_dir, globals.caps)
        .map_err(|e| fail(&e))
}

/// Prints `e` after the program's name, as every tool's error is printed, and gives the
/// exit code for it.
pub fn fail(e: &dyn std::fmt::Display) -> ExitCode {
    eprintln!("{}: {e}", prog::name());
    ExitCode::FAILURE
}
