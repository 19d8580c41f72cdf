use super::*;
use crate::export::ExportFeatures;
use crate::negotiate::transmission_flags;

const SIZE: u64 = 1 << 20;

fn limits(mode: Mode, features: ExportFeatures) -> Limits {
    Limits {
        mode,
        size: SIZE,
        flags: transmission_flags(&features, mode),
        min_block: features.block_size.minimum,
        max_payload: features.block_size.maximum,
        meta: MetaSelection {
            base_allocation: mode != Mode::Simple,
            allocation_depth: false,
            dirty_bitmaps: 0,
        },
    }
}

fn rw() -> Limits {
    limits(Mode::Structured, ExportFeatures::default())
}

fn req(command: Command, flags: u16, offset: u64, length: u64) -> RequestHeader {
    RequestHeader {
        flags,
        command,
        cookie: 7,
        offset,
        length,
    }
}

fn check(h: RequestHeader, l: &Limits) -> Result<Action, Errno> {
    validate(&h, l, payload_of(&h, l.mode, l.max_payload)).map_err(|r| r.errno)
}

#[test]
fn payload_sizes_per_mode() {
    let max = MAX_PAYLOAD;
    let w = req(Command::Write, 0, 0, 4096);
    assert_eq!(payload_of(&w, Mode::Simple, max), Payload::Read(4096));
    // Tolerated like QEMU's server does: QEMU's client omits PAYLOAD_LEN on writes.
    assert_eq!(payload_of(&w, Mode::Extended, max), Payload::Read(4096));
    let w_ext = req(Command::Write, CMD_FLAG_PAYLOAD_LEN, 0, 4096);
    assert_eq!(payload_of(&w_ext, Mode::Extended, max), Payload::Read(4096));
    let huge = req(Command::Write, 0, 0, u64::from(u32::MAX));
    assert_eq!(
        payload_of(&huge, Mode::Structured, max),
        Payload::Drain(u64::from(u32::MAX))
    );
    let huge_ext = req(Command::Write, CMD_FLAG_PAYLOAD_LEN, 0, 1 << 40);
    assert_eq!(
        payload_of(&huge_ext, Mode::Extended, max),
        Payload::Disconnect
    );
    let huge_ext_no_flag = req(Command::Write, 0, 0, 1 << 40);
    assert_eq!(
        payload_of(&huge_ext_no_flag, Mode::Extended, max),
        Payload::Disconnect
    );
    let trim_payload = req(Command::Trim, CMD_FLAG_PAYLOAD_LEN, 0, 100);
    assert_eq!(
        payload_of(&trim_payload, Mode::Extended, max),
        Payload::Drain(100)
    );
    // In compact mode the bit is just an invalid flag: no payload follows.
    assert_eq!(
        payload_of(&trim_payload, Mode::Structured, max),
        Payload::None
    );
    assert_eq!(
        payload_of(&req(Command::Read, 0, 0, 1 << 30), Mode::Simple, max),
        Payload::None
    );
}

#[test]
fn good_requests_become_actions() {
    let l = rw();
    assert_eq!(
        check(req(Command::Read, CMD_FLAG_DF, 512, 4096), &l),
        Ok(Action::Read {
            offset: 512,
            len: 4096,
            df: true
        })
    );
    assert_eq!(
        check(req(Command::Write, CMD_FLAG_FUA, 0, 10), &l),
        Ok(Action::Write {
            offset: 0,
            fua: true
        })
    );
    assert_eq!(
        check(
            req(
                Command::WriteZeroes,
                CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
                0,
                SIZE
            ),
            &l
        ),
        Ok(Action::WriteZeroes {
            offset: 0,
            len: SIZE,
            flags: WriteZeroesFlags {
                may_unmap: false,
                fast: true,
                fua: false
            }
        })
    );
    assert_eq!(
        check(req(Command::BlockStatus, CMD_FLAG_REQ_ONE, 0, 1), &l),
        Ok(Action::BlockStatus {
            offset: 0,
            len: 1,
            req_one: true,
            meta: l.meta,
        })
    );
    assert_eq!(check(req(Command::Flush, 0, 0, 0), &l), Ok(Action::Flush));
    assert_eq!(
        check(req(Command::Disc, 0xffff, 99, 99), &l),
        Ok(Action::Disc)
    );
}

#[test]
fn zero_lengths_are_harmless_except_block_status() {
    let l = rw();
    assert_eq!(
        check(req(Command::Read, 0, SIZE, 0), &l),
        Ok(Action::Read {
            offset: SIZE,
            len: 0,
            df: false
        })
    );
    for c in [
        Command::Write,
        Command::Trim,
        Command::WriteZeroes,
        Command::Cache,
    ] {
        assert_eq!(check(req(c, 0, 0, 0), &l), Ok(Action::Nothing), "{c:?}");
    }
    assert_eq!(
        check(req(Command::BlockStatus, 0, 0, 0), &l),
        Err(Errno::Inval)
    );
}

#[test]
fn past_the_end_is_enospc_for_writes_and_einval_otherwise() {
    let l = rw();
    assert_eq!(
        check(req(Command::Write, 0, SIZE - 1, 2), &l),
        Err(Errno::NoSpc)
    );
    assert_eq!(
        check(req(Command::WriteZeroes, 0, SIZE, 1), &l),
        Err(Errno::NoSpc)
    );
    assert_eq!(
        check(req(Command::WriteZeroes, 0, u64::MAX, 2), &l),
        Err(Errno::NoSpc)
    );
    for c in [
        Command::Read,
        Command::Trim,
        Command::Cache,
        Command::BlockStatus,
    ] {
        assert_eq!(check(req(c, 0, SIZE, 1), &l), Err(Errno::Inval), "{c:?}");
        assert_eq!(
            check(req(c, 0, u64::MAX, u64::MAX), &l),
            Err(Errno::Inval),
            "{c:?}"
        );
    }
}

#[test]
fn unknown_commands_and_flags_are_einval() {
    let l = rw();
    assert_eq!(
        check(req(Command::Unknown(42), 0, 0, 0), &l),
        Err(Errno::Inval)
    );
    assert_eq!(
        check(req(Command::Read, 1 << 15, 0, 1), &l),
        Err(Errno::Inval)
    );
    assert_eq!(
        check(req(Command::Read, CMD_FLAG_NO_HOLE, 0, 1), &l),
        Err(Errno::Inval)
    );
    assert_eq!(
        check(req(Command::Write, CMD_FLAG_DF, 0, 1), &l),
        Err(Errno::Inval)
    );
    assert_eq!(
        check(req(Command::Trim, CMD_FLAG_REQ_ONE, 0, 1), &l),
        Err(Errno::Inval)
    );
    assert_eq!(
        check(req(Command::Read, CMD_FLAG_PAYLOAD_LEN, 0, 1), &l),
        Err(Errno::Inval)
    );
    // DF needs structured replies.
    let simple = limits(Mode::Simple, ExportFeatures::default());
    assert_eq!(
        check(req(Command::Read, CMD_FLAG_DF, 0, 1), &simple),
        Err(Errno::Inval)
    );
    // FUA needs SEND_FUA.
    let no_fua = limits(
        Mode::Structured,
        ExportFeatures {
            fua: false,
            ..ExportFeatures::default()
        },
    );
    assert_eq!(
        check(req(Command::Write, CMD_FLAG_FUA, 0, 1), &no_fua),
        Err(Errno::Inval)
    );
}

#[test]
fn payload_problems_are_einval_after_the_payload_is_skipped() {
    let ext = limits(Mode::Extended, ExportFeatures::default());
    let no_flag = req(Command::Write, 0, 0, 512);
    assert_eq!(
        check(no_flag, &ext),
        Ok(Action::Write {
            offset: 0,
            fua: false
        })
    );
    let trim_payload = req(Command::Trim, CMD_FLAG_PAYLOAD_LEN, 0, 16);
    assert_eq!(check(trim_payload, &ext), Err(Errno::Inval));
    let oversize = req(Command::Write, 0, 0, u64::from(MAX_PAYLOAD) + 1);
    assert_eq!(check(oversize, &rw()), Err(Errno::Inval));
}

#[test]
fn read_only_exports_refuse_writes_with_eperm() {
    let ro = limits(
        Mode::Structured,
        ExportFeatures {
            read_only: true,
            ..ExportFeatures::default()
        },
    );
    for c in [Command::Write, Command::Trim, Command::WriteZeroes] {
        assert_eq!(check(req(c, 0, 0, 1), &ro), Err(Errno::Perm), "{c:?}");
    }
    assert!(check(req(Command::Read, 0, 0, 1), &ro).is_ok());
}

#[test]
fn unadvertised_commands_are_einval() {
    let none = limits(
        Mode::Simple,
        ExportFeatures {
            flush: false,
            fua: false,
            trim: false,
            write_zeroes: false,
            fast_zero: false,
            cache: false,
            ..ExportFeatures::default()
        },
    );
    for c in [
        Command::Flush,
        Command::Trim,
        Command::WriteZeroes,
        Command::Cache,
        Command::BlockStatus,
    ] {
        assert_eq!(check(req(c, 0, 0, 1), &none), Err(Errno::Inval), "{c:?}");
    }
    let structured_no_meta = Limits {
        meta: MetaSelection::default(),
        ..rw()
    };
    assert_eq!(
        check(req(Command::BlockStatus, 0, 0, 1), &structured_no_meta),
        Err(Errno::Inval)
    );
    // FAST_ZERO is only valid when advertised.
    let slow = limits(
        Mode::Structured,
        ExportFeatures {
            fast_zero: false,
            ..ExportFeatures::default()
        },
    );
    assert_eq!(
        check(req(Command::WriteZeroes, CMD_FLAG_FAST_ZERO, 0, 1), &slow),
        Err(Errno::Inval)
    );
}

#[test]
fn alignment_and_maximum_payload() {
    let mut f = ExportFeatures::default();
    f.block_size.minimum = 512;
    let l = limits(Mode::Structured, f);
    assert_eq!(check(req(Command::Read, 0, 1, 512), &l), Err(Errno::Inval));
    assert_eq!(
        check(req(Command::Write, 0, 512, 100), &l),
        Err(Errno::Inval)
    );
    assert!(check(req(Command::Read, 0, 512, 1024), &l).is_ok());
    let odd = Limits { size: 1000, ..l };
    assert!(
        check(req(Command::Read, 0, 512, 488), &odd).is_ok(),
        "tail of an unaligned export"
    );
    let big = req(Command::Read, 0, 0, u64::from(MAX_PAYLOAD) + 512);
    let large = Limits { size: 1 << 30, ..l };
    assert_eq!(check(big, &large), Err(Errno::Inval));
    // Effect lengths of zeroing and trimming are not bounded by the payload maximum.
    assert!(check(req(Command::WriteZeroes, 0, 0, 1 << 29), &large).is_ok());
}

/// A block status payload: the effect length, then the context ids.
fn status_payload(len: u64, ids: &[u32]) -> Vec<u8> {
    let mut out = len.to_be_bytes().to_vec();
    for id in ids {
        out.extend_from_slice(&id.to_be_bytes());
    }
    out
}

fn extended_with_contexts() -> Limits {
    let mut l = limits(Mode::Extended, ExportFeatures::default());
    l.meta = MetaSelection {
        base_allocation: true,
        allocation_depth: true,
        dirty_bitmaps: 0b1,
    };
    l
}

#[test]
fn block_status_payloads_are_read_only_under_extended_headers_and_when_small() {
    let max = MAX_PAYLOAD;
    let with = |len| req(Command::BlockStatus, CMD_FLAG_PAYLOAD_LEN, 0, len);
    assert_eq!(
        payload_of(&with(12), Mode::Extended, max),
        Payload::Filter(12)
    );
    let longest = MAX_STATUS_PAYLOAD as u64;
    assert_eq!(
        payload_of(&with(longest), Mode::Extended, max),
        Payload::Filter(MAX_STATUS_PAYLOAD)
    );
    assert_eq!(
        payload_of(&with(longest + 4), Mode::Extended, max),
        Payload::Drain(longest + 4)
    );
    // Without extended headers the length is the effect length, never a payload.
    assert_eq!(payload_of(&with(12), Mode::Structured, max), Payload::None);
    let plain = req(Command::BlockStatus, 0, 0, 12);
    assert_eq!(payload_of(&plain, Mode::Extended, max), Payload::None);
}

#[test]
fn a_block_status_payload_selects_negotiated_contexts_only() {
    let l = extended_with_contexts();
    let only_depth = status_filter(&status_payload(4096, &[2]), &l.meta);
    assert_eq!(
        only_depth,
        Some(StatusFilter {
            len: 4096,
            meta: MetaSelection {
                allocation_depth: true,
                ..MetaSelection::default()
            }
        })
    );
    let bitmap_and_base = status_filter(&status_payload(1, &[3, 1]), &l.meta).unwrap();
    assert!(bitmap_and_base.meta.base_allocation && !bitmap_and_base.meta.allocation_depth);
    assert_eq!(bitmap_and_base.meta.dirty_bitmaps, 1);
    // No ids, a repeated id, an id never negotiated or never given, a ragged tail.
    for bad in [
        status_payload(1, &[]),
        status_payload(1, &[1, 1]),
        status_payload(1, &[4]),
        status_payload(1, &[0]),
        status_payload(1, &[u32::MAX]),
        [status_payload(1, &[1]), vec![0, 0]].concat(),
        vec![0; 7],
    ] {
        assert_eq!(status_filter(&bad, &l.meta), None, "{bad:?}");
    }
    let none = MetaSelection::default();
    assert_eq!(status_filter(&status_payload(1, &[1]), &none), None);
}

#[test]
fn a_filtered_block_status_runs_with_its_effect_length_and_contexts() {
    let l = extended_with_contexts();
    let h = req(
        Command::BlockStatus,
        CMD_FLAG_PAYLOAD_LEN | CMD_FLAG_REQ_ONE,
        512,
        12,
    );
    let filter = status_filter(&status_payload(4096, &[1]), &l.meta);
    assert_eq!(
        validate_filtered(&h, &l, filter),
        Ok(Action::BlockStatus {
            offset: 512,
            len: 4096,
            req_one: true,
            meta: MetaSelection {
                base_allocation: true,
                ..MetaSelection::default()
            },
        })
    );
    let refused = |filter| validate_filtered(&h, &l, filter).map_err(|r| r.errno);
    assert_eq!(refused(None), Err(Errno::Inval));
    // The effect length is checked like a header's: zero, or past the export's end.
    let zero = status_filter(&status_payload(0, &[1]), &l.meta);
    assert_eq!(refused(zero), Err(Errno::Inval));
    let past = status_filter(&status_payload(SIZE, &[1]), &l.meta);
    assert_eq!(refused(past), Err(Errno::Inval));
}
