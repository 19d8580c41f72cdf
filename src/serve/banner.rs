//! What a person at a terminal sees once the server listens: where it is and how to attach
//! the usual clients. Scripts (stderr not a terminal) get nothing, as from qemu-nbd.

use std::io::{IsTerminal, Write};
use std::path::Path;

/// What the banner describes.
pub struct Banner<'a> {
    /// The image served.
    pub image: &'a Path,
    /// Its size in bytes.
    pub size: u64,
    /// The export name.
    pub export: &'a str,
    /// Where the server listens: `unix:PATH` or `tcp:ADDR` each.
    pub listeners: &'a [String],
    /// Exported read-only.
    pub read_only: bool,
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

/// The hints themselves (separate so tests can read them).
pub fn text(banner: &Banner<'_>) -> String {
    let Banner {
        image,
        size,
        export,
        listeners,
        read_only,
        tls,
    } = *banner;
    let mut out = format!(
        "qcow2-nbd: serving {} ({}{}) as export {export:?}; Ctrl-C stops it.\n",
        image.display(),
        human(size),
        if read_only { ", read-only" } else { "" }
    );
    if let Some(tls) = tls {
        // The hints would need the client's own credentials; say what clients need instead.
        out.push_str(&format!(
            "  {tls}: connect with nbds:// URIs and tls-certificates= or tls-psk-file=, or \
             QEMU's --object tls-creds-*,endpoint=client.\n"
        ));
        return out;
    }
    let name_opt = if export.is_empty() {
        String::new()
    } else {
        format!(" -N {export}")
    };
    let ro = if read_only { "-r " } else { "" };
    for l in listeners {
        let (uri, nbd_client) = if let Some(path) = l.strip_prefix("unix:") {
            (
                format!("nbd+unix:///{export}?socket={path}"),
                format!("nbd-client{name_opt} -u {path} /dev/nbd0"),
            )
        } else if let Some(addr) = l.strip_prefix("tcp:") {
            let (host, port) = addr.rsplit_once(':').unwrap_or((addr, "10809"));
            let host = match host {
                "0.0.0.0" | "[::]" => "localhost",
                h => h,
            };
            (
                format!("nbd://{host}:{port}/{export}"),
                format!("nbd-client {host} {port} /dev/nbd0{name_opt}"),
            )
        } else {
            continue;
        };
        out.push_str(&format!(
            "  qemu-io {ro}-f raw -c 'read -v 0 512' '{uri}'\n  nbdinfo '{uri}'\n  {nbd_client}\n"
        ));
    }
    out
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

    #[test]
    fn unix_and_tcp_hints_name_the_export_and_its_address() {
        let listeners = ["unix:/tmp/demo.sock".into(), "tcp:0.0.0.0:10809".into()];
        let mut b = Banner {
            image: Path::new("demo.qcow2"),
            size: 1 << 30,
            export: "",
            listeners: &listeners,
            read_only: false,
            tls: None,
        };
        let t = text(&b);
        assert!(t.contains("demo.qcow2 (1 GiB)"), "{t}");
        assert!(t.contains("'nbd+unix:///?socket=/tmp/demo.sock'"), "{t}");
        assert!(t.contains("nbd-client -u /tmp/demo.sock /dev/nbd0"), "{t}");
        assert!(t.contains("nbdinfo 'nbd://localhost:10809/'"), "{t}");
        assert!(t.contains("nbd-client localhost 10809 /dev/nbd0"), "{t}");
        let unix = ["unix:/s".into()];
        b = Banner {
            image: Path::new("d"),
            size: 1536,
            export: "disk",
            listeners: &unix,
            read_only: true,
            tls: None,
        };
        let named = text(&b);
        assert!(named.contains("(1536 B, read-only)"), "{named}");
        assert!(named.contains("qemu-io -r -f raw"), "{named}");
        assert!(named.contains("nbd+unix:///disk?socket=/s"), "{named}");
        assert!(
            named.contains("nbd-client -N disk -u /s /dev/nbd0"),
            "{named}"
        );
        let tcp = ["tcp:[::]:10809".into()];
        b = Banner {
            export: "",
            listeners: &tcp,
            read_only: false,
            tls: Some("TLS required (pre-shared keys)"),
            ..b
        };
        let tls = text(&b);
        assert!(
            tls.contains("TLS required (pre-shared keys): connect with nbds://"),
            "{tls}"
        );
        assert!(!tls.contains("nbd://"), "{tls}");
    }
}
