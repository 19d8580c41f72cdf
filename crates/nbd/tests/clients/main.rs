//! The NBD server over an in-memory export, driven by real clients (qemu-io, nbdinfo,
//! nbd-client) and by raw and arbitrary byte streams; one test binary so the suite links
//! once.

mod client;

mod arbitrary_client;
mod nbd_client;
mod nbdinfo;
mod qemu_io;
mod raw_protocol;
mod server_lifecycle;
mod systemd_activation;
