//! Throwaway TLS credentials made for one test with GnuTLS's `certtool` and `psktool` (from
//! Debian's `gnutls-bin`), laid out the way QEMU's `tls-creds-x509` / `tls-creds-psk`
//! objects and libnbd's `tls-certificates=` / `tls-psk-file=` read them. Nothing is checked
//! in: every run makes fresh keys that expire in two days.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::tools::{require, run_ok};

/// The distinguished name of [`Pki::client`]'s certificate as QEMU's authz prints it.
pub const CLIENT_DN: &str = "C=GB,L=London,O=Test Org,CN=client1";

/// The PSK identity in [`Pki::psk_dir`].
pub const PSK_USER: &str = "alice";

/// A CA, a server certificate for `localhost`/127.0.0.1, client certificates and PSK keys.
pub struct Pki {
    dir: tempfile::TempDir,
}

const CA_TEMPLATE: &str = "cn = Test CA\nca\ncert_signing_key\nexpiration_days = 2\n";
/// Another name than the CA's, so that a server naming the CAs it trusts does not name it
/// (GnuTLS clients then withhold certificates it signed, as in QEMU's iotest 233).
const OTHER_CA_TEMPLATE: &str = "cn = Other Test CA\nca\ncert_signing_key\nexpiration_days = 2\n";
const SERVER_TEMPLATE: &str = "organization = Test Org\ncn = localhost\n\
    dns_name = localhost\nip_address = 127.0.0.1\nip_address = ::1\ntls_www_server\n\
    encryption_key\nsigning_key\nexpiration_days = 2\n";
const CLIENT_TEMPLATE: &str = "country = GB\nlocality = London\norganization = Test Org\n\
    cn = client1\ntls_www_client\nencryption_key\nsigning_key\nexpiration_days = 2\n";

impl Pki {
    /// Makes everything (a fraction of a second: RSA keys, as QEMU's key-usage checks
    /// expect key encipherment).
    pub fn new() -> Pki {
        let pki = Pki {
            dir: tempfile::tempdir().unwrap(),
        };
        let root = pki.dir.path();
        for (name, text) in [
            ("ca.info", CA_TEMPLATE),
            ("other-ca.info", OTHER_CA_TEMPLATE),
            ("server.info", SERVER_TEMPLATE),
            ("client.info", CLIENT_TEMPLATE),
        ] {
            std::fs::write(root.join(name), text).unwrap();
        }
        for ca in ["ca", "other-ca"] {
            pki.key(&root.join(format!("{ca}-key.pem")));
            pki.certtool(&[
                "--generate-self-signed",
                "--load-privkey",
                &format!("{ca}-key.pem"),
                "--template",
                &format!("{ca}.info"),
                "--outfile",
                &format!("{ca}-cert.pem"),
            ]);
        }
        pki.signed("server", "server", "ca", "ca");
        pki.signed("client", "client", "ca", "ca");
        // Trusts another CA, so it rejects our server.
        pki.signed("wrong-ca", "client", "other-ca", "other-ca");
        // Trusts our server, but its own certificate comes from another CA.
        pki.signed("rogue", "client", "other-ca", "ca");
        pki.revoking_server();
        let anonymous = root.join("anonymous");
        std::fs::create_dir(&anonymous).unwrap();
        std::fs::copy(root.join("ca-cert.pem"), anonymous.join("ca-cert.pem")).unwrap();
        pki.psk("psk", PSK_USER);
        pki.psk("psk-bob", "bob");
        let wrong = root.join("psk-wrong");
        std::fs::create_dir(&wrong).unwrap();
        std::fs::write(
            wrong.join("keys.psk"),
            format!("{PSK_USER}:{}\n", "5a".repeat(32)),
        )
        .unwrap();
        pki
    }

    /// QEMU's server directory: ca-cert.pem, server-cert.pem, server-key.pem.
    pub fn server(&self) -> PathBuf {
        self.dir.path().join("server")
    }

    /// A client directory (ca-cert.pem, client-cert.pem, client-key.pem) QEMU and libnbd
    /// accept, with the certificate [`CLIENT_DN`].
    pub fn client(&self) -> PathBuf {
        self.dir.path().join("client")
    }

    /// A client that trusts a different CA (so it refuses our server).
    pub fn wrong_ca_client(&self) -> PathBuf {
        self.dir.path().join("wrong-ca")
    }

    /// A client that trusts our CA but whose certificate another CA signed.
    pub fn rogue_client(&self) -> PathBuf {
        self.dir.path().join("rogue")
    }

    /// The server's credentials plus `ca-crl.pem`, a revocation list that revokes
    /// [`Pki::client`]'s certificate.
    pub fn revoked_server(&self) -> PathBuf {
        self.dir.path().join("revoking")
    }

    fn revoking_server(&self) {
        let root = self.dir.path();
        let dir = root.join("revoking");
        std::fs::create_dir(&dir).unwrap();
        for f in ["ca-cert.pem", "server-cert.pem", "server-key.pem"] {
            std::fs::copy(root.join("server").join(f), dir.join(f)).unwrap();
        }
        std::fs::write(
            root.join("crl.info"),
            "crl_next_update = 2\ncrl_number = 1\n",
        )
        .unwrap();
        self.certtool(&[
            "--generate-crl",
            "--load-ca-privkey",
            "ca-key.pem",
            "--load-ca-certificate",
            "ca-cert.pem",
            "--load-certificate",
            "client/client-cert.pem",
            "--template",
            "crl.info",
            "--outfile",
            "revoking/ca-crl.pem",
        ]);
    }

    /// A client that trusts our CA and has no certificate of its own.
    pub fn anonymous_client(&self) -> PathBuf {
        self.dir.path().join("anonymous")
    }

    /// A directory with `keys.psk` holding [`PSK_USER`]'s key.
    pub fn psk_dir(&self) -> PathBuf {
        self.dir.path().join("psk")
    }

    /// A key file for the identity `bob`, unknown to [`Pki::psk_dir`].
    pub fn unknown_psk_dir(&self) -> PathBuf {
        self.dir.path().join("psk-bob")
    }

    /// A key file for [`PSK_USER`] with the wrong key.
    pub fn wrong_psk_dir(&self) -> PathBuf {
        self.dir.path().join("psk-wrong")
    }

    /// The PKI's root, for tests that make broken variants.
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    fn certtool(&self, args: &[&str]) {
        run_ok(
            Command::new(require("certtool", "gnutls-bin"))
                .current_dir(self.dir.path())
                .args(args),
        );
    }

    fn key(&self, path: &Path) {
        self.certtool(&[
            "--generate-privkey",
            "--key-type=rsa",
            "--bits=2048",
            "--outfile",
            path.to_str().unwrap(),
        ]);
    }

    /// A directory `name` holding `trusted`'s certificate as ca-cert.pem and a `role`
    /// certificate and key signed by `signer`.
    fn signed(&self, name: &str, role: &str, trusted: &str, signer: &str) {
        let dir = self.dir.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        std::fs::copy(
            self.dir.path().join(format!("{trusted}-cert.pem")),
            dir.join("ca-cert.pem"),
        )
        .unwrap();
        let key = format!("{name}/{role}-key.pem");
        self.key(&self.dir.path().join(&key));
        self.certtool(&[
            "--generate-certificate",
            "--load-privkey",
            &key,
            "--load-ca-certificate",
            &format!("{signer}-cert.pem"),
            "--load-ca-privkey",
            &format!("{signer}-key.pem"),
            "--template",
            &format!("{role}.info"),
            "--outfile",
            &format!("{name}/{role}-cert.pem"),
        ]);
    }

    fn psk(&self, name: &str, user: &str) {
        let dir = self.dir.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        run_ok(
            Command::new(require("psktool", "gnutls-bin"))
                .args(["-u", user, "-p"])
                .arg(dir.join("keys.psk")),
        );
    }
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}
