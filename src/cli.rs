//! The command line's shape: the global options, the subcommands (each defined by its
//! module in `tools` or `daemon`), the image names read before a subcommand runs, and the
//! hand-off to the subcommand. The one place that names both `tools` and `daemon`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::common::{image_name, startup};
use crate::daemon::{ctl, serve};
use crate::tools::{
    amend, bitmap, check, commit, compare, convert, create, dd, info, map, measure, rebase, resize,
    snapshot,
};

/// Command-line interface.
#[derive(Parser, Debug)]
#[command(
    name = "qcow2-nbd",
    version,
    about = "qcow2 image tools",
    after_help = "Invoked as `qemu-img` (a link or `exec -a`), it takes qemu-img's command \
                  lines; as `qemu-nbd`, serve's options without the subcommand. Messages \
                  then begin with that name."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Image locks, as QEMU takes them (its `locking=` option): `auto` locks where the kernel
    /// has OFD locks, `on` fails where it has none, `off` takes no locks, so QEMU or another
    /// qcow2-nbd may write the image at the same time and corrupt it.
    #[arg(
        long,
        global = true,
        value_name = "auto|on|off",
        default_value = "auto"
    )]
    pub locking: storage::Locking,
    /// Read each image name as a `key=value,...` list of QEMU block options
    /// (`driver=qcow2,file.filename=PATH`), as qemu-img's `--image-opts` does. Without it,
    /// `json:{...}` names and the `file:` prefix are read as QEMU reads them.
    #[arg(long, global = true)]
    pub image_opts: bool,
    /// The image comes from someone not trusted with this host's files (an upload): every
    /// file it names (backing file, external data file, `json:` names) is refused at open,
    /// before anything is read, unless it resolves (symlinks and `..` followed) inside an
    /// `--allow-dir`; names that are not files (NBD, `null-co`, `blkdebug`) are refused.
    /// See docs/untrusted.md.
    #[arg(long, global = true)]
    pub untrusted: bool,
    /// A directory whose files an `--untrusted` image (or a `serve --export` with
    /// `untrusted=on`) may name as its backing or data files. Repeatable.
    #[arg(long = "allow-dir", global = true, value_name = "DIR")]
    pub allow_dir: Vec<std::path::PathBuf>,
    /// Most internal snapshots an untrusted image may declare.
    #[arg(long, global = true, value_name = "N", default_value_t = qcow2::declared::Caps::default().max_snapshots)]
    pub untrusted_max_snapshots: u32,
    /// Most persistent bitmaps an untrusted image may declare.
    #[arg(long, global = true, value_name = "N", default_value_t = qcow2::declared::Caps::default().max_bitmaps)]
    pub untrusted_max_bitmaps: u32,
    /// Most PBKDF2 iterations an untrusted image's LUKS header may declare, its key slots
    /// and master key digest together (what a wrong password costs).
    #[arg(long, global = true, value_name = "N", default_value_t = qcow2::declared::Caps::default().max_kdf_iterations)]
    pub untrusted_max_kdf_iterations: u64,
}

/// The subcommands; each lives in its own module.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Show what a qcow2 image contains, like `qemu-img info`.
    Info(info::InfoArgs),
    /// Check a qcow2 image for consistency and repair it, like `qemu-img check`.
    Check(check::CheckArgs),
    /// Create a new qcow2 or raw image, like `qemu-img create`.
    Create(create::CreateArgs),
    /// Show which layer and file holds each guest byte, like `qemu-img map`.
    Map(map::MapArgs),
    /// Copy an image into a new raw or qcow2 image, like `qemu-img convert`.
    Convert(convert::ConvertArgs),
    /// Compare what a guest sees of two images, like `qemu-img compare`.
    Compare(compare::CompareArgs),
    /// Copy an image block by block into a new image, like `qemu-img dd`.
    Dd(dd::DdArgs),
    /// Calculate the file size a new image needs, like `qemu-img measure`.
    Measure(measure::MeasureArgs),
    /// Export an image over NBD, like `qemu-nbd`.
    Serve(Box<serve::ServeArgs>),
    /// Send a command to a running server's control socket (`serve --control`).
    Ctl(ctl::CtlArgs),
    /// Change an image's persistent dirty bitmaps, like `qemu-img bitmap`.
    Bitmap(bitmap::BitmapArgs),
    /// Change an image's virtual size, like `qemu-img resize`.
    Resize(resize::ResizeArgs),
    /// Change a qcow2 image's options in place, like `qemu-img amend`.
    Amend(amend::AmendArgs),
    /// Copy an image's data into its backing file and empty it, like `qemu-img commit`.
    Commit(commit::CommitArgs),
    /// Change an image's backing file, keeping what it reads, like `qemu-img rebase`.
    Rebase(rebase::RebaseArgs),
    /// List, create, apply or delete internal snapshots, like `qemu-img snapshot`.
    Snapshot(snapshot::SnapshotArgs),
}

/// Reads the image names of the subcommands that take QEMU's image names (`json:`, `file:`,
/// `--image-opts`) into the file and format each subcommand opens.
fn resolve_image_names(
    cmd: &mut Command,
    opts: bool,
) -> Result<(), storage::opener::name::NameError> {
    use image_name::{resolve, resolve_opt};
    match cmd {
        Command::Info(a) => resolve(&mut a.image, &mut a.format, opts),
        Command::Check(a) => resolve(&mut a.image, &mut a.format, opts),
        Command::Map(a) => resolve(&mut a.image, &mut a.format, opts),
        Command::Convert(a) => {
            // Every name but the last is a source; each is read with the formats given.
            let sources = a.files.len().saturating_sub(1);
            let given = a.source_format.clone();
            for file in &mut a.files[..sources] {
                let mut format = given.clone();
                resolve(file, &mut format, opts)?;
                if format.is_some() {
                    a.source_format = format;
                }
            }
            // An existing target (-n) is named as QEMU names an image to open: a `json:`
            // name, or an option string with --target-image-opts, whose driver is its format.
            if a.no_create {
                if let Some(target) = a.files.last_mut() {
                    let mut format = None;
                    resolve(target, &mut format, a.target_image_opts)?;
                    if let Some(f) = format {
                        a.target_format = f;
                    }
                }
            }
            Ok(())
        }
        Command::Compare(a) => {
            resolve(&mut a.first, &mut a.a_format, opts)?;
            resolve(&mut a.second, &mut a.b_format, opts)
        }
        Command::Measure(a) => resolve_opt(&mut a.filename, &mut a.format, opts),
        Command::Bitmap(a) => resolve(&mut a.filename, &mut a.format, opts),
        Command::Resize(a) => resolve(&mut a.filename, &mut a.format, opts),
        Command::Amend(a) => resolve_opt(&mut a.filename, &mut a.format, opts),
        Command::Commit(a) => resolve(&mut a.top, &mut a.format, opts),
        Command::Rebase(a) => resolve(&mut a.image, &mut a.format, opts),
        Command::Snapshot(a) => resolve(&mut a.filename, &mut a.format, opts),
        Command::Serve(a) => {
            let Some(image) = a.image.as_mut() else {
                return Ok(());
            };
            let mut format = a.format.map(|f| f.name().to_string());
            resolve(image, &mut format, opts)?;
            a.format = format.as_deref().and_then(serve::FormatArg::from_name);
            Ok(())
        }
        Command::Create(_) | Command::Dd(_) | Command::Ctl(_) => Ok(()),
    }
}

impl Cli {
    /// Sets the global options and reads the image names; then runs the subcommand.
    /// `matches` are the parse's, which `bitmap` reads its operations' order from.
    pub fn run(mut self, matches: &clap::ArgMatches) -> ExitCode {
        let globals = startup::Globals {
            locking: self.locking,
            untrusted: self.untrusted,
            allow_dir: &self.allow_dir,
            caps: qcow2::declared::Caps {
                max_snapshots: self.untrusted_max_snapshots,
                max_bitmaps: self.untrusted_max_bitmaps,
                max_kdf_iterations: self.untrusted_max_kdf_iterations,
            },
        };
        if let Err(code) = startup::apply(globals) {
            return code;
        }
        if let Err(e) = resolve_image_names(&mut self.command, self.image_opts) {
            return startup::fail(&e);
        }
        self.command.run(matches)
    }
}

impl Command {
    /// Hands off to the subcommand's module.
    fn run(&self, matches: &clap::ArgMatches) -> ExitCode {
        match self {
            Command::Info(args) => {
                info::run(args).map_or_else(|e| startup::fail(&e), |()| ExitCode::SUCCESS)
            }
            Command::Check(args) => check::main(args),
            Command::Create(args) => create::main(args),
            Command::Map(args) => map::main(args),
            Command::Convert(args) => convert::main(args),
            Command::Compare(args) => compare::main(args),
            Command::Dd(args) => dd::main(args),
            Command::Measure(args) => measure::main(args),
            Command::Serve(args) => serve::run(args),
            Command::Ctl(args) => ctl::main(args),
            Command::Resize(args) => resize::main(args),
            Command::Amend(args) => amend::main(args),
            Command::Commit(args) => commit::main(args),
            Command::Rebase(args) => rebase::main(args),
            Command::Snapshot(args) => snapshot::main(args),
            Command::Bitmap(args) => {
                let sub = matches.subcommand_matches("bitmap").cloned();
                bitmap::main(args, &sub.unwrap_or_default())
            }
        }
    }
}
