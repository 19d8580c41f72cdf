//! Confinement of the files an untrusted image names (`--untrusted --allow-dir DIR`): the
//! directories they must resolve inside, and the check of an opened descriptor against them.
//!
//! A path is judged once it is canonical (symlinks followed, `..` resolved) by whoever words
//! the refusal; the file open ([`crate::OpenOptions::confine`]) then checks the descriptor it
//! opened, through `/proc/self/fd`, so a symlink or directory swapped in between the check
//! and the open cannot lead outside.

use std::io;
use std::os::fd::AsRawFd;
use std::path::{Component, Path, PathBuf};

/// The directories files named by an untrusted image may resolve inside, each canonical.
/// Set once per process from the command line, so it is handed around as `&'static`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct AllowDirs {
    dirs: Vec<PathBuf>,
    /// Single files admitted besides (canonical): the image under a server's own overlay.
    files: Vec<PathBuf>,
}

/// Why a name an untrusted image gives is not opened: the rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The name resolves outside every allowed directory.
    #[error("it resolves to '{}', outside {}", .resolved.display(), dirs_phrase(.allowed))]
    Outside {
        /// Where it resolves to.
        resolved: PathBuf,
        /// The allowed directories.
        allowed: Vec<PathBuf>,
    },
    /// The name cannot be resolved to a canonical path (a missing directory, a `..` over a
    /// name that does not exist), so it cannot be shown to stay inside.
    #[error("'{}' cannot be resolved to a canonical path, so it cannot be shown to be inside {}", .path.display(), dirs_phrase(.allowed))]
    Unresolved {
        /// The path as far as it was resolved.
        path: PathBuf,
        /// The allowed directories.
        allowed: Vec<PathBuf>,
    },
    /// The name is not a file (an NBD export, `null-co`, a fault-injection driver).
    #[error("{what} is not a local file, and an untrusted image may name only files")]
    NotAFile {
        /// What the name is.
        what: &'static str,
    },
}

fn dirs_phrase(dirs: &[PathBuf]) -> String {
    if dirs.is_empty() {
        return "every allowed directory (no --allow-dir was given)".into();
    }
    let list: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    format!("every --allow-dir ({})", list.join(", "))
}

impl From<Refusal> for io::Error {
    fn from(e: Refusal) -> io::Error {
        io::Error::new(io::ErrorKind::PermissionDenied, e)
    }
}

impl AllowDirs {
    /// The directories `dirs`, each made canonical; refuses one that is not a directory.
    pub fn new(dirs: &[PathBuf]) -> io::Result<AllowDirs> {
        let mut out = Vec::with_capacity(dirs.len());
        for d in dirs {
            let c = d.canonicalize().map_err(|e| {
                io::Error::new(e.kind(), format!("--allow-dir {}: {e}", d.display()))
            })?;
            if !c.is_dir() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("--allow-dir {}: not a directory", d.display()),
                ));
            }
            out.push(c);
        }
        Ok(AllowDirs {
            dirs: out,
            files: Vec::new(),
        })
    }

    /// No directory: every file is refused.
    pub const fn none() -> AllowDirs {
        AllowDirs {
            dirs: Vec::new(),
            files: Vec::new(),
        }
    }

    /// The same, kept for the rest of the process (it is set once from the command line).
    pub fn leak(self) -> &'static AllowDirs {
        Box::leak(Box::new(self))
    }

    /// These directories and the one file `file` besides (made canonical; left out if it
    /// cannot be), kept for the rest of the process: a server's `-s` overlay names the
    /// image it was made over, which the operator chose.
    pub fn and_file(&self, file: &Path) -> &'static AllowDirs {
        let mut files = self.files.clone();
        files.extend(file.canonicalize().ok());
        AllowDirs {
            dirs: self.dirs.clone(),
            files,
        }
        .leak()
    }

    /// The canonical directories.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Whether `canonical` (a path already canonicalized) lies inside an allowed directory.
    /// A path that is relative or still has `.` or `..` components is not canonical and is
    /// refused as [`Refusal::Unresolved`].
    pub fn judge(&self, canonical: &Path) -> Result<(), Refusal> {
        let plain = canonical.is_absolute()
            && canonical
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        if !plain {
            return Err(Refusal::Unresolved {
                path: canonical.to_path_buf(),
                allowed: self.dirs.clone(),
            });
        }
        if self.dirs.iter().any(|d| canonical.starts_with(d))
            || self.files.iter().any(|f| canonical == f)
        {
            return Ok(());
        }
        Err(Refusal::Outside {
            resolved: canonical.to_path_buf(),
            allowed: self.dirs.clone(),
        })
    }

    /// Checks the file behind an open descriptor: where the kernel says it is
    /// (`/proc/self/fd/N`) must be inside an allowed directory.
    pub fn check_open(&self, file: &impl AsRawFd) -> io::Result<()> {
        let link = format!("/proc/self/fd/{}", file.as_raw_fd());
        let resolved = std::fs::read_link(&link)?;
        Ok(self.judge(&resolved)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("confine-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("allowed")).unwrap();
        d
    }

    /// What the engine does: canonicalize, then judge.
    fn judge_name(allow: &AllowDirs, name: &Path) -> Result<(), Refusal> {
        let canonical = name.canonicalize().unwrap_or_else(|_| name.to_path_buf());
        allow.judge(&canonical)
    }

    #[test]
    fn inside_outside_and_unresolved() {
        let d = scratch("judge");
        let allow = AllowDirs::new(&[d.join("allowed")]).unwrap();
        let inside = d.join("allowed/a.img");
        std::fs::write(&inside, b"x").unwrap();
        std::fs::write(d.join("secret"), b"x").unwrap();
        assert!(judge_name(&allow, &inside).is_ok());
        assert!(matches!(
            judge_name(&allow, &d.join("allowed/../secret")),
            Err(Refusal::Outside { .. })
        ));
        std::os::unix::fs::symlink(d.join("secret"), d.join("allowed/link")).unwrap();
        assert!(matches!(
            judge_name(&allow, &d.join("allowed/link")),
            Err(Refusal::Outside { .. })
        ));
        assert!(matches!(
            allow.judge(Path::new("/x/../y")),
            Err(Refusal::Unresolved { .. })
        ));
        assert!(matches!(
            judge_name(&allow, Path::new("nbd+unix:///?socket=/s")),
            Err(Refusal::Unresolved { .. })
        ));
        // A prefix of a name is not its directory.
        let sibling = d.join("allowed-not");
        std::fs::write(&sibling, b"x").unwrap();
        assert!(judge_name(&allow, &sibling).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn an_open_descriptor_is_judged_where_it_really_is() {
        let d = scratch("fd");
        let allow = AllowDirs::new(&[d.join("allowed")]).unwrap();
        std::fs::write(d.join("secret"), b"x").unwrap();
        std::os::unix::fs::symlink(d.join("secret"), d.join("allowed/link")).unwrap();
        let f = std::fs::File::open(d.join("allowed/link")).unwrap();
        assert!(allow.check_open(&f).is_err());
        std::fs::write(d.join("allowed/ok"), b"x").unwrap();
        let f = std::fs::File::open(d.join("allowed/ok")).unwrap();
        allow.check_open(&f).unwrap();
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn no_allowed_directory_admits_nothing() {
        let allow = AllowDirs::default();
        assert!(allow.judge(Path::new("/")).is_err());
        assert!(judge_name(&allow, Path::new("/")).is_err());
    }
}
