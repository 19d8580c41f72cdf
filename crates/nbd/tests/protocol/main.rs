//! The NBD server's protocol over in-memory exports, without qcow2: raw and arbitrary byte
//! streams from the tests' own client, the server's lifecycle (reply order, shutdown,
//! limits), and systemd socket activation (nbdinfo only as the activator). Real NBD clients
//! are tested in the root package's `tests/serve`. One test binary so the suite links once.

mod client;

mod arbitrary_client;
mod raw_protocol;
mod server_lifecycle;
mod systemd_activation;
