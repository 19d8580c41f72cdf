//! The `-L` listing client (`nbd_client::list`) talking to a hostile server: the input is every
//! byte the server sends (greeting, option replies), delivered in reads of a size the first
//! byte chooses. The client must never panic, and what it lists stays within its bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbd_client::list::{list_exports, MAX_ITEMS, MAX_REPLY};

mod hostile;
use hostile::Hostile;

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, input)) = data.split_first() else {
        return;
    };
    let mut server = Hostile {
        input,
        chunk: usize::from(chunk).max(1),
        written: 0,
    };
    if let Ok((_, exports)) = list_exports(&mut server, None) {
        assert!(exports.len() <= MAX_ITEMS);
        for e in &exports {
            assert!(e.contexts.len() <= MAX_ITEMS);
            // A name and a description come from one reply each.
            assert!(e.name.len() <= MAX_REPLY as usize * 3);
            assert!(e.description.len() <= MAX_REPLY as usize * 3);
        }
    }
});
