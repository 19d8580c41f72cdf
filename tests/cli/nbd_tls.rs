//! The image tools as NBD clients over TLS, side by side with qemu-img: `--object
//! tls-creds-x509|tls-creds-psk,endpoint=client` with the `tls-creds` (and `tls-hostname`)
//! of the `nbd` driver must reach a qemu-nbd that requires TLS, and every refusal (a server
//! without TLS, a plaintext client, a certificate for another host, no host name to check
//! on a Unix socket, another CA, a wrong key) must read as qemu-img words it. The servers
//! are QEMU's own, so only the client side is ours.

use std::path::Path;

use test_support::{Dir, Pki, QemuNbd, PSK_USER};

use crate::qemu_img_options::Pair;

fn x509_client(dir: &Path) -> String {
    format!(
        "tls-creds-x509,dir={},endpoint=client,id=tls0",
        dir.display()
    )
}

fn image() -> Dir {
    let d = Dir::new();
    d.create("disk.qcow2", "qcow2", "", None, "4M");
    d.qemu_io("qcow2", "disk.qcow2", &["write -P 0x11 1M 64k"]);
    d
}

#[test]
fn x509_clients_connect_and_are_refused_in_qemus_words() {
    let (pki, d) = (Pki::new(), image());
    let p = Pair::new(|_| {});
    let server_obj = format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=server,verify-peer=on",
        pki.server().display()
    );
    let tls = QemuNbd::unix(
        &[
            "-f",
            "qcow2",
            "--object",
            &server_obj,
            "--tls-creds",
            "tls0",
        ],
        &d.path("disk.qcow2"),
    );
    let good = x509_client(&pki.client());
    let at = |extra: &str| format!("driver=nbd,path={},tls-creds=tls0{extra}", tls.path());
    for (obj, opts) in [
        // A host name to check the certificate against: reads the export.
        (&good, at(",tls-hostname=localhost")),
        // A Unix socket has no host name of its own.
        (&good, at("")),
        // The certificate names localhost and 127.0.0.1, not this.
        (&good, at(",tls-hostname=example.org")),
        // The client trusts another CA.
        (
            &x509_client(&pki.wrong_ca_client()),
            at(",tls-hostname=localhost"),
        ),
    ] {
        p.same(&["info", "--image-opts", "--object", obj, &opts]);
    }
    // The data comes through, as qemu-img reads it.
    p.same(&[
        "map",
        "--output=json",
        "--image-opts",
        "--object",
        &good,
        &at(",tls-hostname=localhost"),
    ]);
    // A plaintext client is told TLS is needed, with QEMU's hints.
    let plain = format!("nbd+unix:///?socket={}", tls.path());
    p.same(&["info", &plain]);
    drop(tls);
    // A server without TLS refuses STARTTLS.
    let plain_server = QemuNbd::unix(&["-f", "qcow2"], &d.path("disk.qcow2"));
    let opts = format!(
        "driver=nbd,path={},tls-creds=tls0,tls-hostname=localhost",
        plain_server.path()
    );
    p.same(&["info", "--image-opts", "--object", &good, &opts]);
}

#[test]
fn psk_clients_connect_and_a_wrong_key_is_refused() {
    let (pki, d) = (Pki::new(), image());
    let p = Pair::new(|_| {});
    let server_obj = format!(
        "tls-creds-psk,id=tls0,dir={},endpoint=server",
        pki.psk_dir().display()
    );
    let tls = QemuNbd::unix(
        &[
            "-f",
            "qcow2",
            "--object",
            &server_obj,
            "--tls-creds",
            "tls0",
        ],
        &d.path("disk.qcow2"),
    );
    let opts = format!("driver=nbd,path={},tls-creds=tls0", tls.path());
    for dir in [pki.psk_dir(), pki.wrong_psk_dir()] {
        let obj = format!(
            "tls-creds-psk,dir={},username={PSK_USER},endpoint=client,id=tls0",
            dir.display()
        );
        p.same(&["info", "--image-opts", "--object", &obj, &opts]);
    }
}

/// A client whose certificate another CA signed (and which trusts that CA only, as iotest
/// 233's `client2`) sends none to a server that names the CAs it trusts, as QEMU's client
/// (GnuTLS) does: the server then says no certificate came.
#[test]
fn a_certificate_the_servers_cas_did_not_sign_is_withheld() {
    let (pki, d) = (Pki::new(), image());
    let p = Pair::new(|_| {});
    let server_obj = format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=server,verify-peer=on",
        pki.server().display()
    );
    let tls = QemuNbd::unix(
        &[
            "-f",
            "qcow2",
            "--object",
            &server_obj,
            "--tls-creds",
            "tls0",
        ],
        &d.path("disk.qcow2"),
    );
    let opts = format!(
        "driver=nbd,path={},tls-creds=tls0,tls-hostname=localhost",
        tls.path()
    );
    let other = x509_client(&pki.wrong_ca_client());
    // QEMU's qemu-img first, then ours, against the same server.
    p.same(&["info", "--image-opts", "--object", &other, &opts]);
    let log = tls.stop_stderr();
    let line = "option negotiation failed: Verify failed: No certificate was found.";
    assert_eq!(log.matches(line).count(), 2, "{log}");
}
