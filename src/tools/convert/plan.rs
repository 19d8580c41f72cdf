//! What `convert` does with each part of the target, decided the way qemu-img decides it:
//! the sources' block status is walked in guest order and every range becomes data (read and
//! written), zeros (skipped on a target that reads zeros already, else zeroed) or "backing"
//! (left unallocated, so that the target's backing file shows through).
//!
//! With a target backing file (`-B`) only what the source's top layer holds is copied: the
//! rest is assumed to be what the new backing file holds, as qemu-img assumes. Status runs
//! end on the source's cluster boundaries, data requests are bounded, and with compression
//! every request is one target cluster (a partly allocated cluster is copied whole).

use qcow2::engine::{EngineError, Extent, Image};
use qcow2::format::GuestOffset;
use storage::AnyStorage;

use super::sparse::SECTOR;

/// How much of a source one block-status query covers.
const QUERY_BYTES: u64 = 1 << 30;

/// What happens to a range of the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Read from the sources and written (all of it, or its non-zero parts).
    Data,
    /// Reads as zeros in the sources.
    Zero,
    /// Left to the target's backing file.
    Backing,
}

/// A range of the target and what happens to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub start: u64,
    pub len: u64,
    pub status: Status,
}

/// One source image, placed in the target after the ones before it.
#[derive(Clone)]
pub struct Source {
    pub image: Image<AnyStorage>,
    /// Bytes it provides; past them it reads as zeros.
    pub len: u64,
    /// Bytes of the target it covers: its size rounded up to whole sectors, as qemu-img
    /// counts image sizes.
    pub span: u64,
    /// Status runs end on multiples of this (its cluster size), so that no cluster is read
    /// twice.
    pub align: u64,
    /// Size of its backing file, if it has one.
    pub backing_len: Option<u64>,
}

impl Source {
    /// A source that reads `len` bytes from `image`.
    pub fn new(image: Image<AnyStorage>, len: u64) -> Source {
        let facts = image.facts();
        let backing_len = image.chain_sizes().get(1).copied();
        Source {
            image,
            len,
            span: len.div_ceil(SECTOR) * SECTOR,
            align: facts.cluster_size.max(SECTOR),
            backing_len,
        }
    }
}

/// What the sources say about a run, before the target's view is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Raw {
    Data,
    Zero,
    /// Not in the source's top layer (only asked about with a target backing file).
    Unallocated,
}

/// The copy's settings that shape the plan.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// The target has a backing file: only the sources' top layers are copied.
    pub target_backing: bool,
    /// Size of the new target's backing file, when known: past it the target reads zeros
    /// without help.
    pub target_backing_len: Option<u64>,
    /// With compression, the target's cluster size.
    pub compress_cluster: Option<u64>,
    /// Largest data request.
    pub request: u64,
    /// `-S 0`: zeros are written as data too, in requests no larger than data's.
    pub full_allocation: bool,
}

/// A cached block-status answer for one source.
struct Window {
    source: usize,
    /// Runs covering `[start, end of the last run)`, each `(end, status)`.
    start: u64,
    runs: Vec<(u64, Raw)>,
}

/// Walks the target from its start, one chunk at a time.
pub struct Planner<'a> {
    sources: &'a [Source],
    settings: Settings,
    total: u64,
    pos: u64,
    status: Status,
    /// Where the current status stops holding.
    status_end: u64,
    window: Option<Window>,
}

impl<'a> Planner<'a> {
    pub fn new(sources: &'a [Source], settings: Settings) -> Planner<'a> {
        Planner {
            sources,
            settings,
            total: total_span(sources),
            pos: 0,
            status: Status::Data,
            status_end: 0,
            window: None,
        }
    }

    /// The next chunk, or `None` at the end of the target.
    pub async fn next(&mut self) -> Result<Option<Chunk>, EngineError> {
        let pos = self.pos;
        if pos >= self.total {
            return Ok(None);
        }
        let (index, src_start) = locate(self.sources, pos);
        let mut n = self.total - pos;
        let mut past_backing = false;
        if let Some(end) = self.settings.target_backing_len {
            if pos >= end {
                past_backing = true;
            } else {
                // From there on zeros are handled differently.
                n = n.min(end - pos);
            }
        }
        if self.status_end <= pos {
            let src = &self.sources[index];
            let off = pos - src_start;
            let (run, raw) = self.query(index, off, n.min(src.span - off)).await?;
            let mut run = run.div_ceil(SECTOR) * SECTOR;
            let tail = (off + run) % src.align;
            if run > tail {
                run -= tail;
            }
            self.status = match raw {
                Raw::Zero if past_backing => Status::Backing,
                Raw::Zero => Status::Zero,
                Raw::Data => Status::Data,
                Raw::Unallocated if self.settings.target_backing => Status::Backing,
                Raw::Unallocated => Status::Data,
            };
            self.status_end = pos + run;
        }
        n = n.min(self.status_end - pos);
        if self.status == Status::Data {
            n = n.min(self.settings.request);
        }
        if let Some(cluster) = self.settings.compress_cluster {
            // Compressed clusters are written whole.
            if n < cluster {
                n = cluster.min(self.total - pos);
                self.status = Status::Data;
            } else {
                n -= n % cluster;
            }
        }
        if self.settings.full_allocation && self.status == Status::Zero {
            n = n.min(self.settings.request);
        }
        self.pos = pos + n;
        Ok(Some(Chunk {
            start: pos,
            len: n,
            status: self.status,
        }))
    }

    /// The run of one status that starts at `off` in source `index`, at most `limit` long.
    async fn query(
        &mut self,
        index: usize,
        off: u64,
        limit: u64,
    ) -> Result<(u64, Raw), EngineError> {
        let src = &self.sources[index];
        if off >= src.len {
            // The padding up to a whole sector.
            return Ok(((src.span - off).min(limit), Raw::Zero));
        }
        let cached = self.window.as_ref().is_some_and(|w| {
            w.source == index && w.start <= off && w.runs.last().is_some_and(|r| r.0 > off)
        });
        if !cached {
            let len = QUERY_BYTES.min(src.len - off);
            let extents = src.image.block_status(GuestOffset(off), len).await?;
            let mut runs: Vec<(u64, Raw)> = Vec::new();
            for e in &extents {
                for (end, raw) in classify(e, src, self.settings.target_backing) {
                    match runs.last_mut() {
                        Some(last) if last.1 == raw => last.0 = end,
                        _ => runs.push((end, raw)),
                    }
                }
            }
            self.window = Some(Window {
                source: index,
                start: off,
                runs,
            });
        }
        let w = self.window.as_ref().expect("filled above");
        let i = w.runs.partition_point(|r| r.0 <= off);
        match w.runs.get(i) {
            Some(&(end, raw)) => Ok(((end - off).min(limit), raw)),
            // Block status covers what was asked; an empty answer reads as zeros.
            None => Ok((limit.min(src.len - off), Raw::Zero)),
        }
    }
}

/// The status runs of one extent, `(end, status)`: with a target backing file, what is not
/// in the source's top layer is unallocated, except past the end of the source's backing
/// file, where it reads as zeros.
fn classify(e: &Extent, src: &Source, target_backing: bool) -> Vec<(u64, Raw)> {
    let end = e.start + e.len;
    let plain = if e.zero { Raw::Zero } else { Raw::Data };
    let Some(backing_len) = src.backing_len.filter(|_| target_backing) else {
        return vec![(end, plain)];
    };
    if e.present && e.depth == 0 {
        return vec![(end, plain)];
    }
    if end <= backing_len {
        vec![(end, Raw::Unallocated)]
    } else if e.start >= backing_len {
        vec![(end, Raw::Zero)]
    } else {
        vec![(backing_len, Raw::Unallocated), (end, Raw::Zero)]
    }
}

/// Total bytes of the target the sources cover.
pub fn total_span(sources: &[Source]) -> u64 {
    sources.iter().map(|s| s.span).sum()
}

/// The source covering target byte `pos` (below [`total_span`]) and where it starts.
pub fn locate(sources: &[Source], pos: u64) -> (usize, u64) {
    let mut start = 0;
    for (i, s) in sources.iter().enumerate() {
        if pos < start + s.span {
            return (i, start);
        }
        start += s.span;
    }
    let last = sources.len().saturating_sub(1);
    (last, start - sources.last().map_or(0, |s| s.span))
}
