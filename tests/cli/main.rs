//! `create`, `convert`, `map` and the space test through the real binary, with qemu-img and
//! qemu-io as oracles; one test binary so the suite links once.

mod common;

mod bitmap;
mod convert_map_interop;
mod convert_qcow2;
mod create;
mod interop_writes;
mod snapshot;
mod space;
