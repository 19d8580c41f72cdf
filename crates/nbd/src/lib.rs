//! The NBD protocol: wire types, handshake, transmission loop and the `Export` trait (issue 6).
