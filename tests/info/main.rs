//! `qcow2-nbd info` against qemu-img info, hostile images and backing-name rules; one test
//! binary so the suite links once.

mod backing_rules;
mod interop;
mod mutation;
