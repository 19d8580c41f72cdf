//! qcow2: the image format as pure, I/O-free types ([`format`]) and, later, the async engine.

pub mod format;
