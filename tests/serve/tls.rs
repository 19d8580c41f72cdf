//! TLS with real clients: QEMU's (`qemu-io` with `--object tls-creds-x509,endpoint=client`),
//! libnbd's (`nbdinfo`/`nbdcopy`/`nbdsh` with `nbds://` URIs, certificates and PSK) and
//! GnuTLS's own `gnutls-cli`, over TCP and Unix sockets, with multi-conn and socket
//! activation; the refusals of QEMU's iotest 233 side by side with `qemu-nbd`; and the
//! hardening against plaintext sent after STARTTLS. Credentials are made fresh per test
//! (test_support::Pki).

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use crate::nbdcopy::source_bytes;
use crate::support::qemu_nbd::QemuNbd;
use crate::support::raw::{self, finish_option, option, OPT_LIST, REP_ACK};
use crate::support::{serve_fails, Server, BIN};
use test_support::{
    assert_check_clean, python_with_libnbd, qemu, require, run_ok, stdout, wait_until, Dir, Pki,
    CLIENT_DN, PSK_USER,
};

const OPT_STARTTLS: u32 = 5;
const REP_ERR_TLS_REQD: u32 = 0x8000_0005;

fn x509(dir: &Path, extra: &str) -> String {
    format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=server{extra}",
        dir.display()
    )
}

fn psk(dir: &Path) -> String {
    format!(
        "tls-creds-psk,id=tls0,dir={},endpoint=server",
        dir.display()
    )
}

fn authz(identity: &str) -> String {
    format!(
        "authz-simple,id=az0,identity={}",
        identity.replace(',', ",,")
    )
}

/// Fresh credentials, and a directory holding an empty qcow2 `disk.qcow2` of `size`.
fn fixture(size: &str) -> (Pki, Dir) {
    let d = Dir::new();
    d.create("disk.qcow2", "qcow2", "", None, size);
    (Pki::new(), d)
}

/// `start`s `serve` requiring TLS with the credentials `object`, plus `extra` flags, on
/// `d`'s disk.
fn serve_tls(start: fn(&[&str]) -> Server, d: &Dir, object: &str, extra: &[&str]) -> Server {
    let disk = d.s("disk.qcow2");
    let flags = tls_flags(object, None);
    start(&[&strs(&flags)[..], extra, &[&disk]].concat())
}

/// Where a client connects.
#[derive(Clone, Copy)]
enum At<'a> {
    Unix(&'a Path),
    Tcp(u16),
}

impl At<'_> {
    fn of(server: &Server) -> At<'_> {
        match server.port {
            Some(port) => At::Tcp(port),
            None => At::Unix(&server.socket),
        }
    }

    /// QEMU's `--image-opts` for this address through `tls0`.
    fn qemu_opts(self) -> String {
        match self {
            // With a Unix socket QEMU has no host name to check the certificate against.
            At::Unix(p) => format!(
                "driver=nbd,server.type=unix,server.path={},tls-creds=tls0,tls-hostname=localhost",
                p.display()
            ),
            At::Tcp(port) => {
                format!("driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={port},tls-creds=tls0")
            }
        }
    }

    /// A libnbd `nbds` URI with `query` (credentials) appended.
    fn nbds(self, user: Option<&str>, query: &str) -> String {
        let user = user.map(|u| format!("{u}@")).unwrap_or_default();
        match self {
            At::Unix(p) => format!("nbds+unix://{user}/?socket={}&{query}", p.display()),
            At::Tcp(port) => format!("nbds://{user}localhost:{port}/?{query}"),
        }
    }
}

/// qemu-io through x509 client credentials in `dir` (or plaintext with `None`).
fn qemu_io_x509(at: At<'_>, dir: Option<&Path>, cmds: &[&str]) -> Output {
    let mut cmd = qemu("qemu-io");
    match dir {
        Some(dir) => {
            cmd.arg("--object")
                .arg(format!(
                    "tls-creds-x509,id=tls0,dir={},endpoint=client",
                    dir.display()
                ))
                .arg("--image-opts")
                .arg(at.qemu_opts());
        }
        None => {
            let uri = match at {
                At::Unix(p) => test_support::nbd_unix_uri(p, ""),
                At::Tcp(port) => test_support::nbd_tcp_uri(port, ""),
            };
            cmd.args(["-f", "raw"]).arg(uri);
        }
    }
    for c in cmds {
        cmd.args(["-c", c]);
    }
    cmd.output().expect("run qemu-io")
}

/// qemu-io's own failures go to stderr, but a failed command inside it only prints.
fn succeeded(out: &Output) -> bool {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out.status.success() && !text.contains("failed") && !text.contains("can't open")
}

fn nbdinfo_at(uri: &str) -> Output {
    Command::new(require("nbdinfo", "libnbd-bin"))
        .arg(uri)
        .output()
        .unwrap()
}

fn combined(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn qemu_io_writes_and_reads_back_through_x509_on_tcp_and_unix() {
    let (pki, d) = fixture("64M");
    let object = x509(&pki.server(), "");

    let tcp = serve_tls(Server::tcp, &d, &object, &["-t"]);
    let out = qemu_io_x509(
        At::of(&tcp),
        Some(&pki.client()),
        &[
            "write -P 0x5a 0 1M",
            "write -P 0xa5 8M 64k",
            "read -P 0x5a 0 1M",
        ],
    );
    assert!(succeeded(&out), "{}", combined(&out));
    tcp.stop_ok();

    let unix = serve_tls(Server::unix, &d, &object, &["-t"]);
    let out = qemu_io_x509(
        At::of(&unix),
        Some(&pki.client()),
        &[
            "read -P 0x5a 0 1M",
            "read -P 0xa5 8M 64k",
            "write -P 0x11 32M 4k",
        ],
    );
    assert!(succeeded(&out), "{}", combined(&out));
    unix.stop_ok();

    assert_check_clean(&d.path("disk.qcow2"));
    d.qemu_io(
        "qcow2",
        "disk.qcow2",
        &[
            "read -P 0x5a 0 1M",
            "read -P 0xa5 8M 64k",
            "read -P 0x11 32M 4k",
        ],
    );
}

fn nbdcopy(from: &str, to: &str, connections: u32) {
    run_ok(
        Command::new(require("nbdcopy", "libnbd-bin"))
            .arg(format!("--connections={connections}"))
            .arg(format!("--threads={connections}"))
            .arg("--flush")
            .args([from, to]),
    );
}

#[test]
fn nbdcopy_moves_data_through_psk_with_multi_conn_and_through_x509_over_tcp() {
    let (pki, d) = fixture("12M");
    let data = source_bytes(12 << 20);
    std::fs::write(d.path("src.raw"), &data).unwrap();
    let keys = pki.psk_dir().join("keys.psk");
    let psk_query = format!("tls-psk-file={}", keys.display());

    let object = psk(&pki.psk_dir());
    let server = serve_tls(Server::unix_reporting, &d, &object, &["-e", "4", "-t"]);
    let uri = At::of(&server).nbds(Some(PSK_USER), &psk_query);
    let info = stdout(&run_ok(
        Command::new(require("nbdinfo", "libnbd-bin")).arg(&uri),
    ));
    assert!(info.contains("with TLS"), "{info}");
    assert!(info.contains("can_multi_conn: true"), "{info}");
    nbdcopy(&d.s("src.raw"), &uri, 4);
    let report = server.stop_report();
    // nbdinfo, then nbdcopy's four connections: all through TLS, none failed.
    assert!(report.connections >= 5, "{report:?}");
    assert_eq!(report.failed_connections, 0, "{report:?}");
    assert_check_clean(&d.path("disk.qcow2"));
    d.assert_same_contents("disk.qcow2", "qcow2", "src.raw", "raw");

    let object = x509(&pki.server(), "");
    let server = serve_tls(Server::tcp, &d, &object, &["-r"]);
    let client_query = format!("tls-certificates={}", pki.client().display());
    nbdcopy(
        &At::of(&server).nbds(None, &client_query),
        &d.s("out.raw"),
        1,
    );
    server.stop_ok();
    assert!(d.read("out.raw") == data, "data read through TLS differs");
}

#[test]
fn nbdsh_under_socket_activation_speaks_psk() {
    let (pki, d) = fixture("4M");
    let keys = pki.psk_dir().join("keys.psk");
    let script = r#"
import sys, nbd
bin, keys, image = sys.argv[1:4]
h = nbd.NBD()
h.set_tls(nbd.TLS_REQUIRE)
h.set_tls_psk_file(keys)
h.set_tls_username("alice")
h.connect_systemd_socket_activation([bin, "serve", "--tls-psk", keys, image])
assert h.get_tls_negotiated(), "TLS not negotiated"
h.pwrite(b"\x42" * 65536, 1 << 20)
h.flush()
assert h.pread(65536, 1 << 20) == b"\x42" * 65536
h.shutdown()
print("ok")
"#;
    let out = run_ok(
        Command::new(python_with_libnbd())
            .args(["-c", script, BIN])
            .arg(&keys)
            .arg(d.path("disk.qcow2")),
    );
    assert_eq!(stdout(&out).trim(), "ok");
    d.qemu_io("qcow2", "disk.qcow2", &["read -P 0x42 1M 64k"]);
}

/// Everything a child has written to its stdout so far, collected by a thread.
struct Collected(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Collected {
    fn start(mut from: impl Read + Send + 'static) -> Collected {
        let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = std::sync::Arc::clone(&buf);
        std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            while let Ok(n @ 1..) = from.read(&mut chunk) {
                sink.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        Collected(buf)
    }

    /// Waits until `pattern` appears at or after `from`; the `len` bytes starting there
    /// and the offset just past them.
    fn wait_for(&self, pattern: &[u8], from: usize, len: usize) -> (Vec<u8>, usize) {
        let mut found = None;
        wait_until(
            Duration::from_secs(30),
            format!("{:?} from gnutls-cli", String::from_utf8_lossy(pattern)),
            || {
                let buf = self.0.lock().unwrap();
                let at = buf
                    .get(from..)
                    .and_then(|rest| rest.windows(pattern.len()).position(|w| w == pattern));
                if let Some(at) = at.map(|a| a + from).filter(|a| a + len <= buf.len()) {
                    found = Some((buf[at..at + len].to_vec(), at + len));
                }
                found.is_some()
            },
        );
        found.expect("waited")
    }
}

#[test]
fn gnutls_cli_negotiates_psk_after_starttls() {
    let (pki, d) = fixture("4M");
    let keys = std::fs::read_to_string(pki.psk_dir().join("keys.psk")).unwrap();
    let key = keys.trim().split_once(':').unwrap().1.to_owned();
    let object = psk(&pki.psk_dir());
    let server = serve_tls(Server::tcp, &d, &object, &[]);
    // stdbuf: gnutls-cli's messages would otherwise sit in its stdout buffer.
    let mut cli = Command::new("stdbuf")
        .arg("-o0")
        .arg(require("gnutls-cli", "gnutls-bin"))
        // GnuTLS offers PSK only when asked, as libnbd and QEMU ask.
        .args([
            "--priority",
            "NORMAL:+ECDHE-PSK:+DHE-PSK:+PSK",
            "--starttls",
        ])
        .args(["--pskusername", PSK_USER, "--pskkey", &key])
        .args(["-p", &server.port.unwrap().to_string(), "127.0.0.1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut to = cli.stdin.take().unwrap();
    // gnutls-cli mixes its messages with the data on stdout: find the data by its magic.
    let out = Collected::start(cli.stdout.take().unwrap());
    let (greeting, at) = out.wait_for(b"NBDMAGICIHAVEOPT", 0, 18);
    assert_eq!(&greeting[16..], &[0, 3], "fixed newstyle, no zeroes");
    to.write_all(&3u32.to_be_bytes()).unwrap();
    to.write_all(&option(OPT_STARTTLS, &[])).unwrap();
    to.flush().unwrap();
    let reply_magic = 0x0003_e889_0455_65a9u64.to_be_bytes();
    let (ack, at) = out.wait_for(&reply_magic, at, 20);
    assert_eq!(u32::from_be_bytes(ack[12..16].try_into().unwrap()), REP_ACK);
    // gnutls-cli starts the TLS handshake on SIGALRM; anything written before it is done
    // would go out in plaintext (and the server would rightly drop the connection).
    let pid = libc::pid_t::try_from(cli.id()).unwrap();
    // SAFETY: kill only sends a signal to our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGALRM) }, 0);
    let (_, at) = out.wait_for(b"- PSK authentication. Connected as 'alice'", at, 42);
    let (_, at) = out.wait_for(b"- Options:\n", at, 11);
    to.write_all(&option(OPT_LIST, &[])).unwrap();
    to.flush().unwrap();
    let (reply, _) = out.wait_for(&reply_magic, at, 20);
    let kind = u32::from_be_bytes(reply[12..16].try_into().unwrap());
    assert_eq!(kind, 2, "NBD_REP_SERVER, from inside TLS");
    drop(to);
    let _ = cli.kill();
    let _ = cli.wait();
    server.stop_ok();
}

/// One client attempt of the refusal matrix.
enum Attempt<'a> {
    /// qemu-io with x509 client credentials in this directory (`None`: plaintext).
    Qemu(Option<&'a Path>),
    /// nbdinfo with this PSK user and key directory.
    Psk(&'a str, &'a Path),
}

fn attempt(at: At<'_>, how: &Attempt<'_>) -> (bool, String) {
    match how {
        Attempt::Qemu(dir) => {
            let out = qemu_io_x509(at, *dir, &["read 0 4k"]);
            (succeeded(&out), combined(&out))
        }
        Attempt::Psk(user, dir) => {
            let query = format!("tls-psk-file={}", dir.join("keys.psk").display());
            let out = nbdinfo_at(&at.nbds(Some(user), &query));
            (out.status.success(), combined(&out))
        }
    }
}

/// Runs every attempt against our server and qemu-nbd with the same flags; both must give
/// the same outcome each time, and ours must still serve the last (good) client.
fn same_outcomes(image: &Path, flags: &[&str], attempts: &[(&str, Attempt<'_>, bool)]) {
    let ours = Server::unix(&[flags, &["-t", image.to_str().unwrap()]].concat());
    for (what, how, expected) in attempts {
        let (ok, text) = attempt(At::of(&ours), how);
        assert_eq!(ok, *expected, "ours, {what}:\n{text}");
    }
    ours.stop_ok();
    let theirs = QemuNbd::unix(&[flags, &["-f", "qcow2"]].concat(), image);
    for (what, how, expected) in attempts {
        let (ok, text) = attempt(At::Unix(&theirs.socket), how);
        assert_eq!(ok, *expected, "qemu-nbd, {what}:\n{text}");
    }
    theirs.stop();
}

/// `--tls-creds tls0` with `object`, and `--tls-authz az0` with `authz` if given.
fn tls_flags(object: &str, authz: Option<&str>) -> Vec<String> {
    let mut flags = vec!["--object", object, "--tls-creds", "tls0"];
    if let Some(authz) = authz {
        flags.extend(["--object", authz, "--tls-authz", "az0"]);
    }
    flags.into_iter().map(str::to_owned).collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn x509_refusals_match_qemu_nbd_as_in_iotest_233() {
    let (pki, d) = fixture("4M");
    let image = d.path("disk.qcow2");
    let (client, wrong_ca) = (pki.client(), pki.wrong_ca_client());
    let (rogue, anonymous) = (pki.rogue_client(), pki.anonymous_client());
    let object = x509(&pki.server(), ",verify-peer=on");
    let admitted = tls_flags(&object, Some(&authz(CLIENT_DN)));
    same_outcomes(
        &image,
        &strs(&admitted),
        &[
            ("good client", Attempt::Qemu(Some(&client)), true),
            ("plaintext client", Attempt::Qemu(None), false),
            ("trusts another CA", Attempt::Qemu(Some(&wrong_ca)), false),
            (
                "certified by another CA",
                Attempt::Qemu(Some(&rogue)),
                false,
            ),
            ("no certificate", Attempt::Qemu(Some(&anonymous)), false),
            ("good client again", Attempt::Qemu(Some(&client)), true),
        ],
    );
    let other = tls_flags(&object, Some(&authz("C=GB,O=Test Org,CN=someone else")));
    same_outcomes(
        &image,
        &strs(&other),
        &[("identity not admitted", Attempt::Qemu(Some(&client)), false)],
    );
    // A revocation list in the server's directory (ca-crl.pem) shuts out the client.
    let revoking = tls_flags(&x509(&pki.revoked_server(), ""), None);
    same_outcomes(
        &image,
        &strs(&revoking),
        &[("revoked certificate", Attempt::Qemu(Some(&client)), false)],
    );
    // Without verify-peer no client certificate is asked for.
    let lax = tls_flags(&x509(&pki.server(), ",verify-peer=off"), None);
    same_outcomes(
        &image,
        &strs(&lax),
        &[
            ("no certificate", Attempt::Qemu(Some(&anonymous)), true),
            ("plaintext client", Attempt::Qemu(None), false),
        ],
    );
}

#[test]
fn psk_refusals_match_qemu_nbd() {
    let (pki, d) = fixture("4M");
    let image = d.path("disk.qcow2");
    let (good, unknown, wrong) = (pki.psk_dir(), pki.unknown_psk_dir(), pki.wrong_psk_dir());
    let object = psk(&good);
    let alice = tls_flags(&object, Some(&authz(PSK_USER)));
    same_outcomes(
        &image,
        &strs(&alice),
        &[
            ("good key", Attempt::Psk(PSK_USER, &good), true),
            ("unknown identity", Attempt::Psk("bob", &unknown), false),
            ("wrong key", Attempt::Psk(PSK_USER, &wrong), false),
            ("good key again", Attempt::Psk(PSK_USER, &good), true),
        ],
    );
    // Deliberately stricter than qemu-nbd: QEMU 10.0 applies --tls-authz to x509 names
    // only and admits any PSK identity with a valid key; ours checks PSK identities too.
    let carol = tls_flags(&object, Some(&authz("carol")));
    let ours = Server::unix(&[&strs(&carol)[..], &["-t", image.to_str().unwrap()]].concat());
    let (ok, text) = attempt(At::of(&ours), &Attempt::Psk(PSK_USER, &good));
    // libnbd shows only the error's class; qemu-io shows the message (tested below).
    assert!(!ok, "{text}");
    ours.stop_ok();
    let theirs = QemuNbd::unix(&[&strs(&carol)[..], &["-f", "qcow2"]].concat(), &image);
    let (ok, text) = attempt(At::Unix(&theirs.socket), &Attempt::Psk(PSK_USER, &good));
    assert!(ok, "qemu-nbd now applies authz to PSK identities: {text}");
    theirs.stop();
}

#[test]
fn refusals_say_why_in_the_clients_words() {
    let (pki, d) = fixture("4M");
    let object = x509(&pki.server(), "");
    let other = authz("CN=someone else");
    let server = serve_tls(
        Server::unix,
        &d,
        &object,
        &["--object", &other, "--tls-authz", "az0", "-t"],
    );
    let (_, plain) = attempt(At::of(&server), &Attempt::Qemu(None));
    assert!(
        plain.contains("Did you forget a valid tls-creds?"),
        "{plain}"
    );
    assert!(plain.contains("not permitted before TLS"), "{plain}");
    // As qemu-nbd, a client access control turns away is dropped once the handshake is
    // over; it sees the TLS session end where its first option's reply should be.
    let (_, denied) = attempt(At::of(&server), &Attempt::Qemu(Some(&pki.client())));
    assert!(
        denied.contains(
            "Failed to read option reply: Cannot read from TLS channel: The TLS connection \
             was non-properly terminated."
        ),
        "{denied}"
    );
    server.stop_ok();
}

/// Runs a qemu-nbd (`ours`: our binary under that name) requiring TLS on `image` with
/// `flags`, lets `client` connect once, and returns what the client printed and the
/// server's stderr.
fn qemu_nbd_session(ours: bool, image: &Path, flags: &[&str], client: &Path) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    let program = if ours {
        let link = dir.path().join("qemu-nbd");
        std::os::unix::fs::symlink(BIN, &link).unwrap();
        link
    } else {
        test_support::require("qemu-nbd", "qemu-utils")
    };
    let socket = dir.path().join("s.sock");
    let mut child = Command::new(&program)
        .args(["-t", "-f", "qcow2", "-k"])
        .arg(&socket)
        .args(flags)
        .arg(image)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start qemu-nbd");
    wait_until(Duration::from_secs(30), "qemu-nbd listens", || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    let out = qemu_io_x509(At::Unix(&socket), Some(client), &["read 0 4k"]);
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: kill only sends a signal to our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    assert!(test_support::exit_within(&mut child, Duration::from_secs(30)).is_some());
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (combined(&out), err)
}

#[test]
fn an_identity_authz_refuses_is_dropped_and_logged_as_qemu_nbd_does() {
    let (pki, d) = fixture("4M");
    let image = d.path("disk.qcow2");
    let object = x509(&pki.server(), ",verify-peer=on");
    let flags = tls_flags(&object, Some(&authz("C=GB,O=Test Org,CN=someone else")));
    let (their_client, their_log) = qemu_nbd_session(false, &image, &strs(&flags), &pki.client());
    let (our_client, our_log) = qemu_nbd_session(true, &image, &strs(&flags), &pki.client());
    let line = format!(
        "qemu-nbd: option negotiation failed: TLS x509 authz check for {CLIENT_DN} is denied"
    );
    assert!(their_log.contains(&line), "qemu-nbd changed: {their_log}");
    assert!(our_log.contains(&line), "ours: {our_log}");
    // qemu-nbd closes at once, so its client sees the session end, or a reset, or a broken
    // pipe, as the race goes; ours lets the client read the end first, every time, which
    // is what iotest 233 expects.
    let ended = "qemu-io: can't open: Failed to read option reply: Cannot read from TLS \
                 channel: The TLS connection was non-properly terminated.\n";
    assert!(
        their_client.starts_with("qemu-io: can't open: "),
        "qemu-nbd changed: {their_client}"
    );
    assert_eq!(our_client, ended);
}

/// Reads until the server closes: everything it sent.
fn read_to_close(s: &mut std::os::unix::net::UnixStream) -> Vec<u8> {
    let mut got = Vec::new();
    match s.read_to_end(&mut got) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the server neither answered nor closed: {e}"),
    }
    got
}

#[test]
fn plaintext_after_starttls_is_never_read_as_tls_or_as_options() {
    let (pki, d) = fixture("4M");
    let object = psk(&pki.psk_dir());
    let server = serve_tls(Server::unix_reporting, &d, &object, &["-t"]);
    // Before TLS every option but STARTTLS is refused with TLS_REQD, and nothing leaks.
    let mut s = raw::negotiating(&server.socket);
    s.write_all(&option(OPT_LIST, &[])).unwrap();
    assert_eq!(finish_option(&mut s), REP_ERR_TLS_REQD);

    // An option injected behind STARTTLS in the same write: the server hangs up without
    // even acknowledging STARTTLS.
    let mut s = raw::negotiating(&server.socket);
    let mut burst = option(OPT_STARTTLS, &[]);
    burst.extend(option(raw::OPT_STRUCTURED_REPLY, &[]));
    s.write_all(&burst).unwrap();
    assert_eq!(
        read_to_close(&mut s),
        b"",
        "the server answered an injected option"
    );

    // Plaintext after the ACK is fed to TLS, which rejects it: at most a TLS alert comes
    // back (record type 21), never an option reply.
    let mut s = raw::negotiating(&server.socket);
    s.write_all(&option(OPT_STARTTLS, &[])).unwrap();
    assert_eq!(finish_option(&mut s), REP_ACK);
    s.write_all(&option(OPT_LIST, &[])).unwrap();
    let got = read_to_close(&mut s);
    assert!(
        got.is_empty() || got[0] == 21,
        "not a TLS alert: {got:02x?}"
    );

    // The server is unharmed.
    let query = format!("tls-psk-file={}", pki.psk_dir().join("keys.psk").display());
    let out = nbdinfo_at(&At::of(&server).nbds(Some(PSK_USER), &query));
    assert!(out.status.success(), "{}", combined(&out));
    let report = server.stop_report();
    assert_eq!(report.connections, 4, "{report:?}");
}

#[test]
fn a_client_stalled_in_the_tls_handshake_is_cut_off_by_the_handshake_limit() {
    let (pki, d) = fixture("4M");
    let object = psk(&pki.psk_dir());
    let server = serve_tls(Server::unix, &d, &object, &["--handshake-limit", "1", "-t"]);
    let mut s = raw::negotiating(&server.socket);
    s.write_all(&option(OPT_STARTTLS, &[])).unwrap();
    assert_eq!(finish_option(&mut s), REP_ACK);
    // Half a TLS record header, then silence: the limit must end the wait. The read
    // timeout is only a safety net against a hang.
    s.write_all(&[0x16, 0x03]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let got = read_to_close(&mut s);
    assert!(got.is_empty() || got[0] == 21, "{got:02x?}");
    server.stop_ok();
}

#[test]
fn bad_credentials_and_flags_are_refused_at_start_naming_the_problem() {
    let (pki, d) = fixture("4M");
    let image = d.s("disk.qcow2");
    let root = pki.root();
    let copy_dir = |name: &str, from: &Path| {
        let dir = root.join(name);
        std::fs::create_dir(&dir).unwrap();
        for f in ["ca-cert.pem", "server-cert.pem", "server-key.pem"] {
            std::fs::copy(from.join(f), dir.join(f)).unwrap();
        }
        dir
    };
    let mismatched = copy_dir("mismatched", &pki.server());
    std::fs::copy(
        pki.client().join("client-key.pem"),
        mismatched.join("server-key.pem"),
    )
    .unwrap();
    let untrusted = copy_dir("untrusted", &pki.server());
    std::fs::copy(
        pki.wrong_ca_client().join("ca-cert.pem"),
        untrusted.join("ca-cert.pem"),
    )
    .unwrap();
    let bad_psk = root.join("bad-psk");
    std::fs::create_dir(&bad_psk).unwrap();
    std::fs::write(bad_psk.join("keys.psk"), "alice:xyz\n").unwrap();
    let empty = root.join("empty");
    std::fs::create_dir(&empty).unwrap();

    let cases: Vec<(Vec<String>, String)> = vec![
        (
            vec![
                "--object".into(),
                x509(&empty, ""),
                "--tls-creds".into(),
                "tls0".into(),
            ],
            format!("{}", empty.join("ca-cert.pem").display()),
        ),
        (
            vec![
                "--object".into(),
                x509(&mismatched, ""),
                "--tls-creds".into(),
                "tls0".into(),
            ],
            "server-key.pem: does not match the key of server-cert.pem".into(),
        ),
        (
            vec![
                "--object".into(),
                x509(&untrusted, ""),
                "--tls-creds".into(),
                "tls0".into(),
            ],
            "server-cert.pem: does not verify against".into(),
        ),
        (
            vec![
                "--object".into(),
                psk(&bad_psk),
                "--tls-creds".into(),
                "tls0".into(),
            ],
            "keys.psk:1: the key is not hexadecimal".into(),
        ),
        (
            vec![
                "--object".into(),
                format!("tls-creds-psk,id=tls0,dir={}", pki.psk_dir().display()),
                "--tls-creds".into(),
                "tls0".into(),
            ],
            "endpoint=server".into(),
        ),
        (
            vec!["--tls-creds".into(), "tls0".into()],
            "no --object has this id".into(),
        ),
        (
            vec!["--object".into(), "iothread,id=io0".into()],
            "object type \"iothread\" is not supported".into(),
        ),
    ];
    for (args, expected) in cases {
        let mut full: Vec<&str> = args.iter().map(String::as_str).collect();
        full.extend(["-k", "/nonexistent/never-bound.sock", &image]);
        let err = serve_fails(&full);
        assert!(err.contains(&expected), "{args:?}: {err}");
    }
}

/// What one `-L` run printed and how it ended, with the program name before each message
/// dropped, so qemu-nbd's output and ours can be compared.
fn list_outcome(mut cmd: Command, args: &[&str]) -> String {
    let out = cmd.args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let err: Vec<&str> = err
        .lines()
        .map(|l| l.split_once(": ").map_or(l, |(_, rest)| rest))
        .collect();
    format!(
        "{}{}\n{}",
        if out.status.success() {
            "ok\n"
        } else {
            "failed\n"
        },
        String::from_utf8_lossy(&out.stdout),
        err.join("\n")
    )
}

/// Runs `-L` with `args` through qemu-nbd and through ours: qemu-nbd's output must contain
/// `want`, and ours must be the same.
fn check_list(what: &str, args: &[&str], want: &str) {
    let mut ours = Command::new(BIN);
    ours.arg("serve");
    let theirs = list_outcome(qemu("qemu-nbd"), args);
    let ours = list_outcome(ours, args);
    assert!(theirs.contains(want), "{what}: qemu-nbd changed: {theirs}");
    assert_eq!(ours, theirs, "{what}: ours (left) against qemu-nbd (right)");
}

/// `base` followed by the credentials object `obj` as `tls0`, then `more`.
fn list_args(base: &[&str], obj: &str, more: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = base.iter().map(|s| s.to_string()).collect();
    v.extend(["--object", obj, "--tls-creds", "tls0"].map(str::to_owned));
    v.extend(more.iter().map(|s| s.to_string()));
    v
}

/// `serve -L` with `--object tls-creds-*,endpoint=client --tls-creds`, against one of our
/// TLS servers, says what `qemu-nbd -L` with the same arguments says: the listing, or the
/// same refusal (only the program name before the first colon differs).
#[test]
fn list_mode_over_tls_says_what_qemu_nbd_says() {
    let pki = Pki::new();
    let d = Dir::new();
    d.create("disk.qcow2", "qcow2", "", None, "4M");
    let disk = d.s("disk.qcow2");
    let client_obj = |dir: &Path| {
        format!(
            "tls-creds-x509,id=tls0,dir={},endpoint=client",
            dir.display()
        )
    };
    let psk_obj = |dir: &Path, user: &str| {
        format!(
            "tls-creds-psk,id=tls0,dir={},username={user},endpoint=client",
            dir.display()
        )
    };
    let client = client_obj(&pki.client());
    let wrong_ca = client_obj(&pki.wrong_ca_client());
    let x509_server = x509(&pki.server(), ",verify-peer=on");
    let tcp = Server::tcp(&["--object", &x509_server, "--tls-creds", "tls0", "-t", &disk]);
    let port = tcp.port.unwrap().to_string();
    let at_tcp = ["-L", "-b", "127.0.0.1", "-p", port.as_str()];
    check_list(
        "x509 over TCP",
        &strs(&list_args(&at_tcp, &client, &[])),
        "export: ''",
    );
    check_list(
        "a certificate for another host",
        &strs(&list_args(
            &at_tcp,
            &client,
            &["--tls-hostname=example.invalid"],
        )),
        "Certificate does not match the hostname example.invalid",
    );
    check_list(
        "another CA",
        &strs(&list_args(&at_tcp, &wrong_ca, &[])),
        "The certificate hasn't got a known issuer",
    );
    check_list(
        "no TLS",
        &at_tcp,
        "TLS negotiation required before option 3 (list)",
    );
    tcp.stop_ok();
    let unix = Server::unix(&["--object", &x509_server, "--tls-creds", "tls0", "-t", &disk]);
    let sock = unix.socket.to_str().unwrap().to_owned();
    let at_unix = ["-L", "-k", sock.as_str()];
    check_list(
        "x509 over a Unix socket",
        &strs(&list_args(&at_unix, &client, &[])),
        "No hostname for certificate validation",
    );
    check_list(
        "x509 over a Unix socket with a host name",
        &strs(&list_args(
            &at_unix,
            &client,
            &["--tls-hostname", "localhost"],
        )),
        "export: ''",
    );
    unix.stop_ok();
    // QEMU takes verify-peer on any credentials object (iotest 233 gives it to PSK).
    let psk_server = format!("{},verify-peer=on", psk(&pki.psk_dir()));
    let unix = Server::unix(&["--object", &psk_server, "--tls-creds", "tls0", "-t", &disk]);
    let sock = unix.socket.to_str().unwrap().to_owned();
    let at_unix = ["-L", "-k", sock.as_str()];
    check_list(
        "PSK",
        &strs(&list_args(
            &at_unix,
            &psk_obj(&pki.psk_dir(), PSK_USER),
            &[],
        )),
        "export: ''",
    );
    check_list(
        "a wrong PSK",
        &strs(&list_args(
            &at_unix,
            &psk_obj(&pki.wrong_psk_dir(), PSK_USER),
            &[],
        )),
        "TLS handshake failed",
    );
    unix.stop_ok();
    let plain = Server::unix(&["-t", &disk]);
    let sock = plain.socket.to_str().unwrap().to_owned();
    check_list(
        "TLS to a server without it",
        &strs(&list_args(
            &["-L", "-k", sock.as_str()],
            &client,
            &["--tls-hostname", "localhost"],
        )),
        "Denied by server for option 5 (starttls)",
    );
    plain.stop_ok();
}
