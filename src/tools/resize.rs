//! `qcow2-nbd resize`: change the virtual size of a qcow2 or raw image, with `qemu-img
//! resize`'s options, checks, messages and exit codes. Shrinking needs `--shrink`, as in
//! qemu-img, because it deletes the data past the new end.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use qcow2::engine::{EngineError, Format, Image, OpenOptions, Preallocation};
use storage::AnyStorage;

use crate::common::engine_run::{self, OpenError};

/// Arguments of `resize`.
#[derive(Args, Debug)]
#[command(
    about = "Change the virtual size of an image, like `qemu-img resize`",
    long_about = "Change the virtual size of a qcow2 or raw image, like `qemu-img resize`.\n\n\
        New space reads as zeros (also over a longer backing file). Shrinking deletes every \
        cluster past the new end and needs --shrink; qcow2 images then give the freed space \
        back to the file system."
)]
pub struct ResizeArgs {
    /// Allow the new size to be smaller than the current one (the data past it is lost).
    #[arg(long)]
    pub shrink: bool,
    /// How to allocate the space a growing image gains: off (nothing), metadata (qcow2
    /// only: L2 tables and clusters, data untouched), falloc (reserved with fallocate) or
    /// full (written with zeros).
    #[arg(long, value_name = "off|metadata|falloc|full")]
    pub preallocation: Option<String>,
    /// Format of FILENAME: qcow2 or raw (default: probed).
    #[arg(short = 'f', long = "format", value_name = "FMT")]
    pub format: Option<String>,
    /// Do not print "Image resized.".
    #[arg(short = 'q', long)]
    pub quiet: bool,
    /// The image to resize.
    pub filename: PathBuf,
    /// The new size, or with + or - the amount to grow or shrink by; an optional suffix
    /// (k, M, G, T, P, E) multiplies by powers of 1024. A multiple of 512.
    #[arg(allow_hyphen_values = true, value_name = "[+|-]SIZE")]
    pub size: String,
}

/// The `--preallocation` mode (checked here rather than by clap so that a bad one exits
/// 1 with qemu-img's message).
fn parse_prealloc(s: Option<&str>) -> Result<Preallocation, ResizeCliError> {
    match s {
        None => Ok(Preallocation::Off),
        Some(s) => {
            Preallocation::from_name(s).ok_or_else(|| ResizeCliError::BadPrealloc(s.to_string()))
        }
    }
}

/// Why `resize` failed, in qemu-img's words.
#[derive(Debug, thiserror::Error)]
enum ResizeCliError {
    #[error(
        "Parameter 'size' expects a non-negative number below 2^64\n\
         Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\n\
         and exabytes, respectively."
    )]
    BadSize,
    #[error("Invalid preallocation mode '{0}'")]
    BadPrealloc(String),
    #[error("New image size must be positive")]
    NotPositive,
    #[error("Preallocation can only be used for growing images")]
    PreallocNotGrowing,
    #[error(
        "Use the --shrink option to perform a shrink operation.\n\
         {0}: warning: Shrinking an image will delete all data beyond the shrunken \
         image's end. Before performing such an operation, make sure there is no important \
         data there."
    )]
    /// With the program name the warning line begins with.
    ShrinkNotAllowed(&'static str),
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("{}", engine_reason(.0))]
    Resize(EngineError),
    #[error("{0}")]
    Runtime(std::io::Error),
}

/// An engine error as qemu-img reports a failed resize: QEMU's reason alone where it has
/// one, anything else in full.
fn engine_reason(e: &EngineError) -> String {
    match e {
        EngineError::Resize { source, .. } => source.to_string(),
        EngineError::Bitmap { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}

/// Runs `qcow2-nbd resize`.
pub fn main(args: &ResizeArgs) -> ExitCode {
    let result = engine_run::block_on(run(args))
        .map_err(ResizeCliError::Runtime)
        .and_then(|r| r);
    engine_run::exit_code(result)
}

/// The size argument: absolute, or relative with its sign.
enum Requested {
    Absolute(u64),
    Relative(i128),
}

fn parse_requested(s: &str) -> Result<Requested, ResizeCliError> {
    let (sign, digits) = match s.as_bytes().first() {
        Some(b'+') => (1, &s[1..]),
        Some(b'-') => (-1, &s[1..]),
        _ => (0, s),
    };
    let n = crate::common::size_string::parse_size(digits).map_err(|_| ResizeCliError::BadSize)?;
    Ok(match sign {
        0 => Requested::Absolute(n),
        _ => Requested::Relative(sign * i128::from(n)),
    })
}

/// The new size from the request and the current size, with qemu-img's checks (it reads
/// the size as a signed 64-bit number, so anything from 2^63 on is not positive).
fn new_size(
    requested: &Requested,
    current: u64,
    shrink: bool,
    prealloc: Preallocation,
) -> Result<u64, ResizeCliError> {
    let total = match *requested {
        Requested::Absolute(n) => i128::from(n as i64),
        Requested::Relative(delta) => i128::from(current) + delta,
    };
    let total = u64::try_from(total)
        .ok()
        .filter(|&t| t > 0 && t <= i64::MAX as u64)
        .ok_or(ResizeCliError::NotPositive)?;
    if total <= current && prealloc != Preallocation::Off {
        return Err(ResizeCliError::PreallocNotGrowing);
    }
    if total < current && !shrink {
        return Err(ResizeCliError::ShrinkNotAllowed(crate::common::prog::name()));
    }
    Ok(total)
}

async fn run(args: &ResizeArgs) -> Result<(), ResizeCliError> {
    let prealloc = parse_prealloc(args.preallocation.as_deref())?;
    let requested = parse_requested(&args.size)?;
    let format = match &args.format {
        Some(f) => engine_run::parse_format(f)?,
        None => {
            let probed = engine_run::probe_format(&args.filename)?;
            if probed == Format::Raw {
                eprintln!(
                    "WARNING: Image format was not specified for '{}' and probing guessed raw.\n         \
                     Specify the 'raw' format explicitly to remove this warning.",
                    args.filename.display()
                );
            }
            probed
        }
    };
    let opts = OpenOptions {
        format: Some(format),
        passwords: crate::common::secrets::passwords_for(&args.filename),
        untrusted: crate::common::engine_run::untrusted(),
        ..OpenOptions::default()
    };
    let img: Image<AnyStorage> = Image::open(&engine_run::opener(), &args.filename, &opts)
        .await
        .map_err(OpenError::from)?;
    let outcome = match new_size(&requested, img.size(), args.shrink, prealloc) {
        Ok(size) => img
            .resize(size, prealloc)
            .await
            .map_err(ResizeCliError::Resize),
        Err(e) => Err(e),
    };
    // Stores the bitmaps at their new size and makes everything durable.
    let closed = img.close().await.map_err(ResizeCliError::Resize);
    outcome.and(closed)?;
    if !args.quiet {
        println!("Image resized.");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(s: &str, current: u64, shrink: bool) -> Result<u64, String> {
        let r = parse_requested(s).map_err(|e| e.to_string())?;
        new_size(&r, current, shrink, Preallocation::Off).map_err(|e| e.to_string())
    }

    #[test]
    fn sizes_read_as_qemu_img_reads_them() {
        assert_eq!(size("+1M", 1 << 20, false), Ok(2 << 20));
        assert_eq!(size("-512", 1 << 20, true), Ok((1 << 20) - 512));
        assert_eq!(size("2G", 1 << 20, false), Ok(2 << 30));
        assert!(size("-1M", 1 << 20, true).unwrap_err().contains("positive"));
        assert!(size("0", 1 << 20, true).unwrap_err().contains("positive"));
        assert!(size("9E", 1 << 20, true).unwrap_err().contains("positive"));
        assert!(size("512", 1 << 20, false)
            .unwrap_err()
            .contains("--shrink"));
        assert!(size("1x", 1 << 20, false)
            .unwrap_err()
            .contains("Parameter 'size'"));
        assert!(size("+", 1 << 20, false)
            .unwrap_err()
            .contains("Parameter 'size'"));
    }
}
