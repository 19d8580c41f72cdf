//! Thin, checked wrappers over the Linux syscalls the file backends need and std lacks:
//! positional I/O into raw buffers, fallocate, fdatasync, O_DIRECT alignment probing.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::{IoBuf, OpenOptions};

/// fallocate mode that zeroes a range (allocating unwritten extents, extending the file).
pub(crate) const ZERO_RANGE: i32 = libc::FALLOC_FL_ZERO_RANGE;
/// fallocate mode that deallocates a range without changing the file size.
pub(crate) const PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;

/// Open a file the way `opts` asks: only a regular file or a block device (QEMU's file
/// and host_device drivers take nothing else that Linux calls a disk).
///
/// What the path names is learnt first through an `O_PATH` descriptor, which runs no
/// driver's open: a FIFO cannot make the open wait for a writer, and a device node (a
/// watchdog, a tape that rewinds on close) is never opened at all. The file opened after is
/// checked to be the one looked at, so a path swapped in between is refused too.
pub(crate) fn open(path: &Path, opts: OpenOptions) -> io::Result<File> {
    let looked = match look(path) {
        Ok(meta) => Some(meta),
        // Created by the open below; checked once open.
        Err(e) if e.kind() == io::ErrorKind::NotFound && opts.create && !opts.read_only => None,
        Err(e) => return Err(opening(path, opts, e)),
    };
    if let Some(meta) = &looked {
        refuse_kind(path, meta)?;
    }
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    if !opts.read_only {
        o.write(true).create(opts.create);
    }
    let mut flags = libc::O_CLOEXEC;
    if opts.direct {
        flags |= libc::O_DIRECT;
    }
    o.custom_flags(flags);
    let file = o.open(path).map_err(|e| opening(path, opts, e))?;
    let meta = file.metadata().map_err(|e| opening(path, opts, e))?;
    refuse_kind(path, &meta)?;
    if let Some(allowed) = opts.confine {
        allowed
            .check_open(&file)
            .map_err(|e| io::Error::new(e.kind(), format!("opening {}: {e}", path.display())))?;
    }
    if let Some(first) = looked {
        use std::os::unix::fs::MetadataExt;
        if (first.dev(), first.ino()) != (meta.dev(), meta.ino()) {
            return Err(io::Error::other(format!(
                "opening {}: the path was replaced while it was being opened",
                path.display()
            )));
        }
    }
    let perms = crate::lock::Permissions::for_open(opts.read_only, opts.force_share);
    crate::lock::lock(&file, path, perms, opts.locking)?;
    Ok(file)
}

/// What `path` names, through a descriptor that opens nothing.
fn look(path: &Path) -> io::Result<std::fs::Metadata> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_CLOEXEC)
        .open(path)?
        .metadata()
}

fn refuse_kind(path: &Path, meta: &std::fs::Metadata) -> io::Result<()> {
    match crate::FileKind::refused(meta.file_type()) {
        None => Ok(()),
        Some(kind) => Err(crate::NotAnImageFile {
            path: path.display().to_string(),
            kind,
        }
        .into()),
    }
}

fn opening(path: &Path, opts: OpenOptions, e: io::Error) -> io::Error {
    io::Error::new(
        e.kind(),
        format!("opening {}{}: {e}", path.display(), direct_note(opts)),
    )
}

fn direct_note(opts: OpenOptions) -> &'static str {
    if opts.direct {
        " with O_DIRECT"
    } else {
        ""
    }
}

fn cvt(ret: libc::c_int) -> io::Result<()> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn off_t(offset: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(offset).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("offset {offset} exceeds the maximum file offset"),
        )
    })
}

/// Run a read/write-style syscall until it is not interrupted; returns the byte count.
fn transfer(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        match usize::try_from(call()) {
            Ok(n) => return Ok(n),
            Err(_) => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// One `pread` into `buf`; returns the bytes read (0 at end of file).
pub(crate) fn pread(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let off = off_t(offset)?;
    // SAFETY: `buf` is a valid, exclusively borrowed region of buf.len() bytes.
    transfer(|| unsafe { libc::pread(file.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), off) })
}

/// One `pwrite` from `buf`; returns the bytes written.
pub(crate) fn pwrite(file: &File, buf: &[u8], offset: u64) -> io::Result<usize> {
    let off = off_t(offset)?;
    // SAFETY: `buf` is a valid region of buf.len() bytes that the kernel only reads.
    transfer(|| unsafe { libc::pwrite(file.as_raw_fd(), buf.as_ptr().cast(), buf.len(), off) })
}

/// `fallocate(mode, offset, len)`.
pub(crate) fn fallocate(file: &File, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    let (off, len) = (off_t(offset)?, off_t(len)?);
    // SAFETY: plain syscall on an owned descriptor; no memory is passed.
    cvt(unsafe { libc::fallocate(file.as_raw_fd(), mode, off, len) })
}

/// `lseek(SEEK_DATA/SEEK_HOLE)`: whether `offset` is in data, and where that run ends
/// (`u64::MAX` when unknown or at end of file, or when `find_end` is false: the caller knows
/// `SEEK_HOLE` is costly there). File systems without hole reporting say data.
pub(crate) fn data_run(file: &File, offset: u64, find_end: bool) -> io::Result<(bool, u64)> {
    let off = off_t(offset)?;
    // SAFETY: plain syscall on an owned descriptor; no memory is passed.
    let data = unsafe { libc::lseek(file.as_raw_fd(), off, libc::SEEK_DATA) };
    if data < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            // No data at or after `offset`: a hole up to (and past) the end of the file.
            Some(libc::ENXIO) => Ok((false, u64::MAX)),
            Some(libc::EINVAL | libc::EOPNOTSUPP) => Ok((true, u64::MAX)),
            _ => Err(e),
        };
    }
    if data > off {
        return Ok((false, data as u64));
    }
    if !find_end {
        return Ok((true, u64::MAX));
    }
    // SAFETY: as above.
    let hole = unsafe { libc::lseek(file.as_raw_fd(), off, libc::SEEK_HOLE) };
    Ok((true, if hole < 0 { u64::MAX } else { hole as u64 }))
}

/// `fdatasync`.
pub(crate) fn fdatasync(file: &File) -> io::Result<()> {
    // SAFETY: plain syscall on an owned descriptor.
    cvt(unsafe { libc::fdatasync(file.as_raw_fd()) })
}

/// True when `e` means "this file system cannot do that fallocate mode".
pub(crate) fn is_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL)
    )
}

/// Whether the file system under `file` implements fallocate's ZERO_RANGE and PUNCH_HOLE as
/// metadata operations (the ones QEMU relies on for cheap zeroes). Unknown ones say no; the
/// answer is also corrected at run time when fallocate fails.
pub(crate) fn fs_has_cheap_zeroes(file: &File) -> bool {
    const EXT4: i64 = 0xEF53;
    const XFS: i64 = 0x5846_5342;
    const BTRFS: i64 = 0x9123_683E;
    const F2FS: i64 = 0xF2F5_2010;
    const BCACHEFS: i64 = 0xCA45_1A4E;
    fs_magic(file).is_some_and(|m| matches!(m, EXT4 | XFS | BTRFS | F2FS | BCACHEFS))
}

/// Whether `file` lives in memory (tmpfs, ramfs): its reads and writes are copies that never
/// wait for a device. Such file systems also refuse non-blocking I/O (`RWF_NOWAIT`), so
/// io_uring hands every operation on them to a kernel worker thread and wakes the submitter
/// with an interrupt when it is done, which costs far more than the copy itself.
pub(crate) fn fs_is_memory(file: &File) -> bool {
    const TMPFS: i64 = 0x0102_1994;
    const RAMFS: i64 = 0x8584_58F6;
    fs_magic(file).is_some_and(|m| matches!(m, TMPFS | RAMFS))
}

/// The file system type (`statfs.f_type`) under `file`, if the kernel says.
fn fs_magic(file: &File) -> Option<i64> {
    // SAFETY: statfs is plain data; all-zero is a valid value to overwrite.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable statfs for the kernel to fill.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
        return None;
    }
    // f_type is i64 on x86_64 but narrower on some targets.
    #[allow(clippy::useless_conversion)]
    Some(i64::from(st.f_type))
}

/// The offset/length alignment O_DIRECT needs on `file`: statx's DIOALIGN when the kernel
/// reports it, else probed by reading (512 first, then 4096).
pub(crate) fn direct_alignment(file: &File) -> usize {
    if let Some(a) = statx_dio_align(file) {
        return a;
    }
    // Reading at an offset the device cannot address fails with EINVAL before any EOF check.
    let mut probe = IoBuf::zeroed(512);
    match pread(file, &mut probe, 512) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => 4096,
        _ => 512,
    }
}

fn statx_dio_align(file: &File) -> Option<usize> {
    // SAFETY: statx is plain data; all-zero is a valid value to overwrite.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the path is an empty C string with AT_EMPTY_PATH (so the fd itself is queried)
    // and `stx` is a valid, writable statx buffer.
    let ret = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if ret != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    let off = usize::try_from(stx.stx_dio_offset_align).ok()?;
    let mem = usize::try_from(stx.stx_dio_mem_align).ok()?;
    // 0 means "O_DIRECT unsupported here"; >64 KiB would be a device we cannot buffer for.
    let a = off.max(mem);
    (a.is_power_of_two() && a <= 65536).then_some(a.max(1))
}
