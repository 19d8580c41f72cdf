//! The NBD server over an in-memory export, driven by real clients (qemu-io, nbdinfo, nbdcopy,
//! nbdsh, fio, nbd-client) and by raw and arbitrary byte streams; one test binary so the
//! suite links once.

mod client;

mod arbitrary_client;
mod fio_multiconn;
mod nbd_client;
mod nbdcopy;
mod nbdinfo;
mod nbdsh_abuse;
mod qemu_io;
mod raw_protocol;
mod server_lifecycle;
mod systemd_activation;
