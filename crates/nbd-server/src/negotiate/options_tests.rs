use nbd_proto::wire::option_data::{
    InfoReply, InfoRequest, MetaContextEntry, MetaContextRequest, ServerEntry,
};

use super::*;
use crate::exports::ExportEntry;
use crate::mem_export::MemExport;
use crate::negotiate::meta::MetaSelection;
use crate::ExportFeatures;
use std::rc::Rc;

fn exports() -> Exports<MemExport> {
    let ro = ExportFeatures {
        read_only: true,
        allocation_depth: false,
        ..ExportFeatures::default()
    };
    Exports::new(vec![
        ExportEntry::new("", Rc::new(MemExport::new(1 << 20))).with_description("default disk"),
        ExportEntry::new("ro", Rc::new(MemExport::new(4096).with_features(ro))),
    ])
    .unwrap()
}

fn fixed() -> OptionState {
    OptionState::new(true, true)
}

fn types(replies: &[OptReply]) -> Vec<u32> {
    replies.iter().map(|r| r.reply_type).collect()
}

fn go_data(name: &[u8], requests: &[u16]) -> Vec<u8> {
    InfoRequest {
        name,
        requests: requests.to_vec(),
    }
    .encode()
}

fn meta_data(name: &[u8], queries: &[&[u8]]) -> Vec<u8> {
    MetaContextRequest {
        name,
        queries: queries.to_vec(),
    }
    .encode()
}

fn continue_replies(step: Step) -> Vec<OptReply> {
    match step {
        Step::Continue(r) => r,
        other => panic!("expected Continue, got {other:?}"),
    }
}

fn context_names(replies: &[OptReply]) -> Vec<(u32, String)> {
    replies
        .iter()
        .filter(|r| r.reply_type == REP_META_CONTEXT)
        .map(|r| {
            let e = MetaContextEntry::decode(&r.data).unwrap();
            (e.id, String::from_utf8(e.name.to_vec()).unwrap())
        })
        .collect()
}

#[test]
fn unknown_options_get_unsup_and_negotiation_goes_on() {
    let ex = exports();
    let mut s = fixed();
    for opt in [OPT_PEEK_EXPORT, 99, u32::MAX] {
        let r = continue_replies(s.handle(&ex, opt, b"junk"));
        assert_eq!(types(&r), [REP_ERR_UNSUP]);
        assert_eq!(r[0].option, opt);
    }
    assert!(matches!(
        s.handle(&ex, OPT_GO, &go_data(b"", &[])),
        Step::Go(..)
    ));
}

#[test]
fn non_fixed_clients_may_only_send_export_name() {
    let ex = exports();
    let mut s = OptionState::new(false, false);
    assert!(matches!(s.handle(&ex, OPT_LIST, b""), Step::Close(_)));
    match s.handle(&ex, OPT_EXPORT_NAME, b"ro") {
        Step::ExportName(n) => {
            assert_eq!(n.export, 1);
            assert_eq!(n.size, 4096);
            assert_eq!(n.mode, Mode::Simple);
            assert_ne!(n.flags & FLAG_READ_ONLY, 0);
            assert_eq!(
                n.flags & (FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES | FLAG_SEND_DF),
                0
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn export_name_for_an_unknown_export_hangs_up() {
    let ex = exports();
    assert!(matches!(
        fixed().handle(&ex, OPT_EXPORT_NAME, b"nope"),
        Step::Close(_)
    ));
    let long = vec![b'a'; 5000];
    assert!(matches!(
        fixed().handle(&ex, OPT_EXPORT_NAME, &long),
        Step::Close(_)
    ));
}

#[test]
fn go_answers_export_and_block_size_always_name_and_description_on_request() {
    let ex = exports();
    let (replies, n) =
        match fixed().handle(&ex, OPT_GO, &go_data(b"", &[INFO_NAME, INFO_DESCRIPTION])) {
            Step::Go(r, n) => (r, n),
            other => panic!("{other:?}"),
        };
    assert_eq!(*types(&replies).last().unwrap(), REP_ACK);
    let infos: Vec<InfoReply<'_>> = replies
        .iter()
        .filter(|r| r.reply_type == REP_INFO)
        .map(|r| InfoReply::decode(&r.data).unwrap())
        .collect();
    assert!(infos.contains(&InfoReply::Name(b"")));
    assert!(infos.contains(&InfoReply::Description(b"default disk")));
    assert!(infos.contains(&InfoReply::Export {
        size: 1 << 20,
        flags: n.flags
    }));
    assert!(infos.contains(&InfoReply::BlockSize {
        minimum: 1,
        preferred: 4096,
        maximum: MAX_PAYLOAD
    }));
    assert_eq!(n.mode, Mode::Simple);
    assert_eq!(
        n.flags & FLAG_SEND_DF,
        0,
        "no DF without structured replies"
    );

    let replies = continue_replies(fixed().handle(&ex, OPT_INFO, &go_data(b"ro", &[])));
    assert_eq!(types(&replies), [REP_INFO, REP_INFO, REP_ACK]);
}

#[test]
fn info_and_go_errors_are_replies_not_hangups() {
    let ex = exports();
    let mut s = fixed();
    let r = continue_replies(s.handle(&ex, OPT_GO, &go_data(b"missing", &[])));
    assert_eq!(types(&r), [REP_ERR_UNKNOWN]);
    let r = continue_replies(s.handle(&ex, OPT_INFO, &[0, 0, 0, 50]));
    assert_eq!(types(&r), [REP_ERR_INVALID]);
    assert!(String::from_utf8_lossy(&r[0].data).contains("export name"));
}

#[test]
fn list_names_every_export_and_refuses_data() {
    let ex = exports();
    let r = continue_replies(fixed().handle(&ex, OPT_LIST, b""));
    assert_eq!(types(&r), [REP_SERVER, REP_SERVER, REP_ACK]);
    let first = ServerEntry::decode(&r[0].data).unwrap();
    assert_eq!(
        (first.name, first.details),
        (&b""[..], &b"default disk"[..])
    );
    assert_eq!(ServerEntry::decode(&r[1].data).unwrap().name, b"ro");
    let r = continue_replies(fixed().handle(&ex, OPT_LIST, b"x"));
    assert_eq!(types(&r), [REP_ERR_INVALID]);
}

#[test]
fn abort_is_acknowledged() {
    let ex = exports();
    assert_eq!(
        fixed().handle(&ex, OPT_ABORT, b"ignored"),
        Step::Abort(vec![OptReply::ack(OPT_ABORT)])
    );
}

#[test]
fn structured_and_extended_negotiation_rules() {
    let ex = exports();
    let mut s = fixed();
    let r = continue_replies(s.handle(&ex, OPT_STRUCTURED_REPLY, b"x"));
    assert_eq!(types(&r), [REP_ERR_INVALID]);
    assert_eq!(s.mode(), Mode::Simple);
    let r = continue_replies(s.handle(&ex, OPT_STRUCTURED_REPLY, b""));
    assert_eq!(types(&r), [REP_ACK]);
    assert_eq!(s.mode(), Mode::Structured);
    let r = continue_replies(s.handle(&ex, OPT_STRUCTURED_REPLY, b""));
    assert_eq!(types(&r), [REP_ERR_INVALID]);
    let r = continue_replies(s.handle(&ex, OPT_EXTENDED_HEADERS, b""));
    assert_eq!(types(&r), [REP_ACK]);
    assert_eq!(s.mode(), Mode::Extended);
    let r = continue_replies(s.handle(&ex, OPT_EXTENDED_HEADERS, b""));
    assert_eq!(types(&r), [REP_ERR_INVALID]);

    let mut e = fixed();
    continue_replies(e.handle(&ex, OPT_EXTENDED_HEADERS, b""));
    let r = continue_replies(e.handle(&ex, OPT_STRUCTURED_REPLY, b""));
    assert_eq!(types(&r), [REP_ERR_EXT_HEADER_REQD]);
    assert!(matches!(
        e.handle(&ex, OPT_EXPORT_NAME, b""),
        Step::Close(_)
    ));
    match e.handle(&ex, OPT_GO, &go_data(b"", &[])) {
        Step::Go(_, n) => {
            assert_eq!(n.mode, Mode::Extended);
            assert_ne!(n.flags & FLAG_SEND_DF, 0);
            // No context was chosen, so there is nothing a payload could narrow.
            assert_eq!(n.flags & FLAG_BLOCK_STATUS_PAYLOAD, 0);
        }
        other => panic!("{other:?}"),
    }
}

/// The transmission flags of the `NBD_INFO_EXPORT` item among `replies`.
fn info_export_flags(replies: &[OptReply]) -> u16 {
    let item = replies
        .iter()
        .find(|r| r.reply_type == REP_INFO && r.data[..2] == INFO_EXPORT.to_be_bytes())
        .expect("an NBD_INFO_EXPORT item");
    u16::from_be_bytes([item.data[10], item.data[11]])
}

#[test]
fn block_status_payloads_are_offered_as_qemu_nbd_offers_them() {
    let ex = exports();
    let base: [&[u8]; 1] = [b"base:allocation"];
    let mut extended = fixed();
    continue_replies(extended.handle(&ex, OPT_EXTENDED_HEADERS, b""));
    // OPT_INFO under extended headers offers them before any context is chosen.
    let r = continue_replies(extended.handle(&ex, OPT_INFO, &go_data(b"", &[])));
    assert_ne!(info_export_flags(&r) & FLAG_BLOCK_STATUS_PAYLOAD, 0);
    continue_replies(extended.handle(&ex, OPT_SET_META_CONTEXT, &meta_data(b"", &base)));
    match extended.handle(&ex, OPT_GO, &go_data(b"", &[])) {
        Step::Go(replies, n) => {
            assert_ne!(n.flags & FLAG_BLOCK_STATUS_PAYLOAD, 0);
            assert_eq!(info_export_flags(&replies), n.flags);
        }
        other => panic!("{other:?}"),
    }
    // Structured replies have no payloads on block status.
    let mut structured = fixed();
    continue_replies(structured.handle(&ex, OPT_STRUCTURED_REPLY, b""));
    let r = continue_replies(structured.handle(&ex, OPT_INFO, &go_data(b"", &[])));
    assert_eq!(info_export_flags(&r) & FLAG_BLOCK_STATUS_PAYLOAD, 0);
    continue_replies(structured.handle(&ex, OPT_SET_META_CONTEXT, &meta_data(b"", &base)));
    match structured.handle(&ex, OPT_GO, &go_data(b"", &[])) {
        Step::Go(_, n) => assert_eq!(n.flags & FLAG_BLOCK_STATUS_PAYLOAD, 0),
        other => panic!("{other:?}"),
    }
}

#[test]
fn meta_contexts_need_structured_replies() {
    let ex = exports();
    let mut s = fixed();
    let r = continue_replies(s.handle(&ex, OPT_LIST_META_CONTEXT, &meta_data(b"", &[])));
    assert_eq!(types(&r), [REP_ERR_INVALID]);
    let r = continue_replies(s.handle(
        &ex,
        OPT_SET_META_CONTEXT,
        &meta_data(b"", &[b"base:allocation"]),
    ));
    assert_eq!(types(&r), [REP_ERR_INVALID]);
}

#[test]
fn list_meta_context_expands_wildcards_with_zero_ids() {
    let ex = exports();
    let mut s = fixed();
    continue_replies(s.handle(&ex, OPT_STRUCTURED_REPLY, b""));
    let r = continue_replies(s.handle(&ex, OPT_LIST_META_CONTEXT, &meta_data(b"", &[])));
    assert_eq!(
        context_names(&r),
        [
            (0, "base:allocation".into()),
            (0, "qemu:allocation-depth".into())
        ]
    );
    assert_eq!(*types(&r).last().unwrap(), REP_ACK);
    let r = continue_replies(s.handle(&ex, OPT_LIST_META_CONTEXT, &meta_data(b"", &[b"qemu:"])));
    assert_eq!(context_names(&r), [(0, "qemu:allocation-depth".into())]);
    // The read-only export does not offer allocation depth.
    let r = continue_replies(s.handle(&ex, OPT_LIST_META_CONTEXT, &meta_data(b"ro", &[b"qemu:"])));
    assert_eq!(types(&r), [REP_ACK]);
    let r = continue_replies(s.handle(&ex, OPT_LIST_META_CONTEXT, &meta_data(b"nope", &[])));
    assert_eq!(types(&r), [REP_ERR_UNKNOWN]);
    let r = continue_replies(s.handle(&ex, OPT_LIST_META_CONTEXT, &[0, 0, 0, 0, 0, 0, 0, 1]));
    assert_eq!(types(&r), [REP_ERR_INVALID]);
}

#[test]
fn set_meta_context_selection_reaches_go_for_the_same_export_only() {
    let ex = exports();
    let mut s = fixed();
    continue_replies(s.handle(&ex, OPT_STRUCTURED_REPLY, b""));
    let q: [&[u8]; 3] = [
        b"base:allocation",
        b"qemu:allocation-depth",
        b"x-unknown:thing",
    ];
    let r = continue_replies(s.handle(&ex, OPT_SET_META_CONTEXT, &meta_data(b"", &q)));
    assert_eq!(
        context_names(&r),
        [
            (1, "base:allocation".into()),
            (2, "qemu:allocation-depth".into())
        ]
    );
    let mut other = s.clone();
    match s.handle(&ex, OPT_GO, &go_data(b"", &[])) {
        Step::Go(_, n) => assert_eq!(
            n.meta,
            MetaSelection {
                base_allocation: true,
                allocation_depth: true,
                dirty_bitmaps: 0,
            }
        ),
        x => panic!("{x:?}"),
    }
    match other.handle(&ex, OPT_GO, &go_data(b"ro", &[])) {
        Step::Go(_, n) => assert!(n.meta.is_empty()),
        x => panic!("{x:?}"),
    }
}

#[test]
fn a_failed_set_meta_context_clears_the_selection() {
    let ex = exports();
    let mut s = fixed();
    continue_replies(s.handle(&ex, OPT_STRUCTURED_REPLY, b""));
    continue_replies(s.handle(
        &ex,
        OPT_SET_META_CONTEXT,
        &meta_data(b"", &[b"base:allocation"]),
    ));
    let r = continue_replies(s.handle(&ex, OPT_SET_META_CONTEXT, &[1, 2, 3]));
    assert_eq!(types(&r), [REP_ERR_INVALID]);
    match s.handle(&ex, OPT_GO, &go_data(b"", &[])) {
        Step::Go(_, n) => assert!(n.meta.is_empty()),
        x => panic!("{x:?}"),
    }
}

#[test]
fn oversized_options_are_refused_without_hanging_up_when_possible() {
    let mut s = fixed();
    assert_eq!(
        types(&continue_replies(s.oversized(OPT_GO, u32::MAX))),
        [REP_ERR_TOO_BIG]
    );
    assert_eq!(
        types(&continue_replies(s.oversized(1234, u32::MAX))),
        [REP_ERR_UNSUP]
    );
    assert!(matches!(
        s.oversized(OPT_EXPORT_NAME, u32::MAX),
        Step::Close(_)
    ));
    assert!(matches!(
        OptionState::new(false, false).oversized(OPT_GO, 1 << 30),
        Step::Close(_)
    ));
}

mod arbitrary {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any sequence of options with any data, on servers with and without TLS: never a
        /// panic, every step that continues carries at least one reply (the client always
        /// gets an answer), and no export is reached before TLS where TLS is required.
        #[test]
        fn option_sequences_never_panic(
            fixed in any::<bool>(),
            tls in any::<bool>(),
            opts in proptest::collection::vec((0u32..14, proptest::collection::vec(any::<u8>(), 0..64)), 1..12),
        ) {
            let ex = exports();
            let mut s = if tls {
                OptionState::requiring_tls(fixed, false)
            } else {
                OptionState::new(fixed, false)
            };
            for (option, data) in opts {
                let before_tls = s.tls() == TlsPhase::Required;
                match s.handle(&ex, option, &data) {
                    Step::Continue(replies) => prop_assert!(!replies.is_empty()),
                    Step::Go(replies, n) => {
                        prop_assert!(!before_tls);
                        prop_assert_eq!(replies.last().map(|r| r.reply_type), Some(REP_ACK));
                        prop_assert!(ex.get(n.export).is_some());
                        break;
                    }
                    Step::ExportName(_) => {
                        prop_assert!(!before_tls);
                        break;
                    }
                    Step::StartTls(replies) => {
                        prop_assert!(before_tls && data.is_empty());
                        prop_assert_eq!(types(&replies), vec![REP_ACK]);
                        s.tls_started();
                    }
                    Step::Fail(replies, _) => {
                        prop_assert!(!replies.is_empty());
                        break;
                    }
                    Step::Abort(_) | Step::Close(_) => break,
                }
            }
        }
    }
}

#[test]
fn without_tls_starttls_is_refused_by_policy_as_qemu_nbd_does() {
    let ex = exports();
    let mut s = fixed();
    let r = continue_replies(s.handle(&ex, OPT_STARTTLS, b""));
    assert_eq!(types(&r), [REP_ERR_POLICY]);
    assert_eq!(s.tls(), TlsPhase::Off);
    assert!(matches!(
        s.handle(&ex, OPT_GO, &go_data(b"", &[])),
        Step::Go(..)
    ));
}

#[test]
fn before_tls_only_starttls_and_abort_get_anywhere() {
    let ex = exports();
    let mut s = OptionState::requiring_tls(true, true);
    for (opt, data) in [
        (OPT_LIST, Vec::new()),
        (OPT_GO, go_data(b"", &[])),
        (OPT_INFO, go_data(b"", &[])),
        (OPT_STRUCTURED_REPLY, Vec::new()),
        (OPT_EXTENDED_HEADERS, Vec::new()),
        (OPT_SET_META_CONTEXT, meta_data(b"", &[b"base:allocation"])),
        (OPT_PEEK_EXPORT, Vec::new()),
        (99, b"junk".to_vec()),
    ] {
        let r = continue_replies(s.handle(&ex, opt, &data));
        assert_eq!(types(&r), [REP_ERR_TLS_REQD], "option {opt}");
        assert_eq!(r[0].option, opt);
    }
    // Nothing above took effect: structured replies were not negotiated.
    assert_eq!(s.mode(), Mode::Simple);
    assert_eq!(s.tls(), TlsPhase::Required);
    // Oversized options are refused the same way, without a hint of what they were.
    let r = continue_replies(s.oversized(OPT_LIST, 1 << 30));
    assert_eq!(types(&r), [REP_ERR_TLS_REQD]);
    assert!(matches!(
        s.handle(&ex, OPT_EXPORT_NAME, b""),
        Step::Close(_)
    ));
    assert!(matches!(s.handle(&ex, OPT_ABORT, b""), Step::Abort(_)));
    match s.handle(&ex, OPT_STARTTLS, b"") {
        Step::StartTls(r) => assert_eq!(types(&r), [REP_ACK]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn starttls_with_data_is_answered_then_the_client_dropped() {
    let ex = exports();
    let mut s = OptionState::requiring_tls(true, true);
    match s.handle(&ex, OPT_STARTTLS, b"x") {
        Step::Fail(r, _) => assert_eq!(types(&r), [REP_ERR_INVALID]),
        other => panic!("{other:?}"),
    }
    assert!(matches!(s.oversized(OPT_STARTTLS, 1 << 30), Step::Fail(..)));
}

#[test]
fn inside_tls_negotiation_starts_afresh_and_a_second_starttls_is_invalid() {
    let ex = exports();
    let mut s = OptionState::requiring_tls(true, false);
    s.tls_started();
    assert_eq!(s.tls(), TlsPhase::Active);
    assert!(s.fixed && !s.no_zeroes);
    let r = continue_replies(s.handle(&ex, OPT_STARTTLS, b""));
    assert_eq!(types(&r), [REP_ERR_INVALID]);
    let r = continue_replies(s.handle(&ex, OPT_STRUCTURED_REPLY, b""));
    assert_eq!(types(&r), [REP_ACK]);
    let r = continue_replies(s.handle(&ex, OPT_LIST, b""));
    assert_eq!(types(&r), [REP_SERVER, REP_SERVER, REP_ACK]);
    match s.handle(&ex, OPT_GO, &go_data(b"", &[])) {
        Step::Go(_, n) => assert_eq!(n.mode, Mode::Structured),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_identity_authz_refuses_gets_policy_errors_for_everything_but_abort() {
    let ex = exports();
    let mut s = OptionState::requiring_tls(true, true);
    s.tls_started();
    s.deny("TLS identity \"mallory\" is not authorized".into());
    for (opt, data) in [
        (OPT_LIST, Vec::new()),
        (OPT_GO, go_data(b"", &[])),
        (OPT_INFO, go_data(b"ro", &[])),
        (OPT_STRUCTURED_REPLY, Vec::new()),
        (OPT_STARTTLS, Vec::new()),
    ] {
        let r = continue_replies(s.handle(&ex, opt, &data));
        assert_eq!(types(&r), [REP_ERR_POLICY], "option {opt}");
        assert!(String::from_utf8_lossy(&r[0].data).contains("mallory"));
    }
    assert!(matches!(
        s.handle(&ex, OPT_EXPORT_NAME, b""),
        Step::Close(_)
    ));
    assert!(matches!(s.handle(&ex, OPT_ABORT, b""), Step::Abort(_)));
}

/// An export whose minimum block size is 512, as a probed raw image's.
fn sector_exports() -> Exports<MemExport> {
    let features = ExportFeatures {
        block_size: crate::BlockSize {
            minimum: 512,
            ..crate::BlockSize::default()
        },
        ..ExportFeatures::default()
    };
    Exports::new(vec![ExportEntry::new(
        "",
        Rc::new(MemExport::new(1 << 20).with_features(features)),
    )])
    .unwrap()
}

fn block_sizes(replies: &[OptReply]) -> Vec<(u32, u32, u32)> {
    replies
        .iter()
        .filter(|r| r.reply_type == REP_INFO)
        .filter_map(|r| match InfoReply::decode(&r.data).unwrap() {
            InfoReply::BlockSize {
                minimum,
                preferred,
                maximum,
            } => Some((minimum, preferred, maximum)),
            _ => None,
        })
        .collect()
}

#[test]
fn only_clients_that_ask_for_block_sizes_are_held_to_the_minimum() {
    let ex = sector_exports();
    // OPT_GO with the request: the export's minimum, enforced in transmission.
    match fixed().handle(&ex, OPT_GO, &go_data(b"", &[INFO_BLOCK_SIZE])) {
        Step::Go(r, n) => {
            assert_eq!(block_sizes(&r), [(512, 4096, MAX_PAYLOAD)]);
            assert_eq!(n.block_size.minimum, 512);
        }
        other => panic!("{other:?}"),
    }
    // OPT_GO without it: minimum 1, told and enforced, as qemu-nbd.
    match fixed().handle(&ex, OPT_GO, &go_data(b"", &[])) {
        Step::Go(r, n) => {
            assert_eq!(block_sizes(&r), [(1, 4096, MAX_PAYLOAD)]);
            assert_eq!(*types(&r).last().unwrap(), REP_ACK);
            assert_eq!(n.block_size.minimum, 1);
        }
        other => panic!("{other:?}"),
    }
    // OPT_EXPORT_NAME cannot ask: minimum 1.
    match fixed().handle(&ex, OPT_EXPORT_NAME, b"") {
        Step::ExportName(n) => assert_eq!(n.block_size.minimum, 1),
        other => panic!("{other:?}"),
    }
}

#[test]
fn info_without_a_block_size_request_is_refused_where_the_minimum_matters() {
    let ex = sector_exports();
    let r = continue_replies(fixed().handle(&ex, OPT_INFO, &go_data(b"", &[])));
    assert_eq!(types(&r), [REP_INFO, REP_INFO, REP_ERR_BLOCK_SIZE_REQD]);
    assert_eq!(block_sizes(&r), [(512, 4096, MAX_PAYLOAD)]);
    assert!(String::from_utf8_lossy(&r[2].data).contains("NBD_INFO_BLOCK_SIZE"));
    let r = continue_replies(fixed().handle(&ex, OPT_INFO, &go_data(b"", &[INFO_BLOCK_SIZE])));
    assert_eq!(types(&r), [REP_INFO, REP_INFO, REP_ACK]);
    assert_eq!(block_sizes(&r), [(512, 4096, MAX_PAYLOAD)]);
    // An export without a minimum answers whether asked or not.
    let r = continue_replies(fixed().handle(&exports(), OPT_INFO, &go_data(b"", &[])));
    assert_eq!(types(&r), [REP_INFO, REP_INFO, REP_ACK]);
}
