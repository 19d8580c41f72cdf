//! Metadata contexts: which ones exist, and which a client's query strings select.
//!
//! Queries follow `nbd-proto.md` for `base:` and `qemu-nbd-extensions.txt` for `qemu:`: an
//! empty leaf (`base:`, `qemu:`, `qemu:dirty-bitmap:`) is a wildcard when listing and selects
//! nothing when setting; unknown namespaces, unknown leaves and strings without a colon are
//! ignored.

use nbd_proto::wire::consts::{ALLOCATION_DEPTH, BASE_ALLOCATION, DIRTY_BITMAP_PREFIX};

/// A metadata context this server can offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetaContext {
    /// `base:allocation`: hole and zero bits.
    BaseAllocation,
    /// `qemu:allocation-depth`: which backing layer provides the data.
    AllocationDepth,
    /// `qemu:dirty-bitmap:NAME`: the export's dirty bitmap number `n` (dirty = bit 0).
    DirtyBitmap(u8),
}

/// Dirty bitmaps one export may offer (each selected one is a bit of [`MetaSelection`]).
pub const MAX_DIRTY_BITMAPS: usize = 64;

impl MetaContext {
    /// The context's name; `bitmaps` are the export's dirty bitmap names.
    pub fn name(self, bitmaps: &[String]) -> String {
        match self {
            Self::BaseAllocation => BASE_ALLOCATION.to_string(),
            Self::AllocationDepth => ALLOCATION_DEPTH.to_string(),
            Self::DirtyBitmap(n) => {
                let name = bitmaps.get(usize::from(n)).map_or("", String::as_str);
                format!("{DIRTY_BITMAP_PREFIX}{name}")
            }
        }
    }

    /// The id sent in `NBD_REP_META_CONTEXT` after a set, and in block status chunks.
    pub fn id(self) -> u32 {
        match self {
            Self::BaseAllocation => 1,
            Self::AllocationDepth => 2,
            Self::DirtyBitmap(n) => 3 + u32::from(n),
        }
    }

    /// The context an id names (the inverse of [`MetaContext::id`]), if any can have it.
    pub fn from_id(id: u32) -> Option<Self> {
        match id {
            1 => Some(Self::BaseAllocation),
            2 => Some(Self::AllocationDepth),
            n => {
                let bitmap = u8::try_from(n.checked_sub(3)?).ok()?;
                (usize::from(bitmap) < MAX_DIRTY_BITMAPS).then_some(Self::DirtyBitmap(bitmap))
            }
        }
    }
}

/// The contexts selected for transmission (or offered by an export).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MetaSelection {
    /// `base:allocation` is selected.
    pub base_allocation: bool,
    /// `qemu:allocation-depth` is selected.
    pub allocation_depth: bool,
    /// Bit `n`: the export's dirty bitmap `n` is selected.
    pub dirty_bitmaps: u64,
}

impl MetaSelection {
    /// True if no context is selected (block status is then refused).
    pub fn is_empty(&self) -> bool {
        !self.base_allocation && !self.allocation_depth && self.dirty_bitmaps == 0
    }

    /// Every one of `count` dirty bitmaps (at most [`MAX_DIRTY_BITMAPS`]).
    pub fn all_bitmaps(count: usize) -> u64 {
        match count {
            0 => 0,
            n if n >= MAX_DIRTY_BITMAPS => u64::MAX,
            n => (1u64 << n) - 1,
        }
    }

    /// Whether the export's allocation (`base:allocation`, `qemu:allocation-depth`) is asked.
    pub fn wants_allocation(&self) -> bool {
        self.base_allocation || self.allocation_depth
    }

    /// Selected contexts in a fixed order.
    pub fn contexts(&self) -> Vec<MetaContext> {
        let mut out = Vec::with_capacity(2);
        if self.base_allocation {
            out.push(MetaContext::BaseAllocation);
        }
        if self.allocation_depth {
            out.push(MetaContext::AllocationDepth);
        }
        for n in 0..MAX_DIRTY_BITMAPS as u8 {
            if self.dirty_bitmaps >> n & 1 != 0 {
                out.push(MetaContext::DirtyBitmap(n));
            }
        }
        out
    }

    /// Adds `ctx` to the selection.
    pub fn insert(&mut self, ctx: MetaContext) {
        match ctx {
            MetaContext::BaseAllocation => self.base_allocation = true,
            MetaContext::AllocationDepth => self.allocation_depth = true,
            MetaContext::DirtyBitmap(n) => self.dirty_bitmaps |= 1 << n,
        }
    }

    /// Whether `ctx` is in the selection.
    pub fn offers(&self, ctx: MetaContext) -> bool {
        match ctx {
            MetaContext::BaseAllocation => self.base_allocation,
            MetaContext::AllocationDepth => self.allocation_depth,
            MetaContext::DirtyBitmap(n) => self.dirty_bitmaps >> n & 1 != 0,
        }
    }
}

/// Whether a query is for listing (wildcards expand) or for setting (they select nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryMode {
    /// `NBD_OPT_LIST_META_CONTEXT`.
    List,
    /// `NBD_OPT_SET_META_CONTEXT`.
    Set,
}

/// The contexts `queries` select on an export offering `available` (whose dirty bitmaps are
/// named `bitmaps`), each once, in a fixed order. An empty query list while listing means
/// "everything available".
pub fn select(
    queries: &[&[u8]],
    mode: QueryMode,
    available: MetaSelection,
    bitmaps: &[String],
) -> MetaSelection {
    let mut out = MetaSelection::default();
    if queries.is_empty() {
        if mode == QueryMode::List {
            out = available;
        }
        return out;
    }
    for query in queries {
        for ctx in matches(query, mode, bitmaps) {
            if available.offers(ctx) {
                out.insert(ctx);
            }
        }
    }
    out
}

fn every_bitmap(bitmaps: &[String]) -> impl Iterator<Item = MetaContext> {
    (0..bitmaps.len().min(MAX_DIRTY_BITMAPS)).map(|n| MetaContext::DirtyBitmap(n as u8))
}

fn matches(query: &[u8], mode: QueryMode, bitmaps: &[String]) -> Vec<MetaContext> {
    let Some(colon) = query.iter().position(|&b| b == b':') else {
        return Vec::new();
    };
    let (namespace, leaf) = (&query[..colon], &query[colon + 1..]);
    let listing = mode == QueryMode::List;
    match (namespace, leaf) {
        (b"base", b"") if listing => vec![MetaContext::BaseAllocation],
        (b"base", b"allocation") => vec![MetaContext::BaseAllocation],
        (b"qemu", b"") if listing => std::iter::once(MetaContext::AllocationDepth)
            .chain(every_bitmap(bitmaps))
            .collect(),
        (b"qemu", b"allocation-depth") => vec![MetaContext::AllocationDepth],
        (b"qemu", b"dirty-bitmap:") if listing => every_bitmap(bitmaps).collect(),
        (b"qemu", leaf) => match leaf.strip_prefix(b"dirty-bitmap:") {
            Some(name) if !name.is_empty() => every_bitmap(bitmaps)
                .filter(|c| matches!(c, MetaContext::DirtyBitmap(n) if bitmaps[usize::from(*n)].as_bytes() == name))
                .collect(),
            _ => Vec::new(),
        },
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: MetaSelection = MetaSelection {
        base_allocation: true,
        allocation_depth: true,
        dirty_bitmaps: 0,
    };
    const BASE_ONLY: MetaSelection = MetaSelection {
        base_allocation: true,
        allocation_depth: false,
        dirty_bitmaps: 0,
    };

    fn names(sel: MetaSelection) -> Vec<String> {
        sel.contexts().into_iter().map(|c| c.name(&[])).collect()
    }

    fn select(q: &[&[u8]], mode: QueryMode, available: MetaSelection) -> MetaSelection {
        super::select(q, mode, available, &[])
    }

    #[test]
    fn listing_without_queries_returns_everything_available() {
        assert_eq!(
            names(select(&[], QueryMode::List, ALL)),
            [BASE_ALLOCATION, ALLOCATION_DEPTH]
        );
        assert_eq!(
            names(select(&[], QueryMode::List, BASE_ONLY)),
            [BASE_ALLOCATION]
        );
        assert!(select(&[], QueryMode::Set, ALL).is_empty());
    }

    #[test]
    fn wildcards_expand_only_when_listing() {
        assert_eq!(
            names(select(&[b"qemu:"], QueryMode::List, ALL)),
            [ALLOCATION_DEPTH]
        );
        assert_eq!(
            names(select(&[b"base:"], QueryMode::List, ALL)),
            [BASE_ALLOCATION]
        );
        assert!(select(&[b"qemu:", b"base:"], QueryMode::Set, ALL).is_empty());
        assert!(select(&[b"qemu:"], QueryMode::List, BASE_ONLY).is_empty());
    }

    #[test]
    fn exact_names_select_and_duplicates_collapse() {
        let q: [&[u8]; 3] = [
            b"qemu:allocation-depth",
            b"base:allocation",
            b"base:allocation",
        ];
        assert_eq!(
            names(select(&q, QueryMode::Set, ALL)),
            [BASE_ALLOCATION, ALLOCATION_DEPTH]
        );
        assert_eq!(
            names(select(&q, QueryMode::Set, BASE_ONLY)),
            [BASE_ALLOCATION]
        );
    }

    #[test]
    fn unknown_and_malformed_queries_are_ignored() {
        let q: [&[u8]; 5] = [
            b"x-foo:bar",
            b"nocolon",
            b"base:other",
            b"qemu:dirty-bitmap:b",
            b":",
        ];
        assert!(select(&q, QueryMode::List, ALL).is_empty());
        assert!(select(&q, QueryMode::Set, ALL).is_empty());
    }

    #[test]
    fn dirty_bitmaps_are_listed_by_wildcard_and_set_by_name() {
        let bitmaps = ["b1".to_string(), "b2".to_string()];
        let available = MetaSelection {
            base_allocation: true,
            allocation_depth: false,
            dirty_bitmaps: MetaSelection::all_bitmaps(2),
        };
        let named = |q: &[&[u8]], mode| {
            let sel = super::select(q, mode, available, &bitmaps);
            sel.contexts()
                .into_iter()
                .map(|c| c.name(&bitmaps))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            named(&[b"qemu:"], QueryMode::List),
            ["qemu:dirty-bitmap:b1", "qemu:dirty-bitmap:b2"]
        );
        assert_eq!(
            named(&[b"qemu:dirty-bitmap:"], QueryMode::List),
            ["qemu:dirty-bitmap:b1", "qemu:dirty-bitmap:b2"]
        );
        assert!(named(&[b"qemu:dirty-bitmap:"], QueryMode::Set).is_empty());
        assert_eq!(
            named(
                &[b"qemu:dirty-bitmap:b2", b"qemu:dirty-bitmap:b3"],
                QueryMode::Set
            ),
            ["qemu:dirty-bitmap:b2"]
        );
        assert_eq!(
            named(&[], QueryMode::List),
            [
                "base:allocation",
                "qemu:dirty-bitmap:b1",
                "qemu:dirty-bitmap:b2"
            ]
        );
        assert_eq!(MetaContext::DirtyBitmap(1).id(), 4);
    }
}
