//! Live statistics of `serve`: per export and for the whole server, requests, bytes and
//! latency by NBD command, errors by errno, connections, and the image's metadata caches.
//!
//! - `counters`: what is counted ([`ExportStats`], written by `ImageExport` on the image's
//!   thread) and [`Counters`], the numbers copied out at one moment;
//! - `histogram`: the fixed log-spaced latency buckets;
//! - `registry`: [`StatsRegistry`], the exports counted now (added and removed at run time)
//!   and the server's total;
//! - `json` and `prometheus`: the same numbers as a JSON object and as Prometheus text;
//! - `http`: the `--metrics` endpoint.
//!
//! With statistics off nothing is created and `ImageExport` skips all of it.

mod counters;
mod histogram;
pub mod http;
pub mod json;
pub mod prometheus;
mod registry;

pub use counters::{Command, ExportStats, Gauges};
pub use registry::{StatsError, StatsRegistry};
