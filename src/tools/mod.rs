//! The image tools: one module per `qemu-img`-like subcommand (`info`, `check`, `create`,
//! `map`, `convert`, `compare`, `measure`, `bitmap`, `snapshot`, `resize`, `amend`, `commit`,
//! `rebase`, `dd`), each taking that subcommand's arguments and running it to an exit code; and
//! what several of them share to copy data between images: `inflight` (requests in flight)
//! and `progress` (`-p`), and `same_file`. They never import the daemon (`crate::daemon`); what both need is
//! in `crate::common`.

pub mod amend;
pub mod bitmap;
pub mod check;
pub mod commit;
pub mod compare;
pub mod convert;
pub mod create;
pub mod dd;
pub mod inflight;
pub mod info;
pub mod map;
pub mod measure;
pub mod progress;
pub mod rebase;
pub mod resize;
pub mod snapshot;

/// True when `a` and `b` name the same existing file (both canonicalized; a file that does
/// not exist is nobody's twin).
pub(crate) fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}
