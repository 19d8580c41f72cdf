//! The qcow2 engine announces QEMU's blkdebug events to its file: a rule for an event fails
//! the requests that follow it, the operation reports the failure, and the image left
//! behind is never corrupt (leaks at worst).

use qcow2::format::GuestOffset;
use std::io;
use std::path::{Path, PathBuf};

use qcow2::engine::{libc_errno, Image, OpenOptions};
use storage::blkdebug::Rules;
use storage::{BlkdebugStorage, MemStorage, Opener};
use test_support::{run, Dir};

/// Opens one image (its bytes in memory) behind blkdebug rules.
struct RulesFs {
    path: PathBuf,
    image: MemStorage,
    rules: Rules,
}

impl Opener for RulesFs {
    type Storage = BlkdebugStorage<MemStorage>;
    async fn open(&self, path: &Path, _: storage::OpenOptions) -> io::Result<Self::Storage> {
        if path != self.path {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        Ok(BlkdebugStorage::new(self.image.clone(), self.rules.clone()))
    }
}

/// Writes 64 KiB at 0 into a fresh image with a rule for `event`, then flushes and closes:
/// the first error, and what `qemu-img check` says of the image left behind.
fn write_with_rule(event: &str) -> (Option<i32>, Option<i32>) {
    let d = Dir::new();
    let path = d.create("img.qcow2", "qcow2", "", None, "16M");
    let image = MemStorage::from_bytes(&std::fs::read(&path).unwrap());
    let conf = format!("[inject-error]\nevent = \"{event}\"\nonce = \"on\"\n");
    let fs = RulesFs {
        path: path.clone(),
        image: image.clone(),
        rules: Rules::parse_config(&conf).unwrap(),
    };
    let failed = run(async {
        let img = Image::open(&fs, &path, &OpenOptions::default())
            .await
            .expect("open read-write");
        let buf = storage::IoBuf::from_slice(&[5u8; 65536]);
        let (r, _) = img.write(GuestOffset(0), buf, false).await;
        let r = r.and(img.flush().await);
        let _ = img.close().await;
        r.err().map(|e| e.errno())
    });
    let out = d.path("after.qcow2");
    std::fs::write(&out, image.to_vec()).unwrap();
    let check = std::process::Command::new("qemu-img")
        .args(["check", out.to_str().unwrap()])
        .output()
        .unwrap();
    (failed, check.status.code())
}

#[test]
fn each_announced_event_fails_the_request_after_it() {
    for event in [
        "write_aio",
        "cluster_alloc",
        "l1_update",
        "l2_update",
        "refblock_update_part",
    ] {
        let (failed, check) = write_with_rule(event);
        assert_eq!(failed, Some(libc_errno::EIO), "{event}");
        // 0: clean, 3: leaked clusters only; never corruption.
        assert!(matches!(check, Some(0 | 3)), "{event}: check {check:?}");
    }
}

#[test]
fn an_event_never_announced_fails_nothing() {
    assert_eq!(write_with_rule("vmstate_save"), (None, Some(0)));
}
