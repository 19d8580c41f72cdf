//! TLS on the command line: qemu-nbd's `--object tls-creds-x509|tls-creds-psk|authz-simple`
//! with `--tls-creds` and `--tls-authz`, and nbdkit-style short forms (`--tls-certificates`,
//! `--tls-psk`, `--tls-verify-peer`), turned into one [`TlsServer`] (or, for `serve --list`,
//! a [`TlsClient`]); and the client side of the image tools: the `tls-creds-x509` /
//! `tls-creds-psk` objects of an image tool's command line, taken out of it with the
//! secrets at start, and the client registered for each export an `nbd` node of an image
//! name reaches with `tls-creds` ([`note`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use nbd_client::TlsClient;
use nbd_proto::tls::TlsError;
use nbd_server::tls::{Authz, TlsServer};

/// The flags that decide TLS.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFlags {
    /// `--object` specifications, in order.
    pub objects: Vec<String>,
    /// `--tls-creds ID`.
    pub creds: Option<String>,
    /// `--tls-authz ID`.
    pub authz: Option<String>,
    /// `--tls-certificates DIR`.
    pub certificates: Option<PathBuf>,
    /// `--tls-psk FILE`.
    pub psk: Option<PathBuf>,
    /// `--tls-verify-peer`.
    pub verify_peer: bool,
}

/// Why the TLS flags cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum TlsArgError {
    /// An `--object` is malformed.
    #[error("--object {spec:?}: {reason}")]
    Object {
        /// The specification given.
        spec: String,
        /// What is wrong.
        reason: String,
    },
    /// Two objects share an id.
    #[error("--object: id {0:?} is used twice")]
    DuplicateId(String),
    /// `--tls-creds` or `--tls-authz` names no object.
    #[error("{flag} {id:?}: no --object has this id")]
    NoSuchObject {
        /// The flag.
        flag: &'static str,
        /// The id it names.
        id: String,
    },
    /// The object named has the wrong type.
    #[error("{flag} {id:?}: object is a {actual}, expected {expected}")]
    WrongType {
        /// The flag.
        flag: &'static str,
        /// The id it names.
        id: String,
        /// The object's type.
        actual: String,
        /// Types accepted, joined with "or".
        expected: String,
    },
    /// Flags that do not go together.
    #[error("{0}")]
    Conflict(&'static str),
    /// The credentials cannot be loaded.
    #[error("TLS credentials: {0}")]
    Load(#[from] TlsError),
}

/// One `--object`: its type, id and properties.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuObject {
    /// `qom-type`, e.g. `tls-creds-x509`.
    pub qom_type: String,
    /// `id`.
    pub id: String,
    /// The other properties, in order.
    pub props: Vec<(String, String)>,
}

/// Parses QEMU's `TYPE,key=value,...` syntax (also `qom-type=TYPE,...`), where `,,` stands
/// for a comma inside a value.
pub fn parse_object(spec: &str) -> Result<QemuObject, TlsArgError> {
    let fail = |reason: &str| TlsArgError::Object {
        spec: spec.to_owned(),
        reason: reason.to_owned(),
    };
    let mut parts = split_escaped(spec).into_iter();
    let first = parts.next().unwrap_or_default();
    let qom_type = match first.split_once('=') {
        Some(("qom-type", t)) => t.to_owned(),
        Some(_) => return Err(fail("the first element must be the object type")),
        None => first,
    };
    if qom_type.is_empty() {
        return Err(fail("the object type is missing"));
    }
    let (mut id, mut props) = (None, Vec::new());
    for part in parts {
        let Some((key, value)) = part.split_once('=') else {
            return Err(fail(&format!("{part:?} is not key=value")));
        };
        if props.iter().any(|(k, _)| k == key) || (key == "id" && id.is_some()) {
            return Err(fail(&format!("property {key:?} given twice")));
        }
        match key {
            "id" => id = Some(value.to_owned()),
            _ => props.push((key.to_owned(), value.to_owned())),
        }
    }
    let id = id
        .filter(|i| !i.is_empty())
        .ok_or_else(|| fail("every object needs an id"))?;
    Ok(QemuObject {
        qom_type,
        id,
        props,
    })
}

fn split_escaped(spec: &str) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut chars = spec.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' && chars.peek() == Some(&',') {
            chars.next();
            parts.last_mut().expect("never empty").push(',');
        } else if c == ',' {
            parts.push(String::new());
        } else {
            parts.last_mut().expect("never empty").push(c);
        }
    }
    parts
}

/// The properties of one object, consumed as they are understood; what is left over is an
/// error, so a misspelt property is never silently ignored.
struct Props<'a> {
    object: &'a QemuObject,
    props: HashMap<&'a str, &'a str>,
}

impl<'a> Props<'a> {
    fn new(object: &'a QemuObject) -> Self {
        let props = object
            .props
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        Self { object, props }
    }

    fn error(&self, reason: String) -> TlsArgError {
        TlsArgError::Object {
            spec: format!("{},id={}", self.object.qom_type, self.object.id),
            reason,
        }
    }

    fn take(&mut self, key: &str) -> Option<&'a str> {
        self.props.remove(key)
    }

    fn required(&mut self, key: &str) -> Result<&'a str, TlsArgError> {
        let qom_type = &self.object.qom_type;
        self.take(key)
            .ok_or_else(|| self.error(format!("{qom_type} needs {key}=")))
    }

    fn bool(&mut self, key: &str, default: bool) -> Result<bool, TlsArgError> {
        match self.take(key) {
            None => Ok(default),
            Some("on" | "yes" | "true") => Ok(true),
            Some("off" | "no" | "false") => Ok(false),
            Some(v) => Err(self.error(format!("{key}={v}: expected on or off"))),
        }
    }

    fn finish(self) -> Result<(), TlsArgError> {
        let mut left: Vec<&str> = self.props.keys().copied().collect();
        left.sort_unstable();
        match left.first() {
            None => Ok(()),
            Some(key) => Err(self.error(format!(
                "property {key:?} is not supported for {}",
                self.object.qom_type
            ))),
        }
    }

    /// QEMU's default endpoint is the client, which a listing (`-L`) needs.
    fn client_endpoint(&mut self) -> Result<(), TlsArgError> {
        match self.take("endpoint") {
            None | Some("client") => Ok(()),
            Some(other) => Err(self.error(format!(
                "endpoint={other}: listing is a client, so the credentials need \
                 endpoint=client"
            ))),
        }
    }

    /// QEMU's default endpoint is the client; a server needs `endpoint=server`.
    fn server_endpoint(&mut self) -> Result<(), TlsArgError> {
        match self.take("endpoint") {
            Some("server") => Ok(()),
            other => Err(self.error(format!(
                "endpoint={}: qcow2-nbd is the server, so the credentials need endpoint=server",
                other.unwrap_or("client (the default)")
            ))),
        }
    }
}

/// The TLS server the flags ask for, with its credentials loaded, or `None` for plaintext.
pub fn tls_server(flags: &TlsFlags) -> Result<Option<TlsServer>, TlsArgError> {
    let objects = objects_by_id(&flags.objects)?;
    let short = flags.certificates.is_some() || flags.psk.is_some();
    if flags.creds.is_some() && short {
        return Err(TlsArgError::Conflict(
            "--tls-creds cannot be combined with --tls-certificates or --tls-psk",
        ));
    }
    if flags.certificates.is_some() && flags.psk.is_some() {
        return Err(TlsArgError::Conflict(
            "--tls-certificates and --tls-psk exclude each other",
        ));
    }
    if flags.verify_peer && flags.certificates.is_none() {
        return Err(TlsArgError::Conflict(
            "--tls-verify-peer goes with --tls-certificates (with --tls-creds, use the \
             object's verify-peer=on)",
        ));
    }
    if flags.authz.is_some() && flags.creds.is_none() && !short {
        return Err(TlsArgError::Conflict(
            "--tls-authz is not permitted without TLS credentials",
        ));
    }
    let authz = flags
        .authz
        .as_deref()
        .map(|id| authz(&objects, id))
        .transpose()?;
    if let Some(dir) = &flags.certificates {
        return Ok(Some(TlsServer::x509(dir, flags.verify_peer, authz)?));
    }
    if let Some(file) = &flags.psk {
        return Ok(Some(TlsServer::psk(file, authz)?));
    }
    match flags.creds.as_deref() {
        Some(id) => creds(&objects, id, authz).map(Some),
        None => Ok(None),
    }
}

fn objects_by_id(specs: &[String]) -> Result<HashMap<String, QemuObject>, TlsArgError> {
    let mut objects = HashMap::new();
    for spec in specs {
        let object = parse_object(spec)?;
        match object.qom_type.as_str() {
            "tls-creds-x509" | "tls-creds-psk" | "authz-simple" => {}
            other => {
                return Err(TlsArgError::Object {
                    spec: spec.clone(),
                    reason: format!(
                        "object type {other:?} is not supported (qcow2-nbd knows \
                         secret, tls-creds-x509, tls-creds-psk and authz-simple)"
                    ),
                })
            }
        }
        if objects.contains_key(&object.id) {
            return Err(TlsArgError::DuplicateId(object.id));
        }
        objects.insert(object.id.clone(), object);
    }
    Ok(objects)
}

fn lookup<'a>(
    objects: &'a HashMap<String, QemuObject>,
    flag: &'static str,
    id: &str,
    expected: &[&str],
) -> Result<&'a QemuObject, TlsArgError> {
    let object = objects.get(id).ok_or_else(|| TlsArgError::NoSuchObject {
        flag,
        id: id.to_owned(),
    })?;
    if !expected.contains(&object.qom_type.as_str()) {
        return Err(TlsArgError::WrongType {
            flag,
            id: id.to_owned(),
            actual: object.qom_type.clone(),
            expected: expected.join(" or "),
        });
    }
    Ok(object)
}

fn authz(objects: &HashMap<String, QemuObject>, id: &str) -> Result<Authz, TlsArgError> {
    let object = lookup(objects, "--tls-authz", id, &["authz-simple"])?;
    let mut props = Props::new(object);
    let identity = props.required("identity")?.to_owned();
    props.finish()?;
    Ok(Authz::new(vec![identity]))
}

fn creds(
    objects: &HashMap<String, QemuObject>,
    id: &str,
    authz: Option<Authz>,
) -> Result<TlsServer, TlsArgError> {
    let object = lookup(
        objects,
        "--tls-creds",
        id,
        &["tls-creds-x509", "tls-creds-psk"],
    )?;
    let mut props = Props::new(object);
    props.server_endpoint()?;
    let dir = PathBuf::from(props.required("dir")?);
    if object.qom_type == "tls-creds-x509" {
        // QEMU verifies client certificates unless told not to.
        let verify_peer = props.bool("verify-peer", true)?;
        props.finish()?;
        Ok(TlsServer::x509(&dir, verify_peer, authz)?)
    } else {
        // QEMU takes verify-peer for every credentials type; keys verify both ends.
        props.bool("verify-peer", true)?;
        props.finish()?;
        Ok(TlsServer::psk(&psk_file(&dir), authz)?)
    }
}

/// The credentials a listing (`-L`) connects with: the `--tls-creds` object, which must
/// have `endpoint=client` (QEMU's default). x509 reads `ca-cert.pem` (and
/// `client-cert.pem`, `client-key.pem` when present) from its `dir` and verifies the
/// server unless `verify-peer=off`; PSK reads the key of `username` (QEMU's default
/// `qemu`) from `dir/keys.psk`.
pub fn tls_client(flags: &TlsFlags) -> Result<Option<TlsClient>, TlsArgError> {
    let Some(id) = flags.creds.as_deref() else {
        return Ok(None);
    };
    let objects = objects_by_id(&flags.objects)?;
    let object = lookup(
        &objects,
        "--tls-creds",
        id,
        &["tls-creds-x509", "tls-creds-psk"],
    )?;
    let mut props = Props::new(object);
    props.client_endpoint()?;
    let dir = PathBuf::from(props.required("dir")?);
    let verify_peer = props.bool("verify-peer", true)?;
    if object.qom_type == "tls-creds-x509" {
        props.finish()?;
        Ok(Some(TlsClient::x509(&dir, verify_peer)?))
    } else {
        let username = props.take("username").unwrap_or("qemu").to_owned();
        props.finish()?;
        Ok(Some(TlsClient::psk(&psk_file(&dir), &username)?))
    }
}

/// Why a client's negotiation failed, in the words qemu-nbd (GnuTLS) logs it with where
/// OpenSSL's differ: a client that sent no certificate, a PSK client whose key or identity
/// is not ours.
pub fn qemu_negotiation_words(reason: &str) -> String {
    const OURS_THEIRS: &[(&str, &str)] = &[
        (
            "peer did not return a certificate",
            "Verify failed: No certificate was found.",
        ),
        (
            "no suitable signature algorithm",
            "TLS handshake failed: An illegal parameter has been received.",
        ),
    ];
    OURS_THEIRS
        .iter()
        .find(|(ours, _)| reason.contains(ours))
        .map_or_else(|| reason.to_owned(), |(_, theirs)| (*theirs).to_owned())
}

/// Where QEMU's `tls-creds-psk,dir=DIR` finds its keys.
pub fn psk_file(dir: &Path) -> PathBuf {
    dir.join("keys.psk")
}

/// The credential objects of the command line, in their `--object` text.
static OBJECTS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// The object types an `nbd` node's `tls-creds` may name.
const CREDS_TYPES: &[&str] = &["tls-creds-x509", "tls-creds-psk"];

/// Whether `object_type` is a type of TLS credentials object.
pub fn is_creds_type(object_type: &str) -> bool {
    CREDS_TYPES.contains(&object_type)
}

/// Keeps the command line's credential objects (once, at start).
pub fn set_objects(objects: Vec<String>) {
    let _ = OBJECTS.set(objects);
}

/// Notes that the NBD export `path` names is reached over TLS with the credentials object
/// `id` of the command line (and `hostname` to check the server's certificate against).
pub fn note(path: &Path, id: &str, hostname: Option<String>) -> Result<(), String> {
    let objects = OBJECTS.get().cloned().unwrap_or_default();
    let has = |o: &String| parse_object(o).is_ok_and(|o| o.id == id);
    if !objects.iter().any(has) {
        return Err(format!("No TLS credentials with id '{id}'"));
    }
    let flags = TlsFlags {
        objects,
        creds: Some(id.to_owned()),
        ..Default::default()
    };
    let client = tls_client(&flags)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("No TLS credentials with id '{id}'"))?;
    nbd_client::register_tls(
        &path.display().to_string(),
        nbd_client::ClientTls {
            client: std::sync::Arc::new(client),
            hostname,
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_parse_like_qemus_keyval() {
        let o = parse_object("tls-creds-x509,id=tls0,dir=/etc/pki/qemu,endpoint=server").unwrap();
        assert_eq!(
            (o.qom_type.as_str(), o.id.as_str()),
            ("tls-creds-x509", "tls0")
        );
        assert_eq!(
            o.props,
            [
                ("dir".to_owned(), "/etc/pki/qemu".to_owned()),
                ("endpoint".to_owned(), "server".to_owned())
            ]
        );
        let o = parse_object("qom-type=authz-simple,id=a,identity=CN=x,,O=Org,,C=GB").unwrap();
        assert_eq!(o.qom_type, "authz-simple");
        assert_eq!(
            o.props,
            [("identity".to_owned(), "CN=x,O=Org,C=GB".to_owned())]
        );
        for bad in [
            "",
            ",id=x",
            "tls-creds-x509",
            "tls-creds-x509,id=",
            "t,id=a,dir",
            "t,id=a,id=b",
            "t,id=a,x=1,x=2",
            "foo=bar,id=a",
        ] {
            assert!(parse_object(bad).is_err(), "{bad:?} accepted");
        }
    }

    proptest::proptest! {
        /// Any text, commas and equals signs especially: a parse or an error, never a
        /// panic, and an accepted object always has a type and an id.
        #[test]
        fn any_object_text_parses_or_is_refused(spec in "[a-z=,-]{0,40}") {
            if let Ok(o) = parse_object(&spec) {
                proptest::prop_assert!(!o.qom_type.is_empty() && !o.id.is_empty());
            }
        }
    }

    fn flags(objects: &[&str], creds: Option<&str>, authz: Option<&str>) -> TlsFlags {
        TlsFlags {
            objects: objects.iter().map(|s| s.to_string()).collect(),
            creds: creds.map(str::to_owned),
            authz: authz.map(str::to_owned),
            ..TlsFlags::default()
        }
    }

    fn error(f: &TlsFlags) -> String {
        tls_server(f).expect_err("refused").to_string()
    }

    #[test]
    fn no_flags_mean_no_tls() {
        assert!(tls_server(&TlsFlags::default()).unwrap().is_none());
    }

    #[test]
    fn misuse_is_refused_with_a_reason() {
        let x509 = "tls-creds-x509,id=t,dir=/nonexistent,endpoint=server";
        let cases = [
            (flags(&[], Some("t"), None), "no --object has this id"),
            (
                flags(&["authz-simple,id=t,identity=a"], Some("t"), None),
                "expected tls-creds",
            ),
            (
                flags(
                    &[x509, "tls-creds-psk,id=t,dir=/x,endpoint=server"],
                    Some("t"),
                    None,
                ),
                "twice",
            ),
            (
                flags(&["tls-creds-x509,id=t,dir=/x"], Some("t"), None),
                "endpoint=server",
            ),
            (
                flags(&["tls-creds-x509,id=t,endpoint=server"], Some("t"), None),
                "needs dir=",
            ),
            (
                flags(&[&format!("{x509},verify-peer=maybe")], Some("t"), None),
                "on or off",
            ),
            (
                flags(&[&format!("{x509},priority=NORMAL")], Some("t"), None),
                "\"priority\" is not supported",
            ),
            (flags(&["secret,id=s,data=x"], None, None), "not supported"),
            (
                flags(&["authz-simple,id=a,identity=x"], None, Some("a")),
                "without TLS credentials",
            ),
            (flags(&[x509], Some("t"), Some("nope")), "no --object"),
            (
                flags(&[x509, "authz-simple,id=a"], Some("t"), Some("a")),
                "needs identity=",
            ),
            (flags(&[x509], Some("t"), None), "/nonexistent/ca-cert.pem"),
        ];
        for (f, expected) in cases {
            let e = error(&f);
            assert!(e.contains(expected), "{f:?}: {e}");
        }
        let short = TlsFlags {
            certificates: Some("/d".into()),
            psk: Some("/k".into()),
            ..TlsFlags::default()
        };
        assert!(error(&short).contains("exclude each other"));
        let verify_alone = TlsFlags {
            verify_peer: true,
            ..TlsFlags::default()
        };
        assert!(error(&verify_alone).contains("--tls-verify-peer"));
        let both = TlsFlags {
            certificates: Some("/d".into()),
            ..flags(&[x509], Some("t"), None)
        };
        assert!(error(&both).contains("cannot be combined"));
    }
}
