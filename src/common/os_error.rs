//! OS errors in the words C tools print them.

/// An I/O error's text as C tools print it: strerror's words, without Rust's
/// " (os error N)" suffix or the storage layer's "opening PATH: " context.
pub fn plain_io(e: &std::io::Error) -> String {
    use std::io::ErrorKind;
    let strerror = match (e.raw_os_error(), e.kind()) {
        (Some(code), _) => Some(std::io::Error::from_raw_os_error(code).to_string()),
        (None, ErrorKind::NotFound) => Some("No such file or directory".to_string()),
        (None, ErrorKind::PermissionDenied) => Some("Permission denied".to_string()),
        (None, ErrorKind::IsADirectory) => Some("Is a directory".to_string()),
        _ => None,
    };
    let s = strerror.unwrap_or_else(|| e.to_string());
    match s.rfind(" (os error ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}
