//! `qemu-nbd` as the oracle: shared with the image tools' tests, so it lives in test_support.

pub use test_support::QemuNbd;
