//! In-memory storage for tests: sparse, copy-on-write chunks so snapshots (and the crash images
//! of `FaultStorage`) cost a pointer per chunk, not a copy of the data.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use crate::error::{checked_end, len_u64};
use crate::{BufResult, OpenOptions, Opener, Slice, Storage};

/// Bytes per copy-on-write chunk: big enough that maps stay small, small enough that a 512-byte
/// write into a shared snapshot copies little.
const CHUNK: usize = 64 * 1024;
const CHUNK_U64: u64 = CHUNK as u64;

/// The contents of an in-memory file: a length and the non-zero chunks below it.
#[derive(Clone, Default, Debug)]
pub(crate) struct MemData {
    len: u64,
    /// Chunk index -> bytes; absent chunks read as zeros. Shared between snapshots.
    chunks: BTreeMap<u64, Rc<Vec<u8>>>,
}

/// Split `[offset, offset+len)` into (chunk index, offset in chunk, piece length) pieces.
fn pieces(offset: u64, len: usize) -> impl Iterator<Item = (u64, usize, usize)> {
    let mut pos = offset;
    let mut left = len;
    std::iter::from_fn(move || {
        if left == 0 {
            return None;
        }
        let index = pos / CHUNK_U64;
        // The remainder is < CHUNK, which fits usize.
        let within = usize::try_from(pos % CHUNK_U64).unwrap_or(0);
        let n = left.min(CHUNK - within);
        pos += len_u64(n);
        left -= n;
        Some((index, within, n))
    })
}

impl MemData {
    /// Current length.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Copy bytes at `offset` into `out`; bytes past the end read as zeros. The caller has
    /// checked that the range does not overflow.
    pub(crate) fn read(&self, offset: u64, out: &mut [u8]) {
        let mut done = 0;
        for (index, within, n) in pieces(offset, out.len()) {
            let dst = &mut out[done..done + n];
            match self.chunks.get(&index) {
                Some(chunk) => dst.copy_from_slice(&chunk[within..within + n]),
                None => dst.fill(0),
            }
            done += n;
        }
        // Bytes at or past `len` must read as zeros even if a chunk still holds stale data.
        let end = offset + len_u64(out.len());
        if end > self.len {
            let n = out.len();
            let keep = usize::try_from(self.len.saturating_sub(offset)).unwrap_or(n);
            out[keep.min(n)..].fill(0);
        }
    }

    /// Write `data` at `offset`, extending the length.
    pub(crate) fn write(&mut self, offset: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let mut done = 0;
        for (index, within, n) in pieces(offset, data.len()) {
            let chunk = self
                .chunks
                .entry(index)
                .or_insert_with(|| Rc::new(vec![0; CHUNK]));
            Rc::make_mut(chunk)[within..within + n].copy_from_slice(&data[done..done + n]);
            done += n;
        }
        self.len = self.len.max(offset + len_u64(data.len()));
    }

    /// Zero `[offset, offset+len)` without changing the length; whole chunks are dropped.
    pub(crate) fn zero(&mut self, offset: u64, len: u64) {
        let end = offset.saturating_add(len).min(self.len);
        if offset >= end {
            return;
        }
        let mut pos = offset;
        while pos < end {
            let index = pos / CHUNK_U64;
            let chunk_start = index * CHUNK_U64;
            let piece_end = end.min(chunk_start + CHUNK_U64);
            if pos == chunk_start && piece_end == chunk_start + CHUNK_U64 {
                self.chunks.remove(&index);
            } else if let Some(chunk) = self.chunks.get_mut(&index) {
                let a = usize::try_from(pos - chunk_start).unwrap_or(0);
                let b = usize::try_from(piece_end - chunk_start).unwrap_or(CHUNK);
                Rc::make_mut(chunk)[a..b].fill(0);
            }
            pos = piece_end;
        }
    }

    /// Zero the range and extend the length to cover it, as `write_zeroes_at` does.
    pub(crate) fn write_zeroes(&mut self, offset: u64, len: u64) {
        self.zero(offset, len);
        self.len = self.len.max(offset.saturating_add(len));
    }

    /// Truncate or extend; bytes past a shrink are forgotten so a later extension reads zeros.
    pub(crate) fn set_len(&mut self, len: u64) {
        if len < self.len {
            let old = self.len;
            self.zero(len, old - len);
            let first_dead = len.div_ceil(CHUNK_U64);
            self.chunks.retain(|&index, _| index < first_dead);
        }
        self.len = len;
    }

    /// Bytes of chunk memory allocated (shared chunks counted once per map).
    pub(crate) fn allocated_bytes(&self) -> u64 {
        len_u64(self.chunks.len()) * CHUNK_U64
    }

    /// The whole contents as one vector (tests and debugging).
    pub(crate) fn to_vec(&self) -> Vec<u8> {
        let len = usize::try_from(self.len).expect("MemStorage too large for to_vec");
        let mut out = vec![0; len];
        self.read(0, &mut out);
        out
    }
}

/// In-memory storage: a growable, sparse byte array behind `Rc<RefCell>`.
///
/// `clone()` gives another handle to the same bytes (like opening the same file twice);
/// [`MemStorage::snapshot`] gives an independent copy in O(chunks) time.
#[derive(Clone, Default, Debug)]
pub struct MemStorage {
    data: Rc<RefCell<MemData>>,
    read_only: bool,
}

fn read_only_error(op: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("{op}: in-memory storage is read-only"),
    )
}

impl MemStorage {
    /// An empty storage.
    pub fn new() -> MemStorage {
        MemStorage::default()
    }

    /// A storage holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> MemStorage {
        let mut data = MemData::default();
        data.write(0, bytes);
        MemStorage::from_data(data)
    }

    pub(crate) fn from_data(data: MemData) -> MemStorage {
        MemStorage {
            data: Rc::new(RefCell::new(data)),
            read_only: false,
        }
    }

    /// An independent copy of the current contents (copy-on-write, cheap).
    pub fn snapshot(&self) -> MemStorage {
        MemStorage::from_data(self.data.borrow().clone())
    }

    /// Another handle to the same bytes that refuses writes.
    pub fn read_only_handle(&self) -> MemStorage {
        MemStorage {
            data: Rc::clone(&self.data),
            read_only: true,
        }
    }

    /// The whole contents as a vector.
    pub fn to_vec(&self) -> Vec<u8> {
        self.data.borrow().to_vec()
    }

    /// Current length (synchronous; the trait's `len` is the async form).
    pub fn size(&self) -> u64 {
        self.data.borrow().len()
    }

    /// Memory held by chunks, showing that snapshots share data.
    pub fn allocated_bytes(&self) -> u64 {
        self.data.borrow().allocated_bytes()
    }

    pub(crate) fn data(&self) -> std::cell::Ref<'_, MemData> {
        self.data.borrow()
    }

    fn writable(&self, op: &str) -> io::Result<()> {
        if self.read_only {
            Err(read_only_error(op))
        } else {
            Ok(())
        }
    }
}

impl Storage for MemStorage {
    async fn read_at(&self, mut buf: Slice, offset: u64) -> BufResult<Slice> {
        if let Err(e) = checked_end("read_at", offset, len_u64(buf.len())) {
            return (Err(e.into()), buf);
        }
        self.data.borrow().read(offset, &mut buf);
        (Ok(()), buf)
    }

    async fn write_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        let check = self.writable("write_at").and_then(|()| {
            checked_end("write_at", offset, len_u64(buf.len()))
                .map(drop)
                .map_err(io::Error::from)
        });
        if let Err(e) = check {
            return (Err(e), buf);
        }
        self.data.borrow_mut().write(offset, &buf);
        (Ok(()), buf)
    }

    async fn write_zeroes_at(&self, offset: u64, len: u64, _unmap: bool) -> io::Result<()> {
        self.writable("write_zeroes_at")?;
        checked_end("write_zeroes_at", offset, len)?;
        self.data.borrow_mut().write_zeroes(offset, len);
        Ok(())
    }

    async fn discard_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.writable("discard_at")?;
        checked_end("discard_at", offset, len)?;
        self.data.borrow_mut().zero(offset, len);
        Ok(())
    }

    async fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    async fn len(&self) -> io::Result<u64> {
        Ok(self.size())
    }

    async fn set_len(&self, len: u64) -> io::Result<()> {
        self.writable("set_len")?;
        checked_end("set_len", len, 0)?;
        self.data.borrow_mut().set_len(len);
        Ok(())
    }

    fn zeroes_are_cheap(&self) -> bool {
        true
    }

    fn alignment(&self) -> usize {
        1
    }
}

/// A map from paths to [`MemStorage`]s, so backing chains can be tested without files.
///
/// Opening a path twice gives handles to the same bytes, as a real file system would.
#[derive(Clone, Default, Debug)]
pub struct MemFs {
    files: Rc<RefCell<HashMap<PathBuf, MemStorage>>>,
}

impl MemFs {
    /// An empty file system.
    pub fn new() -> MemFs {
        MemFs::default()
    }

    /// Put `storage` at `path`, replacing whatever was there.
    pub fn insert(&self, path: impl Into<PathBuf>, storage: MemStorage) {
        self.files.borrow_mut().insert(path.into(), storage);
    }

    /// A writable handle to the file at `path`, if any.
    pub fn get(&self, path: &Path) -> Option<MemStorage> {
        self.files.borrow().get(path).cloned()
    }

    /// Remove the file at `path`, returning it.
    pub fn remove(&self, path: &Path) -> Option<MemStorage> {
        self.files.borrow_mut().remove(path)
    }

    /// All paths, sorted.
    pub fn paths(&self) -> Vec<PathBuf> {
        let mut paths: Vec<PathBuf> = self.files.borrow().keys().cloned().collect();
        paths.sort();
        paths
    }
}

impl Opener for MemFs {
    type Storage = MemStorage;

    async fn open(&self, path: &Path, opts: OpenOptions) -> io::Result<MemStorage> {
        let mut files = self.files.borrow_mut();
        let storage = match files.get(path) {
            Some(s) => s.clone(),
            None if opts.create && !opts.read_only => {
                let s = MemStorage::new();
                files.insert(path.to_path_buf(), s.clone());
                s
            }
            None => {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("{}: no such file in MemFs", path.display()),
                ))
            }
        };
        Ok(if opts.read_only {
            storage.read_only_handle()
        } else {
            storage
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_shares_chunks_until_written() {
        let mut a = MemData::default();
        a.write(0, &vec![1u8; 4 * CHUNK]);
        let mut b = a.clone();
        b.write(10, &[2u8; 3]);
        assert_eq!(
            a.to_vec()[10],
            1,
            "write into snapshot leaked into original"
        );
        assert_eq!(b.to_vec()[10..13], [2, 2, 2]);
        assert_eq!(
            Rc::strong_count(&a.chunks[&1]),
            2,
            "untouched chunks must stay shared"
        );
        assert_eq!(Rc::strong_count(&a.chunks[&0]), 1);
    }

    #[test]
    fn shrink_then_grow_reads_zeros() {
        let mut d = MemData::default();
        d.write(0, &[9u8; 200]);
        d.set_len(50);
        d.set_len(300);
        let v = d.to_vec();
        assert_eq!(v.len(), 300);
        assert!(v[..50].iter().all(|&b| b == 9));
        assert!(v[50..].iter().all(|&b| b == 0));
    }

    #[test]
    fn zero_drops_whole_chunks_and_keeps_len() {
        let mut d = MemData::default();
        d.write(0, &vec![5u8; 3 * CHUNK]);
        d.zero(100, 2 * CHUNK_U64);
        assert_eq!(d.len(), len_u64(3 * CHUNK));
        assert!(
            !d.chunks.contains_key(&1),
            "fully zeroed chunk still allocated"
        );
        let v = d.to_vec();
        assert!(v[..100].iter().all(|&b| b == 5));
        assert!(v[100..100 + 2 * CHUNK].iter().all(|&b| b == 0));
        assert!(v[100 + 2 * CHUNK..].iter().all(|&b| b == 5));
    }

    #[test]
    fn sparse_high_offset_allocates_one_chunk() {
        let mut d = MemData::default();
        d.write(1 << 40, b"x");
        assert_eq!(d.len(), (1 << 40) + 1);
        assert_eq!(d.allocated_bytes(), CHUNK_U64);
        let mut out = [1u8; 4];
        d.read((1 << 40) - 2, &mut out);
        assert_eq!(out, [0, 0, b'x', 0]);
    }
}
