//! Image locks that QEMU understands: one-byte OFD read locks on the image file, at the
//! offsets QEMU's file-posix driver uses, so that `qemu-img`, `qemu-io`, `qemu-nbd` and QEMU
//! itself refuse an image we hold in a conflicting way, and we refuse theirs.
//!
//! QEMU names four permissions a user of an image may hold: consistent read, write, write
//! unchanged and resize (bits 0 to 3). Holding permission `i` is shown by a shared lock on
//! byte `100 + i`; refusing to let others hold it, by a shared lock on byte `200 + i`.
//! Opening checks both directions: none of our permissions may be refused by another file
//! description (byte `200 + i` locked elsewhere), and nobody else may hold one we refuse
//! (byte `100 + i` locked elsewhere). Our own bytes are taken first and then checked, so of
//! two processes opening at once, at worst both fail; never both succeed.
//!
//! OFD locks belong to an open file description: they live exactly as long as the file the
//! storage holds, are released by the kernel when the process dies, and conflict between two
//! opens of the same file even inside one process (as in QEMU).
//!
//! A note on test processes: one that forks children (qemu-img, ...) from several threads
//! lends each child a copy of every descriptor until the child execs, so a file this
//! process just closed can keep its locks a moment longer and its next open here fails.
//! The tools never fork after opening images; the test suites that open images in-process
//! while other threads spawn tools therefore open them with [`Locking::Off`], and locking
//! itself is tested from separate processes.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Whether to take image locks (QEMU's `locking=` option of the file driver).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Locking {
    /// Take locks where the kernel supports OFD locks; skip them silently where it does not
    /// (QEMU's default).
    #[default]
    Auto,
    /// Take locks; fail the open where OFD locks are unavailable.
    On,
    /// Take and check no locks: other programs may write the image at the same time.
    Off,
}

impl std::str::FromStr for Locking {
    type Err = String;
    fn from_str(s: &str) -> Result<Locking, String> {
        match s {
            "auto" => Ok(Locking::Auto),
            "on" => Ok(Locking::On),
            "off" => Ok(Locking::Off),
            other => Err(format!(
                "unknown locking mode {other:?} (expected on, off or auto)"
            )),
        }
    }
}

/// QEMU's permission bits, in lock-byte order.
const PERMISSIONS: [&str; 4] = ["consistent read", "write", "write unchanged", "resize"];
const CONSISTENT_READ: u8 = 1 << 0;
const WRITE: u8 = 1 << 1;
const WRITE_UNCHANGED: u8 = 1 << 2;
const RESIZE: u8 = 1 << 3;
const ALL: u8 = CONSISTENT_READ | WRITE | WRITE_UNCHANGED | RESIZE;

/// First byte of the "holds permission" locks.
const PERM_BASE: i64 = 100;
/// First byte of the "refuses permission to others" locks.
const SHARED_BASE: i64 = 200;

/// The permissions an open holds and those it lets others hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permissions {
    held: u8,
    shared: u8,
}

impl Permissions {
    /// What QEMU holds for an image it opens: read-write opens may write and resize and let
    /// nobody else do either; read-only opens read and still let nobody write; with
    /// `force_share` (qemu-img's `-U`, read-only only) others may do anything.
    pub fn for_open(read_only: bool, force_share: bool) -> Permissions {
        let held = if read_only {
            CONSISTENT_READ
        } else {
            CONSISTENT_READ | WRITE | RESIZE
        };
        let shared = if force_share && read_only {
            ALL
        } else {
            CONSISTENT_READ | WRITE_UNCHANGED
        };
        Permissions { held, shared }
    }
}

/// Why an image could not be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process (or another open in this one) holds the image in a way that
    /// conflicts with ours.
    #[error(
        "Failed to get {}\"{permission}\" lock: is another process using the image?",
        if *.shared { "shared " } else { "" }
    )]
    Conflict {
        /// The file.
        path: String,
        /// The permission concerned, in QEMU's words.
        permission: &'static str,
        /// True when another user holds a permission we refuse to share ("shared" lock);
        /// false when another user refuses a permission we need.
        shared: bool,
    },
    /// The lock itself could not be taken (a file system without lock support, for one).
    #[error("Failed to lock byte {byte}: {source}")]
    Apply {
        /// The file.
        path: String,
        /// The lock byte.
        byte: i64,
        /// The system's error.
        source: io::Error,
    },
}

impl From<LockError> for io::Error {
    fn from(e: LockError) -> io::Error {
        let kind = match &e {
            LockError::Conflict { .. } => io::ErrorKind::WouldBlock,
            LockError::Apply { source, .. } => source.kind(),
        };
        io::Error::new(kind, e)
    }
}

/// Takes and checks the locks `perms` needs on `file`, as `locking` says. The locks last as
/// long as `file`'s open file description.
pub fn lock(
    file: &File,
    path: &Path,
    perms: Permissions,
    locking: Locking,
) -> Result<(), LockError> {
    if locking == Locking::Off {
        return Ok(());
    }
    let fd = file.as_raw_fd();
    let apply_err = |byte, source| LockError::Apply {
        path: path.display().to_string(),
        byte,
        source,
    };
    for (i, _) in PERMISSIONS.iter().enumerate() {
        let bit = 1u8 << i;
        for (byte, wanted) in [
            (PERM_BASE + i as i64, perms.held & bit != 0),
            (SHARED_BASE + i as i64, perms.shared & bit == 0),
        ] {
            match set(fd, byte, wanted) {
                Ok(()) => {}
                // A kernel without OFD locks: QEMU's `auto` goes on without locking.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) && locking == Locking::Auto => {
                    return Ok(())
                }
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    return Err(conflict(path, i, byte >= SHARED_BASE))
                }
                Err(e) => return Err(apply_err(byte, e)),
            }
        }
    }
    check(fd, path, perms).inspect_err(|_| {
        // Leave nothing behind: the caller drops the file, but a caller that keeps it must
        // not keep refusing others.
        for byte in (PERM_BASE..PERM_BASE + 4).chain(SHARED_BASE..SHARED_BASE + 4) {
            let _ = set(fd, byte, false);
        }
    })
}

fn check(fd: i32, path: &Path, perms: Permissions) -> Result<(), LockError> {
    let taken = |byte| {
        locked_elsewhere(fd, byte).map_err(|source| LockError::Apply {
            path: path.display().to_string(),
            byte,
            source,
        })
    };
    for i in 0..PERMISSIONS.len() {
        if perms.held & (1 << i) != 0 && taken(SHARED_BASE + i as i64)? {
            return Err(conflict(path, i, false));
        }
    }
    for i in 0..PERMISSIONS.len() {
        if perms.shared & (1 << i) == 0 && taken(PERM_BASE + i as i64)? {
            return Err(conflict(path, i, true));
        }
    }
    Ok(())
}

fn conflict(path: &Path, bit: usize, shared: bool) -> LockError {
    LockError::Conflict {
        path: path.display().to_string(),
        permission: PERMISSIONS[bit],
        shared,
    }
}

fn flock_at(byte: i64, kind: i32) -> libc::flock {
    // SAFETY: flock is a plain C struct for which all-zero bytes are a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = byte;
    fl.l_len = 1;
    fl
}

/// Takes (shared) or releases the lock on one byte.
fn set(fd: i32, byte: i64, locked: bool) -> io::Result<()> {
    let fl = flock_at(byte, if locked { libc::F_RDLCK } else { libc::F_UNLCK });
    // SAFETY: fd is an open descriptor owned by the caller's File, and fl is a valid flock
    // that lives for the whole call.
    if unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &fl) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// True if another open file description holds a lock on `byte` (ours never conflict with
/// ourselves, so asking whether an exclusive lock could be taken tells exactly that).
fn locked_elsewhere(fd: i32, byte: i64) -> io::Result<bool> {
    let mut fl = flock_at(byte, libc::F_WRLCK);
    // SAFETY: as in `set`; the kernel writes the conflicting lock, if any, into fl.
    if unsafe { libc::fcntl(fd, libc::F_OFD_GETLK, &mut fl) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl.l_type != libc::F_UNLCK as libc::c_short)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(path: &Path) -> File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap()
    }

    #[test]
    fn writers_exclude_each_other_and_readers_but_readers_coexist() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, b"x").unwrap();
        let rw = Permissions::for_open(false, false);
        let ro = Permissions::for_open(true, false);
        let shared_ro = Permissions::for_open(true, true);

        let writer = open(&path);
        lock(&writer, &path, rw, Locking::On).unwrap();
        let second = open(&path);
        let err = lock(&second, &path, rw, Locking::On).unwrap_err();
        assert!(
            matches!(
                err,
                LockError::Conflict {
                    permission: "write",
                    shared: false,
                    ..
                }
            ),
            "{err}"
        );
        let reader = open(&path);
        let err = lock(&reader, &path, ro, Locking::On).unwrap_err();
        assert!(
            matches!(
                err,
                LockError::Conflict {
                    permission: "write",
                    shared: true,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err
            .to_string()
            .contains("Failed to get shared \"write\" lock"));
        lock(&reader, &path, shared_ro, Locking::On).expect("-U reads beside a writer");
        lock(&second, &path, rw, Locking::Off).expect("locking off checks nothing");
        drop(writer);

        // With the writer gone, readers coexist and keep writers out.
        let r1 = open(&path);
        let r2 = open(&path);
        lock(&r1, &path, ro, Locking::Auto).unwrap();
        lock(&r2, &path, ro, Locking::Auto).unwrap();
        let w = open(&path);
        assert!(lock(&w, &path, rw, Locking::Auto).is_err());
        drop((r1, r2, reader));
        lock(&w, &path, rw, Locking::Auto).expect("free again once the readers close");
    }

    #[test]
    fn a_refused_open_leaves_no_locks_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, b"x").unwrap();
        let reader = open(&path);
        lock(
            &reader,
            &path,
            Permissions::for_open(true, false),
            Locking::On,
        )
        .unwrap();
        let refused = open(&path);
        assert!(lock(
            &refused,
            &path,
            Permissions::for_open(false, false),
            Locking::On
        )
        .is_err());
        drop(reader);
        // `refused` is still open but holds nothing, so a writer gets in.
        let w = open(&path);
        lock(&w, &path, Permissions::for_open(false, false), Locking::On).unwrap();
        drop(refused);
    }
}
