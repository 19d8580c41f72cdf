//! The image engine against QEMU: reads, writes, chains, concurrency and crash consistency; one test binary so the suite links once.

mod support;

mod bitmaps;
mod blkdebug;
mod chain;
mod concurrency;
mod crash;
mod crash_amend_refcount;
mod crash_snapshots;
mod encryption;
mod grow_ahead;
mod io_errors;
mod open_duties;
mod prealloc_once;
mod read;
mod read_props;
mod write;
mod write_props;
