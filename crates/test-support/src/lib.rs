//! Helpers the workspace's integration tests share, so each test tree stops carrying its own
//! copy: the external tools the tests use as oracles (QEMU's qemu-img and qemu-io, libnbd's
//! nbdinfo), a temporary directory to make images in, a deterministic random source, the
//! runtime the server's code runs on, throwaway TLS credentials, and waiting for something with a deadline; with the
//! `nbd` feature, the nbd-server crate's server in-process (`nbd_server`).
//!
//! A missing tool fails the test with the Debian package to install rather than skipping it:
//! a skipped interop test looks like a passing one.

mod dir;
#[cfg(feature = "nbd")]
pub mod nbd_server;
mod process;
mod qemu_nbd;
mod runtime;
mod tls;
mod tools;

pub use dir::Dir;
pub use process::{exit_within, peak_rss_mib, process_exited, rss_bytes, wait_until};
pub use qemu_nbd::QemuNbd;
pub use runtime::run;
/// The workspace's deterministic random source (SplitMix64), which the fault storage uses too.
pub use storage::rng::Rng;
pub use tls::{Pki, CLIENT_DN, PSK_USER};
pub use tools::{
    assert_check_clean, assert_same_bytes, assert_same_contents, create_image, nbd_tcp_uri,
    nbd_unix_uri, nbdinfo, parse_nbdinfo_map, python_with_libnbd, qemu, qemu_bitmaps,
    qemu_contents, qemu_dirty_ranges, qemu_img, qemu_io, qemu_io_direct, qemu_io_read_only,
    require, run_ok, stdout, text, QemuBitmap,
};
