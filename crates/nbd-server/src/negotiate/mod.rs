//! The handshake: greeting, client flags and option haggling up to transmission.
//!
//! Fixed newstyle and non-fixed newstyle clients are served; oldstyle is not (the spec has
//! retired it). The decisions live in [`options`] as a pure state machine; this module only
//! moves bytes.

pub mod meta;
pub mod options;
mod outcome;

pub use outcome::{transmission_flags, Mode, Negotiated};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use nbd_proto::wire::consts::*;
use nbd_proto::wire::handshake::{
    ClientFlags, ExportNameReply, Greeting, OptionHeader, OptionReplyHeader, CLIENT_FLAGS_LEN,
    OPTION_HEADER_LEN,
};
use nbd_proto::wire::WireError;

use crate::export::Export;
use crate::exports::{Attachment, Exports};
use options::{OptReply, OptionState, Step};

/// Largest option payload we buffer; larger ones are drained and refused, never allocated.
/// Generous for every option we know (a `SET_META_CONTEXT` with hundreds of queries fits).
pub const MAX_OPTION_LEN: u32 = 1 << 20;

/// Most options one handshake may send. Real clients send a handful (nbdinfo --list about
/// a dozen per export); a client that keeps haggling is cut off instead of keeping the
/// server busy until the handshake time limit.
pub const MAX_OPTIONS: u32 = 1024;

/// Most option bytes (payloads, drained ones included) one handshake may send.
pub const MAX_OPTION_BYTES: u64 = 16 << 20;

/// Why a handshake ended without reaching transmission (other than the client leaving).
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The socket failed.
    #[error("handshake I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The client sent a malformed structure.
    #[error("handshake: {0}")]
    Wire(#[from] WireError),
    /// The client broke a rule that leaves no way to answer but hanging up.
    #[error("handshake refused: {0}")]
    Refused(String),
}

/// How a handshake ended normally.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeEnd {
    /// Enter transmission, attached to the export selected.
    Transmission(Negotiated, Attachment),
    /// The client aborted, or hung up, before choosing an export.
    ClientLeft,
    /// The client hung up where the next option should have begun (no NBD_OPT_ABORT).
    HungUp,
    /// STARTTLS was acknowledged: run the TLS handshake on the socket, then go on with
    /// [`negotiate_options`] and this state inside TLS.
    StartTls(OptionState),
}

/// Runs the server side of the handshake over `reader`/`writer`: the greeting, the client
/// flags, then options until transmission. With `tls_required`, only STARTTLS (or ABORT)
/// gets anywhere.
pub async fn negotiate<R, W, E>(
    reader: &mut BufReader<R>,
    writer: &mut W,
    exports: &Exports<E>,
    tls_required: bool,
) -> Result<HandshakeEnd, HandshakeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
    E: Export,
{
    let server_flags = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES;
    writer
        .write_all(
            &Greeting {
                flags: server_flags,
            }
            .encode(),
        )
        .await?;
    writer.flush().await?;

    let mut buf = [0u8; CLIENT_FLAGS_LEN];
    if !read_or_eof(reader, &mut buf).await? {
        return Ok(HandshakeEnd::ClientLeft);
    }
    let client = ClientFlags::decode(&buf, server_flags)?;
    let state = if tls_required {
        OptionState::requiring_tls(client.fixed_newstyle, client.no_zeroes)
    } else {
        OptionState::new(client.fixed_newstyle, client.no_zeroes)
    };
    negotiate_options(reader, writer, exports, state).await
}

/// Option haggling from `state` on: after the client flags, or inside TLS.
pub async fn negotiate_options<R, W, E>(
    reader: &mut BufReader<R>,
    writer: &mut W,
    exports: &Exports<E>,
    mut state: OptionState,
) -> Result<HandshakeEnd, HandshakeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
    E: Export,
{
    let mut data = Vec::new();
    let (mut options, mut option_bytes) = (0u32, 0u64);
    loop {
        let mut head = [0u8; OPTION_HEADER_LEN];
        if !read_or_eof(reader, &mut head).await? {
            return Ok(HandshakeEnd::HungUp);
        }
        let header = OptionHeader::decode(&head)?;
        options += 1;
        option_bytes += u64::from(header.length);
        if options > MAX_OPTIONS || option_bytes > MAX_OPTION_BYTES {
            return Err(HandshakeError::Refused(format!(
                "more than {MAX_OPTIONS} options or {MAX_OPTION_BYTES} bytes of options in one \
                 handshake"
            )));
        }
        let step = if header.length > MAX_OPTION_LEN {
            drain(reader, header.length.into()).await?;
            state.oversized(header.option, header.length)
        } else {
            data.clear();
            data.resize(usize::try_from(header.length).unwrap_or(0), 0);
            reader.read_exact(&mut data).await?;
            state.handle(exports, header.option, &data)
        };
        tracing::debug!(
            option = header.option,
            length = header.length,
            ?step,
            "option"
        );
        match step {
            Step::Continue(replies) => send_replies(writer, &replies).await?,
            Step::Go(replies, negotiated) => {
                // Attached before the reply goes out: a close of the export from now on
                // counts this client.
                let attached = attach(exports, &negotiated)?;
                send_replies(writer, &replies).await?;
                return Ok(HandshakeEnd::Transmission(negotiated, attached));
            }
            Step::ExportName(negotiated) => {
                let attached = attach(exports, &negotiated)?;
                let reply = ExportNameReply {
                    size: negotiated.size,
                    flags: negotiated.flags,
                };
                writer.write_all(&reply.encode(state.no_zeroes)).await?;
                writer.flush().await?;
                return Ok(HandshakeEnd::Transmission(negotiated, attached));
            }
            Step::Abort(replies) => {
                // The client may already be gone; an ACK it never reads is no error.
                let _ = send_replies(writer, &replies).await;
                return Ok(HandshakeEnd::ClientLeft);
            }
            Step::Close(reason) => return Err(HandshakeError::Refused(reason)),
            Step::Fail(replies, reason) => {
                let _ = send_replies(writer, &replies).await;
                return Err(HandshakeError::Refused(reason));
            }
            Step::StartTls(replies) => {
                // Bytes already here came in plaintext after STARTTLS, before our answer:
                // they must never be taken for part of the TLS stream (or, worse, for
                // options negotiated inside it).
                let early = reader.buffer().len();
                if early > 0 {
                    return Err(HandshakeError::Refused(format!(
                        "{early} plaintext bytes after OPT_STARTTLS, sent before its reply"
                    )));
                }
                send_replies(writer, &replies).await?;
                return Ok(HandshakeEnd::StartTls(state));
            }
        }
    }
}

/// Attaches the connection to the export the option just selected (in the same step, so
/// the export cannot have been closed in between).
fn attach<E>(exports: &Exports<E>, negotiated: &Negotiated) -> Result<Attachment, HandshakeError> {
    exports
        .attach(negotiated.export)
        .ok_or_else(|| HandshakeError::Refused("the export selected is closing".into()))
}

async fn send_replies<W: AsyncWrite + Unpin>(
    writer: &mut W,
    replies: &[OptReply],
) -> std::io::Result<()> {
    let mut out = Vec::new();
    for r in replies {
        let header = OptionReplyHeader {
            option: r.option,
            reply_type: r.reply_type,
            length: u32::try_from(r.data.len()).unwrap_or(u32::MAX),
        };
        out.extend_from_slice(&header.encode());
        out.extend_from_slice(&r.data);
    }
    writer.write_all(&out).await?;
    writer.flush().await
}

/// Fills `buf`; `Ok(false)` if the peer closed before sending its first byte.
pub(crate) async fn read_or_eof<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut [u8],
) -> std::io::Result<bool> {
    let mut filled = 0;
    while filled < buf.len() {
        let n = reader.read(&mut buf[filled..]).await?;
        if n == 0 {
            if filled == 0 {
                return Ok(false);
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        filled += n;
    }
    Ok(true)
}

/// Reads and discards `len` bytes without allocating them.
pub(crate) async fn drain<R: AsyncRead + Unpin>(reader: &mut R, len: u64) -> std::io::Result<()> {
    let copied = tokio::io::copy(&mut reader.take(len), &mut tokio::io::sink()).await?;
    if copied < len {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}
