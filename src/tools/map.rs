//! `qcow2-nbd map`: what every guest byte of an image is (data, zeros, nothing) and which
//! layer of the chain provides it, in `qemu-img map`'s human and JSON layouts.

use qcow2::format::GuestOffset;
use std::io::{self, BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use qcow2::engine::{EngineError, Extent, Image};
use storage::AnyStorage;

use crate::common::engine_run::{self, OpenError};
use crate::common::size_string;

/// How much of the disk one block-status query covers: bounds memory on huge, fragmented
/// images while keeping the number of queries small.
const QUERY_BYTES: u64 = 1 << 30;

/// Output layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MapOutput {
    /// `Offset Length Mapped-to File` lines for data with a host offset.
    Human,
    /// qemu-img's JSON: one object per run with start, length, depth, present, zero, data,
    /// compressed and offset.
    Json,
}

/// Arguments of `map`.
#[derive(Args, Debug)]
pub struct MapArgs {
    /// The image file.
    pub image: PathBuf,
    /// Output layout.
    #[arg(long, value_enum, default_value_t = MapOutput::Human)]
    pub output: MapOutput,
    /// Format of the image (qcow2 or raw); probed when not given.
    #[arg(short = 'f', long = "format")]
    pub format: Option<String>,
    #[command(flatten)]
    pub share: crate::common::engine_run::ForceShare,
    /// First guest byte to map (size suffixes allowed).
    #[arg(short = 's', long = "start-offset", value_parser = parse_size_arg)]
    pub start_offset: Option<u64>,
    /// Map at most this many bytes (size suffixes allowed).
    #[arg(short = 'l', long = "max-length", value_parser = parse_size_arg)]
    pub max_length: Option<u64>,
}

/// A size argument (`1M`, `4096`), read as QEMU reads it.
fn parse_size_arg(s: &str) -> Result<u64, String> {
    size_string::parse_size(s).map_err(|e| e.to_string())
}

/// Why `map` failed.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    /// The image could not be opened.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// Block status failed (a corrupt table, an I/O error).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Human output cannot show data without a host offset, as in qemu-img.
    #[error("File contains external, encrypted or compressed clusters.")]
    NoOffset,
    /// Writing the output, or starting the runtime, failed.
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// One run of the map, with qemu-img's fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapEntry {
    /// First guest byte.
    pub start: u64,
    /// Length in bytes.
    pub length: u64,
    /// Layer providing it (0 = the image itself), or the deepest layer covering it.
    pub depth: usize,
    /// Allocated in some layer.
    pub present: bool,
    /// Reads as zeros.
    pub zero: bool,
    /// Reads from stored data.
    pub data: bool,
    /// Stored compressed.
    pub compressed: bool,
    /// Offset in the layer's file, for uncompressed data.
    pub offset: Option<u64>,
}

impl From<&Extent> for MapEntry {
    fn from(e: &Extent) -> MapEntry {
        MapEntry {
            start: e.start,
            length: e.len,
            depth: e.depth,
            present: e.present,
            zero: e.zero,
            data: e.data,
            compressed: e.compressed,
            offset: e.offset,
        }
    }
}

impl MapEntry {
    /// Appends `next` when it continues this entry with the same meaning (qemu-img's rule).
    fn try_merge(&mut self, next: &MapEntry) -> bool {
        let same = self.start + self.length == next.start
            && self.depth == next.depth
            && self.present == next.present
            && self.zero == next.zero
            && self.data == next.data
            && self.compressed == next.compressed
            && match (self.offset, next.offset) {
                (None, None) => true,
                (Some(a), Some(b)) => a.checked_add(self.length) == Some(b),
                _ => false,
            };
        if same {
            self.length += next.length;
        }
        same
    }

    /// The JSON object qemu-img prints (same keys, same order).
    pub fn json(&self) -> String {
        let mut s = format!(
            "{{ \"start\": {}, \"length\": {}, \"depth\": {}, \"present\": {}, \"zero\": {}, \"data\": {}, \"compressed\": {}",
            self.start, self.length, self.depth, self.present, self.zero, self.data, self.compressed
        );
        if let Some(o) = self.offset {
            s.push_str(&format!(", \"offset\": {o}"));
        }
        s.push('}');
        s
    }
}

/// C's `%#-16x`: `0` without a prefix, otherwise `0x...`, left-aligned in 16 columns.
fn hex16(v: u64) -> String {
    let s = if v == 0 {
        "0".to_string()
    } else {
        format!("{v:#x}")
    };
    format!("{s:<16}")
}

/// Writes entries in one of the layouts as they are produced.
struct Printer<W: Write> {
    out: W,
    output: MapOutput,
    chain: Vec<String>,
    first: bool,
}

impl<W: Write> Printer<W> {
    fn begin(&mut self) -> Result<(), MapError> {
        match self.output {
            MapOutput::Human => writeln!(
                self.out,
                "{:<16}{:<16}{:<16}File",
                "Offset", "Length", "Mapped to"
            )?,
            MapOutput::Json => write!(self.out, "[")?,
        }
        Ok(())
    }

    fn entry(&mut self, e: &MapEntry) -> Result<(), MapError> {
        match self.output {
            MapOutput::Human => {
                if e.data && e.offset.is_none() {
                    return Err(MapError::NoOffset);
                }
                if let (true, false, Some(off)) = (e.data, e.zero, e.offset) {
                    let file = self.chain.get(e.depth).map_or("", String::as_str);
                    writeln!(
                        self.out,
                        "{}{}{}{file}",
                        hex16(e.start),
                        hex16(e.length),
                        hex16(off)
                    )?;
                }
            }
            MapOutput::Json => {
                let sep = if self.first { "" } else { ",\n" };
                write!(self.out, "{sep}{}", e.json())?;
            }
        }
        self.first = false;
        Ok(())
    }

    fn end(&mut self) -> Result<(), MapError> {
        if self.output == MapOutput::Json {
            writeln!(self.out, "]")?;
        }
        self.out.flush()?;
        Ok(())
    }
}

/// The merged map of `[start, end)`, handed to `emit` run by run in guest order. Past the
/// image's size (`end` may reach [`disk_size`]) the run is the tail of the last sector of a
/// raw file: zeros at their offset in the file, as QEMU maps them; but with O_DIRECT
/// (`direct`) QEMU's file driver answers in whole blocks, so the run before it reaches on
/// into the tail.
pub async fn walk(
    img: &Image<AnyStorage>,
    (start, end): (u64, u64),
    direct: bool,
    mut emit: impl FnMut(&MapEntry) -> Result<(), MapError>,
) -> Result<(), MapError> {
    let mut pending: Option<MapEntry> = None;
    // Merges `e` into the run before it, or hands that run on and keeps `e`.
    let push = |pending: &mut Option<MapEntry>,
                e: MapEntry,
                emit: &mut dyn FnMut(&MapEntry) -> Result<(), MapError>|
     -> Result<(), MapError> {
        if !pending.as_mut().is_some_and(|p| p.try_merge(&e)) {
            if let Some(p) = pending.replace(e) {
                emit(&p)?;
            }
        }
        Ok(())
    };
    let data_end = end.min(img.size());
    let mut pos = start;
    while pos < data_end {
        // Queries end on QUERY_BYTES boundaries so that runs split the same way every time.
        let len = (QUERY_BYTES - pos % QUERY_BYTES).min(data_end - pos);
        for ext in img.block_status(GuestOffset(pos), len).await? {
            push(&mut pending, MapEntry::from(&ext), &mut emit)?;
        }
        pos += len;
    }
    let tail = start.max(data_end);
    if end > tail {
        let last = pending
            .as_ref()
            .filter(|p| direct && p.start + p.length == tail);
        let entry = match last {
            Some(p) => MapEntry {
                start: tail,
                length: end - tail,
                offset: p.offset.map(|o| o + p.length),
                ..p.clone()
            },
            None => MapEntry {
                start: tail,
                length: end - tail,
                depth: 0,
                present: true,
                zero: true,
                data: false,
                compressed: false,
                offset: Some(tail),
            },
        };
        push(&mut pending, entry, &mut emit)?;
    }
    if let Some(p) = pending {
        emit(&p)?;
    }
    Ok(())
}

/// The disk as QEMU maps it: a raw file's length counted in whole 512-byte sectors (QEMU's
/// block layer has no smaller unit), the tail past the file reading as zeros; a qcow2
/// image's size, always whole sectors.
fn disk_size(img: &Image<AnyStorage>) -> u64 {
    let size = img.size();
    if img.facts().qcow2 {
        return size;
    }
    size.checked_next_multiple_of(512).unwrap_or(size)
}

async fn map(args: &MapArgs) -> Result<(), MapError> {
    let format = args
        .format
        .as_deref()
        .map(engine_run::parse_format)
        .transpose()?;
    let img = engine_run::open_read_only(&args.image, format, None, args.share.force_share).await?;
    let size = disk_size(&img);
    let start = args.start_offset.unwrap_or(0).min(size);
    let end = match args.max_length {
        Some(l) => start.saturating_add(l).min(size),
        None => size,
    };
    let stdout = io::stdout();
    let mut p = Printer {
        out: BufWriter::new(stdout.lock()),
        output: args.output,
        chain: img.facts().chain,
        first: true,
    };
    p.begin()?;
    if size == 0 && p.output == MapOutput::Json {
        // qemu-img describes an empty disk with one empty, absent run.
        let empty = MapEntry {
            start: 0,
            length: 0,
            depth: 0,
            present: false,
            zero: false,
            data: false,
            compressed: false,
            offset: None,
        };
        p.entry(&empty)?;
    }
    let direct = crate::common::image_name::direct_for(&args.image);
    let res = walk(&img, (start, end), direct, |e| p.entry(e)).await;
    // What was printed stays printed (qemu-img also stops mid-way on compressed clusters).
    p.out.flush()?;
    res?;
    p.end()
}

/// Runs `map` and returns the exit status.
pub fn main(args: &MapArgs) -> ExitCode {
    let res = engine_run::block_on(map(args)).map_err(MapError::from);
    engine_run::exit_code(res.and_then(|r| r))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(start: u64, length: u64, data: bool, offset: Option<u64>) -> MapEntry {
        MapEntry {
            start,
            length,
            depth: 0,
            present: true,
            zero: !data,
            data,
            compressed: false,
            offset,
        }
    }

    #[test]
    fn merges_only_continuing_runs() {
        let mut a = entry(0, 512, true, Some(4096));
        assert!(a.try_merge(&entry(512, 512, true, Some(4608))));
        assert_eq!(a.length, 1024);
        assert!(!a.try_merge(&entry(1024, 512, true, Some(9000))));
        assert!(!a.try_merge(&entry(1024, 512, false, None)));
        let mut z = entry(0, 512, false, None);
        assert!(z.try_merge(&entry(512, 100, false, None)));
        let mut deeper = entry(612, 1, false, None);
        deeper.depth = 1;
        assert!(!z.try_merge(&deeper));
    }

    #[test]
    fn json_and_human_layouts() {
        assert_eq!(
            entry(0, 4096, true, Some(327680)).json(),
            r#"{ "start": 0, "length": 4096, "depth": 0, "present": true, "zero": false, "data": true, "compressed": false, "offset": 327680}"#
        );
        assert_eq!(
            entry(4096, 512, false, None).json(),
            r#"{ "start": 4096, "length": 512, "depth": 0, "present": true, "zero": true, "data": false, "compressed": false}"#
        );
        assert_eq!(hex16(0), "0               ");
        assert_eq!(hex16(0x80000), "0x80000         ");
    }

    #[test]
    fn human_output_refuses_data_without_offset() {
        let mut p = Printer {
            out: Vec::new(),
            output: MapOutput::Human,
            chain: vec!["a.qcow2".into()],
            first: true,
        };
        p.begin().unwrap();
        p.entry(&entry(0, 65536, true, Some(0x50000))).unwrap();
        p.entry(&entry(65536, 512, false, None)).unwrap();
        let mut c = entry(66048, 512, true, None);
        c.compressed = true;
        assert!(matches!(p.entry(&c), Err(MapError::NoOffset)));
        assert_eq!(
            String::from_utf8(p.out).unwrap(),
            "Offset          Length          Mapped to       File\n0               0x10000         0x50000         a.qcow2\n"
        );
    }
}
