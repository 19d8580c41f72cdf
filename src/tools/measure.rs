//! `qcow2-nbd measure`: the file size a new qcow2 or raw image needs, for a given virtual size
//! or to hold a copy of an existing image (`convert`), with qemu-img measure's numbers, option
//! checks, messages and output layouts.
//!
//! The formulas are in `qcow2::measure`; this module reads the options and, for a source
//! image, walks its allocation: data clusters count, zeros and holes do not (the target has no
//! backing file, so they read as zeros there too).

use qcow2::format::GuestOffset;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use qcow2::engine::{EngineError, Format, Image, Preallocation};
use qcow2::measure::{self, MeasureError, RequiredData, SourceBitmap, Target};
use storage::AnyStorage;

use crate::common::engine_run::{self, OpenError};
use crate::common::options::{self, OptionsError, Parsed, Spec};
use crate::tools::convert::{snapshot_param, ConvertError};
use crate::tools::create::{self, CreateError};

/// How much of the source one block-status query covers.
const QUERY_BYTES: u64 = 1 << 30;

/// Output layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MeasureOutput {
    /// `required size: N` lines.
    Human,
    /// qemu-img's JSON object.
    Json,
}

/// Arguments of `measure`.
#[derive(Args, Debug)]
pub struct MeasureArgs {
    /// Output layout.
    #[arg(long, value_enum, default_value_t = MeasureOutput::Human)]
    pub output: MeasureOutput,
    /// Format of the image to create: raw (the default, as in qemu-img) or qcow2.
    #[arg(short = 'O', long = "target-format", default_value = "raw")]
    pub target_format: String,
    /// Options of the image to create, as for `create` (`-o help` lists them); may be
    /// repeated.
    #[arg(short = 'o', long = "options")]
    pub options: Vec<String>,
    /// Measure a new empty image of this virtual size (suffixes k, M, G, T, P, E) instead of a
    /// copy of FILENAME.
    #[arg(short = 's', long = "size", allow_hyphen_values = true)]
    pub size: Option<String>,
    /// Format of FILENAME (qcow2 or raw); probed when not given.
    #[arg(short = 'f', long = "format")]
    pub format: Option<String>,
    /// Measure a copy of this internal snapshot of FILENAME: its id or name, or
    /// `snapshot.id=ID` / `snapshot.name=NAME`.
    #[arg(short = 'l', long = "snapshot")]
    pub snapshot: Option<String>,
    #[command(flatten)]
    pub share: crate::common::engine_run::ForceShare,
    /// The image whose copy (`convert`) is measured: only its data clusters count.
    pub filename: Option<PathBuf>,
}

/// Why `measure` failed; the messages are qemu-img's where it has one.
#[derive(Debug, thiserror::Error)]
pub enum MeasureCliError {
    /// Neither a size nor an image.
    #[error("Either --size N or one filename must be specified.")]
    NothingToMeasure,
    /// Both a size and an image.
    #[error("--size N cannot be used together with a filename.")]
    SizeAndFile,
    /// Source options without a source.
    #[error("-f and -l require a filename argument.")]
    SourceOptionsWithoutFile,
    /// A bad `--size`.
    #[error("{0}")]
    Size(CreateError),
    /// A bad `-o` list.
    #[error("{0}")]
    List(OptionsError),
    /// An `-o` entry the target format does not take.
    #[error("{source}\nInvalid options for file format '{format}'")]
    Options {
        /// The target format.
        format: &'static str,
        /// What is wrong.
        source: OptionsError,
    },
    /// A value of an option the measurement reads is refused.
    #[error("{0}")]
    Invalid(String),
    /// The size cannot be measured.
    #[error("{0}")]
    Measure(#[from] MeasureError),
    /// A bad `-l` parameter.
    #[error(transparent)]
    Snapshot(#[from] ConvertError),
    /// The source could not be opened.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// Block status of the source failed.
    #[error("Unable to get block status: {0}")]
    BlockStatus(EngineError),
    /// Reading the source's bitmaps failed.
    #[error("Unable to read the persistent bitmaps: {0}")]
    Bitmaps(EngineError),
    /// Writing the result, or starting the runtime, failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// What was measured, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Measured {
    /// The file size of the new image with what must be written.
    pub required: u64,
    /// The file size of the new image fully allocated.
    pub fully_allocated: u64,
    /// What the source's persistent bitmaps add, when both images can hold bitmaps.
    pub bitmaps: Option<u64>,
}

impl Measured {
    /// The report in qemu-img's layouts (its JSON puts `bitmaps` first).
    pub fn render(&self, output: MeasureOutput) -> String {
        match output {
            MeasureOutput::Human => {
                let mut s = format!(
                    "required size: {}\nfully allocated size: {}\n",
                    self.required, self.fully_allocated
                );
                if let Some(b) = self.bitmaps {
                    s.push_str(&format!("bitmaps size: {b}\n"));
                }
                s
            }
            MeasureOutput::Json => {
                let bitmaps = self
                    .bitmaps
                    .map_or_else(String::new, |b| format!("    \"bitmaps\": {b},\n"));
                format!(
                    "{{\n{bitmaps}    \"required\": {},\n    \"fully-allocated\": {}\n}}\n",
                    self.required, self.fully_allocated
                )
            }
        }
    }
}

/// The qcow2 settings the measurement depends on, read with qemu-img measure's checks (which
/// differ from create's: `compat` takes only `0.10` and `1.1`, and compat=0.10 with extended
/// L2 entries is not refused).
#[derive(Debug, Clone, Copy)]
struct Qcow2Settings {
    target: Target,
    version: u32,
    preallocation: Preallocation,
    has_backing: bool,
    /// Bytes of a LUKS header's clusters (0 without LUKS).
    luks_len: u64,
}

fn qcow2_settings(p: &Parsed) -> Result<Qcow2Settings, MeasureCliError> {
    let invalid = |s: &str| Err(MeasureCliError::Invalid(s.to_string()));
    let extended_l2 = p.bool("extended_l2").unwrap_or(false);
    let cluster_size = p.num("cluster_size").unwrap_or(65536);
    if !cluster_size.is_power_of_two() || !(512..=2 << 20).contains(&cluster_size) {
        return invalid("Cluster size must be a power of two between 512 and 2048k");
    }
    if extended_l2 && cluster_size < 16384 {
        return invalid(
            "Extended L2 entries are only supported with cluster sizes of at least 16384 bytes",
        );
    }
    let version = match p.str("compat") {
        None | Some("1.1") => 3,
        Some("0.10") => 2,
        Some(other) => {
            return Err(MeasureCliError::Invalid(format!(
                "Invalid compatibility level: '{other}'"
            )))
        }
    };
    let refcount_bits = p.num("refcount_bits").unwrap_or(16);
    if refcount_bits > 64 || !refcount_bits.is_power_of_two() {
        return invalid("Refcount width must be a power of two and may not exceed 64 bits");
    }
    if version < 3 && refcount_bits != 16 {
        return invalid("Different refcount widths than 16 bits require compatibility level 1.1 or above (use compat=1.1 or greater)");
    }
    let preallocation = match p.str("preallocation") {
        None => Preallocation::Off,
        Some(s) => Preallocation::from_name(s)
            .ok_or_else(|| MeasureCliError::Invalid(format!("invalid parameter value: {s}")))?,
    };
    // A LUKS header takes clusters of its own; its size follows from the cipher.
    let luks_len = match super::create::encryption_settings(p).map_err(MeasureCliError::Invalid)? {
        Some(qcow2::engine::NewEncryption::Luks { opts, .. }) => {
            qcow2::crypto::luks::area_len(&opts).next_multiple_of(cluster_size)
        }
        _ => 0,
    };
    Ok(Qcow2Settings {
        target: Target {
            cluster_size,
            refcount_order: refcount_bits.trailing_zeros(),
            extended_l2,
        },
        version,
        preallocation,
        has_backing: p.has("backing_file"),
        luks_len,
    })
}

/// The source image and the size a copy of it has.
struct Source {
    img: Image<AnyStorage>,
    size: u64,
}

/// Bytes of data clusters a qcow2 copy of `src` needs (`cluster_size`-byte clusters).
async fn required_data(src: &Source, cluster_size: u64) -> Result<u64, MeasureCliError> {
    let mut counter = RequiredData::new(cluster_size);
    // With -l the snapshot may be shorter than the copy: past its end the copy reads zeros.
    let end = src.size.min(src.img.size());
    let mut pos = 0;
    while pos < end {
        let len = QUERY_BYTES.min(end - pos);
        let extents = src
            .img
            .block_status(GuestOffset(pos), len)
            .await
            .map_err(MeasureCliError::BlockStatus)?;
        for e in extents.iter().filter(|e| e.present && e.data && !e.zero) {
            counter.data(e.start, e.len);
        }
        pos += len;
    }
    Ok(counter.bytes())
}

/// qemu-img measure for a qcow2 target.
async fn measure_qcow2(
    parsed: &Parsed,
    size: u64,
    source: Option<&Source>,
) -> Result<Measured, MeasureCliError> {
    let s = qcow2_settings(parsed)?;
    let cs = s.target.cluster_size;
    s.target.check_virtual_size(size)?;
    let round = |n: u64| {
        n.checked_next_multiple_of(cs)
            .ok_or(MeasureError::Overflow(n))
    };
    let mut virtual_size = round(size)?;
    let mut required = 0;
    if let Some(src) = source {
        virtual_size = round(src.size)?;
        // The new image's backing file may share nothing with the source: count it all.
        required = match s.has_backing {
            true => virtual_size,
            false => required_data(src, cs).await?,
        };
    }
    if matches!(s.preallocation, Preallocation::Full | Preallocation::Falloc) {
        required = virtual_size;
    }
    let fully_allocated = s.target.fully_allocated(virtual_size)? + s.luks_len;
    // QEMU keeps the fully allocated metadata in the required size (an overestimate).
    let required = fully_allocated - virtual_size + required;
    let bitmaps = match source {
        Some(src) if s.version >= 3 && src.img.supports_persistent_bitmaps() => {
            let list = src.img.bitmaps().await.map_err(MeasureCliError::Bitmaps)?;
            let list: Vec<SourceBitmap> = list
                .iter()
                .map(|b| SourceBitmap {
                    name_len: b.name.len(),
                    granularity: b.granularity,
                })
                .collect();
            Some(measure::bitmaps_size(&list, src.img.size(), cs))
        }
        _ => None,
    };
    Ok(Measured {
        required,
        fully_allocated,
        bitmaps,
    })
}

/// qemu-img measure for a raw target: the whole disk, in 512-byte sectors.
fn measure_raw(size: u64, source: Option<&Source>) -> Result<Measured, MeasureCliError> {
    let size = source.map_or(size, |s| s.size);
    let bytes = size
        .checked_next_multiple_of(512)
        .ok_or(MeasureError::Overflow(size))?;
    Ok(Measured {
        required: bytes,
        fully_allocated: bytes,
        bitmaps: None,
    })
}

/// A LUKS volume holds its header and every byte of the disk (unwritten sectors are
/// enciphered too), whatever is allocated in the source.
fn measure_luks(
    parsed: &Parsed,
    size: u64,
    source: Option<&Source>,
) -> Result<Measured, MeasureCliError> {
    let size = source.map_or(size, |s| s.size);
    let opts = create::luks_header_settings(parsed).map_err(MeasureCliError::Invalid)?;
    let bytes = qcow2::crypto::luks::area_len(&opts)
        .checked_add(size)
        .ok_or(MeasureError::Overflow(size))?;
    Ok(Measured {
        required: bytes,
        fully_allocated: bytes,
        bitmaps: None,
    })
}

/// Opens FILENAME (at the `-l` snapshot, if any); the size of a copy is the active disk's,
/// as for `convert -l`.
async fn open_source(args: &MeasureArgs, path: &Path) -> Result<Source, MeasureCliError> {
    let snapshot = args.snapshot.as_deref().map(snapshot_param).transpose()?;
    let format = args
        .format
        .as_deref()
        .map(engine_run::parse_format)
        .transpose()?;
    let force = args.share.force_share;
    let img = engine_run::open_read_only(path, format, snapshot.clone(), force).await?;
    let size = match snapshot {
        Some(_) => engine_run::open_read_only(path, format, None, force)
            .await?
            .size(),
        None => img.size(),
    };
    Ok(Source { img, size })
}

/// The option table `measure` reads for a target format.
fn option_specs(format: Format) -> Vec<Spec> {
    // create's table, the external data file and the file's options included (they do
    // not change the size).
    create::option_table(format)
}

async fn run(args: &MeasureArgs) -> Result<(), MeasureCliError> {
    let target = engine_run::parse_format(&args.target_format)?;
    let specs = option_specs(target);
    let list = options::join_lists(&args.options).map_err(MeasureCliError::List)?;
    if list.as_deref().is_some_and(options::wants_help) {
        print!("{}", options::help_text(&specs));
        return Ok(());
    }
    let path = match (&args.filename, &args.size) {
        (None, _) if args.format.is_some() || args.snapshot.is_some() => {
            return Err(MeasureCliError::SourceOptionsWithoutFile)
        }
        (Some(_), Some(_)) => return Err(MeasureCliError::SizeAndFile),
        (None, None) => return Err(MeasureCliError::NothingToMeasure),
        (p, _) => p.clone(),
    };
    let size_arg = args
        .size
        .as_deref()
        .map(create::parse_image_size)
        .transpose()
        .map_err(MeasureCliError::Size)?;
    let source = match &path {
        Some(p) => Some(open_source(args, p).await?),
        None => None,
    };
    let parsed = match list.as_deref() {
        Some(l) => Parsed::parse(l, &specs, &[]).map_err(|source| MeasureCliError::Options {
            format: engine_run::format_name(target),
            source,
        })?,
        None => Parsed::default(),
    };
    let size = size_arg.or(parsed.num("size")).unwrap_or(0);
    let measured = match target {
        Format::Qcow2 => measure_qcow2(&parsed, size, source.as_ref()).await?,
        Format::Raw => measure_raw(size, source.as_ref())?,
        Format::Luks => measure_luks(&parsed, size, source.as_ref())?,
    };
    let mut out = std::io::stdout().lock();
    out.write_all(measured.render(args.output).as_bytes())?;
    out.flush()?;
    Ok(())
}

/// Runs `measure` and returns the exit status.
pub fn main(args: &MeasureArgs) -> ExitCode {
    let res = engine_run::block_on(run(args)).map_err(MeasureCliError::from);
    engine_run::exit_code(res.and_then(|r| r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_qemu_imgs() {
        let m = Measured {
            required: 327680,
            fully_allocated: 67436544,
            bitmaps: Some(196608),
        };
        assert_eq!(
            m.render(MeasureOutput::Human),
            "required size: 327680\nfully allocated size: 67436544\nbitmaps size: 196608\n"
        );
        assert_eq!(
            m.render(MeasureOutput::Json),
            "{\n    \"bitmaps\": 196608,\n    \"required\": 327680,\n    \"fully-allocated\": 67436544\n}\n"
        );
        let m = Measured { bitmaps: None, ..m };
        assert_eq!(
            m.render(MeasureOutput::Json),
            "{\n    \"required\": 327680,\n    \"fully-allocated\": 67436544\n}\n"
        );
    }
}
