//! The real `qcow2-nbd serve` binary against real NBD clients (qemu-io, nbdinfo, nbdcopy,
//! nbdsh, fio, nbd-client and a kernel-like client), one test binary so the suite links once.

mod support;

mod abuse;
mod enospc;
mod fio;
mod kernel_client;
mod lifecycle;
mod limits;
mod locks;
mod nbd_client;
mod nbdcopy;
mod nbdinfo;
mod options;
mod qemu_io;
mod soak;
