//! A temporary directory to make images in, with QEMU's tools run inside it.

use std::ffi::OsStr;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::tools::{
    assert_check_clean, assert_qemu_io_ok, assert_same_contents, create_image_with, qemu,
    qemu_io_with, run_ok, stdout,
};

/// A temporary directory (under $TMPDIR), removed when dropped. Tools run with it as their
/// working directory, so image names, and the backing names written into images, can be
/// short relative ones.
pub struct Dir {
    dir: tempfile::TempDir,
}

impl Default for Dir {
    fn default() -> Self {
        Self::new()
    }
}

impl Dir {
    /// A new temporary directory.
    pub fn new() -> Dir {
        Dir {
            dir: tempfile::tempdir().expect("create a temporary directory"),
        }
    }

    /// The directory itself.
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// `name` inside the directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `name` inside the directory, as a string.
    pub fn s(&self, name: &str) -> String {
        self.path(name)
            .to_str()
            .expect("UTF-8 temporary path")
            .to_owned()
    }

    /// Runs `program ARGS` in the directory, whatever its outcome.
    pub fn run(&self, program: impl AsRef<OsStr>, args: &[&str]) -> Output {
        let program = program.as_ref();
        Command::new(program)
            .args(args)
            .current_dir(self.root())
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {} ({e})", program.to_string_lossy()))
    }

    /// Runs `program ARGS` in the directory, which must succeed: its stdout.
    pub fn ok(&self, program: impl AsRef<OsStr>, args: &[&str]) -> String {
        stdout(&run_ok(
            Command::new(program)
                .args(args)
                .current_dir(self.root())
                .stdin(Stdio::null()),
        ))
    }

    /// `qemu-img ARGS` in the directory, which must succeed: its stdout.
    pub fn qemu_img(&self, args: &[&str]) -> String {
        stdout(&run_ok(
            qemu("qemu-img").current_dir(self.root()).args(args),
        ))
    }

    /// `qemu-img info --output=json IMAGE`.
    pub fn info(&self, image: &str) -> serde_json::Value {
        let json = self.qemu_img(&["info", "--output=json", image]);
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("qemu-img info JSON: {e}\n{json}"))
    }

    /// `qemu-img check --output=json IMAGE` (which must succeed).
    pub fn check_json(&self, image: &str) -> serde_json::Value {
        let json = self.qemu_img(&["check", "--output=json", image]);
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("qemu-img check JSON: {e}\n{json}"))
    }

    /// `qemu-io -f FMT -c CMD... IMAGE` in the directory; see [`crate::qemu_io`].
    pub fn qemu_io(&self, fmt: &str, image: &str, cmds: &[&str]) -> String {
        let mut cmd = qemu("qemu-io");
        cmd.current_dir(self.root());
        qemu_io_with(cmd, &["-f", fmt], OsStr::new(image), cmds)
    }

    /// Feeds `script` (one qemu-io command per line) to `qemu-io -f FMT IMAGE` on stdin, for
    /// more commands than a command line holds; every one must succeed.
    pub fn qemu_io_script(&self, fmt: &str, image: &str, script: &str) {
        let mut child = qemu("qemu-io")
            .args(["-f", fmt, image])
            .current_dir(self.root())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run qemu-io ({e})"));
        let mut stdin = child.stdin.take().expect("stdin");
        let script = script.to_string();
        // Write from another thread: qemu-io's output could otherwise fill its pipe and block.
        let writer = std::thread::spawn(move || {
            stdin
                .write_all(script.as_bytes())
                .expect("write qemu-io script");
        });
        let out = child.wait_with_output().expect("wait for qemu-io");
        writer.join().expect("script writer");
        assert!(
            out.status.success(),
            "qemu-io script on {image} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert_qemu_io_ok(&stdout(&out), OsStr::new(image), &"script");
    }

    /// `qemu-img create -q -f FMT [-o OPTS] [-b BACKING -F BFMT] NAME [SIZE]` in the
    /// directory (where a relative `data_file` option lands too), with `backing` another file
    /// of the directory recorded by its absolute path: the new image's path.
    pub fn create(
        &self,
        name: &str,
        fmt: &str,
        opts: &str,
        backing: Option<(&str, &str)>,
        size: &str,
    ) -> PathBuf {
        let backing = backing.map(|(file, bfmt)| (self.path(file), bfmt));
        let path = self.path(name);
        let mut cmd = qemu("qemu-img");
        cmd.current_dir(self.root());
        create_image_with(
            cmd,
            &path,
            fmt,
            opts,
            backing.as_ref().map(|(file, bfmt)| (file.as_path(), *bfmt)),
            size,
        );
        path
    }

    /// Copies file `from` to `to` in the directory: the new path.
    pub fn copy(&self, from: &str, to: &str) -> PathBuf {
        std::fs::copy(self.path(from), self.path(to))
            .unwrap_or_else(|e| panic!("copy {from} to {to}: {e}"));
        self.path(to)
    }

    /// The bytes of file `name`.
    pub fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.path(name)).unwrap_or_else(|e| panic!("read {name}: {e}"))
    }

    /// Bytes file `name` occupies on disk (what `du` counts).
    pub fn disk_usage(&self, name: &str) -> u64 {
        std::fs::metadata(self.path(name))
            .unwrap_or_else(|e| panic!("stat {name}: {e}"))
            .blocks()
            * 512
    }

    /// [`crate::assert_check_clean`] of image `name`.
    pub fn assert_check_clean(&self, name: &str) {
        assert_check_clean(&self.path(name));
    }

    /// [`crate::assert_same_contents`] of images `a` and `b`.
    pub fn assert_same_contents(&self, a: &str, a_fmt: &str, b: &str, b_fmt: &str) {
        assert_same_contents(&self.path(a), a_fmt, &self.path(b), b_fmt);
    }
}
