//! What is counted per export: requests, bytes and latency by command, errors by errno,
//! connections; and [`Counters`], the same numbers (with the engine's cache statistics)
//! copied out at one moment, which the registry adds up and the renderers print.
//!
//! The live counters are plain `Cell`s: every request of an export runs on the thread that
//! owns its image (with `--threads`, other threads send their calls there), so counting is
//! an increment in memory the thread already owns, with no atomic operation or lock, and
//! the type (neither `Send` nor `Sync`) keeps it that way.

use std::cell::Cell;
use std::time::Duration;

use nbd_proto::Errno;
use qcow2::engine::{MetaCacheCounters, MetaCacheStats};

use super::histogram::{Histogram, HistogramCounts};

/// The NBD commands that reach an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// `NBD_CMD_READ`.
    Read,
    /// `NBD_CMD_WRITE`.
    Write,
    /// `NBD_CMD_WRITE_ZEROES`.
    WriteZeroes,
    /// `NBD_CMD_TRIM`.
    Trim,
    /// `NBD_CMD_FLUSH`.
    Flush,
    /// `NBD_CMD_BLOCK_STATUS`: one per lookup the image makes for it, so a request counts
    /// once for the allocation contexts (`base:allocation`, `qemu:allocation-depth`) together
    /// and once more for each dirty bitmap it asks about.
    BlockStatus,
    /// `NBD_CMD_CACHE`.
    Cache,
}

impl Command {
    /// Every command, in the order the counters keep them.
    pub const ALL: [Command; 7] = [
        Self::Read,
        Self::Write,
        Self::WriteZeroes,
        Self::Trim,
        Self::Flush,
        Self::BlockStatus,
        Self::Cache,
    ];

    /// The label value: the command's name in the spec, lower case.
    pub fn name(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::WriteZeroes => "write_zeroes",
            Self::Trim => "trim",
            Self::Flush => "flush",
            Self::BlockStatus => "block_status",
            Self::Cache => "cache",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

const COMMANDS: usize = Command::ALL.len();
const ERRNOS: usize = Errno::ALL.len();

fn errno_index(e: Errno) -> usize {
    Errno::ALL.iter().position(|&x| x == e).unwrap_or(0)
}

fn bump(c: &Cell<u64>, n: u64) {
    c.set(c.get().saturating_add(n));
}

/// The live counters of one export.
#[derive(Debug, Default)]
pub struct ExportStats {
    /// Latency per command; its count is the command's request count.
    latency: [Histogram; COMMANDS],
    bytes: [Cell<u64>; COMMANDS],
    errors: [Cell<u64>; ERRNOS],
    connections: Cell<u64>,
}

impl ExportStats {
    /// Counts one finished request of `bytes` bytes that took `elapsed`; a failed one counts
    /// its errno, and no bytes.
    pub fn record(&self, cmd: Command, bytes: u64, elapsed: Duration, error: Option<Errno>) {
        let i = cmd.index();
        self.latency[i].record(elapsed);
        match error {
            None => bump(&self.bytes[i], bytes),
            Some(e) => bump(&self.errors[errno_index(e)], 1),
        }
    }

    /// A connection started transmission on the export. How many are attached now is the
    /// export's own count (see [`Gauges`]); this is the running total.
    pub fn attached(&self) {
        bump(&self.connections, 1);
    }

    /// The counters now, with what is true now of the export.
    pub fn counters(&self, now: Gauges) -> Counters {
        Counters {
            commands: std::array::from_fn(|i| CommandCounters {
                latency: self.latency[i].counts(),
                bytes: self.bytes[i].get(),
            }),
            errors: std::array::from_fn(|i| self.errors[i].get()),
            attached: now.attached,
            connections: self.connections.get(),
            caches: now.caches,
        }
    }
}

/// One command's numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommandCounters {
    /// Latency of every request (failed ones too); its count is the number of requests.
    pub latency: HistogramCounts,
    /// Bytes the successful requests covered (their length; none for flush).
    pub bytes: u64,
}

impl CommandCounters {
    /// Requests finished, failed ones included.
    pub fn requests(&self) -> u64 {
        self.latency.count()
    }
}

/// What is true of an export at one moment, read from its owners when the numbers are
/// asked for: the connections attached (counted by the NBD server, which waits on that
/// count when the export is closed) and the image's metadata caches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gauges {
    /// Connections attached now.
    pub attached: u64,
    /// The image's metadata caches.
    pub caches: MetaCacheStats,
}

/// An export's (or the server's) statistics at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Per command, in [`Command::ALL`] order.
    pub commands: [CommandCounters; COMMANDS],
    /// Failed requests per errno, in [`Errno::ALL`] order.
    pub errors: [u64; ERRNOS],
    /// Connections attached now: they selected the export and have not ended (in
    /// transmission, or waiting for a `-e` slot).
    pub attached: u64,
    /// Connections that ever started transmission.
    pub connections: u64,
    /// The image's metadata caches.
    pub caches: MetaCacheStats,
}

impl Counters {
    /// One command's numbers.
    pub fn command(&self, cmd: Command) -> &CommandCounters {
        &self.commands[cmd.index()]
    }

    /// Failed requests with `errno`.
    pub fn errors_of(&self, errno: Errno) -> u64 {
        self.errors[errno_index(errno)]
    }

    /// Adds `other` to these numbers (for the server's total).
    pub fn add(&mut self, other: &Counters) {
        for (a, b) in self.commands.iter_mut().zip(&other.commands) {
            a.latency.add(&b.latency);
            a.bytes = a.bytes.saturating_add(b.bytes);
        }
        for (a, b) in self.errors.iter_mut().zip(other.errors) {
            *a = a.saturating_add(b);
        }
        self.attached = self.attached.saturating_add(other.attached);
        self.connections = self.connections.saturating_add(other.connections);
        add_cache(&mut self.caches.l2, &other.caches.l2);
        add_cache(&mut self.caches.refcount, &other.caches.refcount);
    }

    /// These numbers as history only: what is true "now" (connections attached, cache
    /// occupancy) dropped, for an export that is gone.
    pub fn history(mut self) -> Counters {
        self.attached = 0;
        for c in [&mut self.caches.l2, &mut self.caches.refcount] {
            c.dirty_bytes = 0;
            c.memory_bytes = 0;
        }
        self
    }
}

fn add_cache(a: &mut MetaCacheCounters, b: &MetaCacheCounters) {
    a.hits = a.hits.saturating_add(b.hits);
    a.misses = a.misses.saturating_add(b.misses);
    a.evictions = a.evictions.saturating_add(b.evictions);
    a.dirty_bytes = a.dirty_bytes.saturating_add(b.dirty_bytes);
    a.memory_bytes = a.memory_bytes.saturating_add(b.memory_bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_bytes_and_errors_are_counted_per_command() {
        let s = ExportStats::default();
        let ms = Duration::from_millis(1);
        s.record(Command::Read, 4096, ms, None);
        s.record(Command::Read, 65536, ms, None);
        s.record(Command::Write, 512, ms, Some(Errno::NoSpc));
        s.record(Command::Flush, 0, ms, None);
        let c = s.counters(Gauges::default());
        assert_eq!(c.command(Command::Read).requests(), 2);
        assert_eq!(c.command(Command::Read).bytes, 69632);
        assert_eq!(c.command(Command::Write).requests(), 1);
        assert_eq!(
            c.command(Command::Write).bytes,
            0,
            "a failed write moved nothing"
        );
        assert_eq!(c.command(Command::Flush).requests(), 1);
        assert_eq!(c.command(Command::Trim).requests(), 0);
        assert_eq!(c.errors_of(Errno::NoSpc), 1);
        assert_eq!(c.errors.iter().sum::<u64>(), 1);
    }

    #[test]
    fn connections_count_up_and_attached_is_what_the_export_says() {
        let s = ExportStats::default();
        s.attached();
        s.attached();
        let c = s.counters(Gauges {
            attached: 1,
            ..Gauges::default()
        });
        assert_eq!((c.attached, c.connections), (1, 2));
    }

    #[test]
    fn totals_add_everything_and_history_drops_the_present() {
        let s = ExportStats::default();
        s.attached();
        s.record(Command::Trim, 1 << 20, Duration::from_micros(3), None);
        let caches = MetaCacheStats {
            l2: MetaCacheCounters {
                hits: 3,
                misses: 1,
                evictions: 0,
                dirty_bytes: 4096,
                memory_bytes: 65536,
            },
            refcount: MetaCacheCounters::default(),
        };
        let one = s.counters(Gauges {
            attached: 1,
            caches,
        });
        let mut total = one;
        total.add(&one);
        assert_eq!(total.command(Command::Trim).requests(), 2);
        assert_eq!(total.command(Command::Trim).bytes, 2 << 20);
        assert_eq!((total.attached, total.connections), (2, 2));
        assert_eq!(total.caches.l2.hits, 6);
        let past = one.history();
        assert_eq!((past.attached, past.connections), (0, 1));
        assert_eq!(past.caches.l2.hits, 3);
        assert_eq!(past.caches.l2.memory_bytes, 0);
        assert_eq!(past.caches.l2.dirty_bytes, 0);
    }
}
