//! The statistics as JSON, for a control interface (`query-stats`): one object per export
//! or for the server, with every number the Prometheus endpoint shows.
//!
//! ```json
//! {"commands": {"read": {"requests": 5, "bytes": 327680,
//!                        "latency": {"sum_seconds": 0.0012,
//!                                    "buckets": [{"le_seconds": 1.6e-05, "count": 0}, ...]}},
//!               "write": {...}, "write_zeroes": {...}, "trim": {...}, "flush": {...},
//!               "block_status": {...}, "cache": {...}},
//!  "errors": {"EPERM": 0, "EIO": 0, ...},
//!  "connections": {"attached": 1, "total": 3},
//!  "caches": {"l2": {"hits": 7, "misses": 2, "evictions": 0, "dirty_bytes": 0,
//!                    "memory_bytes": 131072},
//!             "refcount": {...}}}
//! ```
//!
//! Latency buckets are cumulative like Prometheus' (requests at or below the bound); the
//! last, unbounded one is `requests` itself.

use nbd_proto::Errno;
use qcow2::engine::MetaCacheCounters;
use serde_json::{json, Map, Value};

use super::counters::{Command, CommandCounters, Counters};
use super::histogram::bound_seconds;

/// Every statistic in `c`.
pub fn counters(c: &Counters) -> Value {
    let commands: Map<String, Value> = Command::ALL
        .iter()
        .map(|&cmd| (cmd.name().to_owned(), command(c.command(cmd))))
        .collect();
    let errors: Map<String, Value> = Errno::ALL
        .iter()
        .map(|&e| (e.name().to_owned(), json!(c.errors_of(e))))
        .collect();
    json!({
        "commands": commands,
        "errors": errors,
        "connections": {"attached": c.attached, "total": c.connections},
        "caches": {"l2": cache(&c.caches.l2), "refcount": cache(&c.caches.refcount)},
    })
}

fn command(c: &CommandCounters) -> Value {
    let buckets: Vec<Value> = c
        .latency
        .cumulative()
        .iter()
        .enumerate()
        .map(|(i, n)| json!({"le_seconds": bound_seconds(i), "count": n}))
        .collect();
    json!({
        "requests": c.requests(),
        "bytes": c.bytes,
        "latency": {"sum_seconds": c.latency.sum_ns as f64 / 1e9, "buckets": buckets},
    })
}

fn cache(c: &MetaCacheCounters) -> Value {
    json!({
        "hits": c.hits,
        "misses": c.misses,
        "evictions": c.evictions,
        "dirty_bytes": c.dirty_bytes,
        "memory_bytes": c.memory_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::stats::{ExportStats, Gauges};
    use qcow2::engine::MetaCacheStats;
    use std::time::Duration;

    #[test]
    fn every_statistic_is_in_the_object() {
        let s = ExportStats::default();
        s.attached();
        s.record(Command::Write, 4096, Duration::from_micros(20), None);
        s.record(
            Command::Write,
            4096,
            Duration::from_micros(20),
            Some(Errno::Io),
        );
        let mut caches = MetaCacheStats::default();
        caches.refcount.misses = 2;
        let v = counters(&s.counters(Gauges {
            attached: 1,
            caches,
        }));
        let w = &v["commands"]["write"];
        assert_eq!(w["requests"], 2);
        assert_eq!(w["bytes"], 4096);
        assert_eq!(w["latency"]["buckets"][0]["count"], 0);
        assert_eq!(w["latency"]["buckets"][1]["count"], 2);
        assert_eq!(w["latency"]["buckets"][1]["le_seconds"], 32e-6);
        assert_eq!(w["latency"]["buckets"].as_array().unwrap().len(), 19);
        assert_eq!(v["commands"].as_object().unwrap().len(), 7);
        assert_eq!(v["commands"]["block_status"]["requests"], 0);
        assert_eq!(v["errors"]["EIO"], 1);
        assert_eq!(v["errors"]["ENOSPC"], 0);
        assert_eq!(v["errors"].as_object().unwrap().len(), 8);
        assert_eq!(v["connections"]["attached"], 1);
        assert_eq!(v["connections"]["total"], 1);
        assert_eq!(v["caches"]["refcount"]["misses"], 2);
        assert_eq!(v["caches"]["l2"]["memory_bytes"], 0);
    }
}
