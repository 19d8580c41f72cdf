//! A bounded soak: many connections with deep queues of mixed requests against the real
//! server, clients killed in the middle of their work every second, every read checked
//! against a model, and at the end `qemu-img check` and the image's contents checked too.
//!
//! The disk is cut into one lane per connection slot, so what a lane's blocks may contain
//! depends only on that lane's requests; within a lane no two requests in flight touch the
//! same block, so each reply can be checked exactly. A killed client's unanswered requests
//! leave their blocks with two possible contents (old or new); those blocks rest for a while
//! before the lane's next client touches them, because the server may still be finishing
//! the orphaned request.
//!
//! `QCOW2_NBD_SOAK_SECS` sets the duration (60 s by default). Run with `--nocapture` to print
//! the totals.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::support::raw::{go, negotiating};
use crate::support::Server;
use test_support::{assert_check_clean, peak_rss_mib, qemu_contents, Dir, Rng};

const LANES: usize = 16;
const QUEUE_DEPTH: usize = 32;
const BLOCK: usize = 4096;
const BLOCKS_PER_LANE: usize = 1024;
const MAX_BLOCKS_PER_REQUEST: usize = 8;
/// How long a killed client's blocks rest before they are used again: far longer than any
/// request takes, so the orphaned request has finished by then.
const REST: Duration = Duration::from_secs(3);

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const CMD_WRITE_ZEROES: u16 = 6;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// What a block may contain: tag 0 is zeros, any other tag is the block filled with it.
#[derive(Clone, Debug)]
struct Block {
    possible: Vec<u64>,
    busy: bool,
    rest_until: Option<Instant>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Read,
    Write,
    Trim,
    Zero,
    Flush,
}

#[derive(Debug)]
struct InFlight {
    op: Op,
    first: usize,
    count: usize,
    /// For writes: the tag of each block, in order.
    tags: Vec<u64>,
}

struct Lane {
    index: usize,
    blocks: Vec<Block>,
    in_flight: HashMap<u64, InFlight>,
    next_tag: u64,
    failures: Vec<String>,
}

#[derive(Default)]
struct Totals {
    requests: AtomicU64,
    bytes: AtomicU64,
    kills: AtomicU64,
    error_replies: AtomicU64,
}

fn fill(tag: u64) -> Vec<u8> {
    tag.to_le_bytes().repeat(BLOCK / 8)
}

/// The tag a block's bytes carry, or None when they are no block any request wrote.
fn tag_of(bytes: &[u8]) -> Option<u64> {
    let first = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    bytes
        .chunks_exact(8)
        .all(|w| u64::from_le_bytes(w.try_into().unwrap()) == first)
        .then_some(first)
}

impl Lane {
    fn new(index: usize) -> Lane {
        Lane {
            index,
            blocks: vec![
                Block {
                    possible: vec![0],
                    busy: false,
                    rest_until: None,
                };
                BLOCKS_PER_LANE
            ],
            in_flight: HashMap::new(),
            // Tags carry the lane in their top byte, so a block from another lane never
            // passes for one of ours.
            next_tag: ((index as u64 + 1) << 56) | 1,
            failures: Vec::new(),
        }
    }

    fn offset(&self, block: usize) -> u64 {
        ((self.index * BLOCKS_PER_LANE + block) * BLOCK) as u64
    }

    /// A run of free blocks, or None when the random spot is taken.
    fn pick(&self, rng: &mut Rng, now: Instant) -> Option<(usize, usize)> {
        let first = rng.index(BLOCKS_PER_LANE);
        let want = 1 + rng.index(MAX_BLOCKS_PER_REQUEST);
        let free = |b: &Block| !b.busy && b.rest_until.is_none_or(|t| t <= now);
        let count = self.blocks[first..]
            .iter()
            .take(want)
            .take_while(|b| free(b))
            .count();
        (count > 0).then_some((first, count))
    }

    fn check_read(&mut self, req: &InFlight, data: &[u8]) {
        for (i, bytes) in data.chunks_exact(BLOCK).enumerate() {
            let block = req.first + i;
            let possible = &self.blocks[block].possible;
            let ok = tag_of(bytes).is_some_and(|t| possible.contains(&t));
            if !ok {
                self.failures.push(format!(
                    "lane {} block {block}: read {:?} (first word {:#x}), expected one of {:x?}",
                    self.index,
                    tag_of(bytes),
                    u64::from_le_bytes(bytes[..8].try_into().unwrap()),
                    possible
                ));
            }
        }
    }

    /// What the blocks of an answered request may contain now.
    fn acknowledged(&mut self, req: &InFlight) {
        for i in 0..req.count {
            let b = &mut self.blocks[req.first + i];
            b.busy = false;
            match req.op {
                Op::Write => b.possible = vec![req.tags[i]],
                Op::Zero => b.possible = vec![0],
                // A trim may leave the data (a partial cluster) or zeros.
                Op::Trim if !b.possible.contains(&0) => b.possible.push(0),
                _ => {}
            }
        }
    }

    /// A killed client's unanswered request: old or new contents, after a rest.
    fn orphaned(&mut self, req: &InFlight, now: Instant) {
        for i in 0..req.count {
            let b = &mut self.blocks[req.first + i];
            b.busy = false;
            b.rest_until = Some(now + REST);
            let new = match req.op {
                Op::Write => Some(req.tags[i]),
                Op::Zero | Op::Trim => Some(0),
                _ => None,
            };
            if let Some(t) = new.filter(|t| !b.possible.contains(t)) {
                b.possible.push(t);
            }
        }
    }
}

/// A connection in transmission with the default export (simple replies).
fn connect(socket: &Path) -> UnixStream {
    let mut s = negotiating(socket);
    go(&mut s);
    s
}

fn header(cmd: u16, cookie: u64, offset: u64, len: u32) -> [u8; 28] {
    let mut h = [0u8; 28];
    h[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    h[6..8].copy_from_slice(&cmd.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h[16..24].copy_from_slice(&offset.to_be_bytes());
    h[24..28].copy_from_slice(&len.to_be_bytes());
    h
}

/// Reads simple replies until the socket closes, checking each against the lane's model.
fn read_replies(mut s: UnixStream, lane: Arc<(Mutex<Lane>, Condvar)>, totals: Arc<Totals>) {
    loop {
        let mut head = [0u8; 16];
        if s.read_exact(&mut head).is_err() {
            return;
        }
        let magic = u32::from_be_bytes(head[..4].try_into().unwrap());
        let error = u32::from_be_bytes(head[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(head[8..16].try_into().unwrap());
        let (lock, cv) = &*lane;
        let req = lock.lock().unwrap().in_flight.remove(&cookie);
        let Some(req) = req else {
            lock.lock().unwrap().failures.push(format!(
                "reply to unknown cookie {cookie} (magic {magic:#x})"
            ));
            return;
        };
        let mut data = Vec::new();
        if req.op == Op::Read && error == 0 {
            data = vec![0u8; req.count * BLOCK];
            if s.read_exact(&mut data).is_err() {
                // Killed while the data arrived: the request stays unanswered.
                let mut l = lock.lock().unwrap();
                l.orphaned(&req, Instant::now());
                cv.notify_all();
                return;
            }
        }
        let mut l = lock.lock().unwrap();
        if magic != SIMPLE_REPLY_MAGIC {
            l.failures.push(format!("bad reply magic {magic:#x}"));
        } else if error != 0 {
            totals.error_replies.fetch_add(1, Ordering::Relaxed);
            l.failures.push(format!(
                "{:?} at block {}: error {error}",
                req.op, req.first
            ));
        } else if req.op == Op::Read {
            l.check_read(&req, &data);
        }
        l.acknowledged(&req);
        totals.requests.fetch_add(1, Ordering::Relaxed);
        totals
            .bytes
            .fetch_add((req.count * BLOCK) as u64, Ordering::Relaxed);
        cv.notify_all();
    }
}

fn random_op(rng: &mut Rng) -> Op {
    match rng.index(100) {
        0..40 => Op::Read,
        40..75 => Op::Write,
        75..83 => Op::Trim,
        83..95 => Op::Zero,
        _ => Op::Flush,
    }
}

/// Registers a request in the lane's model and returns its bytes on the wire, or None when
/// the randomly chosen blocks are taken.
fn prepare(l: &mut Lane, rng: &mut Rng, op: Op, cookie: u64) -> Option<Vec<u8>> {
    let (first, count) = match op {
        Op::Flush => (0, 0),
        _ => l.pick(rng, Instant::now())?,
    };
    let mut tags = Vec::new();
    if op == Op::Write {
        for _ in 0..count {
            tags.push(l.next_tag);
            l.next_tag += 1;
        }
    }
    for b in &mut l.blocks[first..first + count] {
        b.busy = true;
    }
    let cmd = match op {
        Op::Read => CMD_READ,
        Op::Write => CMD_WRITE,
        Op::Trim => CMD_TRIM,
        Op::Zero => CMD_WRITE_ZEROES,
        Op::Flush => CMD_FLUSH,
    };
    let len = (count * BLOCK) as u32;
    let mut msg = header(cmd, cookie, l.offset(first), len).to_vec();
    for t in &tags {
        msg.extend_from_slice(&fill(*t));
    }
    let req = InFlight {
        op,
        first,
        count,
        tags,
    };
    l.in_flight.insert(cookie, req);
    Some(msg)
}

/// One lane's client for its lifetime: sends requests until killed or the end, then either
/// vanishes mid-request (killed) or waits for its answers and disconnects.
fn run_client(
    socket: &Path,
    lane: &Arc<(Mutex<Lane>, Condvar)>,
    totals: &Arc<Totals>,
    rng: &mut Rng,
    kill: &AtomicBool,
    end: Instant,
) {
    let mut s = connect(socket);
    let reader = {
        let (s, lane, totals) = (s.try_clone().unwrap(), lane.clone(), totals.clone());
        std::thread::spawn(move || read_replies(s, lane, totals))
    };
    let (lock, cv) = &**lane;
    let mut cookie = 0u64;
    let killed = loop {
        if kill.swap(false, Ordering::Relaxed) {
            break true;
        }
        if Instant::now() >= end {
            break false;
        }
        let mut l = lock.lock().unwrap();
        while l.in_flight.len() >= QUEUE_DEPTH {
            l = cv.wait_timeout(l, Duration::from_millis(50)).unwrap().0;
        }
        cookie += 1;
        let op = random_op(rng);
        let Some(msg) = prepare(&mut l, rng, op, cookie) else {
            continue;
        };
        drop(l);
        if s.write_all(&msg).is_err() {
            break true;
        }
    };
    if killed {
        // Half the kills happen in the middle of a write's payload.
        if rng.index(2) == 0 {
            cookie += 1;
            let msg = prepare(&mut lock.lock().unwrap(), rng, Op::Write, cookie);
            if let Some(msg) = msg {
                let _ = s.write_all(&msg[..msg.len() / 2]);
            }
        }
        let _ = s.shutdown(std::net::Shutdown::Both);
        reader.join().unwrap();
        let mut l = lock.lock().unwrap();
        let orphans: Vec<InFlight> = l.in_flight.drain().map(|(_, r)| r).collect();
        let now = Instant::now();
        for r in &orphans {
            l.orphaned(r, now);
        }
        totals.kills.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let mut l = lock.lock().unwrap();
    while !l.in_flight.is_empty() && l.failures.is_empty() {
        l = cv.wait_timeout(l, Duration::from_millis(50)).unwrap().0;
    }
    drop(l);
    let _ = s.write_all(&header(2, 0, 0, 0)); // NBD_CMD_DISC
    let _ = s.shutdown(std::net::Shutdown::Write);
    reader.join().unwrap();
}

#[test]
fn soak_mixed_requests_with_clients_killed_every_second() {
    let seconds: u64 = std::env::var("QCOW2_NBD_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let images = Dir::new();
    let size = (LANES * BLOCKS_PER_LANE * BLOCK).to_string();
    let img = images.create(
        "soak.qcow2",
        "qcow2",
        "extended_l2=on,cluster_size=64k",
        None,
        &size,
    );
    let server = Server::unix(&[
        "-t",
        "-e",
        "64",
        "--discard",
        "unmap",
        img.to_str().unwrap(),
    ]);
    let socket = server.socket.clone();
    let totals = Arc::new(Totals::default());
    let lanes: Vec<_> = (0..LANES)
        .map(|i| Arc::new((Mutex::new(Lane::new(i)), Condvar::new())))
        .collect();
    let kills: Vec<Arc<AtomicBool>> = (0..LANES).map(|_| Arc::default()).collect();
    let start = Instant::now();
    let end = start + Duration::from_secs(seconds);
    let workers: Vec<_> = (0..LANES)
        .map(|i| {
            let (socket, lane, totals, kill) = (
                socket.clone(),
                lanes[i].clone(),
                totals.clone(),
                kills[i].clone(),
            );
            std::thread::spawn(move || {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (i as u64 + 1) << 32);
                while Instant::now() < end && lane.0.lock().unwrap().failures.is_empty() {
                    run_client(&socket, &lane, &totals, &mut rng, &kill, end);
                }
            })
        })
        .collect();
    let mut rng = Rng(42);
    while Instant::now() + Duration::from_secs(1) < end {
        std::thread::sleep(Duration::from_secs(1));
        kills[rng.index(LANES)].store(true, Ordering::Relaxed);
    }
    for w in workers {
        w.join().expect("a client thread panicked");
    }
    let peak = peak_rss_mib(server.pid());
    let failures: Vec<String> = lanes
        .iter()
        .flat_map(|l| l.0.lock().unwrap().failures.clone())
        .collect();
    assert!(
        failures.is_empty(),
        "{} failures: {:#?}",
        failures.len(),
        &failures[..failures.len().min(20)]
    );
    server.stop_ok();

    assert_check_clean(&img);
    let contents = qemu_contents(&img, &["-f", "qcow2"]);
    for (i, lane) in lanes.iter().enumerate() {
        let l = lane.0.lock().unwrap();
        let at = i * BLOCKS_PER_LANE * BLOCK;
        l.check_read_final(&contents[at..at + BLOCKS_PER_LANE * BLOCK]);
    }
    let requests = totals.requests.load(Ordering::Relaxed);
    eprintln!(
        "soak: {seconds} s, {LANES} connections x QD{QUEUE_DEPTH}: {requests} requests \
         ({:.0}/s), {:.1} MiB moved, {} clients killed, {} error replies, server peak RSS {:.1} MiB",
        requests as f64 / seconds as f64,
        totals.bytes.load(Ordering::Relaxed) as f64 / (1 << 20) as f64,
        totals.kills.load(Ordering::Relaxed),
        totals.error_replies.load(Ordering::Relaxed),
        peak
    );
    assert!(totals.kills.load(Ordering::Relaxed) >= seconds.saturating_sub(2));
    assert!(requests > 0);
}

impl Lane {
    /// The image as QEMU reads it after the server stopped: every block one of its possible
    /// contents.
    fn check_read_final(&self, contents: &[u8]) {
        for (block, bytes) in contents.chunks_exact(BLOCK).enumerate() {
            let possible = &self.blocks[block].possible;
            assert!(
                tag_of(bytes).is_some_and(|t| possible.contains(&t)),
                "after the soak, lane {} block {block} holds {:?}, expected one of {:x?}",
                self.index,
                tag_of(bytes),
                possible
            );
        }
    }
}
