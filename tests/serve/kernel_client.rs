//! A client that never negotiates structured replies, like the Linux kernel's: it reads,
//! writes (plain and FUA), trims, zeroes and flushes a backed qcow2 image through
//! `qcow2-nbd serve`, with requests pipelined and answered in any order. The image then
//! passes `qemu-img check` and equals a model kept by the test.

use std::collections::HashMap;

use crate::support::kernel_client::{
    KernelClient, CMD_FLUSH, CMD_READ, CMD_TRIM, CMD_WRITE, CMD_WRITE_ZEROES, FLAG_FUA,
    TFLAG_CAN_MULTI_CONN, TFLAG_READ_ONLY, TFLAG_SEND_FLUSH, TFLAG_SEND_FUA, TFLAG_SEND_TRIM,
};
use crate::support::Server;
use test_support::{assert_check_clean, assert_same_contents, qemu_contents, Dir};

const MIB: usize = 1 << 20;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i / 512) as u8) ^ (i as u8))
        .collect()
}

#[test]
fn a_simple_reply_client_reads_writes_trims_zeroes_and_flushes() {
    let images = Dir::new();
    images.create("base.qcow2", "qcow2", "", None, "8M");
    images.qemu_io("qcow2", "base.qcow2", &["write -P 0x3c 0 4M"]);
    let top = images.create(
        "top.qcow2",
        "qcow2",
        "cluster_size=65536,extended_l2=on",
        Some(("base.qcow2", "qcow2")),
        "8M",
    );
    let mut model = qemu_contents(&top, &["-f", "qcow2"]);
    let server = Server::unix(&["-t", "--discard=unmap", top.to_str().unwrap()]);
    let mut c = KernelClient::connect(&server.socket, "");
    assert_eq!(c.size, 8 << 20);
    for flag in [TFLAG_SEND_FLUSH, TFLAG_SEND_FUA, TFLAG_SEND_TRIM] {
        assert_ne!(c.flags & flag, 0, "flag {flag:#x} in {:#x}", c.flags);
    }
    assert_eq!(c.flags & (TFLAG_READ_ONLY | TFLAG_CAN_MULTI_CONN), 0);

    // Backing data shows through.
    assert_eq!(c.read(0, 4096), model[..4096]);

    // Plain and FUA writes, one unaligned across a cluster boundary.
    let a = pattern(1, 5000);
    assert_eq!(c.call(CMD_WRITE, 0, 65000, 5000, &a).error, 0);
    model[65000..70000].copy_from_slice(&a);
    let b = pattern(2, 64 << 10);
    assert_eq!(c.call(CMD_WRITE, FLAG_FUA, 1 << 20, 65536, &b).error, 0);
    model[MIB..MIB + 65536].copy_from_slice(&b);

    // Pipelined: sixteen writes in flight, then sixteen reads; replies in any order.
    let mut expected: HashMap<u64, Vec<u8>> = HashMap::new();
    for i in 0..16u64 {
        let data = pattern(10 + i as u8, 12288);
        let at = (2 << 20) + i * 100_000;
        c.send(CMD_WRITE, 0, 100 + i, at, 12288, &data);
        let at = usize::try_from(at).unwrap();
        model[at..at + 12288].copy_from_slice(&data);
    }
    for _ in 0..16 {
        let r = c.reply();
        assert!((100..116).contains(&r.cookie) && r.error == 0, "{r:?}");
    }
    for i in 0..16u64 {
        let at = (2 << 20) + i * 100_000 - 1000;
        c.send(CMD_READ, 0, 200 + i, at, 14000, &[]);
        let at = usize::try_from(at).unwrap();
        expected.insert(200 + i, model[at..at + 14000].to_vec());
    }
    for _ in 0..16 {
        let r = c.reply();
        assert_eq!(r.error, 0);
        assert!(
            expected
                .remove(&r.cookie)
                .is_some_and(|want| want == r.data),
            "read {} returned the wrong data",
            r.cookie
        );
    }

    // Trim whole clusters over backing data: they read as zeroes afterwards.
    assert_eq!(c.call(CMD_TRIM, 0, 3 << 20, 131072, &[]).error, 0);
    model[3 * MIB..3 * MIB + 131072].fill(0);
    assert_eq!(c.read(3 << 20, 131072), vec![0; 131072]);
    // Zeroing, unaligned, with FUA.
    assert_eq!(c.call(CMD_WRITE_ZEROES, FLAG_FUA, 100, 70000, &[]).error, 0);
    model[100..70100].fill(0);
    assert_eq!(c.call(CMD_FLUSH, 0, 0, 0, &[]).error, 0);
    assert_eq!(c.read(0, 131072), model[..131072]);
    c.disconnect();

    server.stop_ok();
    let model_path = images.path("model.raw");
    std::fs::write(&model_path, &model).unwrap();
    assert_check_clean(&top);
    assert_same_contents(&top, "qcow2", &model_path, "raw");
}
