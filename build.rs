//! Has the linker place the code that runs at start-up and on the request path side by side
//! at the start of the release binary (the list is `build/hot-code.txt`, written by
//! `scripts/hot-code.sh`). The kernel maps code 64 KiB around each first touch, so scattered
//! hot code made nearly the whole binary resident; ordered, it fills a few windows. The
//! list names symbols whose hashes change with the code, so it must be written again after
//! changes to the server's crates (`scripts/hot-code.sh`). Also packs the relative
//! relocations, which the loader would otherwise keep resident as a large table.
//!
//! Only where the linker is known to take a symbol ordering file: LLD, which Rust uses by
//! default on x86_64 Linux since 1.90. `QCOW2_NBD_NO_CODE_ORDER=1` turns it off (for
//! another linker set in a cargo config this script cannot see).

use std::env;
use std::path::Path;
use std::process::Command;

fn main() {
    let list = Path::new(&env::var("CARGO_MANIFEST_DIR").expect("set by cargo"))
        .join("build")
        .join("hot-code.txt");
    println!("cargo:rerun-if-changed={}", list.display());
    println!("cargo:rerun-if-env-changed=QCOW2_NBD_NO_CODE_ORDER");
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER");
    if env::var_os("QCOW2_NBD_NO_CODE_ORDER").is_some()
        || env::var("PROFILE").as_deref() != Ok("release")
        || env::var("TARGET").as_deref() != Ok("x86_64-unknown-linux-gnu")
        || env::var_os("CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER").is_some()
        || env::var("CARGO_ENCODED_RUSTFLAGS").is_ok_and(|f| f.contains("link"))
        || !list.exists()
        || !rustc_links_with_lld()
    {
        return;
    }
    println!(
        "cargo:rustc-link-arg-bins=-Wl,--symbol-ordering-file={}",
        list.display()
    );
    // Names the list has that this build lacks are expected (code changed since it was
    // written): they only leave that code where it was.
    println!("cargo:rustc-link-arg-bins=-Wl,--no-warn-symbol-ordering");
    // The dynamic loader reads every relocation at start-up: tens of thousands of
    // pointer-sized relative ones (vtables, string tables) took a quarter of a MiB as RELA
    // entries, resident for the life of the server. Packed (DT_RELR) they take a few KiB,
    // but only glibc 2.36 and later can load such a binary.
    if glibc_at_least(2, 36) {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}

/// Whether the build machine's glibc (which the binary will run with) is at least
/// `major.minor`, as `getconf GNU_LIBC_VERSION` reports it ("glibc 2.36").
fn glibc_at_least(major: u32, minor: u32) -> bool {
    let Ok(out) = Command::new("getconf").arg("GNU_LIBC_VERSION").output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(version) = text.trim().strip_prefix("glibc ") else {
        return false;
    };
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (major, minor)
}

/// Whether rustc is 1.90 or later, the first to link x86_64 Linux binaries with its LLD.
fn rustc_links_with_lld() -> bool {
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let Ok(out) = Command::new(rustc).arg("--version").output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let mut parts = text
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .split('.')
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (1, 90)
}
