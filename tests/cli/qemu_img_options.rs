//! qemu-img's options, side by side: the same command line through qemu-img and through our
//! binary invoked as `qemu-img`, on copies of the same files, must exit the same way and
//! print the same lines on stdout and stderr.

use std::process::Output;

use test_support::Dir;

use crate::common::BIN;

/// Two directories with the same files: one for qemu-img, one for us (with a link named
/// `qemu-img` to our binary, so messages carry the same prefix).
pub struct Pair {
    pub qemu: Dir,
    pub ours: Dir,
}

impl Pair {
    /// Runs `setup` (with QEMU's tools, the same in both) in two new directories, so the
    /// files are the same, down to what they occupy on disk.
    pub fn new(setup: impl Fn(&Dir)) -> Pair {
        let (qemu, ours) = (Dir::new(), Dir::new());
        setup(&qemu);
        setup(&ours);
        std::os::unix::fs::symlink(BIN, ours.path("qemu-img")).expect("link the binary");
        Pair { qemu, ours }
    }

    /// `qemu-img ARGS` in both directories: (QEMU's, ours).
    pub fn run(&self, args: &[&str]) -> (Output, Output) {
        let q = test_support::qemu("qemu-img")
            .args(args)
            .current_dir(self.qemu.root())
            .output()
            .expect("run qemu-img");
        let o = self.ours.run(self.ours.path("qemu-img"), args);
        (q, o)
    }

    /// Runs `args` in both and asserts the same exit code, stdout and stderr, with the
    /// directories' paths taken out.
    pub fn same(&self, args: &[&str]) -> Output {
        let (q, o) = self.run(args);
        let clean = |d: &Dir, b: &[u8]| {
            String::from_utf8_lossy(b).replace(d.root().to_str().expect("UTF-8 path"), "DIR")
        };
        let (qo, oo) = (clean(&self.qemu, &q.stdout), clean(&self.ours, &o.stdout));
        let (qe, oe) = (clean(&self.qemu, &q.stderr), clean(&self.ours, &o.stderr));
        assert_eq!(
            (o.status.code(), &oo, &oe),
            (q.status.code(), &qo, &qe),
            "qemu-img {args:?}: ours (left) and QEMU's (right) differ"
        );
        o
    }
}

/// A qcow2 image with data and a raw file, for the format options.
fn images(d: &Dir) {
    d.create("a.qcow2", "qcow2", "", None, "64M");
    d.qemu_io("qcow2", "a.qcow2", &["write -P 0x5a 1M 64k"]);
    d.create("r.raw", "raw", "", None, "1M");
}

#[test]
fn check_takes_the_format() {
    let p = Pair::new(images);
    for args in [
        &["check", "-f", "qcow2", "a.qcow2"][..],
        &["check", "-f", "raw", "r.raw"],
        &["check", "-f", "raw", "a.qcow2"],
        &["check", "-f", "qcow2", "r.raw"],
        &["check", "-f", "nosuchfmt", "a.qcow2"],
        &["check", "-f", "raw", "missing"],
        &["check", "missing"],
        &["check", "r.raw"],
        &["check", "--output=json", "-f", "qcow2", "a.qcow2"],
    ] {
        p.same(args);
    }
}

#[test]
fn info_takes_the_format() {
    let p = Pair::new(images);
    for args in [
        &["info", "-f", "qcow2", "a.qcow2"][..],
        &["info", "-f", "raw", "r.raw"],
        &["info", "r.raw"],
        &["info", "-f", "qcow2", "r.raw"],
        &["info", "-f", "nosuchfmt", "a.qcow2"],
    ] {
        p.same(args);
    }
}

/// qemu-img announces an image ("Formatting ...") before its driver checks the settings, so
/// a refused combination prints the line and then the reason.
#[test]
fn create_prints_the_formatting_line_before_refusing() {
    let p = Pair::new(|_| {});
    for opts in [
        "refcount_bits=0",
        "refcount_bits=128",
        "cluster_size=1000",
        "compat=0.10,lazy_refcounts=on",
        "compat=0.10,extended_l2=on",
        "extended_l2=on,cluster_size=4k",
    ] {
        p.same(&["create", "-f", "qcow2", "-o", opts, "x.qcow2", "64M"]);
    }
    p.same(&[
        "create",
        "-f",
        "raw",
        "-o",
        "preallocation=metadata",
        "r",
        "1M",
    ]);
}
