//! The statistics as Prometheus text (exposition format 0.0.4), written by the Prometheus
//! project's `prometheus-client` from a [`Snapshot`] taken at the scrape.
//!
//! Every family comes twice: `qcow2_nbd_export_*` with an `export` label per export, and
//! `qcow2_nbd_*` without it for the whole server. The server's series are kept rather than
//! left to `sum()`: they include exports removed since, so they never go back.

use std::fmt;

use nbd_proto::Errno;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use qcow2::engine::MetaCacheCounters;

use super::counters::{Command, CommandCounters, Counters};
use super::histogram::{bound_seconds, FINITE_BUCKETS};
use super::registry::Snapshot;

/// The `Content-Type` of the text.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// The text for `snapshot`.
pub fn render(snapshot: Snapshot) -> Result<String, fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(SnapshotCollector(snapshot)));
    let mut out = String::new();
    prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)?;
    Ok(out)
}

#[derive(Debug)]
struct SnapshotCollector(Snapshot);

type Labels = Vec<(&'static str, String)>;

/// A cache family: name suffix, help, kind, and the number it shows.
type CacheFamily = (
    &'static str,
    &'static str,
    MetricType,
    fn(&MetaCacheCounters) -> u64,
);

/// One set of series: its labels (none, or the export's) and its numbers.
type Set<'a> = (Labels, &'a Counters);

impl Collector for SnapshotCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let exports: Vec<Set<'_>> = self
            .0
            .exports
            .iter()
            .map(|(name, c)| (vec![("export", name.clone())], c))
            .collect();
        families(&mut enc, "qcow2_nbd_export", "this export", &exports)?;
        families(
            &mut enc,
            "qcow2_nbd",
            "all exports",
            &[(Vec::new(), &self.0.total)],
        )?;
        let n = u64::try_from(self.0.exports.len()).unwrap_or(u64::MAX);
        scalar(
            &mut enc,
            "qcow2_nbd_exports",
            "Exports served now.",
            MetricType::Gauge,
            &[(Vec::new(), n)],
        )
    }
}

fn with(labels: &Labels, key: &'static str, value: &str) -> Labels {
    let mut l = labels.clone();
    l.push((key, value.to_owned()));
    l
}

/// Every family of `sets`, named `prefix_*`; `whose` completes the help texts.
fn families(
    enc: &mut DescriptorEncoder,
    prefix: &str,
    whose: &str,
    sets: &[Set<'_>],
) -> fmt::Result {
    let counter = MetricType::Counter;
    let per_command = |f: fn(&CommandCounters) -> u64| -> Vec<(Labels, u64)> {
        sets.iter()
            .flat_map(|(l, c)| {
                Command::ALL.map(|cmd| (with(l, "command", cmd.name()), f(c.command(cmd))))
            })
            .collect()
    };
    let help = format!("NBD requests finished by {whose}, failed ones included.");
    scalar(
        enc,
        &format!("{prefix}_requests"),
        &help,
        counter,
        &per_command(CommandCounters::requests),
    )?;
    let help = format!("Bytes covered by the successful requests of {whose}.");
    scalar(
        enc,
        &format!("{prefix}_bytes"),
        &help,
        counter,
        &per_command(|c| c.bytes),
    )?;
    let errors: Vec<(Labels, u64)> = sets
        .iter()
        .flat_map(|(l, c)| Errno::ALL.map(|e| (with(l, "errno", e.name()), c.errors_of(e))))
        .collect();
    let help = format!("Requests {whose} failed, by the NBD error sent.");
    scalar(enc, &format!("{prefix}_errors"), &help, counter, &errors)?;
    latency(enc, prefix, whose, sets)?;
    let attached: Vec<(Labels, u64)> = sets.iter().map(|(l, c)| (l.clone(), c.attached)).collect();
    let help =
        format!("Connections attached to {whose} now (in transmission or waiting for a slot).");
    scalar(
        enc,
        &format!("{prefix}_clients"),
        &help,
        MetricType::Gauge,
        &attached,
    )?;
    let total: Vec<(Labels, u64)> = sets
        .iter()
        .map(|(l, c)| (l.clone(), c.connections))
        .collect();
    let help = format!("Connections that selected {whose}.");
    scalar(
        enc,
        &format!("{prefix}_connections"),
        &help,
        counter,
        &total,
    )?;
    caches(enc, prefix, whose, sets)
}

/// One counter or gauge family.
fn scalar(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: &[(Labels, u64)],
) -> fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in rows {
        let mut sample = m.encode_family(labels)?;
        match kind {
            MetricType::Counter => sample.encode_counter::<NoLabelSet, _, u64>(v, None)?,
            _ => sample.encode_gauge(v)?,
        }
    }
    Ok(())
}

fn latency(
    enc: &mut DescriptorEncoder,
    prefix: &str,
    whose: &str,
    sets: &[Set<'_>],
) -> fmt::Result {
    let name = format!("{prefix}_request_duration_seconds");
    let help = format!("Time {whose} took to carry out a request.");
    let mut m = enc.encode_descriptor(&name, &help, None, MetricType::Histogram)?;
    for (l, c) in sets {
        for cmd in Command::ALL {
            let h = &c.command(cmd).latency;
            let mut buckets: Vec<(f64, u64)> = (0..FINITE_BUCKETS)
                .map(|i| (bound_seconds(i), h.buckets[i]))
                .collect();
            buckets.push((f64::INFINITY, h.buckets[FINITE_BUCKETS]));
            let labels = with(l, "command", cmd.name());
            m.encode_family(&labels)?.encode_histogram::<NoLabelSet>(
                h.sum_ns as f64 / 1e9,
                h.count(),
                &buckets,
                None,
            )?;
        }
    }
    Ok(())
}

fn caches(enc: &mut DescriptorEncoder, prefix: &str, whose: &str, sets: &[Set<'_>]) -> fmt::Result {
    let rows = |f: fn(&MetaCacheCounters) -> u64| -> Vec<(Labels, u64)> {
        sets.iter()
            .flat_map(|(l, c)| {
                [("l2", &c.caches.l2), ("refcount", &c.caches.refcount)]
                    .map(|(cache, m)| (with(l, "cache", cache), f(m)))
            })
            .collect()
    };
    let families: [CacheFamily; 5] = [
        (
            "cache_hits",
            "Metadata cache lookups answered from memory",
            MetricType::Counter,
            |m| m.hits,
        ),
        (
            "cache_misses",
            "Metadata cache lookups that read the file",
            MetricType::Counter,
            |m| m.misses,
        ),
        (
            "cache_evictions",
            "Metadata cache entries dropped for room",
            MetricType::Counter,
            |m| m.evictions,
        ),
        (
            "cache_dirty_bytes",
            "Metadata cache bytes not yet written back",
            MetricType::Gauge,
            |m| m.dirty_bytes,
        ),
        (
            "cache_memory_bytes",
            "Metadata cache bytes in use",
            MetricType::Gauge,
            |m| m.memory_bytes,
        ),
    ];
    for (suffix, help, kind, f) in families {
        let help = format!("{help}, {whose}.");
        scalar(enc, &format!("{prefix}_{suffix}"), &help, kind, &rows(f))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::stats::{ExportStats, Gauges};
    use qcow2::engine::MetaCacheStats;
    use std::time::Duration;

    fn sample<'a>(text: &'a str, series: &str) -> &'a str {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
    }

    #[test]
    fn the_text_has_typed_families_per_export_and_in_total() {
        let a = ExportStats::default();
        a.attached();
        a.record(Command::Read, 65536, Duration::from_micros(10), None);
        a.record(Command::Read, 65536, Duration::from_micros(100), None);
        a.record(
            Command::Write,
            4096,
            Duration::from_secs(9),
            Some(Errno::NoSpc),
        );
        let mut caches = MetaCacheStats::default();
        caches.l2.hits = 4;
        let a = a.counters(Gauges {
            attached: 1,
            caches,
        });
        let b = ExportStats::default().counters(Gauges::default());
        let mut total = a;
        total.add(&b);
        let text = render(Snapshot {
            exports: vec![("a".into(), a), ("we\"ird\\".into(), b)],
            total,
        })
        .unwrap();
        assert!(text.contains("# TYPE qcow2_nbd_export_requests_total counter\n"));
        assert!(text.contains("# TYPE qcow2_nbd_export_request_duration_seconds histogram\n"));
        assert!(text.contains("# TYPE qcow2_nbd_export_clients gauge\n"));
        assert!(text.contains("# TYPE qcow2_nbd_cache_memory_bytes gauge\n"));
        let s = |series: &str| sample(&text, series);
        assert_eq!(
            s(r#"qcow2_nbd_export_requests_total{export="a",command="read"}"#),
            "2"
        );
        assert_eq!(
            s(r#"qcow2_nbd_export_bytes_total{export="a",command="read"}"#),
            "131072"
        );
        assert_eq!(
            s(r#"qcow2_nbd_export_bytes_total{export="a",command="write"}"#),
            "0"
        );
        assert_eq!(
            s(r#"qcow2_nbd_export_errors_total{export="a",errno="ENOSPC"}"#),
            "1"
        );
        assert_eq!(
            s(r#"qcow2_nbd_export_requests_total{export="we\"ird\\",command="read"}"#),
            "0"
        );
        assert_eq!(s(r#"qcow2_nbd_requests_total{command="read"}"#), "2");
        assert_eq!(s(r#"qcow2_nbd_export_clients{export="a"}"#), "1");
        assert_eq!(s(r#"qcow2_nbd_connections_total"#), "1");
        assert_eq!(
            s(r#"qcow2_nbd_export_cache_hits_total{export="a",cache="l2"}"#),
            "4"
        );
        assert_eq!(s(r#"qcow2_nbd_exports"#), "2");
        let h = "qcow2_nbd_export_request_duration_seconds";
        assert_eq!(
            s(&format!(
                r#"{h}_bucket{{export="a",command="read",le="1.6e-05"}}"#
            )),
            "1"
        );
        assert_eq!(
            s(&format!(
                r#"{h}_bucket{{export="a",command="read",le="0.000128"}}"#
            )),
            "2"
        );
        assert_eq!(
            s(&format!(
                r#"{h}_bucket{{export="a",command="write",le="4.194304"}}"#
            )),
            "0"
        );
        assert_eq!(
            s(&format!(
                r#"{h}_bucket{{export="a",command="write",le="+Inf"}}"#
            )),
            "1"
        );
        assert_eq!(
            s(&format!(r#"{h}_count{{export="a",command="read"}}"#)),
            "2"
        );
        assert_eq!(
            s(&format!(r#"{h}_sum{{export="a",command="read"}}"#)),
            "0.00011"
        );
    }
}
