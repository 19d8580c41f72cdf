//! `qcow2-nbd dd`: copy an image block by block into a new image, like `qemu-img dd`, with
//! its dd(1)-style operands: `if=` and `of=` (both required), `bs=` (block size, default
//! 512), `count=` (blocks to copy) and `skip=` (input blocks to skip). The output is created
//! (`-O`, raw by default) with the size that remains to copy, and every block is written,
//! zeros included, as qemu-img writes them.

use qcow2::format::GuestOffset;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use qcow2::engine::{EngineError, Format, Image, OpenOptions, Preallocation};
use storage::{AnyStorage, IoBuf};

use crate::common::engine_run::{self, OpenError};
use crate::common::options::Parsed;
use crate::common::size_string::cvtnum;
use crate::tools::create::{self, CreateError};

/// Bytes copied per request: whole blocks, so the output is what block-by-block copying
/// gives, in fewer, larger requests.
const CHUNK_BYTES: u64 = 1 << 20;

/// Arguments of `dd`.
#[derive(Args, Debug)]
pub struct DdArgs {
    /// Format of the input (qcow2 or raw); probed when not given.
    #[arg(short = 'f', long = "format")]
    pub format: Option<String>,
    /// Format of the output: raw (the default, as in qemu-img) or qcow2.
    #[arg(short = 'O', long = "output-format", default_value = "raw")]
    pub output_format: String,
    #[command(flatten)]
    pub share: engine_run::ForceShare,
    /// Operands: if=INPUT of=OUTPUT [bs=BYTES] [count=BLOCKS] [skip=BLOCKS].
    #[arg(value_name = "OPERAND")]
    pub operands: Vec<String>,
}

/// Why `dd` failed; the messages are qemu-img's.
#[derive(Debug, thiserror::Error)]
pub enum DdError {
    /// An operand that is not `NAME=VALUE` with a known name.
    #[error("unrecognized operand {0}")]
    Operand(String),
    /// A bad number.
    #[error("{0}")]
    Number(String),
    /// `if=` or `of=` missing.
    #[error("Must specify both input and output files")]
    Files,
    /// An output format we cannot create.
    #[error("Unknown file format")]
    Format,
    /// The input could not be opened.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// The output could not be created.
    #[error("{image}: error while creating output image: {source}")]
    Create {
        /// The output.
        image: String,
        /// Why.
        source: Box<CreateError>,
    },
    /// Reading the input failed.
    #[error("error while reading from input image file: {0}")]
    Read(Box<EngineError>),
    /// Writing the output failed.
    #[error("error while writing to output image file: {0}")]
    Write(Box<EngineError>),
    /// The runtime could not start.
    #[error("starting the runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

/// The operands, read.
#[derive(Debug, Default, PartialEq, Eq)]
struct Operands {
    input: Option<PathBuf>,
    output: Option<PathBuf>,
    block: u64,
    count: Option<u64>,
    skip: Option<u64>,
}

/// Reads dd's operands in order (a later one of a name wins), with qemu-img's checks.
fn operands(list: &[String]) -> Result<Operands, DdError> {
    let mut o = Operands {
        block: 512,
        ..Operands::default()
    };
    for arg in list {
        let Some((name, value)) = arg.split_once('=') else {
            return Err(DdError::Operand(arg.clone()));
        };
        match name {
            "bs" => {
                let v = cvtnum("bs", value).map_err(DdError::Number)?;
                if !(1..=i32::MAX as u64).contains(&v) {
                    return Err(DdError::Number(format!(
                        "Invalid bs specified. Must be between 1 and {}.",
                        i32::MAX
                    )));
                }
                o.block = v;
            }
            "count" => o.count = Some(cvtnum("count", value).map_err(DdError::Number)?),
            "skip" => o.skip = Some(cvtnum("skip", value).map_err(DdError::Number)?),
            "if" => o.input = Some(PathBuf::from(value)),
            "of" => o.output = Some(PathBuf::from(value)),
            _ => return Err(DdError::Operand(name.to_string())),
        }
    }
    Ok(o)
}

/// Reads `len` bytes at `pos` of `img`, zeros past its end (qemu-img counts sizes in whole
/// sectors).
async fn read_padded(img: &Image<AnyStorage>, pos: u64, len: u64) -> Result<IoBuf, EngineError> {
    let have = img.size().saturating_sub(pos).min(len);
    let mut buf = if have > 0 {
        img.read(GuestOffset(pos), have as usize).await?
    } else {
        IoBuf::zeroed(0)
    };
    if have < len {
        buf.resize(len as usize);
        buf[have as usize..].fill(0);
    }
    Ok(buf)
}

/// Creates the output of `size` bytes and opens it for writing.
async fn create_output(
    path: &Path,
    format: Format,
    size: u64,
) -> Result<Image<AnyStorage>, CreateError> {
    let image = path.display().to_string();
    match format {
        Format::Luks => {
            return Err(CreateError::invalid(&image)(
                "dd cannot create a LUKS volume: its secret cannot be given here".into(),
            ))
        }
        Format::Raw => {
            create::create_raw(path, size, Preallocation::Off, create::FileAttrs::default())
                .await
                .map_err(|source| CreateError::Io {
                    image: image.clone(),
                    what: "creating the raw image",
                    source,
                })?
        }
        Format::Qcow2 => {
            let mut plan = create::qcow2_plan(&Parsed::default(), false)
                .map_err(CreateError::invalid(&image))?;
            plan.opts.size = size;
            create::check_qcow2_size(&plan.opts).map_err(CreateError::invalid(&image))?;
            create::create_qcow2(path, &plan.opts, create::FileAttrs::default())
                .await
                .map_err(|source| CreateError::Engine {
                    image: image.clone(),
                    source: Box::new(source),
                })?;
        }
    }
    Image::open(
        &engine_run::opener(),
        path,
        &OpenOptions {
            format: Some(format),
            no_backing: true,
            untrusted: crate::common::engine_run::untrusted(),
            ..OpenOptions::default()
        },
    )
    .await
    .map_err(|source| CreateError::Engine {
        image,
        source: Box::new(source),
    })
}

async fn dd(args: &DdArgs) -> Result<(), DdError> {
    let o = operands(&args.operands)?;
    let (Some(input), Some(output)) = (&o.input, &o.output) else {
        return Err(DdError::Files);
    };
    let in_format = args
        .format
        .as_deref()
        .map(engine_run::parse_format)
        .transpose()?;
    let src = engine_run::open_read_only(input, in_format, None, args.share.force_share).await?;
    let out_format = Format::from_name(&args.output_format).ok_or(DdError::Format)?;
    let mut size = src.size().div_ceil(512) * 512;
    if let Some(count) = o.count {
        if let Some(bytes) = count.checked_mul(o.block).filter(|&b| b < size) {
            size = bytes;
        }
    }
    // A skip past the end makes an empty output, with a warning, as dd(1) does.
    let start = match o.skip {
        None => Some(0),
        Some(skip) => skip.checked_mul(o.block).filter(|&b| b <= size),
    };
    let dst = create_output(output, out_format, size - start.unwrap_or(size))
        .await
        .map_err(|e| DdError::Create {
            image: output.display().to_string(),
            source: Box::new(e),
        })?;
    if start.is_none() {
        eprintln!(
            "{}: {}: cannot skip to specified offset",
            crate::common::prog::name(),
            input.display()
        );
    }
    let chunk = (CHUNK_BYTES / o.block).max(1) * o.block;
    let mut pos = start.unwrap_or(size);
    let mut out_pos = 0u64;
    while pos < size {
        let n = chunk.min(size - pos);
        let buf = read_padded(&src, pos, n)
            .await
            .map_err(|e| DdError::Read(Box::new(e)))?;
        dst.write(GuestOffset(out_pos), buf, false)
            .await
            .0
            .map_err(|e| DdError::Write(Box::new(e)))?;
        pos += n;
        out_pos += n;
    }
    dst.close().await.map_err(|e| DdError::Write(Box::new(e)))?;
    Ok(())
}

/// Runs `dd` and returns the exit status.
pub fn main(args: &DdArgs) -> ExitCode {
    let res = engine_run::block_on(dd(args)).map_err(DdError::from);
    engine_run::exit_code(res.and_then(|r| r))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops(v: &[&str]) -> Result<Operands, DdError> {
        operands(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn operands_are_read_as_qemu_img_reads_them() {
        let o = ops(&["if=a", "of=b", "bs=1K", "count=3", "skip=2"]).unwrap();
        assert_eq!(
            o,
            Operands {
                input: Some("a".into()),
                output: Some("b".into()),
                block: 1024,
                count: Some(3),
                skip: Some(2),
            }
        );
        assert_eq!(ops(&[]).unwrap().block, 512);
        let err = |v: &[&str]| ops(v).unwrap_err().to_string();
        assert_eq!(err(&["if"]), "unrecognized operand if");
        assert_eq!(err(&["iff=x"]), "unrecognized operand iff");
        assert_eq!(
            err(&["bs=0"]),
            "Invalid bs specified. Must be between 1 and 2147483647."
        );
        assert_eq!(err(&["bs=x"]), "Invalid bs specified: 'x'.");
    }
}
