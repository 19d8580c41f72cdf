//! `json:` backing and data file names as an image header carries them (a qcow2 header
//! whose backing file name or data file extension holds the bytes, or the name alone):
//! parsing never panics and reads no file; under the untrusted rules a name is refused or
//! becomes a plain file path, never an NBD export, a `null-co` device or a blkdebug node;
//! a blkdebug node's name, once made, parses back to the same node.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use qcow2::engine::backing_name::{self, Reference};
use qcow2::format::Header;
use storage::opener::described::{describe_name, Described};

fuzz_target!(|data: &[u8]| {
    let mut names: Vec<String> = Vec::new();
    if let Ok(header) = Header::decode(data) {
        names.extend(
            header
                .backing_file
                .as_deref()
                .map(|n| String::from_utf8_lossy(n).into_owned()),
        );
        names.extend(
            header
                .data_file_name()
                .map(|n| String::from_utf8_lossy(n).into_owned()),
        );
    } else if let Ok(text) = std::str::from_utf8(data) {
        names.push(text.to_string());
    }
    let image = Path::new("/images/top.qcow2");
    for name in names {
        for kind in [Reference::BackingFile, Reference::DataFile] {
            if let Ok(path) = backing_name::resolve_untrusted(image, &name, kind) {
                let text = path.to_str().unwrap_or_default();
                assert!(
                    storage::not_a_file(text).is_none(),
                    "{name:?} became {text:?}"
                );
            }
        }
        if let Some(Ok(Described::Blkdebug(node))) = describe_name(&name) {
            // Only nodes without a configuration file: the fuzzer reads no file.
            if node.config.is_none() && node.rules().is_ok() {
                let made = node.name();
                let back = storage::blkdebug::Node::parse(&made).expect("a node's name parses");
                assert_eq!(back.image, node.image);
                assert_eq!(back.inject, node.inject);
                assert_eq!(back.set_state, node.set_state);
            }
        }
    }
});
