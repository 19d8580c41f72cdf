//! systemd socket activation, the way libnbd's tools start a server they test:
//! `nbdinfo -- [ server ]` binds a socket, passes it as fd 3 with `LISTEN_PID`/`LISTEN_FDS`,
//! and stops the server with SIGTERM when done. Here the "server" is this very test binary
//! re-executed to run the ignored helper test below.

use std::process::Command;
use std::rc::Rc;

use nbd_server::{systemd, ExportEntry, Listener, MemExport, Server, ServerConfig};
use test_support::{require, run_ok, stdout};

/// The server side: serves a 5 MiB export on the activated sockets until SIGTERM.
#[test]
#[ignore = "helper run by socket_activated_server_answers_nbdinfo under socket activation"]
fn socket_activated_child() {
    let sockets = systemd::listen_fds().expect("valid activation environment");
    assert!(
        !sockets.is_empty(),
        "started without LISTEN_PID/LISTEN_FDS for this process"
    );
    test_support::run(async move {
        let listeners: Vec<Listener> = sockets
            .into_iter()
            .map(|s| Listener::from_activated(s).expect("register socket"))
            .collect();
        let export = Rc::new(MemExport::new(5 << 20));
        let config = ServerConfig {
            persistent: true,
            max_connections: None,
            ..ServerConfig::default()
        };
        let server = Server::new(vec![ExportEntry::new("", export)], config).unwrap();
        let report = server
            .serve(listeners, async {
                nbd_server::shutdown_signal()
                    .await
                    .expect("signal handlers");
            })
            .await
            .unwrap();
        assert!(report.shut_down && report.connections >= 1, "{report:?}");
        eprintln!("socket-activated server stopped cleanly: {report:?}");
    });
}

#[test]
fn socket_activated_server_answers_nbdinfo() {
    let nbdinfo = require("nbdinfo", "libnbd-bin");
    let me = std::env::current_exe().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("child.log");
    // `exec` keeps the pid libnbd put in LISTEN_PID; the harness's own output goes to a
    // log so it cannot mix with nbdinfo's JSON.
    let script = r#"exec "$0" --exact systemd_activation::socket_activated_child --ignored --nocapture --test-threads=1 >"$1" 2>&1"#;
    let out = run_ok(
        Command::new(nbdinfo)
            .args(["--json", "--", "[", "sh", "-c", script])
            .arg(&me)
            .arg(&log)
            .arg("]"),
    );
    let v: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(v["exports"][0]["export-size"], 5 << 20, "{v}");
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        log.contains("stopped cleanly") && log.contains("1 passed"),
        "child log:\n{log}"
    );
}
