//! Synchronous inspection of an image's metadata over any [`ByteSource`]: header, extensions,
//! snapshot table and bitmap directory, each within QEMU's limits. `qcow2-nbd info` and the
//! "open these bytes and print info" fuzz target share this code.

mod human;
mod read;
mod report;

pub use crate::metadata::ByteSource;
pub use human::{human_size, snapshot_list};
pub use read::{
    inspect, read_header, read_l1_table, read_refcount_table, ImageMetadata, InspectError,
};
pub use report::{
    BitmapInfo, ChildInfo, EmptyData, EncryptInfo, FileNodeInfo, FileSpecific, FormatSpecific,
    ImageInfo, Qcow2Specific, ReferenceReport, SnapshotInfo, SpecificData,
};
