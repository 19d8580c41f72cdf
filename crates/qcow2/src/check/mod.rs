//! `qemu-img check` for qcow2 images, with repair: the same findings, counts and exit codes.
//!
//! The checker works on the image file itself through [`storage::Storage`], not through
//! [`crate::engine::Image`], so it can look at (and repair) images a normal open refuses. It
//! follows QEMU's `qcow2_check_refcounts`: every reference in the image (header, active and
//! snapshot L1/L2 tables, data and compressed clusters, refcount table and blocks, snapshot
//! table, encryption header, bitmaps) is counted into an in-memory refcount table, which is
//! compared with the stored refcounts: a stored refcount above the count is a leak, below it
//! a corruption. Entries are checked on the way (reserved bits, alignment, regions past the
//! end of the file, subcluster bitmaps, compressed descriptors) and COPIED flags last.
//!
//! Repairs (`-r leaks`, `-r all`) change only what the findings name and never write over
//! live metadata (QEMU's overlap check); when the stored refcount structure is beyond repair,
//! `-r all` writes a new one into unused clusters and switches the header to it in one write
//! (see `rebuild`). [`repair_dirty`] runs the same repair when a dirty lazy-refcount image is
//! opened for writing.
//!
//! Files: `meta` (what is loaded), `pass` (state and helpers), `imrt` (computed refcounts),
//! `snapshots`, `tables` (L1/L2), `bitmaps`, `calculate` (all references), `ondisk` (stored
//! refcounts), `compare`, `copied`, `rebuild`, `snapshot_fix`, `run` (the order of it all),
//! `sections` (what the overlap check guards), `report`, `render` (qemu-img's output), `dirty`,
//! `blocking` (for the CLI), `width` (amend's change of the refcount width, built on `calculate`
//! and `rebuild`).

mod bitmap_refs;
mod bitmaps;
mod blocking;
mod calculate;
mod compare;
mod copied;
mod dirty;
mod error;
mod imrt;
mod io;
mod meta;
mod ondisk;
mod pass;
mod rebuild;
mod render;
mod report;
mod run;
mod sections;
mod snapshot_fix;
mod snapshots;
mod tables;
mod width;

pub use blocking::check_path;
pub(crate) use dirty::repair_dirty_layer;
pub use dirty::{repair_dirty, report_repairs_to};
pub use error::CheckError;
pub use report::{CheckReport, Finding, FindingKind};
pub use run::{check, CheckOutcome, Repair};
pub(crate) use width::{change_refcount_order, Switched};
