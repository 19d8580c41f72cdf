//! Option haggling as a pure state machine: one client option in, the replies and the next
//! step out. No I/O here, so every answer is unit-tested byte for byte.

use nbd_proto::wire::consts::*;
use nbd_proto::wire::option_data::{
    InfoReply, InfoRequest, MetaContextEntry, MetaContextRequest, ServerEntry,
};

use super::meta::{self, MetaSelection, QueryMode};
use super::outcome::{transmission_flags, Mode, Negotiated};
use crate::export::Export;
use crate::exports::Exports;

/// Most queries one LIST/SET_META_CONTEXT may carry; we offer two contexts, so a client
/// never needs more than a handful, and a flood of queries is refused as too big.
pub const MAX_META_QUERIES: usize = 128;

/// One option reply to send: option, reply type, data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptReply {
    /// Option being answered.
    pub option: u32,
    /// `REP_*` type.
    pub reply_type: u32,
    /// Reply data.
    pub data: Vec<u8>,
}

impl OptReply {
    fn ack(option: u32) -> Self {
        Self {
            option,
            reply_type: REP_ACK,
            data: Vec::new(),
        }
    }

    fn error(option: u32, reply_type: u32, message: impl Into<String>) -> Self {
        Self {
            option,
            reply_type,
            data: message.into().into_bytes(),
        }
    }
}

/// What the connection does after an option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Send the replies and read the next option.
    Continue(Vec<OptReply>),
    /// Send the replies and enter transmission (`OPT_GO` succeeded).
    Go(Vec<OptReply>, Negotiated),
    /// Send the `OPT_EXPORT_NAME` reply and enter transmission.
    ExportName(Negotiated),
    /// Send the replies and close (`OPT_ABORT`).
    Abort(Vec<OptReply>),
    /// Close without replying: the protocol leaves no way to report this error.
    Close(String),
    /// Send the replies, then close: the client broke a rule it is told about first.
    Fail(Vec<OptReply>, String),
    /// Send the replies (the STARTTLS acknowledgement), then run the TLS handshake.
    StartTls(Vec<OptReply>),
}

/// Where a connection stands on TLS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TlsPhase {
    /// The server has no TLS: STARTTLS is refused by policy.
    #[default]
    Off,
    /// The server requires TLS and the client has not started it yet: only STARTTLS and
    /// ABORT are served.
    Required,
    /// The client is talking through TLS.
    Active,
}

/// Negotiation state of one connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OptionState {
    /// The client set `NBD_FLAG_C_FIXED_NEWSTYLE`.
    pub fixed: bool,
    /// The client set `NBD_FLAG_C_NO_ZEROES`.
    pub no_zeroes: bool,
    structured: bool,
    extended: bool,
    /// Selected contexts and the export they were selected for.
    meta: Option<(usize, MetaSelection)>,
    tls: TlsPhase,
    /// Why every option is refused: the TLS identity is not admitted.
    denied: Option<String>,
}

impl OptionState {
    /// State after the client flags.
    pub fn new(fixed: bool, no_zeroes: bool) -> Self {
        Self {
            fixed,
            no_zeroes,
            ..Self::default()
        }
    }

    /// State after the client flags, on a server that requires TLS.
    pub fn requiring_tls(fixed: bool, no_zeroes: bool) -> Self {
        Self {
            tls: TlsPhase::Required,
            ..Self::new(fixed, no_zeroes)
        }
    }

    /// The TLS handshake completed: negotiation starts afresh inside TLS.
    pub fn tls_started(&mut self) {
        *self = Self {
            tls: TlsPhase::Active,
            ..Self::new(self.fixed, self.no_zeroes)
        };
    }

    /// Refuses every further option with `NBD_REP_ERR_POLICY` and this reason: the client
    /// finished TLS but its identity is not admitted.
    pub fn deny(&mut self, reason: String) {
        self.denied = Some(reason);
    }

    /// Where the connection stands on TLS.
    pub fn tls(&self) -> TlsPhase {
        self.tls
    }

    /// The reply mode negotiated so far.
    pub fn mode(&self) -> Mode {
        if self.extended {
            Mode::Extended
        } else if self.structured {
            Mode::Structured
        } else {
            Mode::Simple
        }
    }

    /// Answers an option whose data exceeded the size we are willing to buffer (the caller
    /// has already drained the data).
    pub fn oversized(&mut self, option: u32, length: u32) -> Step {
        if option == OPT_EXPORT_NAME || !self.fixed {
            return Step::Close(format!(
                "option {option} with {length} bytes of data is too large"
            ));
        }
        if option == OPT_SET_META_CONTEXT {
            self.meta = None;
        }
        // The data was drained, but there was some: a STARTTLS here is one with data.
        if let Some(step) = self.gatekeep(option, &[0]) {
            return step;
        }
        if option == OPT_STARTTLS {
            return self.starttls(&[0]);
        }
        let reply = if is_known(option) {
            OptReply::error(
                option,
                REP_ERR_TOO_BIG,
                format!("option data of {length} bytes is too large"),
            )
        } else {
            OptReply::error(
                option,
                REP_ERR_UNSUP,
                format!("option {option} is not supported"),
            )
        };
        Step::Continue(vec![reply])
    }

    /// Handles one option with its complete data.
    pub fn handle<E: Export>(&mut self, exports: &Exports<E>, option: u32, data: &[u8]) -> Step {
        if !self.fixed && option != OPT_EXPORT_NAME {
            // A non-fixed client cannot parse option replies: hang up, as qemu-nbd does.
            return Step::Close(format!(
                "option {option} from a client without fixed newstyle"
            ));
        }
        if let Some(step) = self.gatekeep(option, data) {
            return step;
        }
        match option {
            OPT_EXPORT_NAME => self.export_name(exports, data),
            OPT_ABORT => Step::Abort(vec![OptReply::ack(option)]),
            OPT_STARTTLS => self.starttls(data),
            OPT_LIST => Step::Continue(list(exports, data)),
            OPT_INFO | OPT_GO => self.info_or_go(exports, option, data),
            OPT_STRUCTURED_REPLY => Step::Continue(vec![self.structured_reply(data)]),
            OPT_EXTENDED_HEADERS => Step::Continue(vec![self.extended_headers(data)]),
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                Step::Continue(self.meta_context(exports, option, data))
            }
            _ => Step::Continue(vec![OptReply::error(
                option,
                REP_ERR_UNSUP,
                format!("option {option} is not supported"),
            )]),
        }
    }

    /// The answer to an option the TLS policy decides on its own: everything but STARTTLS
    /// and ABORT before TLS, everything but ABORT from an identity not admitted. `None`
    /// lets the option through.
    fn gatekeep(&self, option: u32, data: &[u8]) -> Option<Step> {
        let refuse = |reply_type, message: String| {
            if option == OPT_EXPORT_NAME {
                // No way to answer OPT_EXPORT_NAME with an error but hanging up.
                Step::Close(message)
            } else {
                Step::Continue(vec![OptReply::error(option, reply_type, message)])
            }
        };
        if option == OPT_ABORT {
            return None;
        }
        if self.tls == TlsPhase::Required {
            if option == OPT_STARTTLS {
                return Some(self.starttls(data));
            }
            return Some(refuse(
                REP_ERR_TLS_REQD,
                format!("Option {option:#x} not permitted before TLS"),
            ));
        }
        self.denied
            .as_ref()
            .map(|reason| refuse(REP_ERR_POLICY, reason.clone()))
    }

    fn starttls(&self, data: &[u8]) -> Step {
        let option = OPT_STARTTLS;
        match self.tls {
            // A client that cannot start TLS correctly is dropped, as qemu-nbd does.
            TlsPhase::Required if !data.is_empty() => Step::Fail(
                vec![OptReply::error(
                    option,
                    REP_ERR_INVALID,
                    "OPT_STARTTLS takes no data",
                )],
                "OPT_STARTTLS with data".into(),
            ),
            TlsPhase::Required => Step::StartTls(vec![OptReply::ack(option)]),
            TlsPhase::Active => Step::Continue(vec![OptReply::error(
                option,
                REP_ERR_INVALID,
                "TLS already enabled",
            )]),
            TlsPhase::Off => Step::Continue(vec![OptReply::error(
                option,
                REP_ERR_POLICY,
                "TLS not configured",
            )]),
        }
    }

    /// What transmission with export `index` runs under. `obeys_block_size` says the client
    /// asked for the block sizes (`NBD_INFO_BLOCK_SIZE`): only then is the export's minimum
    /// its to keep. A client that never asked (`OPT_EXPORT_NAME`, or `OPT_GO` without the
    /// request) cannot know of a constraint, so it gets minimum 1, as qemu-nbd gives it, and
    /// the export serves its unaligned requests itself (the spec: a server SHOULD accept
    /// minimum 1 from a client it advertised no constraints to).
    fn negotiated<E: Export>(
        &self,
        exports: &Exports<E>,
        index: usize,
        obeys_block_size: bool,
    ) -> Option<Negotiated> {
        let entry = exports.get(index)?;
        let features = entry.export.features();
        let mut block_size = features.block_size.advertised();
        if !obeys_block_size {
            block_size.minimum = 1;
        }
        let mode = self.mode();
        let meta = match self.meta {
            Some((for_export, sel)) if for_export == index && mode != Mode::Simple => sel,
            _ => MetaSelection::default(),
        };
        let mut flags = transmission_flags(&features, mode);
        if mode == Mode::Extended && !meta.is_empty() {
            flags |= FLAG_BLOCK_STATUS_PAYLOAD;
        }
        Some(Negotiated {
            export: index,
            mode,
            meta,
            size: entry.export.size(),
            flags,
            block_size,
        })
    }

    fn export_name<E: Export>(&mut self, exports: &Exports<E>, data: &[u8]) -> Step {
        if self.extended {
            return Step::Close("OPT_EXPORT_NAME after extended headers were negotiated".into());
        }
        if data.len() > MAX_STRING_LEN {
            return Step::Close(format!("export name of {} bytes is too long", data.len()));
        }
        match exports
            .find(data)
            .and_then(|i| self.negotiated(exports, i, false))
        {
            Some(n) => Step::ExportName(n),
            None => Step::Close(format!(
                "unknown export {:?}",
                String::from_utf8_lossy(data)
            )),
        }
    }

    fn info_or_go<E: Export>(&mut self, exports: &Exports<E>, option: u32, data: &[u8]) -> Step {
        let request = match InfoRequest::decode(data) {
            Ok(r) => r,
            Err(e) => {
                return Step::Continue(vec![OptReply::error(
                    option,
                    REP_ERR_INVALID,
                    e.to_string(),
                )])
            }
        };
        let asked = request.requests.contains(&INFO_BLOCK_SIZE);
        let Some((index, n)) = exports
            .find(request.name)
            .and_then(|i| Some((i, self.negotiated(exports, i, asked)?)))
        else {
            return Step::Continue(vec![OptReply::error(
                option,
                REP_ERR_UNKNOWN,
                format!(
                    "export {:?} not found",
                    String::from_utf8_lossy(request.name)
                ),
            )]);
        };
        let Some(entry) = exports.get(index) else {
            return Step::Continue(vec![OptReply::error(
                option,
                REP_ERR_UNKNOWN,
                "export vanished",
            )]);
        };
        let info = |item: InfoReply<'_>| OptReply {
            option,
            reply_type: REP_INFO,
            data: item.encode(),
        };
        // OPT_INFO tells the export's own minimum whether asked or not (the client is only
        // looking); OPT_GO tells what transmission will enforce.
        let required = entry.export.features().block_size.minimum;
        let minimum = if option == OPT_INFO {
            required
        } else {
            n.block_size.minimum
        };
        let mut replies = Vec::new();
        // Name and description only when asked for; export and block sizes always (the
        // spec allows unrequested items, and clients that ignore them lose nothing).
        if request.requests.contains(&INFO_NAME) {
            replies.push(info(InfoReply::Name(entry.name.as_bytes())));
        }
        if request.requests.contains(&INFO_DESCRIPTION) && !entry.description.is_empty() {
            replies.push(info(InfoReply::Description(entry.description.as_bytes())));
        }
        replies.push(info(InfoReply::BlockSize {
            minimum,
            preferred: n.block_size.preferred,
            maximum: n.block_size.maximum,
        }));
        // As qemu-nbd: OPT_INFO under extended headers offers block status payloads whether
        // or not contexts were chosen yet (the client may still choose before OPT_GO).
        let flags = if option == OPT_INFO && n.mode == Mode::Extended {
            n.flags | FLAG_BLOCK_STATUS_PAYLOAD
        } else {
            n.flags
        };
        replies.push(info(InfoReply::Export {
            size: n.size,
            flags,
        }));
        if option == OPT_INFO && !asked && required > 1 {
            // As qemu-nbd: a client that only asks about an export with a minimum block size
            // but did not ask for block sizes is told it must (OPT_GO is never refused so:
            // it gets minimum 1 instead).
            replies.push(OptReply::error(
                option,
                REP_ERR_BLOCK_SIZE_REQD,
                "request NBD_INFO_BLOCK_SIZE to use this export",
            ));
            return Step::Continue(replies);
        }
        replies.push(OptReply::ack(option));
        if option == OPT_GO {
            Step::Go(replies, n)
        } else {
            Step::Continue(replies)
        }
    }

    fn structured_reply(&mut self, data: &[u8]) -> OptReply {
        let option = OPT_STRUCTURED_REPLY;
        if !data.is_empty() {
            return OptReply::error(
                option,
                REP_ERR_INVALID,
                "OPT_STRUCTURED_REPLY takes no data",
            );
        }
        if self.extended {
            return OptReply::error(
                option,
                REP_ERR_EXT_HEADER_REQD,
                "extended headers already negotiated",
            );
        }
        if self.structured {
            return OptReply::error(
                option,
                REP_ERR_INVALID,
                "structured replies already negotiated",
            );
        }
        self.structured = true;
        OptReply::ack(option)
    }

    fn extended_headers(&mut self, data: &[u8]) -> OptReply {
        let option = OPT_EXTENDED_HEADERS;
        if !data.is_empty() {
            return OptReply::error(
                option,
                REP_ERR_INVALID,
                "OPT_EXTENDED_HEADERS takes no data",
            );
        }
        if self.extended {
            return OptReply::error(
                option,
                REP_ERR_INVALID,
                "extended headers already negotiated",
            );
        }
        self.extended = true;
        OptReply::ack(option)
    }

    fn meta_context<E: Export>(
        &mut self,
        exports: &Exports<E>,
        option: u32,
        data: &[u8],
    ) -> Vec<OptReply> {
        let setting = option == OPT_SET_META_CONTEXT;
        if setting {
            // A set replaces the previous selection even when it fails.
            self.meta = None;
        }
        if self.mode() == Mode::Simple {
            return vec![OptReply::error(
                option,
                REP_ERR_INVALID,
                "negotiate structured replies or extended headers first",
            )];
        }
        let request = match MetaContextRequest::decode(data) {
            Ok(r) => r,
            Err(e) => return vec![OptReply::error(option, REP_ERR_INVALID, e.to_string())],
        };
        let Some(entry) = exports
            .find(request.name)
            .and_then(|i| Some((i, exports.get(i)?)))
        else {
            return vec![OptReply::error(
                option,
                REP_ERR_UNKNOWN,
                format!(
                    "export {:?} not found",
                    String::from_utf8_lossy(request.name)
                ),
            )];
        };
        let (index, entry) = entry;
        if request.queries.len() > MAX_META_QUERIES {
            return vec![OptReply::error(
                option,
                REP_ERR_TOO_BIG,
                format!(
                    "{} metadata context queries; at most {MAX_META_QUERIES} are served",
                    request.queries.len()
                ),
            )];
        }
        let bitmaps = entry.export.dirty_bitmaps();
        let available = MetaSelection {
            base_allocation: true,
            allocation_depth: entry.export.features().allocation_depth,
            dirty_bitmaps: MetaSelection::all_bitmaps(bitmaps.len()),
        };
        let mode = if setting {
            QueryMode::Set
        } else {
            QueryMode::List
        };
        let selected = meta::select(&request.queries, mode, available, &bitmaps);
        let mut replies: Vec<OptReply> = selected
            .contexts()
            .into_iter()
            .map(|ctx| OptReply {
                option,
                reply_type: REP_META_CONTEXT,
                data: MetaContextEntry {
                    id: if setting { ctx.id() } else { 0 },
                    name: ctx.name(&bitmaps).as_bytes(),
                }
                .encode(),
            })
            .collect();
        replies.push(OptReply::ack(option));
        if setting {
            self.meta = Some((index, selected));
        }
        replies
    }
}

fn list<E>(exports: &Exports<E>, data: &[u8]) -> Vec<OptReply> {
    if !data.is_empty() {
        return vec![OptReply::error(
            OPT_LIST,
            REP_ERR_INVALID,
            "OPT_LIST takes no data",
        )];
    }
    let mut replies: Vec<OptReply> = exports
        .entries()
        .iter()
        .map(|e| OptReply {
            option: OPT_LIST,
            reply_type: REP_SERVER,
            data: ServerEntry {
                name: e.name.as_bytes(),
                details: e.description.as_bytes(),
            }
            .encode(),
        })
        .collect();
    replies.push(OptReply::ack(OPT_LIST));
    replies
}

fn is_known(option: u32) -> bool {
    matches!(
        option,
        OPT_EXPORT_NAME
            | OPT_ABORT
            | OPT_LIST
            | OPT_INFO
            | OPT_GO
            | OPT_STRUCTURED_REPLY
            | OPT_LIST_META_CONTEXT
            | OPT_SET_META_CONTEXT
            | OPT_EXTENDED_HEADERS
            | OPT_STARTTLS
    )
}

#[cfg(test)]
#[path = "options_tests.rs"]
mod tests;
