//! File access for the checker: whole-buffer reads (bytes past the end of the file read as
//! zeros, as QEMU reads them), writes and flushes, with errors that say what was being done.

use super::error::CheckError;
use crate::format::header::FieldUpdate;
use storage::{IoBuf, Storage};

/// Reads `len` bytes at `offset`.
pub(crate) async fn read<S: Storage>(
    file: &S,
    what: &'static str,
    offset: u64,
    len: usize,
) -> Result<IoBuf, CheckError> {
    let (res, slice) = file.read_at(IoBuf::zeroed(len).into(), offset).await;
    res.map_err(|e| CheckError::io(what, offset, e))?;
    Ok(slice.into_inner())
}

/// Reads `buf.len()` bytes at `offset` into `buf`.
pub(crate) async fn read_into<S: Storage>(
    file: &S,
    what: &'static str,
    offset: u64,
    buf: IoBuf,
) -> Result<IoBuf, CheckError> {
    let (res, slice) = file.read_at(buf.into(), offset).await;
    res.map_err(|e| CheckError::io(what, offset, e))?;
    Ok(slice.into_inner())
}

/// Writes `bytes` at `offset`.
pub(crate) async fn write<S: Storage>(
    file: &S,
    what: &'static str,
    offset: u64,
    bytes: &[u8],
) -> Result<(), CheckError> {
    let (res, _) = file.write_at(IoBuf::from_slice(bytes).into(), offset).await;
    res.map_err(|e| CheckError::io(what, offset, e))
}

/// Makes everything written so far durable.
/// Writes header fields in place, as `format` encoded them.
pub(crate) async fn write_header<S: Storage, const N: usize>(
    file: &S,
    what: &'static str,
    update: FieldUpdate<N>,
) -> Result<(), CheckError> {
    write(file, what, update.offset, &update.bytes).await
}

pub(crate) async fn flush<S: Storage>(file: &S) -> Result<(), CheckError> {
    file.flush()
        .await
        .map_err(|e| CheckError::io("flushing the image", 0, e))
}
