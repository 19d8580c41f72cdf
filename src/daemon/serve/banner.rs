//! What a person at a terminal sees once the server listens: where it is and how to attach
//! the usual clients. Scripts (stderr not a terminal) get nothing, as from qemu-nbd.

use std::io::{IsTerminal, Write};
use std::path::Path;

/// One export the banner describes.
pub struct BannerExport<'a> {
    /// The image served.
    pub image: &'a Path,
    /// Its size in bytes.
    pub size: u64,
    /// The export name.
    pub name: &'a str,
    /// Exported read-only.
    pub read_only: bool,
}

/// What the banner describes.
pub struct Banner<'a> {
    /// The exports, in the order given.
    pub exports: &'a [BannerExport<'a>],
    /// Where the server listens: `unix:PATH` or `tcp:ADDR` each.
    pub listeners: &'a [String],
    /// What TLS clients need, if the server requires it.
    pub tls: Option<&'a str>,
}

/// Prints the connect hints for each listener to a terminal.
pub fn print(banner: &Banner<'_>) {
    let mut err = std::io::stderr();
    if !err.is_terminal() {
        return;
    }
    let _ = write!(err, "{}", text(banner));
}

/// The hints themselves (separate so tests can read them): what is served, then how to
/// reach each export on each listener.
pub fn text(banner: &Banner<'_>) -> String {
    let mut out = String::new();
    for e in banner.exports {
        out.push_str(&format!(
            "{}: serving {} ({}{}) as export {:?}; Ctrl-C stops it.\n",
            crate::common::prog::name(),
            e.image.display(),
            human(e.size),
            if e.read_only { ", read-only" } else { "" },
            e.name
        ));
    }
    if let Some(tls) = banner.tls {
        // The hints would need the client's own credentials; say what clients need instead.
        out.push_str(&format!(
            "  {tls}: connect with nbds:// URIs and tls-certificates= or tls-psk-file=, or \
             QEMU's --object tls-creds-*,endpoint=client.\n"
        ));
        return out;
    }
    for e in banner.exports {
        for l in banner.listeners {
            out.push_str(&hints(e, l));
        }
    }
    out
}

/// How to reach one export on one listener with the usual clients.
fn hints(export: &BannerExport<'_>, listener: &str) -> String {
    let name = export.name;
    let name_opt = if name.is_empty() {
        String::new()
    } else {
        format!(" -N {name}")
    };
    let ro = if export.read_only { "-r " } else { "" };
    let (uri, nbd_client) = if let Some(path) = listener.strip_prefix("unix:") {
        (
            format!("nbd+unix:///{name}?socket={path}"),
            format!("nbd-client{name_opt} -u {path} /dev/nbd0"),
        )
    } else if let Some(addr) = listener.strip_prefix("tcp:") {
        let (host, port) = addr.rsplit_once(':').unwrap_or((addr, "10809"));
        let host = match host {
            "0.0.0.0" | "[::]" => "localhost",
            h => h,
        };
        (
            format!("nbd://{host}:{port}/{name}"),
            format!("nbd-client {host} {port} /dev/nbd0{name_opt}"),
        )
    } else {
        return String::new();
    };
    format!("  qemu-io {ro}-f raw -c 'read -v 0 512' '{uri}'\n  nbdinfo '{uri}'\n  {nbd_client}\n")
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut unit = 0;
    let mut whole = bytes;
    while whole >= 1024 && whole % 1024 == 0 && unit + 1 < UNITS.len() {
        whole /= 1024;
        unit += 1;
    }
    format!("{whole} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(export: &BannerExport<'_>, listeners: &[String], tls: Option<&str>) -> String {
        text(&Banner {
            exports: std::slice::from_ref(export),
            listeners,
            tls,
        })
    }

    #[test]
    fn unix_and_tcp_hints_name_the_export_and_its_address() {
        let listeners = ["unix:/tmp/demo.sock".into(), "tcp:0.0.0.0:10809".into()];
        let demo = BannerExport {
            image: Path::new("demo.qcow2"),
            size: 1 << 30,
            name: "",
            read_only: false,
        };
        let t = one(&demo, &listeners, None);
        assert!(t.contains("demo.qcow2 (1 GiB)"), "{t}");
        assert!(t.contains("'nbd+unix:///?socket=/tmp/demo.sock'"), "{t}");
        assert!(t.contains("nbd-client -u /tmp/demo.sock /dev/nbd0"), "{t}");
        assert!(t.contains("nbdinfo 'nbd://localhost:10809/'"), "{t}");
        assert!(t.contains("nbd-client localhost 10809 /dev/nbd0"), "{t}");
        let unix = ["unix:/s".into()];
        let disk = BannerExport {
            image: Path::new("d"),
            size: 1536,
            name: "disk",
            read_only: true,
        };
        let named = one(&disk, &unix, None);
        assert!(named.contains("(1536 B, read-only)"), "{named}");
        assert!(named.contains("qemu-io -r -f raw"), "{named}");
        assert!(named.contains("nbd+unix:///disk?socket=/s"), "{named}");
        assert!(
            named.contains("nbd-client -N disk -u /s /dev/nbd0"),
            "{named}"
        );
        let tcp = ["tcp:[::]:10809".into()];
        let tls = one(&demo, &tcp, Some("TLS required (pre-shared keys)"));
        assert!(
            tls.contains("TLS required (pre-shared keys): connect with nbds://"),
            "{tls}"
        );
        assert!(!tls.contains("nbd://"), "{tls}");
    }

    #[test]
    fn every_export_gets_its_line_and_hints() {
        let exports = [
            BannerExport {
                image: Path::new("a.qcow2"),
                size: 1 << 20,
                name: "a",
                read_only: false,
            },
            BannerExport {
                image: Path::new("b.raw"),
                size: 1 << 20,
                name: "b",
                read_only: true,
            },
        ];
        let unix = ["unix:/s".into()];
        let t = text(&Banner {
            exports: &exports,
            listeners: &unix,
            tls: None,
        });
        assert!(t.contains("serving a.qcow2 (1 MiB) as export \"a\""), "{t}");
        assert!(
            t.contains("serving b.raw (1 MiB, read-only) as export \"b\""),
            "{t}"
        );
        assert!(
            t.contains("qemu-io -f raw -c 'read -v 0 512' 'nbd+unix:///a?socket=/s'"),
            "{t}"
        );
        assert!(
            t.contains("qemu-io -r -f raw -c 'read -v 0 512' 'nbd+unix:///b?socket=/s'"),
            "{t}"
        );
    }
}
