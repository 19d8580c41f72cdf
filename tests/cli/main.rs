//! `create`, `convert`, `map`, `compare`, `measure` and the space test through the real
//! binary, with qemu-img and qemu-io as oracles; one test binary so the suite links once.

mod common;

mod amend;
mod bitmap;
mod blkdebug;
mod commit_rebase;
mod compare_measure;
mod convert_map_interop;
mod convert_options;
mod convert_qcow2;
mod create;
mod data_file;
mod dd;
mod drop_in;
mod encryption;
mod image_names;
mod interop_writes;
mod luks_volumes;
mod nbd_tls;
mod nbd_urls;
mod option_lists;
mod qemu_img_options;
mod qemu_img_outputs;
mod raw_files;
mod rebase_compress;
mod resize;
mod snapshot;
mod space;
