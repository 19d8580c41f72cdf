//! The qcow2 on-disk format as pure types: no I/O, no async. Every decoder takes untrusted bytes
//! and returns a [`FormatError`] naming the structure, field and file offset; every encoder
//! round-trips. One structure per file: `header`, `extensions`, `features`, `l1`, `l2`,
//! `l2_extended`, `compressed`, `refcount`, `snapshot`, `bitmap`, `bitmap_data`, `geometry`, `limits`.

pub mod be;
pub mod bitmap;
pub mod bitmap_data;
pub mod compressed;
pub mod error;
pub mod extensions;
pub mod features;
pub mod geometry;
pub mod header;
pub mod l1;
pub mod l2;
pub mod l2_extended;
pub mod limits;
pub mod refcount;
pub mod snapshot;

pub use bitmap::{BitmapDirectoryEntry, BitmapTableEntry, BitmapsExtension};
pub use bitmap_data::BitmapData;
pub use compressed::CompressedDescriptor;
pub use error::{FormatError, Location, Structure};
pub use extensions::{FdeHeaderPointer, FeatureNameEntry, FeatureNameTable, HeaderExtension};
pub use features::FeatureKind;
pub use geometry::{Geometry, GuestCluster, GuestOffset, HostCluster, HostOffset, L1Index};
pub use header::Header;
pub use l1::L1Entry;
pub use l2::L2Entry;
pub use l2_extended::{ExtendedL2Entry, SubclusterState};
pub use refcount::RefcountTableEntry;
pub use snapshot::{SnapshotL1Problem, SnapshotTableEntry};
