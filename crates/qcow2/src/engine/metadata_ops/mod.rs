//! Operations on the whole image rather than on a guest range, each run with no request in
//! flight or with the whole disk locked: creating an image, internal snapshots, amend,
//! resize, persistent bitmaps, the backing name, emptying for commit and LUKS key slots.

pub(crate) mod amend;
pub(crate) mod bitmap;
pub(crate) mod create;
pub(crate) mod key_slots;
pub(crate) mod make_empty;
pub(crate) mod resize;
pub(crate) mod set_backing;
pub(crate) mod snapshot;
