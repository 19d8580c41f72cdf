//! QEMU's `null-co` driver as a storage: a device of a given size that stores nothing.
//! Writes succeed and are dropped, reads give zeros, and with `read-zeroes` block status
//! says every byte reads as zeros (without it, QEMU's driver leaves read buffers as they
//! were and reports data, so that is what [`Storage::data_run`] says then).
//!
//! The image tools name it by `null-co://` (QEMU's defaults: 1 GiB, `read-zeroes` off) or
//! by [`NullTarget::name`], which carries the options the way the opener gets them: in the
//! file name.

use std::io;

use crate::{BufResult, Slice, Storage, MAX_OFFSET};

/// The name QEMU accepts as a `null-co` file name.
pub const NULL_CO: &str = "null-co://";

/// QEMU's default size of a `null-co` device.
pub const DEFAULT_SIZE: u64 = 1 << 30;

/// What a `null-co` device is: its size and whether block status reports zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NullTarget {
    /// Its size in bytes.
    pub size: u64,
    /// QEMU's `read-zeroes`.
    pub read_zeroes: bool,
}

impl Default for NullTarget {
    fn default() -> NullTarget {
        NullTarget {
            size: DEFAULT_SIZE,
            read_zeroes: false,
        }
    }
}

/// True for a name [`NullTarget::parse`] reads.
pub fn is_null_name(name: &str) -> bool {
    name.starts_with(NULL_CO)
}

impl NullTarget {
    /// The name the opener takes: `null-co://`, with `?size=N&read-zeroes=on` for options
    /// other than the defaults.
    pub fn name(&self) -> String {
        if *self == NullTarget::default() {
            return NULL_CO.to_owned();
        }
        let zeroes = if self.read_zeroes { "on" } else { "off" };
        format!("{NULL_CO}?size={}&read-zeroes={zeroes}", self.size)
    }

    /// Reads a name [`NullTarget::name`] gave.
    pub fn parse(name: &str) -> io::Result<NullTarget> {
        let bad = |what: &str| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name}: not a null-co device name ({what})"),
            )
        };
        let rest = name
            .strip_prefix(NULL_CO)
            .ok_or_else(|| bad("no null-co:// prefix"))?;
        let mut target = NullTarget::default();
        if rest.is_empty() {
            return Ok(target);
        }
        let query = rest.strip_prefix('?').ok_or_else(|| bad("text after //"))?;
        for pair in query.split('&') {
            match pair.split_once('=') {
                Some(("size", v)) => {
                    target.size = v
                        .parse()
                        .ok()
                        .filter(|&s| s <= MAX_OFFSET)
                        .ok_or_else(|| bad("size"))?
                }
                Some(("read-zeroes", "on")) => target.read_zeroes = true,
                Some(("read-zeroes", "off")) => target.read_zeroes = false,
                _ => return Err(bad(pair)),
            }
        }
        Ok(target)
    }
}

/// A `null-co` device.
#[derive(Debug)]
pub struct NullStorage {
    target: NullTarget,
}

impl NullStorage {
    /// The device `name` names (see [`NullTarget::name`]).
    pub fn open(name: &str) -> io::Result<NullStorage> {
        Ok(NullStorage {
            target: NullTarget::parse(name)?,
        })
    }
}

impl Storage for NullStorage {
    async fn read_at(&self, mut buf: Slice, _offset: u64) -> BufResult<Slice> {
        buf.fill(0);
        (Ok(()), buf)
    }

    async fn write_at(&self, buf: Slice, _offset: u64) -> BufResult<Slice> {
        (Ok(()), buf)
    }

    async fn write_zeroes_at(&self, _offset: u64, _len: u64, _unmap: bool) -> io::Result<()> {
        Ok(())
    }

    async fn discard_at(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }

    async fn data_run(&self, _offset: u64, len: u64) -> io::Result<(bool, u64)> {
        Ok((!self.target.read_zeroes, len))
    }

    async fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    async fn len(&self) -> io::Result<u64> {
        Ok(self.target.size)
    }

    /// The device's size is fixed, as QEMU's driver has it.
    async fn set_len(&self, len: u64) -> io::Result<()> {
        if len == self.target.size {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "null-co devices cannot be resized",
        ))
    }

    fn zeroes_are_cheap(&self) -> bool {
        true
    }

    fn alignment(&self) -> usize {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_ones_are_refused() {
        assert_eq!(NullTarget::parse(NULL_CO).unwrap(), NullTarget::default());
        let t = NullTarget {
            size: 1 << 20,
            read_zeroes: true,
        };
        assert_eq!(NullTarget::parse(&t.name()).unwrap(), t);
        for bad in [
            "null-co://x",
            "null-co://?size=-1",
            "null-co://?size=1&latency=3",
            "null-co://?read-zeroes=yes",
            "null-co://?size=99999999999999999999",
        ] {
            assert!(NullTarget::parse(bad).is_err(), "{bad}");
        }
    }
}
