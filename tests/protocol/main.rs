//! The NBD server's protocol over in-memory exports, without qcow2: raw and arbitrary byte
//! streams from the tests' own client, the server's lifecycle (reply order, shutdown,
//! limits), and systemd socket activation (nbdinfo only as the activator). They live here, beside
//! `tests/serve` (real NBD clients against the binary), so every NBD test has one home and
//! the nbd-server crate needs no test helpers that depend on itself. One binary so the suite links
//! once.

mod client;

mod arbitrary_client;
mod raw_protocol;
mod server_lifecycle;
mod systemd_activation;
