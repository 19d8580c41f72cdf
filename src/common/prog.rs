//! The name the binary answers to. Invoked as `qemu-img` or `qemu-nbd` (a link of that name,
//! or `exec -a`), it takes that tool's command line, and its messages begin with that name as
//! QEMU's tools' messages do, so scripts and QEMU's own test suite can use it in their place.

use std::ffi::OsString;
use std::path::Path;
use std::sync::OnceLock;

/// Which tool the binary is standing in for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Personality {
    /// Its own name: every subcommand.
    Native,
    /// `qemu-img SUBCOMMAND ...`.
    QemuImg,
    /// `qemu-nbd ...`: `serve`'s options without the subcommand.
    QemuNbd,
}

impl Personality {
    /// The personality for the name in `argv[0]` (its file name: a path or a link works).
    pub fn from_argv0(argv0: Option<&OsString>) -> Personality {
        let name = argv0
            .map(Path::new)
            .and_then(Path::file_name)
            .and_then(|n| n.to_str())
            .unwrap_or("");
        match name {
            "qemu-img" => Personality::QemuImg,
            "qemu-nbd" => Personality::QemuNbd,
            _ => Personality::Native,
        }
    }

    /// The name messages begin with.
    pub fn name(self) -> &'static str {
        match self {
            Personality::Native => "qcow2-nbd",
            Personality::QemuImg => "qemu-img",
            Personality::QemuNbd => "qemu-nbd",
        }
    }

    /// The command line as our own parser takes it: `qemu-nbd`'s arguments follow an
    /// implicit `serve`.
    pub fn native_args(self, args: Vec<OsString>) -> Vec<OsString> {
        let mut out = Vec::with_capacity(args.len() + 1);
        let mut rest = args.into_iter();
        out.push(OsString::from(self.name()));
        let _ = rest.next();
        if self == Personality::QemuNbd {
            out.push(OsString::from("serve"));
        }
        out.extend(rest);
        out
    }
}

/// The QEMU release whose tools this binary stands in for: its tools' behaviour and its test
/// suite are the contract. A script that checks the version of `qemu-img` or `qemu-nbd`
/// before using a feature reads this one. (A macro: the version lines are built with
/// `concat!`.)
macro_rules! qemu_version {
    () => {
        "10.0.2"
    };
}

/// Ours, where a distribution puts its package version in QEMU's version line.
macro_rules! own_version {
    () => {
        concat!("(qcow2-nbd ", env!("CARGO_PKG_VERSION"), ")")
    };
}

/// `qemu-nbd`'s usage lines (QEMU's words), plus the form only ours has.
const QEMU_NBD_USAGE: &str = "qemu-nbd [OPTIONS] FILE\n  or:  qemu-nbd -L [OPTIONS]\n  \
     or:  qemu-nbd --export name=NAME,file=PATH [--export ...] [OPTIONS]";

impl Personality {
    /// The command-line parser as the tool being stood in for shows it: `qemu-nbd`'s usage
    /// lines name no subcommand, and both tools answer `-V`/`--version` with their version
    /// line in QEMU's layout (`ARGV0 10.0.2 (...)` as qemu-nbd prints it, with the name it
    /// was run by; `qemu-img version 10.0.2 (...)`), the QEMU version where scripts parse
    /// it, and ours in the parentheses where a distribution puts its package version.
    pub fn shape(self, cmd: clap::Command, argv0: &str) -> clap::Command {
        match self {
            Personality::Native => cmd,
            Personality::QemuImg => cmd.display_name("qemu-img").version(concat!(
                "version ",
                qemu_version!(),
                " ",
                own_version!()
            )),
            Personality::QemuNbd => cmd.mut_subcommand("serve", |serve| {
                serve
                    .display_name(argv0.to_owned())
                    .bin_name("qemu-nbd")
                    .override_usage(QEMU_NBD_USAGE)
                    .version(concat!(qemu_version!(), " ", own_version!()))
            }),
        }
    }
}

static CURRENT: OnceLock<Personality> = OnceLock::new();

/// Records the personality once, at start.
pub fn set(p: Personality) {
    let _ = CURRENT.set(p);
}

/// The personality in effect (native until [`set`]).
pub fn current() -> Personality {
    CURRENT.get().copied().unwrap_or(Personality::Native)
}

/// The name messages begin with: `qcow2-nbd`, or `qemu-img`/`qemu-nbd` when invoked so.
pub fn name() -> &'static str {
    current().name()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_name_decides_the_command_line() {
        let p = Personality::from_argv0(Some(&OsString::from("/usr/local/bin/qemu-nbd")));
        assert_eq!(p, Personality::QemuNbd);
        assert_eq!(
            p.native_args(os(&[
                "/usr/local/bin/qemu-nbd",
                "-k",
                "s.sock",
                "img.qcow2"
            ])),
            os(&["qemu-nbd", "serve", "-k", "s.sock", "img.qcow2"])
        );
        let p = Personality::from_argv0(Some(&OsString::from("qemu-img")));
        assert_eq!(p, Personality::QemuImg);
        assert_eq!(
            p.native_args(os(&["qemu-img", "info", "x"])),
            os(&["qemu-img", "info", "x"])
        );
        let p = Personality::from_argv0(Some(&OsString::from("./target/debug/qcow2-nbd")));
        assert_eq!(p, Personality::Native);
        assert_eq!(Personality::from_argv0(None), Personality::Native);
    }
}
