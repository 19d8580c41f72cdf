//! The `serve` command line: qemu-nbd's option names and defaults, and the checks that turn
//! it into settings (combinations qemu-nbd refuses are refused here too).

pub use super::export_option::FormatArg;
use std::path::PathBuf;

use clap::{Args, ValueEnum};

use crate::common::cache_mode::CacheMode;
use crate::common::size_string;
use crate::daemon::image_export::{DetectZeroes, DiscardMode};

/// Default of `--control-clients`.
pub const DEFAULT_CLIENTS: u16 = 16;

/// Export an image over NBD, like `qemu-nbd`.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Image to export (qcow2 or raw); or give `--export` instead.
    #[arg(required_unless_present_any = ["exports", "list"])]
    pub image: Option<PathBuf>,

    /// List the exports of the server at -k (or -b and -p; the default host is localhost)
    /// and exit, like `qemu-nbd -L`: a client, nothing is served. With --tls-creds, over TLS
    /// (credentials objects with endpoint=client).
    #[arg(
        short = 'L',
        long = "list",
        conflicts_with_all = ["image", "exports", "export_name", "description", "offset",
                              "format", "bitmaps", "snapshot", "load_snapshot", "fork",
                              "read_only", "allocation_depth", "control", "tls_authz",
                              "tls_certificates", "tls_psk", "tls_verify_peer"]
    )]
    pub list: bool,

    /// Export an image under a name, instead of the positional IMAGE (repeatable, up to
    /// 64):
    /// `name=NAME,file=PATH[,readonly=on|off][,format=qcow2|raw][,description=TEXT][,bitmap=B]...`
    /// (`,,` is a comma in a value; unknown or repeated keys are refused, only bitmap
    /// repeats). Each export has its own image and caches; the other options apply to
    /// every export. Clients select one by name and list them all with their descriptions
    /// (none unless given, as in QEMU). The single-image options -x, -D, -r, -f, -B, -s
    /// and -l are keys here or not available.
    #[arg(
        long = "export",
        value_name = "SPEC",
        value_parser = super::export_option::parse_export_spec,
        conflicts_with_all = ["image", "export_name", "description", "read_only", "format",
                              "bitmaps", "snapshot", "load_snapshot"]
    )]
    pub exports: Vec<super::export_option::ExportSpec>,

    /// Listen on this Unix socket instead of TCP.
    #[arg(short = 'k', long = "socket", value_name = "PATH", conflicts_with_all = ["port", "bind"])]
    pub socket: Option<PathBuf>,

    /// TCP port to listen on [default: 10809].
    #[arg(short = 'p', long, value_name = "PORT")]
    pub port: Option<u16>,

    /// Address or host name to listen on [default: 0.0.0.0].
    #[arg(short = 'b', long, value_name = "IFACE")]
    pub bind: Option<String>,

    /// Name of the export. Clients must ask for exactly this name (as with qemu-nbd: with
    /// `-x disk`, the empty name is refused).
    #[arg(
        short = 'x',
        long = "export-name",
        value_name = "NAME",
        default_value = ""
    )]
    pub export_name: String,

    /// Human-readable description sent to clients that ask.
    #[arg(short = 'D', long, value_name = "TEXT", default_value = "")]
    pub description: String,

    /// Export read-only.
    #[arg(short = 'r', long = "read-only")]
    pub read_only: bool,

    /// Export the image's contents from byte OFFSET on, as qemu-nbd's --offset (for a disk
    /// image stored inside another file, such as a tar archive). Decimal, or 0x hex.
    #[arg(
        short = 'o',
        long = "offset",
        value_name = "OFFSET",
        value_parser = parse_offset,
        conflicts_with_all = ["exports", "control"]
    )]
    pub offset: Option<u64>,

    /// Keep serving after the last client disconnects.
    #[arg(short = 't', long)]
    pub persistent: bool,

    /// Serve up to NUM clients at once, 0 for unlimited (NUM > 1 advertises multi-conn). A
    /// further client waits, after its handshake, until one leaves.
    #[arg(short = 'e', long = "shared", value_name = "NUM", default_value_t = 1)]
    pub shared: usize,

    /// Most connections open at once, those still negotiating included. When full, a new
    /// client replaces the oldest one still negotiating, so idle handshakes cannot keep
    /// real clients out.
    #[arg(long = "max-connections", value_name = "NUM", default_value_t = nbd_server::DEFAULT_MAX_OPEN)]
    pub max_connections: std::num::NonZeroUsize,

    /// Spread connections over NUM threads (1 to 64), round robin. The image stays on the
    /// main thread, which runs every request; the other threads do the clients' socket and
    /// TLS work. Helps many busy clients of a fast image (page cache, tmpfs, NVMe) when
    /// cores are free; one thread is best for a single client and for a disk-bound image.
    #[arg(long = "threads", value_name = "NUM", default_value_t = std::num::NonZeroUsize::MIN,
          value_parser = parse_threads)]
    pub threads: std::num::NonZeroUsize,

    /// Accept QMP-style commands on this Unix socket (created mode 0600): add, delete and
    /// list exports, change bitmaps and read statistics while serving (see `qcow2-nbd ctl`).
    #[arg(long = "control", value_name = "PATH")]
    pub control: Option<PathBuf>,

    /// Most control socket clients at once; a further one is told so and closed.
    #[arg(long = "control-clients", value_name = "NUM", default_value_t = DEFAULT_CLIENTS,
          value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub control_clients: u16,

    /// Largest control command (JSON text), 1K to 16M; a longer one is answered with an
    /// error and its client closed.
    #[arg(long = "control-max-command", value_name = "SIZE", value_parser = parse_size,
          default_value = "64K")]
    pub control_max_command: u64,

    /// Seconds opening an image file (or a file of its backing chain) may take, at start
    /// and for block-export-add, 1 to 3600; past them the open fails with a timeout (a hung
    /// mount cannot freeze the server).
    #[arg(long = "open-timeout", value_name = "SECS", default_value_t = DEFAULT_OPEN_TIMEOUT,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub open_timeout: u64,

    /// Opens that timed out and still wait for the file system, at most; while that many
    /// do, further opens are refused at once (1 to 1024).
    #[arg(long = "open-stuck-max", value_name = "NUM", default_value_t = DEFAULT_OPEN_STUCK_MAX,
          value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub open_stuck_max: u64,
    /// Serve statistics (requests, bytes, latency and errors per export, connections,
    /// metadata caches) as Prometheus text at http://ADDR:PORT/metrics, e.g. 127.0.0.1:9100
    /// or [::1]:9100 (port 0: any free port, logged at start with --log info).
    #[arg(long = "metrics", value_name = "ADDR:PORT")]
    pub metrics: Option<std::net::SocketAddr>,

    /// Scrapes of --metrics served at once (1 to 64). A further client replaces the
    /// oldest one still sending its request head (after its first 25 ms), or else waits
    /// until a slot frees.
    #[arg(long = "metrics-scrapes", value_name = "NUM", default_value_t = 4,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub metrics_scrapes: u16,

    /// Seconds a --metrics client has to send its complete request head (1 to 60); then
    /// it is closed and its slot freed.
    #[arg(long = "metrics-head-timeout", value_name = "SECS", default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(1..=60))]
    pub metrics_head_timeout: u64,

    /// Seconds a --metrics client has to send its request and take the answer (1 to 3600).
    #[arg(long = "metrics-timeout", value_name = "SECS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub metrics_timeout: u64,

    /// Close a client that sent no request for SECS seconds (0: never).
    #[arg(long = "idle-timeout", value_name = "SECS", default_value_t = 0)]
    pub idle_timeout: u64,

    /// Most memory one connection may hold in request payloads and replies at once (READ
    /// and WRITE data, block status and cache replies); further requests wait unread.
    #[arg(long = "connection-memory", value_name = "SIZE", value_parser = parse_size,
          default_value = "64M")]
    pub connection_memory: u64,

    /// TCP keepalive: probe a client after SECS seconds without traffic (then every 10 s,
    /// 6 probes), so a vanished host's connection is closed (0: off).
    #[arg(long = "tcp-keepalive", value_name = "SECS", default_value_t = 60)]
    pub tcp_keepalive: u64,

    /// Send writes to a temporary qcow2 overlay (backed by IMAGE) that is deleted on exit.
    #[arg(short = 's', long, conflicts_with_all = ["read_only", "load_snapshot"])]
    pub snapshot: bool,

    /// Export an internal snapshot read-only: ID_OR_NAME, or snapshot.id=ID / snapshot.name=NAME.
    #[arg(short = 'l', long = "load-snapshot", value_name = "SNAPSHOT")]
    pub load_snapshot: Option<String>,

    /// Image format; without it the format is probed (the qcow2 magic, else raw). A probed
    /// raw image is served in whole sectors and no write may put another format's header
    /// into its first sector, as qemu-nbd serves one; give `-f raw` to lift that.
    #[arg(short = 'f', long, value_enum, value_name = "FORMAT")]
    pub format: Option<FormatArg>,

    /// Host cache mode, as QEMU's `-drive cache=`.
    #[arg(long, value_enum, value_name = "MODE", default_value = "writeback")]
    pub cache: CacheMode,

    /// Same as --cache=none.
    #[arg(short = 'n', long = "nocache", conflicts_with = "cache")]
    pub nocache: bool,

    /// File I/O backend (`native` is accepted as io_uring).
    #[arg(long, value_enum, value_name = "MODE", default_value = "io_uring")]
    pub aio: AioArg,

    /// What TRIM does: `ignore` (off) or `unmap` (on: free clusters, punch holes).
    #[arg(long, value_enum, value_name = "MODE", default_value = "ignore")]
    pub discard: DiscardArg,

    /// Turn all-zero writes into zeroing: `off`, `on`, or `unmap` (needs --discard=unmap).
    #[arg(
        long = "detect-zeroes",
        value_enum,
        value_name = "MODE",
        default_value = "off"
    )]
    pub detect_zeroes: DetectZeroesArg,

    /// Offer the qemu:allocation-depth metadata context.
    #[arg(short = 'A', long = "allocation-depth")]
    pub allocation_depth: bool,

    /// Offer persistent dirty bitmap NAME as the qemu:dirty-bitmap:NAME metadata context
    /// (repeatable, up to 64). A writable export shows the bitmap as writes change it, a
    /// read-only one (-r) as stored; a bitmap left in use by a crash is refused.
    #[arg(short = 'B', long = "bitmap", value_name = "NAME")]
    pub bitmaps: Vec<String>,

    /// Define a TLS credentials or access-control object, as qemu-nbd does (repeatable):
    /// `tls-creds-x509,id=ID,dir=DIR,endpoint=server[,verify-peer=on|off]` reads
    /// ca-cert.pem, server-cert.pem, server-key.pem (and ca-crl.pem if present) from DIR
    /// and by default requires clients to present a certificate the CA signed;
    /// `tls-creds-psk,id=ID,dir=DIR,endpoint=server` reads DIR/keys.psk (`psktool` lines
    /// `identity:hexkey`); `authz-simple,id=ID,identity=NAME` admits one x509 distinguished
    /// name (as QEMU prints it: `C=GB,,O=Org,,CN=host`, commas doubled) or PSK identity.
    #[arg(long = "object", value_name = "SPEC")]
    pub objects: Vec<String>,

    /// Require TLS with the credentials object ID: every client must start TLS
    /// (NBD_OPT_STARTTLS) before anything else; plaintext clients are refused. With -L,
    /// the credentials the listing connects with.
    #[arg(long = "tls-creds", value_name = "ID")]
    pub tls_creds: Option<String>,

    /// With -L: the host name the server's x509 certificate must name, instead of the -b
    /// host (over a Unix socket there is none otherwise).
    #[arg(long = "tls-hostname", value_name = "NAME", requires = "list")]
    pub tls_hostname: Option<String>,

    /// After the TLS handshake, admit only the identity of the authz-simple object ID;
    /// other clients have every option refused (NBD_REP_ERR_POLICY).
    #[arg(long = "tls-authz", value_name = "ID")]
    pub tls_authz: Option<String>,

    /// Short form of an x509 credentials object (as nbdkit's): require TLS with the
    /// certificates in DIR (QEMU's file names). Client certificates are checked only with
    /// --tls-verify-peer.
    #[arg(long = "tls-certificates", value_name = "DIR")]
    pub tls_certificates: Option<PathBuf>,

    /// Short form of a PSK credentials object: require TLS with the keys in FILE
    /// (`psktool` format).
    #[arg(long = "tls-psk", value_name = "FILE")]
    pub tls_psk: Option<PathBuf>,

    /// With --tls-certificates: require a client certificate signed by the CA.
    #[arg(long = "tls-verify-peer")]
    pub tls_verify_peer: bool,

    /// Write the server's process id here once it is listening.
    #[arg(long = "pid-file", value_name = "PATH")]
    pub pid_file: Option<PathBuf>,

    /// Run in the background; the command returns once the server is listening.
    #[arg(long)]
    pub fork: bool,

    /// Seconds a client has to finish the handshake, 0 for no limit.
    #[arg(long = "handshake-limit", value_name = "N", default_value_t = 10)]
    pub handshake_limit: u64,

    /// On SIGTERM, SIGINT or SIGHUP, seconds to let requests in flight finish before every
    /// connection is closed, also those of clients stalled mid-request or not reading
    /// replies; then the caches are written back, the bitmaps stored and the image closed.
    /// Repeating the signal changes nothing; SIGQUIT ends the grace period at once (the
    /// images are still closed cleanly); only SIGKILL skips the close and leaves the
    /// bitmaps in use.
    #[arg(long = "shutdown-grace", value_name = "SECS", default_value_t = 5)]
    pub shutdown_grace: u64,

    /// Maximum size of the L2 table cache (e.g. 8M).
    #[arg(long = "l2-cache-size", value_name = "SIZE", value_parser = parse_size)]
    pub l2_cache_size: Option<u64>,

    /// Size of one L2 cache entry, a slice of an L2 table (e.g. 4K).
    #[arg(long = "l2-cache-entry-size", value_name = "SIZE", value_parser = parse_size)]
    pub l2_cache_entry_size: Option<u64>,

    /// Maximum size of the refcount block cache.
    #[arg(long = "refcount-cache-size", value_name = "SIZE", value_parser = parse_size)]
    pub refcount_cache_size: Option<u64>,

    /// Maximum size of both metadata caches together. With several --export, the budget
    /// of all their caches together, split equally (each image gets SIZE / number of
    /// exports as its own cache-size, never below QEMU's per-image minimum).
    #[arg(long = "cache-size", value_name = "SIZE", value_parser = parse_size)]
    pub cache_size: Option<u64>,

    /// Seconds between drops of cache entries left unused, 0 to never drop them.
    #[arg(long = "cache-clean-interval", value_name = "SECONDS")]
    pub cache_clean_interval: Option<u64>,

    /// As qemu-nbd's: with --fork, stderr stays open, so errors after the start still
    /// show. It does not make the server chattier (qemu-nbd's does not either, and scripts
    /// compare its output); --log does.
    #[arg(short = 'v', long, action = clap::ArgAction::Count)]
    pub verbose: u8,

    /// What the server logs on stderr: error, warn (the default: problems only), info
    /// (connections, settings, the listening address), debug or trace. RUST_LOG, in
    /// tracing's syntax, overrides it.
    #[arg(long = "log", value_name = "LEVEL", value_enum, default_value_t = LogLevel::Warn)]
    pub log: LogLevel,
}

/// `--log`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    /// Errors only.
    Error,
    /// Errors and warnings.
    Warn,
    /// Connections, settings and addresses too.
    Info,
    /// Debugging detail.
    Debug,
    /// Everything.
    Trace,
}

impl LogLevel {
    /// The level as tracing's filter syntax spells it.
    pub fn directive(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::Warn => "warn",
            Self::Info => "info",
            Self::Debug => "debug",
            Self::Trace => "trace",
        }
    }
}

impl ServeArgs {
    /// The flags that decide TLS.
    pub fn tls_flags(&self) -> crate::common::tls::TlsFlags {
        crate::common::tls::TlsFlags {
            objects: self.objects.clone(),
            creds: self.tls_creds.clone(),
            authz: self.tls_authz.clone(),
            certificates: self.tls_certificates.clone(),
            psk: self.tls_psk.clone(),
            verify_peer: self.tls_verify_peer,
        }
    }
}

/// A byte count as C's `strtoull` with base 0 reads it, as qemu-nbd parses `--offset`:
/// decimal, `0x` hexadecimal or `0` octal, with no suffix.
fn parse_offset(s: &str) -> Result<u64, String> {
    let invalid = || format!("Invalid offset '{s}'");
    let (digits, radix) = if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        (hex, 16)
    } else if s.len() > 1 && s.starts_with('0') {
        (&s[1..], 8)
    } else {
        (s, 10)
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return Err(invalid());
    }
    u64::from_str_radix(digits, radix).map_err(|_| invalid())
}

fn parse_size(s: &str) -> Result<u64, String> {
    size_string::parse_size(s).map_err(|e| e.to_string())
}

/// `--aio`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum AioArg {
    /// io_uring (falls back to threads where the kernel refuses it).
    #[value(name = "io_uring", alias = "native")]
    IoUring,
    /// Blocking calls on a thread pool.
    Threads,
}

impl From<AioArg> for storage::Aio {
    fn from(a: AioArg) -> storage::Aio {
        match a {
            AioArg::IoUring => storage::Aio::IoUring,
            AioArg::Threads => storage::Aio::Threads,
        }
    }
}

/// `--discard`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiscardArg {
    /// TRIM does nothing.
    #[value(alias = "off")]
    Ignore,
    /// TRIM frees clusters.
    #[value(alias = "on")]
    Unmap,
}

impl From<DiscardArg> for DiscardMode {
    fn from(d: DiscardArg) -> DiscardMode {
        match d {
            DiscardArg::Ignore => DiscardMode::Ignore,
            DiscardArg::Unmap => DiscardMode::Unmap,
        }
    }
}

/// `--detect-zeroes`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DetectZeroesArg {
    /// Zero writes are written as data.
    Off,
    /// Zero writes become zeroing.
    On,
    /// Zero writes become zeroing that may free clusters.
    Unmap,
}

impl From<DetectZeroesArg> for DetectZeroes {
    fn from(d: DetectZeroesArg) -> DetectZeroes {
        match d {
            DetectZeroesArg::Off => DetectZeroes::Off,
            DetectZeroesArg::On => DetectZeroes::On,
            DetectZeroesArg::Unmap => DetectZeroes::Unmap,
        }
    }
}

/// Why a `-l` argument is not understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid -l/--load-snapshot {0:?}: expected ID_OR_NAME, snapshot.id=ID or snapshot.name=NAME"
)]
pub struct SnapshotParamError(pub String);

/// The internal snapshot `-l` selects, as an id or name for the engine. Like qemu-nbd it
/// accepts `snapshot.id=ID`, `snapshot.name=NAME` (or both, comma-separated: the id is
/// then used) and a bare id-or-name.
pub fn snapshot_param(arg: &str) -> Result<String, SnapshotParamError> {
    if !arg.starts_with("snapshot.") {
        if arg.is_empty() {
            return Err(SnapshotParamError(arg.to_owned()));
        }
        return Ok(arg.to_owned());
    }
    let (mut id, mut name) = (None, None);
    for part in arg.split(',') {
        match part.split_once('=') {
            Some(("snapshot.id", v)) if !v.is_empty() => id = Some(v),
            Some(("snapshot.name", v)) if !v.is_empty() => name = Some(v),
            _ => return Err(SnapshotParamError(arg.to_owned())),
        }
    }
    id.or(name)
        .map(str::to_owned)
        .ok_or_else(|| SnapshotParamError(arg.to_owned()))
}

/// Most threads `--threads` accepts: far above any useful value, low enough that a typo
/// cannot start thousands of threads.
const MAX_THREADS: usize = 64;

/// `--open-timeout`'s default, in seconds.
pub const DEFAULT_OPEN_TIMEOUT: u64 = storage::bounded::DEFAULT_OPEN_TIMEOUT.as_secs();

/// `--open-stuck-max`'s default.
pub const DEFAULT_OPEN_STUCK_MAX: u64 = storage::bounded::DEFAULT_MAX_STUCK as u64;

fn parse_threads(s: &str) -> Result<std::num::NonZeroUsize, String> {
    let n: std::num::NonZeroUsize = s
        .parse()
        .map_err(|_| format!("{s:?} is not a thread count (1 to {MAX_THREADS})"))?;
    if n.get() > MAX_THREADS {
        return Err(format!(
            "{n} threads is more than the {MAX_THREADS} allowed"
        ));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> Result<ServeArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied())).map(|c| c.serve)
    }

    #[test]
    fn threads_default_to_one_and_are_bounded() {
        assert_eq!(parse(&["img"]).unwrap().threads.get(), 1);
        assert_eq!(
            parse(&["--threads", "64", "img"]).unwrap().threads.get(),
            64
        );
        for bad in ["0", "65", "two"] {
            let err = parse(&["--threads", bad, "img"]).unwrap_err().to_string();
            assert!(err.contains("thread"), "--threads {bad}: {err}");
        }
    }

    #[test]
    fn metrics_take_an_ipv4_or_ipv6_socket_address() {
        assert_eq!(parse(&["img"]).unwrap().metrics, None);
        let v4 = parse(&["--metrics", "127.0.0.1:9100", "img"]).unwrap();
        assert_eq!(v4.metrics, Some("127.0.0.1:9100".parse().unwrap()));
        let v6 = parse(&["--metrics", "[::1]:9100", "img"]).unwrap();
        assert_eq!(v6.metrics, Some("[::1]:9100".parse().unwrap()));
        for bad in [
            "9100",
            "127.0.0.1",
            "::1:9100",
            "localhost:9100",
            "127.0.0.1:70000",
        ] {
            assert!(parse(&["--metrics", bad, "img"]).is_err(), "{bad}");
        }
        let a = parse(&["img"]).unwrap();
        assert_eq!((a.metrics_scrapes, a.metrics_timeout), (4, 10));
        assert_eq!(a.metrics_head_timeout, 1);
        assert_eq!((a.open_timeout, a.open_stuck_max), (10, 8));
        for (flag, bad) in [
            ("--metrics-head-timeout", "0"),
            ("--metrics-head-timeout", "61"),
            ("--metrics-scrapes", "0"),
            ("--metrics-scrapes", "65"),
            ("--metrics-timeout", "0"),
        ] {
            assert!(parse(&[flag, bad, "img"]).is_err(), "{flag} {bad}");
        }
    }

    #[test]
    fn defaults_are_qemu_nbds() {
        let a = parse(&["disk.qcow2"]).unwrap();
        assert_eq!(a.image, Some(PathBuf::from("disk.qcow2")));
        assert_eq!((a.port, a.bind.as_deref(), a.socket), (None, None, None));
        assert_eq!(
            (a.export_name.as_str(), a.shared, a.persistent),
            ("", 1, false)
        );
        assert_eq!(a.cache, CacheMode::Writeback);
        assert_eq!(a.discard, DiscardArg::Ignore);
        assert_eq!(a.detect_zeroes, DetectZeroesArg::Off);
        assert_eq!(a.handshake_limit, 10);
        assert_eq!(a.shutdown_grace, 5);
        assert!(!a.allocation_depth && !a.read_only && !a.snapshot && !a.fork);
    }

    #[test]
    fn short_and_long_names_and_size_suffixes() {
        let a = parse(&[
            "-k",
            "/tmp/s",
            "-x",
            "disk",
            "-D",
            "a disk",
            "-r",
            "-t",
            "-e",
            "0",
            "-f",
            "raw",
            "--cache=directsync",
            "--aio=native",
            "--discard=on",
            "--detect-zeroes=unmap",
            "-A",
            "--l2-cache-size",
            "8M",
            "--l2-cache-entry-size=4K",
            "--refcount-cache-size",
            "1.5M",
            "--cache-size=16M",
            "--cache-clean-interval=30",
            "-vv",
            "--log=debug",
            "img",
        ])
        .unwrap();
        assert_eq!(a.socket, Some(PathBuf::from("/tmp/s")));
        assert_eq!(
            (a.export_name.as_str(), a.description.as_str()),
            ("disk", "a disk")
        );
        assert!(a.read_only && a.persistent && a.allocation_depth);
        assert_eq!(a.shared, 0);
        assert_eq!(a.format, Some(FormatArg::Raw));
        assert!(a.cache.direct() && a.cache.writethrough() && !a.cache.ignore_flush());
        assert_eq!(a.aio, AioArg::IoUring);
        assert_eq!(a.discard, DiscardArg::Unmap);
        assert_eq!(a.detect_zeroes, DetectZeroesArg::Unmap);
        assert_eq!(a.l2_cache_size, Some(8 << 20));
        assert_eq!(a.l2_cache_entry_size, Some(4096));
        assert_eq!(a.refcount_cache_size, Some(1572864));
        assert_eq!(a.cache_size, Some(16 << 20));
        assert_eq!(a.cache_clean_interval, Some(30));
        assert_eq!(a.verbose, 2);
        assert_eq!(a.log, LogLevel::Debug);
    }

    #[test]
    fn contradictory_or_malformed_flags_are_refused() {
        for bad in [
            &["-k", "/tmp/s", "-p", "10809", "img"][..],
            &["-k", "/tmp/s", "-b", "::1", "img"],
            &["-s", "-r", "img"],
            &["-s", "-l", "snap", "img"],
            &["-n", "--cache=writeback", "img"],
            &["--l2-cache-size=8MB", "img"],
            &["--cache=bogus", "img"],
            &["-f", "vmdk", "img"],
            &["-e", "-1", "img"],
            &[],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn exports_replace_the_positional_image_and_its_options() {
        let a = parse(&[
            "--export",
            "name=a,file=a.qcow2",
            "--export=name=b,file=b.raw,format=raw,readonly=on",
        ])
        .unwrap();
        assert_eq!(a.image, None);
        let names: Vec<&str> = a.exports.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert!(a.exports[1].read_only && a.exports[1].format == Some(FormatArg::Raw));
        for mixed in [
            &["img"][..],
            &["-x", "a"],
            &["-D", "text"],
            &["-r"],
            &["-f", "raw"],
            &["-B", "b"],
            &["-s"],
            &["-l", "snap"],
        ] {
            let mut args = vec!["--export", "name=a,file=f"];
            args.extend_from_slice(mixed);
            let err = parse(&args).unwrap_err().to_string();
            assert!(err.contains("cannot be used with"), "{mixed:?}: {err}");
        }
        let err = parse(&["--export", "name=a,file=f,bogus=1"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("'name=a,file=f,bogus=1'") && err.contains("unknown key \"bogus\""),
            "{err}"
        );
    }

    #[test]
    fn cache_modes_combine_like_qemus() {
        use CacheMode::*;
        let table = [
            (None, true, false, false),
            (Writeback, false, false, false),
            (Writethrough, false, true, false),
            (Directsync, true, true, false),
            (Unsafe, false, false, true),
        ];
        for (mode, direct, wt, ignore) in table {
            assert_eq!(
                (mode.direct(), mode.writethrough(), mode.ignore_flush()),
                (direct, wt, ignore),
                "{mode:?}"
            );
        }
    }

    #[test]
    fn snapshot_parameters_in_both_syntaxes() {
        assert_eq!(snapshot_param("backup1").unwrap(), "backup1");
        assert_eq!(snapshot_param("2").unwrap(), "2");
        assert_eq!(snapshot_param("snapshot.id=3").unwrap(), "3");
        assert_eq!(snapshot_param("snapshot.name=daily").unwrap(), "daily");
        assert_eq!(
            snapshot_param("snapshot.id=4,snapshot.name=daily").unwrap(),
            "4"
        );
        for bad in ["", "snapshot.id=", "snapshot.bogus=1", "snapshot.name=a,x"] {
            assert!(snapshot_param(bad).is_err(), "{bad:?}");
        }
    }
}
