//! A server that is nothing but the bytes it sends, shared by the client targets: it hands
//! the client its script, `chunk` bytes at most per read (so every split of a message into
//! reads is tried), and takes whatever the client writes.

use std::io::{Read, Write};

pub struct Hostile<'a> {
    pub input: &'a [u8],
    pub chunk: usize,
    pub written: usize,
}

impl Read for Hostile<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.chunk).min(self.input.len());
        buf[..n].copy_from_slice(&self.input[..n]);
        self.input = &self.input[n..];
        Ok(n)
    }
}

impl Write for Hostile<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.written = self.written.saturating_add(buf.len());
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
