//! QEMU's `quorum` driver as a storage: the same bytes kept in several children. A read asks
//! every child and returns what most of them agree on, if at least `vote-threshold` do; a
//! write, a zero write and a flush go to every child and succeed when at least that many
//! children took them. The children must be of one length, as QEMU checks; the node cannot be
//! resized, and discards are dropped, as in QEMU.
//!
//! The image tools name it by the JSON name [`QuorumNode::name`] makes (the opener reads a
//! `quorum` node's options into it), and the opener opens each child and wraps them.

use std::io;

use crate::{BufResult, IoBuf, Slice, Storage};

/// The start of every name [`QuorumNode::name`] makes.
const NODE_PREFIX: &str = "json:{\"driver\":\"quorum\"";

/// A quorum node: its children's file names and how many of them must agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuorumNode {
    /// QEMU's `vote-threshold`.
    pub threshold: usize,
    /// The children's names, in QEMU's order (`children.0`, `children.1`, ...).
    pub children: Vec<String>,
}

impl QuorumNode {
    /// The node's JSON name, which [`QuorumNode::parse`] reads back.
    pub fn name(&self) -> String {
        use serde_json::{json, Value};
        let children: Vec<Value> = self
            .children
            .iter()
            .map(|c| json!({"driver": "file", "filename": c}))
            .collect();
        let rest = json!({"children": children, "vote-threshold": self.threshold}).to_string();
        // The driver first, so that the name says what it is.
        format!("{NODE_PREFIX},{}", &rest[1..])
    }

    /// Reads a name [`QuorumNode::name`] made; `None` for any other name.
    pub fn parse(name: &str) -> Option<QuorumNode> {
        use serde_json::Value;
        if !name.starts_with(NODE_PREFIX) {
            return None;
        }
        let Value::Object(mut map) = serde_json::from_str(name.strip_prefix("json:")?).ok()? else {
            return None;
        };
        let threshold = usize::try_from(map.remove("vote-threshold")?.as_u64()?).ok()?;
        let Value::Array(items) = map.remove("children")? else {
            return None;
        };
        let children = items
            .into_iter()
            .map(|item| match item {
                Value::Object(mut m) => match m.remove("filename")? {
                    Value::String(f) => Some(f),
                    _ => None,
                },
                _ => None,
            })
            .collect::<Option<Vec<String>>>()?;
        Some(QuorumNode {
            threshold,
            children,
        })
    }
}

/// Most children a quorum node may have. Every request goes to each child with a buffer of
/// its own, so a name (possibly an image's backing name) must not make one read cost
/// thousands of buffers and open files; QEMU sets no limit, real quorums have a few children.
pub const MAX_CHILDREN: usize = 32;

/// Why a quorum node cannot be built, in QEMU's words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuorumError {
    /// No children.
    #[error("Number of provided children must be 1 or more")]
    NoChildren,
    /// A threshold of 0.
    #[error("Parameter 'vote-threshold' expects a value >= 1")]
    ThresholdZero,
    /// More votes asked for than there are children.
    #[error("threshold may not exceed children count")]
    ThresholdTooHigh,
    /// More children than [`MAX_CHILDREN`].
    #[error("Number of provided children must be at most {MAX_CHILDREN}")]
    TooManyChildren,
}

/// Checks a threshold against the number of children, as QEMU does when it opens the node,
/// and the number of children against [`MAX_CHILDREN`].
pub fn check_threshold(threshold: usize, children: usize) -> Result<(), QuorumError> {
    if children == 0 {
        return Err(QuorumError::NoChildren);
    }
    if children > MAX_CHILDREN {
        return Err(QuorumError::TooManyChildren);
    }
    if threshold == 0 {
        return Err(QuorumError::ThresholdZero);
    }
    if threshold > children {
        return Err(QuorumError::ThresholdTooHigh);
    }
    Ok(())
}

/// The children of a quorum node over storages `S`.
pub struct QuorumStorage<S> {
    children: Vec<S>,
    threshold: usize,
}

impl<S: Storage> QuorumStorage<S> {
    /// A quorum of `children` where `threshold` must agree.
    pub fn new(children: Vec<S>, threshold: usize) -> Result<Self, QuorumError> {
        check_threshold(threshold, children.len())?;
        Ok(QuorumStorage {
            children,
            threshold,
        })
    }

    /// The children, in order.
    pub fn children(&self) -> &[S] {
        &self.children
    }

    /// The outcome of one request sent to every child: success when at least the threshold
    /// succeeded, else the error most children gave (the first of the most common ones), as
    /// QEMU votes on errors.
    fn decide(&self, results: Vec<io::Result<()>>) -> io::Result<()> {
        let successes = results.iter().filter(|r| r.is_ok()).count();
        if successes >= self.threshold {
            return Ok(());
        }
        Err(most_common_error(results))
    }
}

/// The error most results carry (the first of the most common ones); EIO when none does.
fn most_common_error(results: Vec<io::Result<()>>) -> io::Error {
    let errors: Vec<io::Error> = results.into_iter().filter_map(Result::err).collect();
    let key = |e: &io::Error| (e.raw_os_error(), e.kind());
    let mut best: Option<(usize, usize)> = None;
    for (i, e) in errors.iter().enumerate() {
        let n = errors.iter().filter(|o| key(o) == key(e)).count();
        if best.is_none_or(|(_, m)| n > m) {
            best = Some((i, n));
        }
    }
    match best {
        Some((i, _)) => errors
            .into_iter()
            .nth(i)
            .unwrap_or_else(|| io::Error::from_raw_os_error(libc::EIO)),
        None => io::Error::from_raw_os_error(libc::EIO),
    }
}

/// The index of the first read whose bytes most successful reads share, and how many share
/// them.
fn vote(reads: &[Option<IoBuf>]) -> Option<(usize, usize)> {
    let mut best: Option<(usize, usize)> = None;
    for (i, r) in reads.iter().enumerate() {
        let Some(bytes) = r else { continue };
        let n = reads
            .iter()
            .filter(|o| o.as_ref().is_some_and(|o| o[..] == bytes[..]))
            .count();
        if best.is_none_or(|(_, m)| n > m) {
            best = Some((i, n));
        }
    }
    best
}

impl<S: Storage> Storage for QuorumStorage<S> {
    async fn read_at(&self, mut buf: Slice, offset: u64) -> BufResult<Slice> {
        let mut reads = Vec::with_capacity(self.children.len());
        let mut results = Vec::with_capacity(self.children.len());
        for child in &self.children {
            let (res, got) = Box::pin(child.read_at(IoBuf::zeroed(buf.len()).into(), offset)).await;
            reads.push(res.is_ok().then(|| got.into_inner()));
            results.push(res);
        }
        if let Err(e) = self.decide(results) {
            return (Err(e), buf);
        }
        match vote(&reads) {
            Some((winner, votes)) if votes >= self.threshold => {
                if let Some(bytes) = &reads[winner] {
                    buf.copy_from_slice(&bytes[..]);
                }
                (Ok(()), buf)
            }
            _ => (Err(io::Error::from_raw_os_error(libc::EIO)), buf),
        }
    }

    async fn write_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        let mut results = Vec::with_capacity(self.children.len());
        for child in &self.children {
            let copy = IoBuf::from_slice(&buf);
            results.push(Box::pin(child.write_at(copy.into(), offset)).await.0);
        }
        (self.decide(results), buf)
    }

    async fn write_zeroes_at(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        let mut results = Vec::with_capacity(self.children.len());
        for child in &self.children {
            results.push(Box::pin(child.write_zeroes_at(offset, len, unmap)).await);
        }
        self.decide(results)
    }

    async fn discard_at(&self, _offset: u64, _len: u64) -> io::Result<()> {
        // QEMU's quorum driver passes no discard on: its children keep their bytes.
        Ok(())
    }

    /// Data where any child stores data (the longest such run), zeros only where every child
    /// reads zeros (the shortest such run), as QEMU's quorum answers block status.
    async fn data_run(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        let (mut data, mut zero) = (0, len);
        for child in &self.children {
            match Box::pin(child.data_run(offset, len)).await {
                Ok((true, n)) => data = data.max(n),
                Ok((false, n)) => zero = zero.min(n),
                Err(_) => {
                    data = len;
                    break;
                }
            }
        }
        Ok(if data > 0 {
            (true, data)
        } else {
            (false, zero)
        })
    }

    fn allocated_size(&self) -> Option<u64> {
        self.children
            .iter()
            .try_fold(0u64, |sum, c| sum.checked_add(c.allocated_size()?))
    }

    async fn flush(&self) -> io::Result<()> {
        let mut results = Vec::with_capacity(self.children.len());
        for child in &self.children {
            results.push(Box::pin(child.flush()).await);
        }
        self.decide(results)
    }

    async fn len(&self) -> io::Result<u64> {
        let mut len = None;
        for child in &self.children {
            let n = Box::pin(child.len()).await?;
            if len.is_some_and(|l| l != n) {
                // QEMU's answer when the children's lengths differ.
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            len = Some(n);
        }
        len.ok_or_else(|| io::Error::from_raw_os_error(libc::EIO))
    }

    async fn set_len(&self, _len: u64) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "a quorum node cannot be resized",
        ))
    }

    fn zeroes_are_cheap(&self) -> bool {
        self.children.iter().all(|c| c.zeroes_are_cheap())
    }

    fn alignment(&self) -> usize {
        self.children
            .iter()
            .map(|c| c.alignment())
            .max()
            .unwrap_or(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemStorage;

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    async fn read(q: &QuorumStorage<MemStorage>, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let (res, buf) = q.read_at(IoBuf::zeroed(len).into(), offset).await;
        res.map(|()| buf.to_vec())
    }

    #[test]
    fn names_read_back() {
        let node = QuorumNode {
            threshold: 2,
            children: vec!["a b.qcow2".into(), "/x/\"c\".qcow2".into()],
        };
        assert_eq!(QuorumNode::parse(&node.name()), Some(node));
        assert_eq!(QuorumNode::parse("json:{\"driver\":\"blkdebug\"}"), None);
        assert_eq!(QuorumNode::parse("json:{\"driver\":\"quorum\"}"), None);
    }

    #[test]
    fn thresholds_are_checked_as_qemu_checks_them() {
        assert_eq!(check_threshold(1, 0), Err(QuorumError::NoChildren));
        assert_eq!(check_threshold(0, 2), Err(QuorumError::ThresholdZero));
        assert_eq!(check_threshold(3, 2), Err(QuorumError::ThresholdTooHigh));
        assert_eq!(check_threshold(2, 2), Ok(()));
        assert_eq!(check_threshold(1, MAX_CHILDREN), Ok(()));
        assert_eq!(
            check_threshold(1, MAX_CHILDREN + 1),
            Err(QuorumError::TooManyChildren)
        );
    }

    #[test]
    fn reads_return_what_enough_children_agree_on() {
        run(async {
            let kids = || {
                vec![
                    MemStorage::from_bytes(&[1; 512]),
                    MemStorage::from_bytes(&[2; 512]),
                    MemStorage::from_bytes(&[2; 512]),
                ]
            };
            let q = QuorumStorage::new(kids(), 2).unwrap();
            assert_eq!(read(&q, 0, 512).await.unwrap(), vec![2; 512]);
            let q = QuorumStorage::new(kids(), 1).unwrap();
            assert_eq!(
                read(&q, 0, 512).await.unwrap(),
                vec![2; 512],
                "the majority"
            );
            let q = QuorumStorage::new(kids(), 3).unwrap();
            let e = read(&q, 0, 512).await.unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EIO), "no three agree");
        });
    }

    #[test]
    fn writes_reach_every_child() {
        run(async {
            let kids = vec![
                MemStorage::from_bytes(&[0; 1024]),
                MemStorage::from_bytes(&[0; 1024]),
            ];
            let q = QuorumStorage::new(kids, 2).unwrap();
            let (res, _) = q.write_at(IoBuf::from_slice(&[7; 512]).into(), 512).await;
            res.unwrap();
            q.write_zeroes_at(0, 16, false).await.unwrap();
            q.flush().await.unwrap();
            for c in q.children() {
                let (res, buf) = c.read_at(IoBuf::zeroed(1024).into(), 0).await;
                res.unwrap();
                assert_eq!(&buf[512..], &[7; 512][..]);
            }
            assert_eq!(read(&q, 512, 512).await.unwrap(), vec![7; 512]);
        });
    }

    #[test]
    fn children_of_different_lengths_have_no_length() {
        run(async {
            let kids = vec![
                MemStorage::from_bytes(&[0; 1024]),
                MemStorage::from_bytes(&[0; 512]),
            ];
            let q = QuorumStorage::new(kids, 1).unwrap();
            assert_eq!(q.len().await.unwrap_err().raw_os_error(), Some(libc::EIO));
            assert!(q.set_len(0).await.is_err());
        });
    }
}
