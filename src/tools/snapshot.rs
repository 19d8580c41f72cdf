//! `qcow2-nbd snapshot`: list, create, apply and delete the internal snapshots of a qcow2
//! image, with `qemu-img snapshot`'s options, messages and exit codes.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use qcow2::engine::{libc_errno, EngineError, Format, Image, OpenOptions, SnapshotError};
use qcow2::inspect::{snapshot_list, SnapshotInfo};
use storage::AnyStorage;

use crate::common::engine_run::{self, ForceShare, OpenError};

/// `qcow2-nbd snapshot` options.
#[derive(Args, Debug)]
#[command(
    about = "List, create, apply or delete internal snapshots, like `qemu-img snapshot`",
    long_about = "List, create, apply or delete the internal snapshots of a qcow2 image, like \
        `qemu-img snapshot`.\n\n\
        Give at most one of -l, -c, -a, -d; without one the snapshots are listed. A snapshot \
        holds the disk only (no VM state). -c, -a and -d open the image for writing: they \
        fail while another process (a VM, qemu-nbd, `qcow2-nbd serve`) has it open."
)]
pub struct SnapshotArgs {
    /// List the snapshots of FILENAME (the default).
    #[arg(short = 'l', long = "list")]
    list: bool,
    /// Create a snapshot of the disk as it is now, named SNAPSHOT (at most 255 bytes; longer
    /// names are cut, as qemu-img cuts them). Names need not be unique: each snapshot gets
    /// the next free numeric ID.
    #[arg(short = 'c', long = "create", value_name = "SNAPSHOT")]
    create: Option<String>,
    /// Revert the disk to snapshot SNAPSHOT (looked up by ID, then by name), including the
    /// disk size it had. What was written since is lost; the snapshot stays. Refused while
    /// the image has persistent dirty bitmaps, as qemu-img refuses it.
    #[arg(short = 'a', long = "apply", value_name = "SNAPSHOT")]
    apply: Option<String>,
    /// Delete the first snapshot named SNAPSHOT (by name only, as qemu-img looks it up) and
    /// free the clusters only it used.
    #[arg(short = 'd', long = "delete", value_name = "SNAPSHOT")]
    delete: Option<String>,
    /// Format of FILENAME (only qcow2 holds snapshots; default: probed).
    #[arg(short = 'f', long = "format", value_name = "FMT")]
    pub(crate) format: Option<String>,
    /// Quiet: print nothing but errors (and the list, which is what -l asks for).
    #[arg(short = 'q', long = "quiet")]
    quiet: bool,
    #[command(flatten)]
    force_share: ForceShare,
    /// The image.
    pub(crate) filename: PathBuf,
}

/// What the command was asked to do.
enum Action<'a> {
    List,
    Create(&'a str),
    Apply(&'a str),
    Delete(&'a str),
}

/// Why the command failed, in qemu-img's words.
#[derive(Debug, thiserror::Error)]
enum SnapshotCmdError {
    #[error("Cannot mix '-l', '-a', '-c', '-d'")]
    Mixed,
    #[error("Could not open '{0}': force-share=on can only be used with read-only images")]
    ForceShareWrite(String),
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("Could not create snapshot '{name}': {why}")]
    Create { name: String, why: String },
    #[error("Could not apply snapshot '{name}': {why}")]
    Apply { name: String, why: String },
    #[error("Could not delete snapshot '{name}': {why}")]
    Delete { name: String, why: String },
    #[error("{0}")]
    Engine(EngineError),
    #[error("{0}")]
    Runtime(std::io::Error),
}

/// Runs `qcow2-nbd snapshot`.
pub fn main(args: &SnapshotArgs) -> ExitCode {
    engine_run::exit_code(run(args))
}

fn action(args: &SnapshotArgs) -> Result<Action<'_>, SnapshotCmdError> {
    let given = [
        args.list,
        args.create.is_some(),
        args.apply.is_some(),
        args.delete.is_some(),
    ];
    if given.iter().filter(|&&g| g).count() > 1 {
        return Err(SnapshotCmdError::Mixed);
    }
    Ok(match (&args.create, &args.apply, &args.delete) {
        (Some(n), _, _) => Action::Create(n),
        (_, Some(n), _) => Action::Apply(n),
        (_, _, Some(n)) => Action::Delete(n),
        _ => Action::List,
    })
}

fn run(args: &SnapshotArgs) -> Result<(), SnapshotCmdError> {
    let action = action(args)?;
    let format = match &args.format {
        Some(f) => engine_run::parse_format(f)?,
        None => engine_run::probe_format(&args.filename)?,
    };
    if let Action::List = action {
        return engine_run::block_on(list(args, format)).map_err(SnapshotCmdError::Runtime)?;
    }
    if args.force_share.force_share {
        return Err(SnapshotCmdError::ForceShareWrite(
            args.filename.display().to_string(),
        ));
    }
    engine_run::block_on(change(args, format, action)).map_err(SnapshotCmdError::Runtime)?
}

async fn list(args: &SnapshotArgs, format: Format) -> Result<(), SnapshotCmdError> {
    let img = engine_run::open_read_only(
        &args.filename,
        Some(format),
        None,
        args.force_share.force_share,
    )
    .await?;
    let snapshots = img.snapshots().await.map_err(SnapshotCmdError::Engine)?;
    // qemu-img prints nothing at all for an image without snapshots.
    if !snapshots.is_empty() {
        let infos: Vec<SnapshotInfo> = snapshots.iter().map(SnapshotInfo::from_entry).collect();
        print!("{}", snapshot_list(&infos));
    }
    Ok(())
}

async fn change(
    args: &SnapshotArgs,
    format: Format,
    action: Action<'_>,
) -> Result<(), SnapshotCmdError> {
    let opts = OpenOptions {
        format: Some(format),
        untrusted: crate::common::engine_run::untrusted(),
        ..OpenOptions::default()
    };
    let img: Image<AnyStorage> = Image::open(&engine_run::opener(), &args.filename, &opts)
        .await
        .map_err(OpenError::from)?;
    let outcome = match action {
        Action::Create(name) => create(&img, name).await,
        Action::Apply(name) => apply(&img, name).await,
        Action::Delete(name) => delete(&img, name).await,
        Action::List => Ok(()),
    };
    let closed = img.close().await.map_err(SnapshotCmdError::Engine);
    outcome.and(closed)
}

/// qemu-img keeps a name in a 256-byte C string: longer names lose their tail.
const MAX_NAME_BYTES: usize = 255;

async fn create(img: &Image<AnyStorage>, name: &str) -> Result<(), SnapshotCmdError> {
    let bytes = &name.as_bytes()[..name.len().min(MAX_NAME_BYTES)];
    img.create_snapshot(bytes, now())
        .await
        .map(|_| ())
        .map_err(|e| SnapshotCmdError::Create {
            name: name.to_string(),
            why: reason(&e),
        })
}

async fn apply(img: &Image<AnyStorage>, name: &str) -> Result<(), SnapshotCmdError> {
    img.apply_snapshot(name).await.map_err(|e| {
        // qemu-img reports what is wrong with the snapshot's L1 table on a line of its own,
        // and then only that loading the snapshot failed, with the errno.
        if let EngineError::Snapshot {
            source: SnapshotError::L1Table(problem),
            ..
        } = &e
        {
            eprintln!("{}: {problem}", crate::common::prog::name());
        }
        SnapshotCmdError::Apply {
            name: name.to_string(),
            why: apply_reason(&e),
        }
    })
}

async fn delete(img: &Image<AnyStorage>, name: &str) -> Result<(), SnapshotCmdError> {
    let failed = |why: String| SnapshotCmdError::Delete {
        name: name.to_string(),
        why,
    };
    let snapshots = img.snapshots().await.map_err(|e| failed(reason(&e)))?;
    let Some(sn) = snapshots.iter().find(|s| s.name == name.as_bytes()) else {
        return Err(failed("snapshot not found".into()));
    };
    let errno_words =
        |e: &EngineError| engine_run::plain_io(&std::io::Error::from_raw_os_error(e.errno()));
    // QEMU reports a cluster it could not free and goes on: the cluster is only leaked.
    let leaked = |e: &EngineError| eprintln!("qcow2_free_clusters failed: {}", errno_words(e));
    match img.delete_snapshot(&sn.id, &sn.name).await {
        Ok(table_leaked) => {
            if let Some(e) = table_leaked {
                leaked(&e);
            }
            Ok(())
        }
        Err(EngineError::SnapshotRelease {
            source,
            table_leaked,
            ..
        }) => {
            if let Some(e) = table_leaked {
                leaked(&e);
            }
            Err(failed(format!(
                "Failed to free the cluster and L1 table: {}",
                errno_words(&source)
            )))
        }
        Err(e) => Err(failed(reason(&e))),
    }
}

/// The date qemu-img records: the wall clock to the microsecond.
fn now() -> (u32, u32) {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    // The field is 32 bits wide; QEMU keeps the low bits too.
    (t.as_secs() as u32, t.subsec_micros() * 1000)
}

/// Why an operation failed: for what QEMU refuses too, only its words (the errno text), as
/// scripts compare them; anything else in full.
fn reason(e: &EngineError) -> String {
    match e {
        // QEMU words this one itself.
        EngineError::Snapshot {
            source: SnapshotError::L1Table(problem),
            ..
        } => problem.to_string(),
        EngineError::Snapshot { source, .. } => errno_words(source),
        other => other.to_string(),
    }
}

/// The text of the errno QEMU fails with for `source`.
fn errno_words(source: &SnapshotError) -> String {
    engine_run::plain_io(&std::io::Error::from_raw_os_error(source.errno()))
}

/// [`reason`] for `-a`, where qemu-img words a few refusals its own way.
fn apply_reason(e: &EngineError) -> String {
    match e {
        EngineError::Snapshot { source, .. } => match source.errno() {
            libc_errno::ENOENT => "Failed to load snapshot: No such file or directory".into(),
            libc_errno::EBUSY => "Device has active dirty bitmaps".into(),
            _ if matches!(source, SnapshotError::L1Table(_)) => {
                format!("Failed to load snapshot: {}", errno_words(source))
            }
            _ if matches!(source, SnapshotError::NotQcow2) => {
                "Block driver does not support snapshots".into()
            }
            _ => reason(e),
        },
        other => reason(other),
    }
}
