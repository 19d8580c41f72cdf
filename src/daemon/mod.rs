//! The server daemon: `serve` (qemu-nbd's options, the exports, the control socket, signals),
//! `export` (the NBD export over an image, with qemu-nbd's cache, discard and zero policies),
//! `stats` (`query-stats` and the `--metrics` endpoint), and `ctl` (the control socket's
//! command-line client).

pub mod ctl;
pub mod export;
pub mod serve;
pub mod stats;
