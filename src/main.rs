//! `qcow2-nbd`: inspect qcow2 images and serve them over NBD.

use clap::Parser;

/// Command-line interface.
#[derive(Parser, Debug)]
#[command(name = "qcow2-nbd", version, about = "qcow2 image tools and NBD server")]
enum Cli {}

fn main() {
    let _ = Cli::parse();
}
