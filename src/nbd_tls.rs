//! The TLS credentials of `nbd` nodes in image names: the `tls-creds-x509` / `tls-creds-psk`
//! objects of an image tool's command line (not the server's, which `serve` reads itself),
//! taken out of it with the secrets at start, and the client side registered for each
//! export a name reaches with `tls-creds`.

use std::path::Path;
use std::sync::OnceLock;

/// The credential objects of the command line, in their `--object` text.
static OBJECTS: OnceLock<Vec<String>> = OnceLock::new();

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
    let has = |o: &String| crate::daemon::serve::tls::parse_object(o).is_ok_and(|o| o.id == id);
    if !objects.iter().any(has) {
        return Err(format!("No TLS credentials with id '{id}'"));
    }
    let flags = crate::daemon::serve::tls::TlsFlags {
        objects,
        creds: Some(id.to_owned()),
        ..Default::default()
    };
    let client = crate::daemon::serve::tls::tls_client(&flags)
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
