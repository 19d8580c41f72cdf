//! The control socket's QMP framer and request checks on untrusted bytes: never a panic; the
//! frames found do not depend on how the stream was split into reads; the buffer never grows
//! far past the limit.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../src/daemon/serve/control/qmp.rs"]
mod qmp;

use qmp::{Frame, Framer};

/// Every frame of `data` fed in reads of the sizes `cuts` gives (cycling; 0 means 1 byte).
fn frames(data: &[u8], cuts: &[u8], limit: usize) -> Vec<Frame> {
    let mut framer = Framer::new(limit);
    let mut out = Vec::new();
    let mut rest = data;
    let mut sizes = cuts.iter().cycle();
    while !rest.is_empty() {
        let size = sizes.next().map_or(rest.len(), |&c| usize::from(c).max(1));
        let (read, tail) = rest.split_at(size.min(rest.len()));
        framer.push(read);
        rest = tail;
        while let Some(frame) = framer.next_frame() {
            if let Frame::Value(v) = &frame {
                if let Ok(request) = qmp::parse_request(v.clone()) {
                    let id = request.id.clone();
                    assert!(!qmp::line(&qmp::reply(Ok(v.clone()), id)).is_empty());
                }
            }
            out.push(frame);
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    // The first bytes choose the read sizes, the rest is the stream.
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let (cuts, stream) = rest.split_at(usize::from(n % 8).min(rest.len()));
    let whole = frames(stream, &[], usize::MAX);
    assert_eq!(frames(stream, cuts, usize::MAX), whole);
    // With a small limit only the absence of panics and the bound are checked: where a
    // too-long value is cut depends on the reads.
    let mut framer = Framer::new(64);
    for read in stream.chunks(usize::from(n).max(1)) {
        framer.push(read);
        while framer.next_frame().is_some() {}
    }
});
