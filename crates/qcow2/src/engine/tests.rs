//! Tests that look at the engine's private state while driving it through its public
//! operations (a test module, so that no engine module imports from above itself).

use crate::engine::{create, CreateOptions, Image, OpenOptions};
use crate::format::{GuestOffset, HostOffset};
use std::path::Path;
use storage::{IoBuf, MemFs, MemStorage};

/// 64 KiB clusters of 32 subclusters of 2 KiB.
const CS: u64 = 64 * 1024;
const SUB: u64 = 2048;

/// An empty 64 MiB image with extended L2 entries and 64 KiB clusters, in memory.
async fn extended_image() -> Image<MemStorage> {
    let mem = MemStorage::new();
    let opts = CreateOptions {
        size: 64 << 20,
        cluster_size: CS,
        extended_l2: true,
        ..CreateOptions::default()
    };
    create(&mem, &opts).await.expect("create");
    let fs = MemFs::new();
    let path = Path::new("/img.qcow2");
    fs.insert(path, mem);
    Image::open(&fs, path, &OpenOptions::default())
        .await
        .expect("open")
}

/// Through the engine: a fresh cluster is followed until freed, and a cluster taken
/// again from the free list is not taken for a hole.
#[test]
fn the_allocator_follows_fresh_clusters_only_while_they_are_in_use() {
    test_support::run(async {
        let img = extended_image().await;
        let host_of = |guest: u64| {
            let img = img.clone();
            async move {
                let map = img
                    .block_status(GuestOffset(guest), SUB)
                    .await
                    .expect("map");
                HostOffset(map[0].offset.expect("allocated"))
            }
        };
        let write = |at: u64| img.write(GuestOffset(at), IoBuf::from_slice(&[7; 4096]), false);
        write(0).await.0.expect("write");
        let a = host_of(0).await;
        let alloc = img.inner.alloc().expect("writable");
        assert!(!alloc.known_unwritten(a, SUB), "written");
        assert!(
            alloc.known_unwritten(a + 2 * SUB, CS - 2 * SUB),
            "the rest of it"
        );
        img.discard(GuestOffset(0), CS).await.expect("discard");
        assert!(!alloc.known_unwritten(a + 2 * SUB, SUB), "freed");
        write(5 * CS).await.0.expect("write");
        assert_eq!(host_of(5 * CS).await, a, "the freed cluster is taken again");
        assert!(!alloc.known_unwritten(a + 2 * SUB, SUB), "not fresh");
        img.close().await.expect("close");
    });
}
