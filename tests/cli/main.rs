//! `create`, `convert`, `map`, `compare`, `measure` and the space test through the real
//! binary, with qemu-img and qemu-io as oracles; one test binary so the suite links once.

mod common;

mod amend;
mod bitmap;
mod commit_rebase;
mod compare_measure;
mod convert_map_interop;
mod convert_qcow2;
mod create;
mod drop_in;
mod interop_writes;
mod qemu_img_options;
mod qemu_img_outputs;
mod resize;
mod snapshot;
mod space;
