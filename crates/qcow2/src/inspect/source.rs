//! A synchronous random-access byte source, so the inspector runs the same over a file and
//! over an in-memory buffer (the fuzz targets and tests).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Positional reads from something with a length.
pub trait ByteSource {
    /// Total length in bytes.
    fn byte_len(&self) -> io::Result<u64>;

    /// Fills `buf` from `offset`; fails with `UnexpectedEof` if the source ends first.
    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
}

impl ByteSource for [u8] {
    fn byte_len(&self) -> io::Result<u64> {
        Ok(self.len() as u64)
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let src = usize::try_from(offset)
            .ok()
            .and_then(|start| self.get(start..start.checked_add(buf.len())?))
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

impl ByteSource for Vec<u8> {
    fn byte_len(&self) -> io::Result<u64> {
        self.as_slice().byte_len()
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.as_slice().read_exact_at(offset, buf)
    }
}

impl ByteSource for File {
    fn byte_len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_reads_are_bounds_checked() {
        let data: &[u8] = &[1, 2, 3, 4];
        let mut buf = [0u8; 2];
        data.read_exact_at(2, &mut buf).unwrap();
        assert_eq!(buf, [3, 4]);
        assert!(data.read_exact_at(3, &mut buf).is_err());
        assert!(data.read_exact_at(u64::MAX, &mut buf).is_err());
        assert_eq!(data.byte_len().unwrap(), 4);
    }
}
