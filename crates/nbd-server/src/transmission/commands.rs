//! Running one validated request against the export and shaping its outcome.

use nbd_proto::errno::Errno;
use nbd_proto::wire::reply::BlockStatusChunk;

use super::block_status::{descriptors, dirty_descriptors, Allocation, StatusQuery};
use super::reply_writer::Outcome;
use super::validate::Action;
use crate::export::{Export, ReadChunk};
use crate::negotiate::meta::{MetaContext, MetaSelection};
use crate::negotiate::Mode;

/// What the connection knows that shapes an outcome.
#[derive(Debug, Clone, Copy)]
pub struct ExecContext {
    /// Reply mode.
    pub mode: Mode,
    /// Export size.
    pub size: u64,
}

/// Runs `action`; `payload` is the write data for [`Action::Write`].
pub async fn execute<E: Export>(
    export: &E,
    ctx: &ExecContext,
    action: Action,
    payload: Option<E::Buf>,
) -> Outcome<E::Buf> {
    let done = |r: Result<(), Errno>, what: &'static str| match r {
        Ok(()) => Outcome::Done,
        Err(e) => Outcome::Error(e, what),
    };
    match action {
        Action::Read { offset, len, df } => read(export, offset, len, df).await,
        Action::Write { offset, fua } => match payload {
            Some(buf) => done(export.write(offset, buf, fua).await, "write failed"),
            None => Outcome::Error(Errno::Inval, "write without payload"),
        },
        Action::Flush => done(export.flush().await, "flush failed"),
        Action::Trim { offset, len, fua } => {
            done(export.trim(offset, len, fua).await, "trim failed")
        }
        Action::Cache { offset, len } => done(export.cache(offset, len).await, "cache failed"),
        Action::WriteZeroes { offset, len, flags } => {
            let r = export.write_zeroes(offset, len, flags).await;
            let what = if r == Err(Errno::NotSup) && flags.fast {
                "fast zeroing is not possible for this range"
            } else {
                "write zeroes failed"
            };
            done(r, what)
        }
        Action::BlockStatus {
            offset,
            len,
            req_one,
            meta,
        } => block_status(export, ctx, (offset, len), req_one, meta).await,
        Action::Nothing | Action::Disc => Outcome::Done,
    }
}

async fn read<E: Export>(export: &E, offset: u64, len: usize, df: bool) -> Outcome<E::Buf> {
    if len == 0 {
        return Outcome::Read {
            offset,
            chunks: Vec::new(),
            df,
        };
    }
    match export.read(offset, len).await {
        Ok(chunks) => {
            let total = chunks
                .iter()
                .map(ReadChunk::len)
                .try_fold(0usize, usize::checked_add);
            if total != Some(len) {
                tracing::error!(
                    offset,
                    len,
                    ?total,
                    "export returned a read of the wrong length"
                );
                return Outcome::Error(Errno::Io, "export returned a read of the wrong length");
            }
            Outcome::Read { offset, chunks, df }
        }
        Err(e) => Outcome::Error(e, "read failed"),
    }
}

/// Answers block status for the contexts `meta` over `len` bytes at `offset`.
async fn block_status<E: Export>(
    export: &E,
    ctx: &ExecContext,
    (offset, len): (u64, u64),
    req_one: bool,
    meta: MetaSelection,
) -> Outcome<E::Buf> {
    let extents = if meta.wants_allocation() {
        match export.block_status(offset, len).await {
            Ok(e) => e,
            Err(e) => return Outcome::Error(e, "block status failed"),
        }
    } else {
        Vec::new()
    };
    let q = StatusQuery {
        offset,
        len,
        req_one,
        compact: ctx.mode != Mode::Extended,
        size: ctx.size,
    };
    let mut chunks = Vec::new();
    for context in meta.contexts() {
        let d = match context {
            MetaContext::BaseAllocation => descriptors(&extents, Allocation::Base, &q),
            MetaContext::AllocationDepth => descriptors(&extents, Allocation::Depth, &q),
            MetaContext::DirtyBitmap(n) => {
                let end = ctx.size.min(offset.saturating_add(len));
                match export.dirty_status(n.into(), offset, end - offset).await {
                    Ok(runs) => dirty_descriptors(&runs, &q),
                    Err(e) => return Outcome::Error(e, "dirty bitmap status failed"),
                }
            }
        };
        if d.is_empty() {
            tracing::error!(offset, len, "export returned no extent for block status");
            return Outcome::Error(Errno::Io, "export returned no extent");
        }
        chunks.push(BlockStatusChunk {
            context_id: context.id(),
            descriptors: d,
        });
    }
    Outcome::Status(chunks)
}
