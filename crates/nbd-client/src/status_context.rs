//! QEMU's `x-dirty-bitmap` option of the `nbd` driver: block status read from another
//! metadata context (a dirty bitmap `qemu:dirty-bitmap:NAME`, or `qemu:allocation-depth`)
//! in place of `base:allocation`, its values taken as `base:allocation` flags, which is how
//! `qemu-img map` shows a bitmap's or the allocation depth's contents.
//!
//! Like TLS ([`crate::register_tls`]), the option is noted against the export's name when the
//! command line is read, and [`NbdClient::connect`](crate::NbdClient::connect) looks it up.

use std::sync::Mutex;

/// Exports by the name QEMU shows them, with the context their block status comes from.
static REGISTRY: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());

/// Notes that the block status of the export named `name` comes from `context`; a later
/// note for the same name replaces the earlier one.
pub fn register_status_context(name: &str, context: &str) {
    if let Ok(mut all) = REGISTRY.lock() {
        all.retain(|(n, _)| n != name);
        all.push((name.to_owned(), context.to_owned()));
    }
}

/// The context noted for the export named `name`, if any.
pub(super) fn status_context_for(name: &str) -> Option<String> {
    REGISTRY
        .lock()
        .ok()?
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, c)| c.clone())
}
