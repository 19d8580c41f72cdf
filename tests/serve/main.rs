//! The NBD client tests: real clients (qemu-io, nbdinfo, nbdcopy, nbdsh, fio, nbd-client, a
//! kernel-like client, and gnutls-cli for TLS) against the real `qcow2-nbd serve` binary, and,
//! where only the export can tell what arrived or the binary cannot serve it (several exports, any
//! feature flags), against the nbd-server crate's server over in-memory exports (the `mem_export`
//! modules). One test binary so the suite links once.

mod support;

mod abuse;
mod backup;
mod bitmaps;
mod block_sizes;
mod control;
mod enospc;
mod fio;
mod kernel_client;
mod lifecycle;
mod limits;
mod locks;
mod metrics;
mod multi_export;
mod nbd_client;
mod nbdcopy;
mod nbdinfo;
mod options;
mod qemu_io;
mod qemu_nbd_compat;
mod soak;
mod tls;
mod untrusted;
