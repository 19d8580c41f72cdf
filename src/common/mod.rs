//! What the image tools and the daemon both need, below both: the start-up before any
//! subcommand runs (`startup`), the single-threaded runtime and image opening
//! (`engine_run`), image names as the command line gives them (`image_name`), the TLS
//! credential objects (`tls`), secrets, cache modes, size strings, option lists, OS error
//! wording and the program's name. Nothing here imports `tools` or `daemon`; they never
//! import each other.

pub mod cache_mode;
pub mod engine_run;
pub mod image_bytes;
pub mod image_name;
pub mod malloc_tuning;
pub mod options;
pub mod os_error;
pub mod prog;
pub mod secrets;
pub mod settings;
pub mod size_string;
pub mod startup;
pub mod tls;
pub mod zeroes;
