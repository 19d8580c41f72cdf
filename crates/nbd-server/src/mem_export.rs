//! [`MemExport`]: an in-memory export with allocation tracking, an optional backing layer
//! and error injection, for tests of this crate and of its users.
//!
//! Storage is sparse (a map of granules), so a large export costs only what is written.
//! Each granule is unallocated (reads through to the backing layer, or as zeroes), allocated
//! zero, or data. Zeroing or trimming whole granules is "fast" and deallocates them when
//! allowed; a fast zero that would have to write zero bytes into part of a granule fails
//! with `ENOTSUP`, as the spec asks of a zeroing that is no faster than a write.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use nbd_proto::errno::Errno;

use crate::export::{Export, ExportFeatures, Extent, ReadChunk, WriteZeroesFlags};

#[derive(Debug, Clone)]
enum Granule {
    Data(Box<[u8]>),
    Zero,
}

/// Counters of the calls a [`MemExport`] received.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemStats {
    /// `read` calls.
    pub reads: u64,
    /// `write` calls.
    pub writes: u64,
    /// `write` calls with FUA.
    pub fua_writes: u64,
    /// `write_zeroes` calls that succeeded.
    pub zero_writes: u64,
    /// `write_zeroes` calls with `may_unmap`.
    pub unmapping_zero_writes: u64,
    /// Fast zero requests refused with `ENOTSUP`.
    pub fast_zero_refusals: u64,
    /// `trim` calls.
    pub trims: u64,
    /// `flush` calls.
    pub flushes: u64,
    /// `cache` calls.
    pub caches: u64,
    /// `block_status` calls.
    pub block_status: u64,
}

/// A sparse in-memory export.
#[derive(Debug)]
pub struct MemExport {
    size: u64,
    granularity: u64,
    features: ExportFeatures,
    granules: RefCell<BTreeMap<u64, Granule>>,
    backing: Option<Box<MemExport>>,
    failures: RefCell<Vec<(u64, u64, Errno)>>,
    stats: Cell<MemStats>,
}

/// What a run of bytes reads as, from the top layer's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    Data,
    Zero,
    Unallocated,
}

impl MemExport {
    /// An all-unallocated export of `size` bytes with 4 KiB granules and every feature on.
    pub fn new(size: u64) -> Self {
        Self {
            size,
            granularity: 4096,
            features: ExportFeatures::default(),
            granules: RefCell::new(BTreeMap::new()),
            backing: None,
            failures: RefCell::new(Vec::new()),
            stats: Cell::new(MemStats::default()),
        }
    }

    /// Replaces the advertised features.
    pub fn with_features(mut self, features: ExportFeatures) -> Self {
        self.features = features;
        self
    }

    /// Sets the allocation granularity (rounded to a power of two in 512..=1 MiB).
    pub fn with_granularity(mut self, granularity: u64) -> Self {
        self.granularity = granularity.clamp(512, 1 << 20).next_power_of_two();
        self
    }

    /// Puts `backing` under this export: unallocated ranges read from it, and block status
    /// reports its layers one level deeper (`qemu:allocation-depth` 2, 3, ...).
    pub fn with_backing(mut self, backing: MemExport) -> Self {
        self.backing = Some(Box::new(backing));
        self
    }

    /// Makes reads and writes touching `[offset, offset + len)` fail with `errno`.
    pub fn fail_range(&self, offset: u64, len: u64, errno: Errno) {
        self.failures.borrow_mut().push((offset, len, errno));
    }

    /// Call counters so far.
    pub fn stats(&self) -> MemStats {
        self.stats.get()
    }

    /// Writes `data` at `offset` synchronously (test setup; out-of-range bytes are dropped).
    pub fn fill(&self, offset: u64, data: &[u8]) {
        let len = u64::try_from(data.len())
            .unwrap_or(u64::MAX)
            .min(self.size.saturating_sub(offset));
        let len = usize::try_from(len).unwrap_or(0);
        self.write_bytes(offset, &data[..len]);
    }

    /// Zeroes `len` bytes at `offset` synchronously (test setup): whole granules become
    /// allocated zeroes, or unallocated with `may_unmap` (out-of-range bytes are ignored).
    pub fn zero(&self, offset: u64, len: u64, may_unmap: bool) {
        let end = offset.saturating_add(len).min(self.size);
        if offset < end {
            self.clear(offset, end, may_unmap, true);
        }
    }

    /// The whole export's contents (for tests of small exports).
    pub fn contents(&self) -> Vec<u8> {
        let mut out = vec![0u8; usize::try_from(self.size).unwrap_or(0)];
        self.read_into(0, &mut out);
        out
    }

    /// Allocation of the whole export, as block status would report it.
    pub fn extents(&self) -> Vec<Extent> {
        self.extents_in(0, self.size)
    }

    fn bump(&self, f: impl FnOnce(&mut MemStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }

    fn check_failures(&self, offset: u64, len: u64) -> Result<(), Errno> {
        let end = offset.saturating_add(len);
        for &(o, l, e) in self.failures.borrow().iter() {
            if o < end && offset < o.saturating_add(l) {
                return Err(e);
            }
        }
        Ok(())
    }

    fn granule_len(&self, g: u64) -> u64 {
        let start = g * self.granularity;
        self.granularity.min(self.size.saturating_sub(start))
    }

    /// Splits `[offset, end)` into maximal runs of one top-layer state.
    fn runs(&self, offset: u64, end: u64) -> Vec<(u64, u64, Run)> {
        let mut out: Vec<(u64, u64, Run)> = Vec::new();
        let mut push = |start: u64, stop: u64, run: Run| {
            if stop <= start {
                return;
            }
            match out.last_mut() {
                Some(last) if last.2 == run && last.1 == start => last.1 = stop,
                _ => out.push((start, stop, run)),
            }
        };
        let g = self.granularity;
        let first = offset / g;
        let mut pos = offset;
        for (&idx, granule) in self.granules.borrow().range(first..) {
            let gstart = idx * g;
            if gstart >= end {
                break;
            }
            push(pos, gstart.min(end), Run::Unallocated);
            let gend = (gstart + g).min(end);
            let run = match granule {
                Granule::Data(_) => Run::Data,
                Granule::Zero => Run::Zero,
            };
            push(pos.max(gstart), gend, run);
            pos = gend;
        }
        push(pos, end, Run::Unallocated);
        out
    }

    fn read_into(&self, offset: u64, out: &mut [u8]) {
        let end = offset + out.len() as u64;
        for (start, stop, run) in self.runs(offset, end) {
            let dst = &mut out[(start - offset) as usize..(stop - offset) as usize];
            match run {
                Run::Zero => dst.fill(0),
                Run::Unallocated => match &self.backing {
                    Some(b) if start < b.size => {
                        let inside = (stop.min(b.size) - start) as usize;
                        b.read_into(start, &mut dst[..inside]);
                        dst[inside..].fill(0);
                    }
                    _ => dst.fill(0),
                },
                Run::Data => {
                    let granules = self.granules.borrow();
                    let mut pos = start;
                    while pos < stop {
                        let idx = pos / self.granularity;
                        let within = (pos - idx * self.granularity) as usize;
                        let take = (self.granularity - within as u64).min(stop - pos) as usize;
                        let d = (pos - start) as usize;
                        if let Some(Granule::Data(bytes)) = granules.get(&idx) {
                            dst[d..d + take].copy_from_slice(&bytes[within..within + take]);
                        }
                        pos += take as u64;
                    }
                }
            }
        }
    }

    /// The granule's current bytes, materialized from the backing layer if unallocated.
    fn materialize(&self, idx: u64) -> Box<[u8]> {
        let mut bytes = vec![0u8; self.granularity as usize].into_boxed_slice();
        let len = self.granule_len(idx) as usize;
        match self.granules.borrow().get(&idx) {
            Some(Granule::Data(b)) => bytes.copy_from_slice(b),
            Some(Granule::Zero) => {}
            None => self.read_into(idx * self.granularity, &mut bytes[..len]),
        }
        bytes
    }

    fn write_bytes(&self, offset: u64, data: &[u8]) {
        let g = self.granularity;
        let end = offset + data.len() as u64;
        let mut pos = offset;
        while pos < end {
            let idx = pos / g;
            let within = (pos - idx * g) as usize;
            let take = (g - within as u64).min(end - pos) as usize;
            let mut bytes = self.materialize(idx);
            let src = (pos - offset) as usize;
            bytes[within..within + take].copy_from_slice(&data[src..src + take]);
            self.granules.borrow_mut().insert(idx, Granule::Data(bytes));
            pos += take as u64;
        }
    }

    /// True if `[offset, end)` starts and ends on granule boundaries (or the export end).
    fn whole_granules(&self, offset: u64, end: u64) -> bool {
        offset % self.granularity == 0 && (end % self.granularity == 0 || end == self.size)
    }

    /// Zeroes or discards `[offset, end)`: whole granules change state; partial ones get
    /// zero bytes written (`zero_partial`) or are left alone.
    fn clear(&self, offset: u64, end: u64, deallocate: bool, zero_partial: bool) {
        let g = self.granularity;
        let mut pos = offset;
        if deallocate && self.backing.is_none() {
            // Drop whole granules by visiting only the allocated ones, so clearing a huge
            // range costs what is allocated, not what is cleared.
            let first_whole = offset.div_ceil(g);
            let end_whole = if end == self.size {
                end.div_ceil(g)
            } else {
                end / g
            };
            if first_whole < end_whole {
                let mut map = self.granules.borrow_mut();
                let doomed: Vec<u64> = map.range(first_whole..end_whole).map(|(&k, _)| k).collect();
                for k in doomed {
                    map.remove(&k);
                }
                drop(map);
                self.clear(offset, (first_whole * g).min(end), false, zero_partial);
                self.clear(
                    (end_whole * g).max(offset).min(end),
                    end,
                    false,
                    zero_partial,
                );
                return;
            }
        }
        while pos < end {
            let idx = pos / g;
            let gstart = idx * g;
            let gend = (gstart + g).min(self.size);
            let stop = gend.min(end);
            if pos == gstart && stop == gend {
                let mut map = self.granules.borrow_mut();
                if deallocate && self.backing.is_none() {
                    map.remove(&idx);
                } else {
                    map.insert(idx, Granule::Zero);
                }
            } else if zero_partial {
                let state = self
                    .granules
                    .borrow()
                    .get(&idx)
                    .map(|x| matches!(x, Granule::Zero));
                let already_zero =
                    state == Some(true) || (state.is_none() && self.backing.is_none());
                if !already_zero {
                    let mut bytes = self.materialize(idx);
                    bytes[(pos - gstart) as usize..(stop - gstart) as usize].fill(0);
                    self.granules.borrow_mut().insert(idx, Granule::Data(bytes));
                }
            }
            pos = stop;
        }
    }

    fn extents_in(&self, offset: u64, end: u64) -> Vec<Extent> {
        let mut out: Vec<Extent> = Vec::new();
        let mut push = |e: Extent| {
            if e.len == 0 {
                return;
            }
            match out.last_mut() {
                Some(l) if (l.hole, l.zero, l.depth) == (e.hole, e.zero, e.depth) => l.len += e.len,
                _ => out.push(e),
            }
        };
        for (start, stop, run) in self.runs(offset, end) {
            let len = stop - start;
            match run {
                Run::Data => push(Extent {
                    len,
                    hole: false,
                    zero: false,
                    depth: 1,
                }),
                Run::Zero => push(Extent {
                    len,
                    hole: false,
                    zero: true,
                    depth: 1,
                }),
                Run::Unallocated => match &self.backing {
                    Some(b) if start < b.size => {
                        for e in b.extents_in(start, stop.min(b.size)) {
                            let depth = if e.depth == 0 { 0 } else { e.depth + 1 };
                            push(Extent { depth, ..e });
                        }
                        let beyond = stop.saturating_sub(b.size.max(start));
                        push(Extent {
                            len: beyond,
                            hole: true,
                            zero: true,
                            depth: 0,
                        });
                    }
                    _ => push(Extent {
                        len,
                        hole: true,
                        zero: true,
                        depth: 0,
                    }),
                },
            }
        }
        out
    }

    fn read_chunks(&self, offset: u64, len: usize) -> Vec<ReadChunk<Vec<u8>>> {
        let mut out: Vec<ReadChunk<Vec<u8>>> = Vec::new();
        let end = offset + len as u64;
        for e in self
            .extents_in(offset, end)
            .into_iter()
            .scan(offset, |pos, e| {
                let start = *pos;
                *pos += e.len;
                Some((start, e))
            })
        {
            let (start, extent) = e;
            let n = extent.len as usize;
            if extent.zero {
                match out.last_mut() {
                    Some(ReadChunk::Hole(h)) => *h += n,
                    _ => out.push(ReadChunk::Hole(n)),
                }
            } else {
                let mut buf = vec![0u8; n];
                self.read_into(start, &mut buf);
                match out.last_mut() {
                    Some(ReadChunk::Data(d)) => d.extend_from_slice(&buf),
                    _ => out.push(ReadChunk::Data(buf)),
                }
            }
        }
        out
    }
}

impl Export for MemExport {
    type Buf = Vec<u8>;

    fn size(&self) -> u64 {
        self.size
    }

    fn features(&self) -> ExportFeatures {
        self.features
    }

    async fn read(&self, offset: u64, len: usize) -> Result<Vec<ReadChunk<Vec<u8>>>, Errno> {
        self.bump(|s| s.reads += 1);
        let end = offset
            .checked_add(len as u64)
            .filter(|&e| e <= self.size)
            .ok_or(Errno::Inval)?;
        self.check_failures(offset, end - offset)?;
        Ok(self.read_chunks(offset, len))
    }

    async fn write(&self, offset: u64, data: Vec<u8>, fua: bool) -> Result<(), Errno> {
        self.bump(|s| {
            s.writes += 1;
            s.fua_writes += u64::from(fua);
        });
        let len = data.len() as u64;
        offset
            .checked_add(len)
            .filter(|&e| e <= self.size)
            .ok_or(Errno::NoSpc)?;
        self.check_failures(offset, len)?;
        self.write_bytes(offset, &data);
        Ok(())
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        flags: WriteZeroesFlags,
    ) -> Result<(), Errno> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.size)
            .ok_or(Errno::NoSpc)?;
        self.check_failures(offset, len)?;
        if flags.fast && !self.whole_granules(offset, end) {
            self.bump(|s| s.fast_zero_refusals += 1);
            return Err(Errno::NotSup);
        }
        self.bump(|s| {
            s.zero_writes += 1;
            s.unmapping_zero_writes += u64::from(flags.may_unmap);
        });
        self.clear(offset, end, flags.may_unmap, true);
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u64, _fua: bool) -> Result<(), Errno> {
        self.bump(|s| s.trims += 1);
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.size)
            .ok_or(Errno::Inval)?;
        self.clear(offset, end, true, false);
        Ok(())
    }

    async fn flush(&self) -> Result<(), Errno> {
        self.bump(|s| s.flushes += 1);
        Ok(())
    }

    async fn cache(&self, offset: u64, len: u64) -> Result<(), Errno> {
        self.bump(|s| s.caches += 1);
        offset
            .checked_add(len)
            .filter(|&e| e <= self.size)
            .ok_or(Errno::Inval)?;
        Ok(())
    }

    async fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, Errno> {
        self.bump(|s| s.block_status += 1);
        if offset >= self.size {
            return Err(Errno::Inval);
        }
        let end = offset.saturating_add(len.max(1)).min(self.size);
        Ok(self.extents_in(offset, end))
    }
}

#[cfg(test)]
#[path = "mem_export_tests.rs"]
mod tests;
