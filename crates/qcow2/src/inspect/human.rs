//! The human-readable `info` output, laid out like `qemu-img info`.

use std::fmt::Write;

use super::report::{ChildInfo, ImageInfo, Qcow2Specific, SnapshotInfo, SpecificData};

/// Formats a byte count like QEMU's `size_to_str`: three significant digits and a binary
/// unit, switching unit once the value reaches 1000 of the smaller one (e.g. `1.29 MiB`).
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    // The unit is the largest 1024^i not exceeding bytes * 1024 / 1000, so that 1000 KiB
    // prints as 0.977 MiB rather than 1e+03 KiB.
    let scaled = bytes as f64 * 1024.0 / 1000.0;
    let mut i = 0usize;
    while i + 1 < UNITS.len() && scaled >= (1u64 << (10 * (i + 1))) as f64 {
        i += 1;
    }
    let value = bytes as f64 / (1u64 << (10 * i)) as f64;
    format!("{} {}", three_significant(value), UNITS[i])
}

/// C's `%0.3g`: three significant digits, trailing zeros dropped (values here are < 1000,
/// so the exponential form never applies).
fn three_significant(v: f64) -> String {
    // The exponent after rounding to three digits decides the decimals, as in C.
    let sci = format!("{v:.2e}");
    let exp: i32 = sci
        .split_once('e')
        .and_then(|(_, e)| e.parse().ok())
        .unwrap_or(0);
    let decimals = usize::try_from(2 - exp).unwrap_or(0);
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

/// Formats seconds since the epoch as `YYYY-MM-DD HH:MM:SS` in UTC.
fn format_date(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm), valid for any u32 second count.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// The snapshot table as `qemu-img info` and `qemu-img snapshot -l` print it: a title,
/// column heads and one line per snapshot.
pub fn snapshot_list(snapshots: &[SnapshotInfo]) -> String {
    let mut out = String::from("Snapshot list:\n");
    let _ = writeln!(
        out,
        "{:<7} {:<17} {:>7} {:>19} {:>15} {:>10}",
        "ID", "TAG", "VM_SIZE", "DATE", "VM_CLOCK", "ICOUNT"
    );
    for s in snapshots {
        snapshot_line(&mut out, s);
    }
    out
}

fn snapshot_line(out: &mut String, s: &SnapshotInfo) {
    let secs = s.vm_clock_sec;
    let clock = format!(
        "{:04}:{:02}:{:02}.{:03}",
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        s.vm_clock_nsec / 1_000_000
    );
    // QEMU prints "--" for a snapshot without an instruction count.
    let icount = s.icount.map_or_else(|| "--".to_string(), |i| i.to_string());
    let _ = writeln!(
        out,
        "{:<7} {:<17} {:>7} {:>19} {:>15} {:>10}",
        s.id,
        s.name,
        human_size(s.vm_state_size),
        format_date(s.date_sec),
        clock,
        icount
    );
}

fn specific(out: &mut String, d: &Qcow2Specific) {
    let mut line = |key: &str, value: &dyn std::fmt::Display| {
        let _ = writeln!(out, "    {key}: {value}");
    };
    line("compat", &d.compat);
    line("compression type", &d.compression_type);
    if let Some(v) = d.lazy_refcounts {
        line("lazy refcounts", &v);
    }
    if let Some(bitmaps) = &d.bitmaps {
        let _ = writeln!(out, "    bitmaps:");
        for (i, b) in bitmaps.iter().enumerate() {
            let _ = writeln!(out, "        [{i}]:");
            let _ = writeln!(out, "            flags:");
            for (j, f) in b.flags.iter().enumerate() {
                let _ = writeln!(out, "                [{j}]: {f}");
            }
            let _ = writeln!(out, "            name: {}", b.name);
            let _ = writeln!(out, "            granularity: {}", b.granularity);
        }
    }
    let mut line = |key: &str, value: &dyn std::fmt::Display| {
        let _ = writeln!(out, "    {key}: {value}");
    };
    line("refcount bits", &d.refcount_bits);
    if let Some(e) = &d.encrypt {
        let _ = writeln!(out, "    encrypt:");
        encrypt(out, e, "        ");
    }
    let mut line = |key: &str, value: &dyn std::fmt::Display| {
        let _ = writeln!(out, "    {key}: {value}");
    };
    if let Some(v) = &d.data_file {
        line("data file", v);
    }
    if let Some(v) = d.data_file_raw {
        line("data file raw", &v);
    }
    if let Some(v) = d.corrupt {
        line("corrupt", &v);
    }
    if let Some(v) = d.extended_l2 {
        line("extended l2", &v);
    }
}

fn child(out: &mut String, c: &ChildInfo) {
    let i = &c.info;
    let _ = writeln!(out, "Child node '/{}':", c.name);
    let _ = writeln!(out, "    filename: {}", i.filename);
    let _ = writeln!(out, "    protocol type: {}", i.format);
    let _ = writeln!(
        out,
        "    file length: {} ({} bytes)",
        human_size(i.virtual_size),
        i.virtual_size
    );
    let disk = i
        .actual_size
        .map_or_else(|| "unavailable".to_owned(), human_size);
    let _ = writeln!(out, "    disk size: {disk}");
}

impl ImageInfo {
    /// Renders the report the way `qemu-img info` prints it.
    pub fn to_human(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "image: {}", self.filename);
        let _ = writeln!(out, "file format: {}", self.format);
        let _ = writeln!(
            out,
            "virtual size: {} ({} bytes)",
            human_size(self.virtual_size),
            self.virtual_size
        );
        let disk = self
            .actual_size
            .map_or_else(|| "unavailable".to_owned(), human_size);
        let _ = writeln!(out, "disk size: {disk}");
        if self.encrypted == Some(true) {
            let _ = writeln!(out, "encrypted: yes");
        }
        if let Some(cs) = self.cluster_size {
            let _ = writeln!(out, "cluster_size: {cs}");
        }
        if self.dirty_flag == Some(true) {
            let _ = writeln!(out, "cleanly shut down: no");
        }
        if let Some(name) = &self.backing_filename {
            let _ = write!(out, "backing file: {name}");
            match &self.full_backing_filename {
                None => {
                    let _ = write!(out, " (cannot determine actual path)");
                }
                Some(full) if full != name => {
                    let _ = write!(out, " (actual path: {full})");
                }
                Some(_) => {}
            }
            out.push('\n');
        }
        if let Some(fmt) = &self.backing_filename_format {
            let _ = writeln!(out, "backing file format: {fmt}");
        }
        if let Some(snapshots) = &self.snapshots {
            out.push_str(&snapshot_list(snapshots));
        }
        if let Some(fs) = &self.format_specific {
            let _ = writeln!(out, "Format specific information:");
            match &fs.data {
                SpecificData::Qcow2(d) => specific(&mut out, d),
                SpecificData::Luks(e) => encrypt(&mut out, e, "    "),
            }
        }
        for c in &self.children {
            child(&mut out, c);
        }
        out
    }
}

/// The LUKS facts (a qcow2 image's encrypt block, a LUKS volume's format-specific block),
/// in qemu-img's order, each line indented by `ind`.
fn encrypt(out: &mut String, e: &super::report::EncryptInfo, ind: &str) {
    let mut line = |key: &str, value: &dyn std::fmt::Display| {
        let _ = writeln!(out, "{ind}{key}: {value}");
    };
    if let Some(v) = &e.ivgen_alg {
        line("ivgen alg", v);
    }
    if let Some(v) = e.detached_header {
        line("detached header", &v);
    }
    if let Some(v) = &e.hash_alg {
        line("hash alg", v);
    }
    if let Some(v) = &e.cipher_alg {
        line("cipher alg", v);
    }
    if let Some(v) = &e.uuid {
        line("uuid", v);
    }
    if let Some(v) = &e.format {
        line("format", v);
    }
    if let Some(v) = &e.cipher_mode {
        line("cipher mode", v);
    }
    if let Some(slots) = &e.slots {
        let _ = writeln!(out, "{ind}slots:");
        for (i, s) in slots.iter().enumerate() {
            let _ = writeln!(out, "{ind}    [{i}]:");
            let _ = writeln!(out, "{ind}        active: {}", s.active);
            if let Some(n) = s.iters {
                let _ = writeln!(out, "{ind}        iters: {n}");
            }
            let _ = writeln!(out, "{ind}        key offset: {}", s.key_offset);
            if let Some(n) = s.stripes {
                let _ = writeln!(out, "{ind}        stripes: {n}");
            }
        }
    }
    let mut line = |key: &str, value: &dyn std::fmt::Display| {
        let _ = writeln!(out, "{ind}{key}: {value}");
    };
    if let Some(v) = e.payload_offset {
        line("payload offset", &v);
    }
    if let Some(v) = e.master_key_iters {
        line("master key iters", &v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_qemu_size_to_str() {
        // Expected strings are what qemu-img 10.0 prints for these sizes.
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(67_108_864), "64 MiB");
        assert_eq!(human_size(1_347_584), "1.29 MiB");
        assert_eq!(human_size(200_704), "196 KiB");
        assert_eq!(human_size(1_769_984), "1.69 MiB");
        assert_eq!(human_size(1_073_741_824), "1 GiB");
        assert_eq!(human_size(1000 * 1024), "0.977 MiB");
        assert_eq!(human_size(999), "999 B");
        assert_eq!(human_size(u64::MAX), "16 EiB");
        assert_eq!(human_size(10_235), "10 KiB");
    }

    #[test]
    fn dates_are_utc_civil_time() {
        assert_eq!(format_date(0), "1970-01-01 00:00:00");
        assert_eq!(format_date(1_795_315_716), "2026-11-22 02:48:36");
        assert_eq!(format_date(951_782_400), "2000-02-29 00:00:00");
    }
}
