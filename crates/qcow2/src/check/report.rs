//! What a check found: the counts qemu-img reports (its `ImageCheck`), and the one-line
//! findings it prints to stderr while counting.

/// The result of one check, with every count `qemu-img check --output=json` has.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// Internal errors: the check could not look at something (an unreadable refcount, ...).
    pub check_errors: u64,
    /// Inconsistencies that may lose data (refcounts too low, bad entries, ...).
    pub corruptions: u64,
    /// Clusters whose refcount is higher than their use: wasted space only.
    pub leaks: u64,
    /// Corruptions repaired by this check.
    pub corruptions_fixed: u64,
    /// Leaks repaired by this check.
    pub leaks_fixed: u64,
    /// End of the last cluster in use (by refcount or by reference), in bytes.
    pub image_end_offset: u64,
    /// Clusters the virtual disk spans.
    pub total_clusters: u64,
    /// Guest clusters with a host cluster (data, compressed or preallocated zero).
    pub allocated_clusters: u64,
    /// Allocated clusters not right after the previous one in the file.
    pub fragmented_clusters: u64,
    /// Compressed guest clusters.
    pub compressed_clusters: u64,
}

impl CheckReport {
    /// qemu-img's exit code for this report: 1 when the check had internal errors, 2 for
    /// corruptions, 3 for leaks only, 0 for a clean image.
    pub fn exit_code(&self) -> u8 {
        if self.check_errors > 0 {
            1
        } else if self.corruptions > 0 {
            2
        } else if self.leaks > 0 {
            3
        } else {
            0
        }
    }

    /// Adds another partial result (QEMU's `qcow2_add_check_result`); with `allocation`, the
    /// image end offset and cluster statistics are taken from `other` too.
    pub(crate) fn add(&mut self, other: &CheckReport, allocation: bool) {
        self.check_errors += other.check_errors;
        self.corruptions += other.corruptions;
        self.leaks += other.leaks;
        self.corruptions_fixed += other.corruptions_fixed;
        self.leaks_fixed += other.leaks_fixed;
        if allocation {
            self.image_end_offset = other.image_end_offset;
            self.total_clusters = other.total_clusters;
            self.allocated_clusters = other.allocated_clusters;
            self.fragmented_clusters = other.fragmented_clusters;
            self.compressed_clusters = other.compressed_clusters;
        }
    }
}

/// What kind of line a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FindingKind {
    /// A corruption or another error.
    Error,
    /// A leaked cluster.
    Leak,
    /// Something being repaired.
    Repair,
    /// Progress of a repair (rebuilding, discarding).
    Info,
    /// An error QEMU gives through its error reporter, so its line begins with the tool's
    /// name (the snapshot table that cannot be read).
    Reported,
}

/// One line of the diagnostics qemu-img prints to stderr while checking, worded as QEMU
/// words it (offsets and entries in hex without `0x` where QEMU prints them so).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Error, leak, repair or progress.
    pub kind: FindingKind,
    /// The line, without a newline.
    pub message: String,
}
