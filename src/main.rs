//! `qcow2-nbd`: qemu-img-like tools for qcow2 images and an NBD server that exports them.
//!
//! `cli` is the command line and hands each subcommand to its module: the image tools in
//! `tools`, the server and its control client in `daemon`, over `common`, which both use.

mod cli;
mod common;
mod daemon;
mod tools;

use std::process::ExitCode;

use clap::CommandFactory;

fn main() -> ExitCode {
    match common::startup::parse::<cli::Cli>(cli::Cli::command()) {
        Ok((matches, cli)) => cli.run(&matches),
        Err(code) => code,
    }
}
