//! Helpers of the engine's integration tests: ways to open and read images through the
//! engine (QEMU's tools and the runtime come from test_support).

use qcow2::engine::{Image, OpenOptions, ReadPart};
use qcow2::format::GuestOffset;
use std::cell::RefCell;
use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use storage::{Aio, AnyStorage, FaultStorage, FileOpener, MemStorage, Opener};

/// A file opener with the given backend.
pub fn opener(aio: Aio) -> FileOpener {
    FileOpener {
        aio,
        direct: false,
        // No image locks: see the note on test processes in storage::lock.
        locking: storage::Locking::Off,
    }
}

/// Opens `path` read-only through the engine.
pub async fn open_ro(path: &Path, aio: Aio) -> Image<AnyStorage> {
    let opts = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    Image::open(&opener(aio), path, &opts)
        .await
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

/// Reads the whole disk in `chunk`-byte requests.
pub async fn read_all(img: &Image<AnyStorage>, chunk: usize) -> Vec<u8> {
    let size = img.size();
    let mut out = Vec::with_capacity(size as usize);
    let mut pos = 0u64;
    while pos < size {
        let n = chunk.min((size - pos) as usize);
        let buf = img
            .read(GuestOffset(pos), n)
            .await
            .unwrap_or_else(|e| panic!("read at {pos:#x}: {e}"));
        out.extend_from_slice(&buf);
        pos += n as u64;
    }
    out
}

/// Reads the whole disk in `chunk`-byte sparse reads (holes as zeros), checking that every
/// hole is something block status calls zero; returns the bytes and how many were holes.
pub async fn read_all_sparse(img: &Image<AnyStorage>, chunk: usize) -> (Vec<u8>, u64) {
    let size = img.size();
    let mut out = Vec::with_capacity(size as usize);
    let mut holes = 0u64;
    let mut pos = 0u64;
    while pos < size {
        let n = chunk.min((size - pos) as usize);
        let parts = img
            .read_sparse(GuestOffset(pos), n)
            .await
            .unwrap_or_else(|e| panic!("sparse read at {pos:#x}: {e}"));
        let mut at = pos;
        for part in parts {
            match part {
                ReadPart::Data(buf) => {
                    out.extend_from_slice(&buf);
                    at += buf.len() as u64;
                }
                ReadPart::Hole(len) => {
                    for e in img.block_status(GuestOffset(at), len as u64).await.unwrap() {
                        assert!(
                            e.zero,
                            "hole at {:#x}+{:#x} is not zero: {e:?}",
                            e.start, e.len
                        );
                    }
                    out.resize(out.len() + len, 0);
                    at += len as u64;
                    holes += len as u64;
                }
            }
        }
        assert_eq!(
            at,
            pos + n as u64,
            "sparse read at {pos:#x} covers {:#x}",
            at - pos
        );
        pos += n as u64;
    }
    (out, holes)
}

/// Paths to fault-injecting storages, so the engine can open an image and its backing files.
#[derive(Clone, Default)]
pub struct FaultFs(pub Rc<RefCell<HashMap<PathBuf, FaultStorage<MemStorage>>>>);

impl Opener for FaultFs {
    type Storage = FaultStorage<MemStorage>;
    async fn open(&self, path: &Path, _: storage::OpenOptions) -> io::Result<Self::Storage> {
        self.0
            .borrow()
            .get(path)
            .cloned()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }
}

/// The crash plans a campaign tries after each failing operation, by index: nothing
/// unflushed survives (0), everything does (1), then random subsets with torn writes.
pub fn crash_plan(
    k: usize,
    handle: &FaultStorage<MemStorage>,
    rng: &mut test_support::Rng,
) -> storage::CrashPlan {
    match k {
        0 => storage::CrashPlan::mask(&[]),
        1 => storage::CrashPlan::mask(&vec![true; handle.unflushed_ops()]),
        _ => storage::CrashPlan::Random {
            seed: rng.next_u64(),
            tear: true,
        },
    }
}

/// `qemu-img check ARGS` of an image holding `image`, written to `dir/top.qcow2` (files it
/// refers to, such as a backing file, already in `dir`): (exit code, stdout, stderr).
pub fn qemu_check(dir: &Path, image: &[u8], args: &[&str]) -> (Option<i32>, String, String) {
    let p = dir.join("top.qcow2");
    std::fs::write(&p, image).expect("write the image to check");
    let out = test_support::qemu("qemu-img")
        .arg("check")
        .args(args)
        .arg(&p)
        .output()
        .expect("run qemu-img check");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// Asserts that `qemu-img check` finds nothing worse than leaks in `image` (exit 0 or 3).
pub fn assert_qemu_check_at_most_leaks(dir: &Path, image: &[u8], what: &str) {
    let (code, out, err) = qemu_check(dir, image, &[]);
    assert!(
        matches!(code, Some(0) | Some(3)),
        "{what}: qemu-img check exited {code:?}: {out}{err}"
    );
}
