//! The first block of a file grown from empty, written as QEMU's `file` driver writes it.
//!
//! When QEMU's `file` driver grows a regular file from length 0 (creating an image, sizing a
//! new data file, resizing an empty raw file) without full preallocation, it writes zeros over
//! the file's first block: a later open that probes the O_DIRECT alignment then reads real
//! blocks instead of a hole that any alignment would accept. The visible effect is that a new
//! raw image is not wholly sparse: `qemu-img map` shows its first 4 KiB (512 bytes when the
//! size is below 4 KiB) as data. Doing the same keeps our maps and allocation figures equal to
//! QEMU's for the images both tools create.

use crate::{IoBuf, Storage};

/// The largest block QEMU assumes a device may have.
const MAX_BLOCK: u64 = 4096;
/// The sector QEMU writes instead when the file is smaller than [`MAX_BLOCK`].
const SECTOR: u64 = 512;

/// How many zero bytes QEMU writes at offset 0 of a file it grew from empty to `size` bytes:
/// none for an empty file, a sector below [`MAX_BLOCK`] (even past `size`, so a file of fewer
/// than 512 bytes ends up 512 long, as QEMU's does), else one [`MAX_BLOCK`].
pub fn first_block_len(size: u64) -> u64 {
    match size {
        0 => 0,
        s if s < MAX_BLOCK => SECTOR,
        _ => MAX_BLOCK,
    }
}

/// Writes the zeros [`first_block_len`] says over the start of `file`, which was just grown
/// from length 0 to `size` bytes. A failure is only reported back; the caller may ignore it,
/// as QEMU does, since the file is already complete without this write.
pub async fn allocate_first_block<S: Storage + ?Sized>(file: &S, size: u64) -> std::io::Result<()> {
    let len = first_block_len(size);
    if len == 0 {
        return Ok(());
    }
    // len <= MAX_BLOCK, which fits any usize.
    let (res, _) = file.write_at(IoBuf::zeroed(len as usize).into(), 0).await;
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_length_follows_the_size() {
        assert_eq!(first_block_len(0), 0);
        assert_eq!(first_block_len(1), 512);
        assert_eq!(first_block_len(4095), 512);
        assert_eq!(first_block_len(4096), 4096);
        assert_eq!(first_block_len(1 << 40), 4096);
    }
}
