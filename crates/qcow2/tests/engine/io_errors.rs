//! I/O errors that must not be lost: a failed fdatasync stays failed, and a full disk is
//! reported as ENOSPC while the image stays consistent.

use qcow2::format::GuestOffset;
use std::path::Path;

use qcow2::engine::{libc_errno, Image, OpenOptions};
use storage::{FaultStorage, InjectedError, IoBuf, MemStorage, OpKind};

use crate::support::FaultFs;
use test_support::{qemu_contents, run, Dir};

const MIB: usize = 1 << 20;

/// An image made by qemu-img, held in fault-injecting memory storage at `path`.
fn image(d: &Dir, opts: &str) -> (FaultFs, FaultStorage<MemStorage>, std::path::PathBuf) {
    let path = d.create("img.qcow2", "qcow2", opts, None, "16M");
    let st = FaultStorage::from_mem(MemStorage::from_bytes(&std::fs::read(&path).unwrap()));
    let fs = FaultFs::default();
    fs.0.borrow_mut().insert(path.clone(), st.clone());
    (fs, st, path)
}

async fn open_rw(fs: &FaultFs, path: &Path) -> Image<FaultStorage<MemStorage>> {
    Image::open(fs, path, &OpenOptions::default())
        .await
        .expect("open read-write")
}

fn data(byte: u8, len: usize) -> IoBuf {
    IoBuf::from_slice(&vec![byte; len])
}

#[test]
fn a_failed_fdatasync_fails_every_later_flush_and_leaves_the_image_dirty() {
    let d = Dir::new();
    let (fs, st, path) = image(&d, "lazy_refcounts=on");
    run(async {
        let img = open_rw(&fs, &path).await;
        let (r, _) = img.write(GuestOffset(0), data(1, 65536), false).await;
        r.unwrap();
        img.flush().await.expect("a healthy flush");

        let (r, _) = img
            .write(GuestOffset(MIB as u64), data(2, 65536), false)
            .await;
        r.unwrap();
        st.fail_nth(OpKind::Flush, 1, InjectedError::Eio);
        let err = img
            .flush()
            .await
            .expect_err("the injected fdatasync failure");
        assert_eq!(err.errno(), libc_errno::EIO, "{err}");

        // The disk is healthy again, but what the failed sync dropped cannot be known.
        st.clear_faults();
        let err = img.flush().await.expect_err("a later flush must fail too");
        assert_eq!(err.errno(), libc_errno::EIO, "{err}");
        assert!(
            err.to_string().contains("earlier fdatasync failed"),
            "{err}"
        );
        let (r, _) = img
            .write(GuestOffset(2 * MIB as u64), data(3, 4096), true)
            .await;
        let err = r.expect_err("a FUA write must fail as well");
        assert_eq!(err.errno(), libc_errno::EIO, "{err}");
        assert!(img.close().await.is_err(), "close cannot claim durability");
    });
    // The lazy-refcount dirty bit stays set, so the next open repairs the refcounts.
    let on_disk = st.inner().to_vec();
    let incompatible = u64::from_be_bytes(on_disk[72..80].try_into().unwrap());
    assert_eq!(incompatible & 1, 1, "the image was marked clean");
}

#[test]
fn a_full_disk_is_enospc_and_the_image_goes_on_serving() {
    let d = Dir::new();
    let (fs, st, path) = image(&d, "cluster_size=65536");
    run(async {
        let img = open_rw(&fs, &path).await;
        let (r, _) = img.write(GuestOffset(0), data(7, 65536), false).await;
        r.unwrap();
        img.flush().await.unwrap();

        // Every write fails with ENOSPC for a while: an allocating write is refused as such.
        st.fail_after(0, InjectedError::Enospc);
        let (r, _) = img
            .write(GuestOffset(4 * MIB as u64), data(8, 65536), false)
            .await;
        let err = r.expect_err("allocation on a full disk");
        assert_eq!(err.errno(), libc_errno::ENOSPC, "{err}");
        st.clear_faults();

        // Reads and writes that allocate nothing still work.
        let back = img.read(GuestOffset(0), 65536).await.unwrap();
        assert!(back.as_ref().iter().all(|&b| b == 7));
        let (r, _) = img.write(GuestOffset(0), data(9, 4096), false).await;
        r.expect("an overwrite of allocated data");
        img.flush().await.expect("flush after space returned");
        img.close().await.expect("close");
    });
    let out = d.path("after.qcow2");
    std::fs::write(&out, st.inner().to_vec()).unwrap();
    let check = std::process::Command::new("qemu-img")
        .args(["check", out.to_str().unwrap()])
        .output()
        .unwrap();
    // 0 clean, 3 leaked clusters only: never corruption.
    assert!(
        matches!(check.status.code(), Some(0 | 3)),
        "qemu-img check: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let contents = qemu_contents(&out, &[]);
    assert!(contents[..4096].iter().all(|&b| b == 9));
    assert!(contents[4096..65536].iter().all(|&b| b == 7));
    assert!(contents[4 * MIB..5 * MIB].iter().all(|&b| b == 0));
}
