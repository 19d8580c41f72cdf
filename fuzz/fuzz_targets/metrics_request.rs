//! The `--metrics` endpoint's request head on untrusted bytes: never a panic, and the end of
//! the head is found the same however the bytes arrive.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../src/daemon/stats/http/request.rs"]
mod request;

use request::{parse, HeadEnd};

fuzz_target!(|data: &[u8]| {
    let Some((&n, head)) = data.split_first() else {
        return;
    };
    let _ = parse(head);
    let whole = HeadEnd::default().scan(head);
    let (mut end, mut seen) = (HeadEnd::default(), Vec::new());
    let mut found = false;
    for read in head.chunks(usize::from(n).max(1)) {
        seen.extend_from_slice(read);
        if end.scan(&seen) {
            found = true;
            break;
        }
    }
    assert_eq!(found, whole);
});
