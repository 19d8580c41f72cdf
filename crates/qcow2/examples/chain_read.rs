//! Builds or reads a backing chain whose layers together hold the same data as a single
//! image, to compare deep chains with one layer (time and peak memory, in separate processes):
//!
//! ```sh
//! cargo run --release -p qcow2 --example chain_read -- build DIR DEPTH SIZE_MIB
//! cargo run --release -p qcow2 --example chain_read -- read DIR/top.qcow2
//! ```

use qcow2::engine::{create_file, CreateOptions, Format, Image, OpenOptions};
use qcow2::format::GuestOffset;
use std::path::Path;
use std::time::Instant;
use storage::{Aio, FileOpener, IoBuf};

const STRETCH: u64 = 1 << 20;

fn opener() -> FileOpener {
    FileOpener {
        aio: Aio::IoUring,
        direct: false,
        ..FileOpener::default()
    }
}

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

async fn build(dir: &Path, depth: u64, size: u64) {
    std::fs::create_dir_all(dir).unwrap();
    let mut below: Option<String> = None;
    for k in 0..depth {
        let name = if k + 1 == depth {
            "top.qcow2".to_string()
        } else {
            format!("l{k}.qcow2")
        };
        let path = dir.join(&name);
        let opts = CreateOptions {
            size,
            backing: below.clone().map(|b| (b, Format::Qcow2)),
            ..CreateOptions::default()
        };
        create_file(&opener(), &path, &opts).await.unwrap();
        let img = Image::open(
            &opener(),
            &path,
            &OpenOptions {
                no_backing: true,
                ..OpenOptions::default()
            },
        )
        .await
        .unwrap();
        // Layer k holds every stretch i with i % depth == k: data at every depth.
        let mut i = k;
        while i * STRETCH < size {
            let byte = (i % 251) as u8 + 1;
            let (r, _) = img
                .write(
                    GuestOffset(i * STRETCH),
                    IoBuf::from_slice(&vec![byte; STRETCH as usize]),
                    false,
                )
                .await;
            r.unwrap();
            i += depth;
        }
        img.close().await.unwrap();
        below = Some(name);
    }
}

async fn read(path: &Path) {
    let t = Instant::now();
    let img = Image::open(
        &opener(),
        path,
        &OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        },
    )
    .await
    .unwrap();
    let opened = t.elapsed();
    let size = img.size();
    let mut pos = 0;
    let mut sum = 0u64;
    while pos < size {
        let buf = img.read(GuestOffset(pos), STRETCH as usize).await.unwrap();
        sum = sum.wrapping_add(buf.iter().map(|&b| u64::from(b)).sum::<u64>());
        pos += STRETCH;
    }
    let total = t.elapsed();
    println!(
        "layers={} open_ms={:.1} read_ms={:.1} peak_rss_mib={:.1} checksum={sum}",
        img.chain_len(),
        opened.as_secs_f64() * 1e3,
        (total - opened).as_secs_f64() * 1e3,
        peak_rss_kib() as f64 / 1024.0
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    match args.get(1).map(String::as_str) {
        Some("build") if args.len() == 5 => {
            let depth: u64 = args[3].parse().expect("DEPTH");
            let size: u64 = args[4].parse::<u64>().expect("SIZE_MIB") << 20;
            local.block_on(&rt, build(Path::new(&args[2]), depth.max(1), size));
        }
        Some("read") if args.len() == 3 => local.block_on(&rt, read(Path::new(&args[2]))),
        _ => {
            eprintln!("usage: chain_read build DIR DEPTH SIZE_MIB | chain_read read IMAGE");
            std::process::exit(2);
        }
    }
}
