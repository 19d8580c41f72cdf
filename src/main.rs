//! `qcow2-nbd`: qemu-img-like tools for qcow2 images and an NBD server that exports them.

mod common;
mod daemon;
mod tools;

use common::{engine_run, image_name, malloc_tuning, prog, secrets};
use daemon::{ctl, serve};
use tools::{
    amend, bitmap, check, commit, compare, convert, create, dd, info, map, measure, rebase, resize,
    snapshot,
};

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

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
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Image locks, as QEMU takes them (its `locking=` option): `auto` locks where the kernel
    /// has OFD locks, `on` fails where it has none, `off` takes no locks, so QEMU or another
    /// qcow2-nbd may write the image at the same time and corrupt it.
    #[arg(
        long,
        global = true,
        value_name = "auto|on|off",
        default_value = "auto"
    )]
    locking: storage::Locking,
    /// Read each image name as a `key=value,...` list of QEMU block options
    /// (`driver=qcow2,file.filename=PATH`), as qemu-img's `--image-opts` does. Without it,
    /// `json:{...}` names and the `file:` prefix are read as QEMU reads them.
    #[arg(long, global = true)]
    image_opts: bool,
    /// The image comes from someone not trusted with this host's files (an upload): every
    /// file it names (backing file, external data file, `json:` names) is refused at open,
    /// before anything is read, unless it resolves (symlinks and `..` followed) inside an
    /// `--allow-dir`; names that are not files (NBD, `null-co`, `blkdebug`) are refused.
    /// See docs/untrusted.md.
    #[arg(long, global = true)]
    untrusted: bool,
    /// A directory whose files an `--untrusted` image (or a `serve --export` with
    /// `untrusted=on`) may name as its backing or data files. Repeatable.
    #[arg(long = "allow-dir", global = true, value_name = "DIR")]
    allow_dir: Vec<std::path::PathBuf>,
    /// Most internal snapshots an untrusted image may declare.
    #[arg(long, global = true, value_name = "N", default_value_t = qcow2::declared::Caps::default().max_snapshots)]
    untrusted_max_snapshots: u32,
    /// Most persistent bitmaps an untrusted image may declare.
    #[arg(long, global = true, value_name = "N", default_value_t = qcow2::declared::Caps::default().max_bitmaps)]
    untrusted_max_bitmaps: u32,
    /// Most PBKDF2 iterations an untrusted image's LUKS header may declare, its key slots
    /// and master key digest together (what a wrong password costs).
    #[arg(long, global = true, value_name = "N", default_value_t = qcow2::declared::Caps::default().max_kdf_iterations)]
    untrusted_max_kdf_iterations: u64,
}

/// The subcommands; each lives in its own module.
#[derive(Subcommand, Debug)]
enum Command {
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

fn main() -> ExitCode {
    malloc_tuning::tune_for_io_buffers();
    // The matches are kept: `bitmap` runs its operations in command-line order, which only
    // they record.
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let personality = prog::Personality::from_argv0(args.first());
    prog::set(personality);
    if personality != prog::Personality::Native {
        // QEMU's tools print what the repair of a dirty image on open finds, as `check -r
        // all` prints it; our own name keeps it in the log.
        qcow2::check::report_repairs_to(|f| match f.kind {
            qcow2::check::FindingKind::Reported => {
                eprintln!("{}: {}", prog::name(), f.message)
            }
            _ => eprintln!("{}", f.message),
        });
    }
    let name = personality.name();
    let argv0 = args
        .first()
        .map_or_else(|| name.to_owned(), |a| a.to_string_lossy().into_owned());
    let args = match secrets::take_from_args(personality.native_args(args)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{name}: {e}");
            return ExitCode::FAILURE;
        }
    };
    // As with QEMU's tools (getopt), an option given twice takes its last value.
    let parsed = personality
        .shape(Cli::command(), &argv0)
        .args_override_self(true)
        .name(name)
        .bin_name(name)
        .try_get_matches_from(args)
        .and_then(|m| Cli::from_arg_matches(&m).map(|cli| (m, cli)));
    let (matches, mut cli) = match parsed {
        Ok(p) => p,
        // QEMU's tools exit 1 on a bad command line; ours, as clap does, 2.
        Err(e) if e.use_stderr() && personality != prog::Personality::Native => {
            let _ = e.print();
            return ExitCode::FAILURE;
        }
        Err(e) => e.exit(),
    };
    engine_run::set_locking(cli.locking);
    let caps = qcow2::declared::Caps {
        max_snapshots: cli.untrusted_max_snapshots,
        max_bitmaps: cli.untrusted_max_bitmaps,
        max_kdf_iterations: cli.untrusted_max_kdf_iterations,
    };
    if let Err(e) = engine_run::set_untrusted(cli.untrusted, &cli.allow_dir, caps) {
        eprintln!("{}: {e}", prog::name());
        return ExitCode::FAILURE;
    }
    if let Err(e) = resolve_image_names(&mut cli.command, cli.image_opts) {
        eprintln!("{}: {e}", prog::name());
        return ExitCode::FAILURE;
    }
    let result = match &cli.command {
        Command::Info(args) => info::run(args),
        Command::Check(args) => return check::main(args),
        Command::Create(args) => return create::main(args),
        Command::Map(args) => return map::main(args),
        Command::Convert(args) => return convert::main(args),
        Command::Compare(args) => return compare::main(args),
        Command::Dd(args) => return dd::main(args),
        Command::Measure(args) => return measure::main(args),
        Command::Serve(args) => return serve::run(args),
        Command::Ctl(args) => return ctl::main(args),
        Command::Resize(args) => return resize::main(args),
        Command::Amend(args) => return amend::main(args),
        Command::Commit(args) => return commit::main(args),
        Command::Rebase(args) => return rebase::main(args),
        Command::Snapshot(args) => return snapshot::main(args),
        Command::Bitmap(args) => {
            let sub = matches.subcommand_matches("bitmap").cloned();
            return bitmap::main(args, &sub.unwrap_or_default());
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}: {e}", prog::name());
            ExitCode::FAILURE
        }
    }
}
