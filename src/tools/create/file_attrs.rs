//! The file options every format takes (QEMU's `file` protocol): the extent size hint and
//! `nocow`. QEMU's `file` driver sets them on the emptied file before anything is written to
//! it (a file system takes an extent size hint only on a file without extents), and goes on
//! when the file system does not support them.

use std::os::fd::AsRawFd;
use std::path::Path;

use crate::common::options::Parsed;

/// The hint QEMU sets when none is given.
const DEFAULT_EXTENT_SIZE_HINT: u32 = 1 << 20;

/// `FS_NOCOW_FL` (linux/fs.h): no copy-on-write for this file (btrfs).
const FS_NOCOW_FL: libc::c_int = 0x0080_0000;
/// `FS_XFLAG_EXTSIZE` (linux/fs.h): `fsx_extsize` is the file's extent size hint.
const FS_XFLAG_EXTSIZE: u32 = 0x0000_0800;

/// `struct fsxattr` (linux/fs.h).
#[repr(C)]
#[derive(Default)]
struct FsXattr {
    xflags: u32,
    extsize: u32,
    nextents: u32,
    projid: u32,
    cowextsize: u32,
    pad: [u8; 8],
}

const FS_IOC_FSGETXATTR: libc::Ioctl = libc::_IOR::<FsXattr>(b'X' as u32, 31);
const FS_IOC_FSSETXATTR: libc::Ioctl = libc::_IOW::<FsXattr>(b'X' as u32, 32);

/// What the file options ask of a new file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileAttrs {
    /// The extent size hint: `None` for QEMU's default (1 MiB, set quietly where the file
    /// system supports it), `Some(0)` for none.
    pub extent_size_hint: Option<u32>,
    /// Turn off copy-on-write (btrfs).
    pub nocow: bool,
}

impl FileAttrs {
    /// Reads the file options from a parsed `-o` list, with QEMU's check on the hint.
    pub fn from_parsed(p: &Parsed) -> Result<FileAttrs, String> {
        let extent_size_hint = match p.num("extent_size_hint") {
            None => None,
            Some(h) => Some(u32::try_from(h).map_err(|_| "Extent size hint is too large")?),
        };
        Ok(FileAttrs {
            extent_size_hint,
            nocow: p.bool("nocow").unwrap_or(false),
        })
    }

    /// Creates `path` empty (or empties it) and sets the attributes on it. An attribute the
    /// file system refuses is skipped; only a hint asked for explicitly earns a warning,
    /// as QEMU gives one.
    /// An NBD export is not a file: it is left alone, as QEMU's `nbd` driver does.
    /// The file is emptied only once the write lock is held, as QEMU's file driver does
    /// on create: a file another process is using is refused, never truncated.
    pub fn prepare(&self, path: &Path) -> std::io::Result<()> {
        if storage::opener::name::kind(path) == storage::opener::name::NameKind::Nbd {
            return Ok(());
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        storage::lock::lock(
            &file,
            path,
            storage::Permissions::for_open(false, false),
            crate::common::engine_run::locking(),
        )?;
        file.set_len(0)?;
        let fd = file.as_raw_fd();
        if self.nocow {
            let mut flags: libc::c_int = 0;
            // SAFETY: FS_IOC_GETFLAGS and FS_IOC_SETFLAGS read and write one int at the
            // pointer, which points to a live c_int.
            unsafe {
                if libc::ioctl(fd, libc::FS_IOC_GETFLAGS, &mut flags) == 0 {
                    flags |= FS_NOCOW_FL;
                    // An optimisation only: a refusal changes nothing else.
                    libc::ioctl(fd, libc::FS_IOC_SETFLAGS, &flags);
                }
            }
        }
        let hint = self.extent_size_hint.unwrap_or(DEFAULT_EXTENT_SIZE_HINT);
        if let Err(e) = set_extent_size_hint(fd, hint) {
            if self.extent_size_hint.is_some_and(|h| h != 0) {
                eprintln!(
                    "{}: warning: Failed to set extent size hint: {}",
                    crate::common::prog::name(),
                    crate::common::engine_run::plain_io(&e)
                );
            }
        }
        Ok(())
    }
}

/// Sets the extent size hint of the file open at `fd` (0 clears it).
fn set_extent_size_hint(fd: libc::c_int, hint: u32) -> std::io::Result<()> {
    let mut attr = FsXattr::default();
    // SAFETY: FS_IOC_FSGETXATTR writes one `struct fsxattr`, FS_IOC_FSSETXATTR reads one;
    // `attr` is a live value of that layout.
    unsafe {
        if libc::ioctl(fd, FS_IOC_FSGETXATTR, &mut attr) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        attr.xflags |= FS_XFLAG_EXTSIZE;
        attr.extsize = hint;
        if libc::ioctl(fd, FS_IOC_FSSETXATTR, &attr) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
