//! The server's multi-threaded path against a model: several threads drive one qcow2 image
//! through `nbd_server::remote` at once (as `serve --threads` does), each in its own region
//! with its own random mix of writes, FUA writes, zeroing, trims, reads and flushes, checking
//! every read against what it wrote. Afterwards the whole image must read as the union of the
//! models, in the engine and in QEMU, and `qemu-img check` must find it clean.

use super::image_export::{DiscardMode, ExportPolicy, ImageExport, Payload};
use nbd_server::remote::{dispatch, Remote};
use nbd_server::{Export, ReadChunk, WriteZeroesFlags};
use qcow2::engine::{Image, OpenOptions};
use std::path::Path;
use std::process::Command;
use std::rc::Rc;
use storage::{Aio, FileOpener, Locking};
use test_support::Rng;

const THREADS: u64 = 3;
const REGION: u64 = 3 << 20;
const OPS: usize = 250;
const MAX_LEN: u64 = 160 << 10;

/// What one region must read as: `None` where a trim left the contents unspecified.
type Model = Vec<Option<u8>>;

fn bytes_of(chunks: Vec<ReadChunk<Payload>>) -> Vec<u8> {
    let mut out = Vec::new();
    for c in chunks {
        match c {
            ReadChunk::Data(b) => out.extend_from_slice(&b.0),
            ReadChunk::Hole(n) => out.resize(out.len() + n, 0),
        }
    }
    out
}

fn assert_matches(model: &[Option<u8>], got: &[u8], what: &str) {
    assert_eq!(model.len(), got.len(), "{what}: length");
    for (i, (m, g)) in model.iter().zip(got).enumerate() {
        if let Some(m) = m {
            assert_eq!(m, g, "{what}: byte {i:#x} of the range");
        }
    }
}

/// One client thread's work on `[base, base + REGION)`; returns its model of the region.
async fn client(remote: Remote<Payload>, base: u64, seed: u64) -> Model {
    let mut rng = Rng(seed);
    let mut model: Model = vec![Some(0); REGION as usize];
    for op in 0..OPS {
        let len = 1 + rng.below(MAX_LEN);
        let off = rng.below(REGION - len + 1);
        let (lo, hi) = (off as usize, (off + len) as usize);
        let what = format!("seed {seed} op {op} at {:#x}+{len:#x}", base + off);
        match rng.below(10) {
            0..=3 => {
                let byte = (rng.below(255) + 1) as u8;
                let mut data = remote.alloc(len as usize);
                data.0.fill(byte);
                let fua = rng.below(4) == 0;
                remote.write(base + off, data, fua).await.expect(&what);
                model[lo..hi].fill(Some(byte));
            }
            4 => {
                let flags = WriteZeroesFlags {
                    may_unmap: rng.below(2) == 0,
                    fast: false,
                    fua: rng.below(4) == 0,
                };
                remote
                    .write_zeroes(base + off, len, flags)
                    .await
                    .expect(&what);
                model[lo..hi].fill(Some(0));
            }
            5 => {
                remote.trim(base + off, len, false).await.expect(&what);
                model[lo..hi].fill(None);
            }
            6 => remote.flush().await.expect(&what),
            _ => {
                let got = bytes_of(remote.read(base + off, len as usize).await.expect(&what));
                assert_matches(&model[lo..hi], &got, &what);
            }
        }
    }
    model
}

/// Runs [`THREADS`] clients at once against the image at `path`, all through one dispatcher
/// on this thread; returns their models, region by region.
fn drive(path: &Path, seed: u64) -> Vec<Model> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        let opener = FileOpener {
            aio: Aio::IoUring,
            direct: false,
            locking: Locking::Off,
        };
        let image = Image::open(&opener, path, &OpenOptions::default())
            .await
            .expect("open the image");
        let policy = ExportPolicy {
            discard: DiscardMode::Unmap,
            multi_conn: true,
            ..ExportPolicy::default()
        };
        let export = Rc::new(ImageExport::new(image.clone(), policy));
        let (handle, done) = dispatch(Rc::clone(&export));
        let mut waiting = Vec::new();
        let mut threads = Vec::new();
        for t in 0..THREADS {
            let remote = Remote::from(handle.clone());
            let (tx, rx) = tokio::sync::oneshot::channel();
            threads.push(std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap();
                let model = rt.block_on(client(remote, t * REGION, seed * 100 + t));
                let _ = tx.send(());
                model
            }));
            waiting.push(rx);
        }
        drop(handle);
        // Serve the clients' calls until each is done (or has panicked).
        for rx in waiting {
            let _ = rx.await;
        }
        let models: Vec<Model> = threads
            .into_iter()
            .map(|t| t.join().expect("a client thread failed"))
            .collect();
        tokio::time::timeout(std::time::Duration::from_secs(30), done)
            .await
            .expect("the dispatcher ends once its handles are gone")
            .unwrap();
        let all = bytes_of(export.read(0, (THREADS * REGION) as usize).await.unwrap());
        for (t, model) in models.iter().enumerate() {
            let r = t * REGION as usize..(t + 1) * REGION as usize;
            assert_matches(model, &all[r], &format!("seed {seed}, region {t}, engine"));
        }
        drop(export);
        image.close().await.expect("close the image");
        models
    })
}

fn qemu_img(args: &[&str]) {
    let out = Command::new("qemu-img")
        .args(args)
        .output()
        .expect("run qemu-img (install qemu-utils)");
    assert!(
        out.status.success(),
        "qemu-img {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn model_run(options: &str, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("img.qcow2");
    let p = path.to_str().unwrap();
    let size = (THREADS * REGION).to_string();
    qemu_img(&["create", "-q", "-f", "qcow2", "-o", options, p, &size]);
    let models = drive(&path, seed);
    qemu_img(&["check", p]);
    let raw = dir.path().join("img.raw");
    qemu_img(&[
        "convert",
        "-f",
        "qcow2",
        "-O",
        "raw",
        p,
        raw.to_str().unwrap(),
    ]);
    let all = std::fs::read(&raw).unwrap();
    for (t, model) in models.iter().enumerate() {
        let r = t * REGION as usize..(t + 1) * REGION as usize;
        assert_matches(model, &all[r], &format!("seed {seed}, region {t}, QEMU"));
    }
}

#[test]
fn clients_on_several_threads_agree_with_the_model_standard_l2() {
    for seed in 1..=2 {
        model_run("cluster_size=65536", seed);
    }
}

#[test]
fn clients_on_several_threads_agree_with_the_model_extended_l2() {
    for seed in 3..=4 {
        model_run("cluster_size=65536,extended_l2=on", seed);
    }
}

#[test]
fn clients_on_several_threads_agree_with_the_model_small_clusters() {
    model_run("cluster_size=4096,refcount_bits=1", 5);
}
