//! A real full file system: the image lives on a small tmpfs mounted in a private mount
//! namespace, a client writes until the disk is full, and must be told ENOSPC (not EIO)
//! while reads and overwrites go on working; after the server stops, the image checks clean
//! (leaked clusters allowed) and holds every byte acknowledged by a flush.

use std::process::Command;

use crate::support::BIN;
use test_support::{python_with_libnbd, require};

/// Runs inside the namespace: mount, serve, write until full, stop, check.
const SCRIPT: &str = r#"
set -eu
mount -t tmpfs -o size=8M tmpfs "$MNT"
qemu-img create -q -f qcow2 "$MNT/img.qcow2" 256M
"$BIN" serve -t -k "$SOCK" --pid-file "$PIDF" "$MNT/img.qcow2" 2>"$WORK/serve.log" &
server=$!
i=0
while [ ! -e "$PIDF" ]; do
    i=$((i + 1)); [ "$i" -lt 600 ] || { echo "server did not start"; cat "$WORK/serve.log"; exit 1; }
    sleep 0.05
done
"$PYTHON" - "$SOCK" <<'EOF'
import errno, json, sys, nbd
h = nbd.NBD()
h.connect_unix(sys.argv[1])
MIB = 1 << 20
h.pwrite(b"\x11" * MIB, 0)
h.flush()
written, err = 1, None
# Far more than the 8 MiB file system holds.
for i in range(1, 64):
    try:
        h.pwrite(bytes([i % 250 + 1]) * MIB, i * MIB)
        written += 1
    except nbd.Error as e:
        err = e.errnum
        break
reads_ok = h.pread(MIB, 0) == b"\x11" * MIB
h.pwrite(b"\x22" * 4096, 0)
h.flush()
print("RESULT " + json.dumps({"written": written, "errno": err, "enospc": errno.ENOSPC,
                              "reads_ok": reads_ok}))
h.shutdown()
EOF
kill -TERM "$server"
wait "$server" && echo "SERVER exit 0" || echo "SERVER exit $?"
echo "CHECK $(qemu-img check "$MNT/img.qcow2" >/dev/null 2>&1; echo $?)"
qemu-io -f qcow2 -r -c 'read -P 0x22 0 4k' -c 'read -P 0x11 4k 1020k' "$MNT/img.qcow2" | grep -c 'pattern verification failed' || true
"#;

#[test]
fn a_full_file_system_is_reported_as_enospc_and_the_image_stays_consistent() {
    // SAFETY: geteuid only reads the process's credentials.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!(
            "SKIPPED: a_full_file_system_is_reported_as_enospc needs root to mount a tmpfs in a \
             private mount namespace (unshare -m); run the suite as root to cover ENOSPC"
        );
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let mnt = work.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let out = Command::new(require("unshare", "util-linux"))
        .args(["-m", "--propagation", "private", "sh", "-c", SCRIPT])
        .env("MNT", &mnt)
        .env("WORK", work.path())
        .env("SOCK", work.path().join("nbd.sock"))
        .env("PIDF", work.path().join("serve.pid"))
        .env("BIN", BIN)
        .env("PYTHON", python_with_libnbd())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned()
        + &String::from_utf8_lossy(&out.stderr)
        + &std::fs::read_to_string(work.path().join("serve.log")).unwrap_or_default();
    assert!(out.status.success(), "{text}");
    let result = text
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("no result:\n{text}"));
    let v: serde_json::Value = serde_json::from_str(result).unwrap();
    assert!(v["written"].as_u64().unwrap() >= 2, "{text}");
    assert!(
        v["written"].as_u64().unwrap() < 64,
        "the disk never filled:\n{text}"
    );
    assert_eq!(
        v["errno"], v["enospc"],
        "a full disk must be ENOSPC:\n{text}"
    );
    assert_eq!(v["reads_ok"], true, "{text}");
    assert!(text.contains("SERVER exit 0"), "{text}");
    assert!(
        text.contains("CHECK 0") || text.contains("CHECK 3"),
        "qemu-img check found corruption:\n{text}"
    );
    let last = text.lines().rfind(|l| l.trim().parse::<u32>().is_ok());
    assert_eq!(
        last.map(str::trim),
        Some("0"),
        "flushed bytes lost:\n{text}"
    );
}
