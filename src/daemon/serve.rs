//! `qcow2-nbd serve IMAGE`: export an image over NBD with qemu-nbd's options; or
//! `serve --export name=...,file=... ...`: several images, each its own named export.
//!
//! The sequence: parse and check the flags, take any socket-activation sockets, `--fork` (while
//! the process still has one thread), then on a current-thread runtime: install the signal
//! handlers, open the images (or a `-s` overlay over the one image), bind the listeners,
//! write the pid file and release a `--fork` parent, and serve until the last client leaves
//! (without `-t`) or SIGINT/SIGTERM. Shutting down lets requests in flight finish, writes
//! the caches back and closes every image cleanly (lazy-refcount dirty bit cleared), then
//! exits 0.
//!
//! Files: `args` (the command line), `export_option` (one `--export` definition), `exports`
//! (the images served: opened all or none, closed all), `listen` (sockets), `daemon`
//! (`--fork`, `--pid-file`), `overlay` (`-s`), `cleaner` (`--cache-clean-interval`),
//! `signals`, `error` (every part's failure, gathered); the NBD export over the engine is
//! `crate::daemon::image_export`.

mod args;
mod banner;
mod cleaner;
mod control;
mod daemon;
mod error;
mod export_option;
mod list;
mod listen;
mod overlay;
mod registry;
mod served_images;
mod signals;

use std::io::IsTerminal;
use std::num::NonZeroUsize;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Duration;

use nbd_server::{Server, ServerConfig};
use qcow2::engine::{CacheOptions, OpenOptions};
use storage::FileOpener;

pub use args::{FormatArg, ServeArgs};
pub(crate) use control::qmp;
pub use error::ServeError;

use crate::common::tls;
use crate::daemon::image_export::{DetectZeroes, DiscardMode, ExportPolicy};
use crate::daemon::stats::http::{HttpLimits, MetricsServer};
use crate::daemon::stats::StatsRegistry;

/// Runs `serve` and reports any failure on stderr.
pub fn run(args: &ServeArgs) -> ExitCode {
    if args.list {
        return list_exports(args);
    }
    match serve(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}: {e}", crate::common::prog::name());
            ExitCode::FAILURE
        }
    }
}

/// `-L`: prints the exports of the server the address flags name.
fn list_exports(args: &ServeArgs) -> ExitCode {
    // As qemu-nbd's client: the server is looked for on localhost by default.
    let bind = args.bind.clone().or_else(|| Some("localhost".to_owned()));
    let endpoint = listen::Endpoint::from_flags(args.socket.clone(), bind, args.port);
    let tls = match tls::tls_client(&args.tls_flags()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{}: {e}", crate::common::prog::name());
            return ExitCode::FAILURE;
        }
    };
    match list::list(&endpoint, tls.as_ref(), args.tls_hostname.as_deref()) {
        Ok((mode, exports)) => {
            print!("{}", list::render(mode, &exports));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}: {e}", crate::common::prog::name());
            for hint in e.hints() {
                eprintln!("{hint}");
            }
            ExitCode::FAILURE
        }
    }
}

/// Everything the flags decide, checked.
struct Plan {
    opener: FileOpener,
    /// The images to serve.
    images: Vec<served_images::ImageSpec>,
    /// What every image is opened with (each adds its read-only flag and format).
    open: OpenOptions,
    policy: ExportPolicy,
    config: ServerConfig,
    endpoint: listen::Endpoint,
    /// An address was given on the command line.
    explicit_endpoint: bool,
    /// TLS every client must start, with its credentials loaded.
    tls: Option<nbd_server::tls::TlsServer>,
    /// Threads connections are spread over.
    threads: NonZeroUsize,
}

impl Plan {
    fn new(args: &ServeArgs) -> Result<Plan, ServeError> {
        let cache_mode = if args.nocache {
            crate::common::cache_mode::CacheMode::None
        } else {
            args.cache
        };
        let discard = DiscardMode::from(args.discard);
        let detect_zeroes = DetectZeroes::from(args.detect_zeroes);
        if detect_zeroes == DetectZeroes::Unmap && discard != DiscardMode::Unmap {
            return Err(ServeError::DetectZeroesUnmap);
        }
        let snapshot = args
            .load_snapshot
            .as_deref()
            .map(args::snapshot_param)
            .transpose()?;
        // Credentials are loaded first, so a mistake in them is reported before the image
        // is opened or the server forks.
        let tls = tls::tls_server(&args.tls_flags())?;
        let images = served_images::image_specs(args, snapshot.is_some())?;
        let direct = cache_mode.direct();
        let open = OpenOptions {
            read_only: false,
            format: None,
            cache: CacheOptions {
                l2_cache_size: args.l2_cache_size,
                l2_cache_entry_size: args.l2_cache_entry_size,
                refcount_cache_size: args.refcount_cache_size,
                cache_size: cache_share(args.cache_size, images.len()),
                cache_clean_interval: args.cache_clean_interval,
            },
            no_backing: false,
            snapshot,
            direct,
            discard_passthrough: discard == DiscardMode::Unmap,
            force_share: false,
            // Per image: see `ImageSpec::open_options`.
            passwords: Default::default(),
            no_io: false,
            data_file: None,
            untrusted: crate::common::engine_run::untrusted(),
            // Even with --cache=unsafe the engine's own ordering flushes stay (only the
            // clients' flushes are ignored): a served image lives on, and a host crash
            // should cost the writes not yet written, never a consistent image.
            ignore_flush: false,
            open_bound: storage::OpenBound {
                timeout: Duration::from_secs(args.open_timeout),
                max_stuck: usize::try_from(args.open_stuck_max).unwrap_or(usize::MAX),
            },
        };
        let policy = ExportPolicy {
            writethrough: cache_mode.writethrough(),
            ignore_flush: cache_mode.ignore_flush(),
            direct,
            discard,
            detect_zeroes,
            multi_conn: args.shared != 1,
            allocation_depth: args.allocation_depth,
            offset: args.offset.unwrap_or(0),
            // Per image: see `registry::entry`.
            probed_raw: false,
            compressed_writes: false,
            qemu_nbd_flags: crate::common::prog::current()
                == crate::common::prog::Personality::QemuNbd,
        };
        let config = ServerConfig {
            persistent: args.persistent,
            max_connections: NonZeroUsize::new(args.shared),
            handshake_timeout: (args.handshake_limit > 0)
                .then(|| Duration::from_secs(args.handshake_limit)),
            shutdown_grace: Duration::from_secs(args.shutdown_grace),
            max_open: args.max_connections,
            idle_timeout: (args.idle_timeout > 0).then(|| Duration::from_secs(args.idle_timeout)),
            connection_memory: usize::try_from(args.connection_memory).unwrap_or(usize::MAX),
            tcp_keepalive: (args.tcp_keepalive > 0)
                .then(|| Duration::from_secs(args.tcp_keepalive)),
        };
        Ok(Plan {
            opener: FileOpener {
                aio: args.aio.into(),
                direct,
                locking: crate::common::engine_run::locking(),
            },
            images,
            open,
            policy,
            config,
            endpoint: listen::Endpoint::from_flags(
                args.socket.clone(),
                args.bind.clone(),
                args.port,
            ),
            explicit_endpoint: args.socket.is_some() || args.bind.is_some() || args.port.is_some(),
            tls,
            threads: args.threads,
        })
    }
}

/// Each image's share of the `--cache-size` budget: equal parts, so the caches of all the
/// images together stay within it (QEMU's per-image minimums aside). One image gets it all.
fn cache_share(budget: Option<u64>, images: usize) -> Option<u64> {
    let images = u64::try_from(images.max(1)).unwrap_or(u64::MAX);
    budget.map(|b| b / images)
}

/// Logs go to stderr: warnings and errors only unless `--log` or `RUST_LOG` asks for more.
fn init_logging(level: args::LogLevel) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level.directive()));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// qemu-nbd's line for a client whose negotiation failed.
fn report_negotiation_failure(e: &str) {
    eprintln!(
        "{}: option negotiation failed: {}",
        crate::common::prog::name(),
        tls::qemu_negotiation_words(e)
    );
}

fn serve(args: &ServeArgs) -> Result<(), ServeError> {
    init_logging(args.log);
    // As qemu-nbd, say why a client was turned away (scripts and logs read these lines).
    if crate::common::prog::current() == crate::common::prog::Personality::QemuNbd {
        nbd_server::report_negotiation_failures(report_negotiation_failure);
    }
    let plan = Plan::new(args)?;
    // Before forking: LISTEN_PID names this process, not the child.
    let activated = nbd_server::systemd::listen_fds()?;
    let readiness = if args.fork {
        Some(daemon::fork_and_wait().map_err(ServeError::Fork)?)
    } else {
        None
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, serve_on_runtime(args, plan, activated, readiness))
}

async fn serve_on_runtime(
    args: &ServeArgs,
    mut plan: Plan,
    activated: Vec<nbd_server::systemd::ActivatedSocket>,
    readiness: Option<daemon::Readiness>,
) -> Result<(), ServeError> {
    let signals = signals::ShutdownSignals::install().map_err(ServeError::Runtime)?;
    let mut specs = std::mem::take(&mut plan.images);
    let overlay = match (args.snapshot, specs.first_mut()) {
        (true, Some(spec)) => {
            let open = spec.open_options(&plan.open);
            let o = overlay::create(&plan.opener, &spec.path, spec.format, &open).await?;
            tracing::info!(overlay = %o.path().display(), "writes go to a temporary overlay");
            spec.overlay = Some(o.path());
            Some(o)
        }
        _ => None,
    };
    let images = served_images::open_all(&plan.opener, specs, &plan.open).await?;
    if let Some(offset) = args.offset {
        let size = images.first().map_or(0, |i| i.image.size());
        if offset > size {
            if let Err(c) = served_images::close_all(images).await {
                tracing::error!(error = %c, "closing the image failed too");
            }
            return Err(ServeError::OffsetBeyondImage { offset, size });
        }
    }
    // Whatever happens from here on, the images are closed: a writable image's bitmaps are
    // marked in use until a clean close stores them.
    let settings = registry::OpenSettings {
        opener: plan.opener,
        open: plan.open.clone(),
        policy: plan.policy,
        // `query-stats` and `--metrics` read them; without either nothing is counted.
        stats: (args.metrics.is_some() || args.control.is_some())
            .then(|| Rc::new(StatsRegistry::default())),
    };
    let registry = match registry::Registry::start(images, settings).await {
        Ok(r) => r,
        Err((e, images)) => {
            if let Err(c) = served_images::close_all(images).await {
                tracing::error!(error = %c, "closing the images failed too");
            }
            return Err(e);
        }
    };
    let served = serve_images(args, plan, activated, readiness, &registry, signals).await;
    let closed = registry.close_all().await;
    let pid_file = match served {
        Ok((report, pid_file)) => {
            tracing::info!(?report, "server stopped");
            pid_file
        }
        Err(e) => {
            tracing::debug!(error = %e, "server failed");
            if let Err(c) = &closed {
                tracing::error!(error = %c, "closing the images failed too");
            }
            drop(overlay);
            return Err(e);
        }
    };
    drop(pid_file);
    drop(overlay);
    closed
}

/// What the banner says about TLS.
fn tls_hint(tls: &nbd_server::tls::TlsServer) -> String {
    use nbd_server::tls::CredsKind;
    let kind = match tls.kind() {
        CredsKind::X509 { verify_peer: true } => "x509 certificates, client certificates verified",
        CredsKind::X509 { verify_peer: false } => "x509 certificates",
        CredsKind::Psk => "pre-shared keys",
    };
    let authz = if tls.authz().is_some() { ", authz" } else { "" };
    format!("TLS required ({kind}{authz})")
}

/// The `--metrics` endpoint over `registry`, when asked for; it stops when dropped.
async fn start_metrics(
    args: &ServeArgs,
    registry: Option<&Rc<StatsRegistry>>,
) -> Result<Option<MetricsServer>, ServeError> {
    let (Some(addr), Some(registry)) = (args.metrics, registry) else {
        return Ok(None);
    };
    let limits = HttpLimits {
        max_scrapes: usize::from(args.metrics_scrapes),
        timeout: Duration::from_secs(args.metrics_timeout),
        head_timeout: Duration::from_secs(args.metrics_head_timeout),
        ..HttpLimits::default()
    };
    let m = MetricsServer::start(addr, Rc::clone(registry), limits).await?;
    tracing::info!(on = %m.addr(), "metrics at http://{}/metrics", m.addr());
    Ok(Some(m))
}

/// Serves the open images until a signal (or `-t`'s lifetime) ends it; returns the server's
/// report and the pid file, which goes once the images are closed.
async fn serve_images(
    args: &ServeArgs,
    plan: Plan,
    activated: Vec<nbd_server::systemd::ActivatedSocket>,
    readiness: Option<daemon::Readiness>,
    registry: &registry::Registry,
    signals: signals::ShutdownSignals,
) -> Result<(nbd_server::ServeReport, Option<daemon::PidFile>), ServeError> {
    let tls = plan.tls.as_ref().map(tls_hint);
    let mut server =
        Server::from_exports(registry.exports(), plan.config).with_threads(plan.threads);
    if let Some(creds) = plan.tls {
        server = server.with_tls(creds);
    }
    let listeners = listen::bind(activated, plan.explicit_endpoint, &plan.endpoint).await?;
    let _metrics = start_metrics(args, registry.stats()).await?;
    let control_socket = args.control.as_deref().map(control::bind).transpose()?;
    let names =
        registry.with_records(|r| r.iter().map(|r| r.spec.name.clone()).collect::<Vec<_>>());
    for (_, on) in &listeners {
        tracing::info!(on = %on, exports = ?names, "listening");
    }
    let pid_file = args
        .pid_file
        .as_deref()
        .map(|p| {
            let keep = crate::common::prog::current() == crate::common::prog::Personality::QemuNbd;
            daemon::PidFile::write(p, keep).map_err(|source| ServeError::PidFile {
                path: p.display().to_string(),
                source,
            })
        })
        .transpose()?;
    if readiness.is_none() {
        registry.with_records(|r| print_banner(r, &listeners, tls.as_deref()));
    }
    if let Some(r) = readiness {
        // Logs asked for by --log need stderr as much as -v's errors do.
        let keep_stderr = args.verbose > 0
            || matches!(
                args.log,
                args::LogLevel::Info | args::LogLevel::Debug | args::LogLevel::Trace
            );
        r.notify(keep_stderr).map_err(ServeError::Fork)?;
    }
    let limits = control::Limits {
        clients: usize::from(args.control_clients),
        max_command: usize::try_from(args.control_max_command.clamp(1 << 10, 16 << 20))
            .unwrap_or(control::DEFAULT_MAX_COMMAND),
    };
    let control = control_socket.map(|s| control::Control::start(s, registry.clone(), limits));
    let shutdown = signals.watch();
    let served = server
        .serve_until(
            listeners.into_iter().map(|(l, _)| l).collect(),
            shutdown.clone().requested(),
            shutdown.forced(),
        )
        .await;
    if let Some(c) = control {
        c.stop().await;
    }
    if let Some(stats) = registry.stats() {
        tracing::info!(total = %stats.total_json(), "statistics");
    }
    Ok((served?, pid_file))
}

fn print_banner(
    images: &[registry::Record],
    listeners: &[(nbd_server::Listener, String)],
    tls: Option<&str>,
) {
    let names: Vec<String> = listeners.iter().map(|(_, n)| n.clone()).collect();
    let exports: Vec<banner::BannerExport<'_>> = images
        .iter()
        .map(|i| banner::BannerExport {
            image: &i.spec.path,
            size: i.image.facts().size,
            name: &i.spec.name,
            read_only: i.image.facts().read_only,
        })
        .collect();
    banner::print(&banner::Banner {
        exports: &exports,
        listeners: &names,
        tls,
    });
}

#[cfg(test)]
mod tests {
    use super::cache_share;

    #[test]
    fn the_cache_budget_is_split_equally() {
        assert_eq!(cache_share(None, 3), None);
        assert_eq!(cache_share(Some(16 << 20), 1), Some(16 << 20));
        assert_eq!(cache_share(Some(16 << 20), 2), Some(8 << 20));
        assert_eq!(cache_share(Some(10), 3), Some(3));
        assert_eq!(cache_share(Some(10), 0), Some(10));
    }
}
