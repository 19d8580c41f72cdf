//! `check` and hostile images: agreement with qemu-img check, repairs, corrupt images and chains; one test binary so the suite links once.

mod common;

mod corrupt_chains;
mod corrupt_images;
mod fuzz;
mod interop;
mod repair;
