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
