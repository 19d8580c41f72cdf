//! The server daemon: `serve` (qemu-nbd's options, the images served, the control socket,
//! signals), `image_export` (what a served image answers: the NBD export over an image, with
//! qemu-nbd's cache, discard and zero policies), `stats` (`query-stats` and the `--metrics`
//! endpoint), and `ctl` (the control socket's command-line client). It never imports the
//! image tools (`crate::tools`); what both need is in `crate::common`.

pub mod ctl;
pub mod image_export;
#[cfg(test)]
mod image_export_model;
pub mod serve;
pub mod stats;
