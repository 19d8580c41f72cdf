//! Helpers of the `check` tests: byte patches that break real images in one precise way, and
//! `qemu-img check` as the oracle our checker must agree with (the images themselves come
//! from test_support's QEMU helpers).
//!
//! Needs qemu-img and qemu-io (Debian: qemu-utils); a missing tool fails the test with a
//! message saying so.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use qcow2::check::{self, CheckError, CheckOutcome, CheckReport, Finding, Repair};
use test_support::{qemu, Dir};

/// What `qemu-img check` said: its exit code, stdout and stderr, and the report parsed from
/// its JSON when it printed one.
#[derive(Debug)]
pub struct QemuCheck {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub report: Option<CheckReport>,
}

/// Parses qemu-img check's JSON into our report type (absent counts are zero).
pub fn parse_report(json: &str) -> Option<CheckReport> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let n = |k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
    Some(CheckReport {
        check_errors: n("check-errors"),
        corruptions: n("corruptions"),
        leaks: n("leaks"),
        corruptions_fixed: n("corruptions-fixed"),
        leaks_fixed: n("leaks-fixed"),
        image_end_offset: n("image-end-offset"),
        total_clusters: n("total-clusters"),
        allocated_clusters: n("allocated-clusters"),
        fragmented_clusters: n("fragmented-clusters"),
        compressed_clusters: n("compressed-clusters"),
    })
}

fn repair_arg(repair: Repair) -> Option<&'static str> {
    match repair {
        Repair::None => None,
        Repair::Leaks => Some("leaks"),
        Repair::All => Some("all"),
    }
}

/// `qemu-img check [-r ...] --output=human|json PATH`.
pub fn qemu_check(path: &Path, repair: Repair, json: bool) -> QemuCheck {
    let mut args = vec!["check"];
    if let Some(r) = repair_arg(repair) {
        args.extend(["-r", r]);
    }
    args.push(if json {
        "--output=json"
    } else {
        "--output=human"
    });
    args.push(path.to_str().unwrap());
    let out = qemu("qemu-img")
        .args(&args)
        .output()
        .expect("run qemu-img check");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    QemuCheck {
        code: out.status.code().unwrap_or(-1),
        report: if json { parse_report(&stdout) } else { None },
        stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Our check of the file at `path`, with every finding collected.
pub fn our_check(path: &Path, repair: Repair) -> (Result<CheckOutcome, CheckError>, Vec<Finding>) {
    let mut findings = Vec::new();
    let r = check::check_path(path, repair, storage::Locking::Auto, false, &mut |f| {
        findings.push(f)
    });
    (r, findings)
}

/// qemu-img's exit code for our result.
pub fn our_code(r: &Result<CheckOutcome, CheckError>) -> i32 {
    match r {
        Ok(o) => i32::from(o.report.exit_code()),
        Err(CheckError::NotQcow2 { .. }) => 63,
        Err(_) => 1,
    }
}

/// Checks (and with `repair`, repairs) two copies of `name`, one with qemu-img and one with
/// us, and asserts that both agree: the exit code, every count, and for repairs the repaired
/// files themselves are checked clean or equally broken afterwards. Returns QEMU's result.
pub fn assert_agree(dir: &Dir, name: &str, repair: Repair) -> QemuCheck {
    let tag = format!("{repair:?}").to_lowercase();
    let theirs = dir.copy(name, &format!("{name}.{tag}.qemu"));
    let ours = dir.copy(name, &format!("{name}.{tag}.ours"));
    let q = qemu_check(&theirs, repair, true);
    let (r, findings) = our_check(&ours, repair);
    let log: Vec<&str> = findings.iter().map(|f| f.message.as_str()).collect();
    assert_eq!(
        our_code(&r),
        q.code,
        "{name} -r {tag}: exit codes differ\nQEMU: {}{}\nours: {r:?}\n{}",
        q.stdout,
        q.stderr,
        log.join("\n")
    );
    if let (Ok(o), Some(qr)) = (&r, &q.report) {
        assert_eq!(
            &o.report,
            qr,
            "{name} -r {tag}: reports differ\nQEMU stderr:\n{}\nours:\n{}",
            q.stderr,
            log.join("\n")
        );
    }
    if repair != Repair::None && q.report.is_some() {
        // Both repaired files must now check the same way. Only the findings are compared:
        // opening an image read-write makes QEMU store its persistent bitmaps again, in new
        // clusters, which moves the image end without being part of the repair.
        let after_q = qemu_check(&theirs, Repair::None, true);
        let after_ours = qemu_check(&ours, Repair::None, true);
        let findings =
            |r: &Option<CheckReport>| r.as_ref().map(|r| (r.check_errors, r.corruptions, r.leaks));
        assert_eq!(
            (after_q.code, findings(&after_q.report)),
            (after_ours.code, findings(&after_ours.report)),
            "{name} -r {tag}: QEMU's check of the two repaired files differs\nafter QEMU's repair: {}{}\nafter ours: {}{}",
            after_q.stdout,
            after_q.stderr,
            after_ours.stdout,
            after_ours.stderr
        );
    }
    q
}

/// Reads and patches an image file in place.
pub struct Patch {
    file: File,
}

impl Patch {
    /// Opens `path` for patching.
    pub fn open(path: &Path) -> Patch {
        Patch {
            file: OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .expect("open image for patching"),
        }
    }

    /// Reads `n` bytes at `off`.
    pub fn bytes(&self, off: u64, n: usize) -> Vec<u8> {
        let mut b = vec![0; n];
        self.file.read_exact_at(&mut b, off).expect("read image");
        b
    }

    pub fn u16(&self, off: u64) -> u16 {
        u16::from_be_bytes(self.bytes(off, 2).try_into().unwrap())
    }

    pub fn u32(&self, off: u64) -> u32 {
        u32::from_be_bytes(self.bytes(off, 4).try_into().unwrap())
    }

    pub fn u64(&self, off: u64) -> u64 {
        u64::from_be_bytes(self.bytes(off, 8).try_into().unwrap())
    }

    /// Writes `b` at `off`.
    pub fn put(&self, off: u64, b: &[u8]) {
        self.file.write_all_at(b, off).expect("patch image");
    }

    pub fn put_u32(&self, off: u64, v: u32) {
        self.put(off, &v.to_be_bytes());
    }

    pub fn put_u64(&self, off: u64, v: u64) {
        self.put(off, &v.to_be_bytes());
    }

    pub fn cluster_bits(&self) -> u32 {
        self.u32(20)
    }

    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits()
    }

    pub fn l1_offset(&self) -> u64 {
        self.u64(40)
    }

    pub fn reftable_offset(&self) -> u64 {
        self.u64(48)
    }

    pub fn snapshots_offset(&self) -> u64 {
        self.u64(64)
    }

    pub fn refcount_order(&self) -> u32 {
        if self.u32(4) >= 3 {
            self.u32(96)
        } else {
            4
        }
    }

    pub fn extended_l2(&self) -> bool {
        self.u32(4) >= 3 && self.u64(72) & (1 << 4) != 0
    }

    /// Bytes per L2 entry.
    pub fn l2_entry_size(&self) -> u64 {
        if self.extended_l2() {
            16
        } else {
            8
        }
    }

    /// File offset of active L1 entry `i`.
    pub fn l1_entry_at(&self, i: u64) -> u64 {
        self.l1_offset() + 8 * i
    }

    /// The L2 table of active L1 entry `i`.
    pub fn l2_table(&self, i: u64) -> u64 {
        self.u64(self.l1_entry_at(i)) & 0x00ff_ffff_ffff_fe00
    }

    /// File offset of the L2 entry (first word) mapping guest offset `guest`.
    pub fn l2_entry_at(&self, guest: u64) -> u64 {
        let cb = self.cluster_bits();
        let l2_bits = cb - if self.extended_l2() { 4 } else { 3 };
        let l1 = guest >> (cb + l2_bits);
        let idx = (guest >> cb) & ((1 << l2_bits) - 1);
        let table = self.l2_table(l1);
        assert_ne!(table, 0, "guest offset {guest:#x} has no L2 table");
        table + idx * self.l2_entry_size()
    }

    /// File offset of the refcount block entry of host cluster `cluster` and the block.
    fn refcount_slot(&self, cluster: u64) -> (u64, u64) {
        let order = self.refcount_order();
        let entries = (self.cluster_size() * 8) >> order;
        let block = self.u64(self.reftable_offset() + 8 * (cluster / entries)) & !0x1ff;
        assert_ne!(block, 0, "cluster {cluster} has no refcount block");
        (block, cluster % entries)
    }

    /// The stored refcount of host cluster `cluster`.
    pub fn refcount(&self, cluster: u64) -> u64 {
        let (block, idx) = self.refcount_slot(cluster);
        let buf = self.bytes(block, self.cluster_size() as usize);
        qcow2::format::refcount::get(&buf, self.refcount_order(), idx as usize).unwrap()
    }

    /// Stores refcount `value` for host cluster `cluster`.
    pub fn set_refcount(&self, cluster: u64, value: u64) {
        let (block, idx) = self.refcount_slot(cluster);
        let mut buf = self.bytes(block, self.cluster_size() as usize);
        qcow2::format::refcount::set(&mut buf, self.refcount_order(), idx as usize, value).unwrap();
        self.put(block, &buf);
    }
}
