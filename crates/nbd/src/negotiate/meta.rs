//! Metadata contexts: which ones exist, and which a client's query strings select.
//!
//! Queries follow `nbd-proto.md` for `base:` and `qemu-nbd-extensions.txt` for `qemu:`: an
//! empty leaf (`base:`, `qemu:`) is a wildcard when listing and selects nothing when setting;
//! unknown namespaces, unknown leaves and strings without a colon are ignored.

/// A metadata context this server can offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetaContext {
    /// `base:allocation`: hole and zero bits.
    BaseAllocation,
    /// `qemu:allocation-depth`: which backing layer provides the data.
    AllocationDepth,
}

/// Name of the `base:allocation` context.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Name of the `qemu:allocation-depth` context.
pub const ALLOCATION_DEPTH: &str = "qemu:allocation-depth";

impl MetaContext {
    /// The context's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::BaseAllocation => BASE_ALLOCATION,
            Self::AllocationDepth => ALLOCATION_DEPTH,
        }
    }

    /// The id sent in `NBD_REP_META_CONTEXT` after a set, and in block status chunks.
    pub fn id(self) -> u32 {
        match self {
            Self::BaseAllocation => 1,
            Self::AllocationDepth => 2,
        }
    }
}

/// The contexts selected for transmission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MetaSelection {
    /// `base:allocation` is selected.
    pub base_allocation: bool,
    /// `qemu:allocation-depth` is selected.
    pub allocation_depth: bool,
}

impl MetaSelection {
    /// True if no context is selected (block status is then refused).
    pub fn is_empty(&self) -> bool {
        !self.base_allocation && !self.allocation_depth
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
        out
    }

    fn insert(&mut self, ctx: MetaContext) {
        match ctx {
            MetaContext::BaseAllocation => self.base_allocation = true,
            MetaContext::AllocationDepth => self.allocation_depth = true,
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

/// The contexts `queries` select on an export offering `available`, each once, in a fixed
/// order. An empty query list while listing means "everything available".
pub fn select(queries: &[&[u8]], mode: QueryMode, available: MetaSelection) -> MetaSelection {
    let mut out = MetaSelection::default();
    if queries.is_empty() {
        if mode == QueryMode::List {
            out = available;
        }
        return out;
    }
    for query in queries {
        for &ctx in matches(query, mode) {
            let offered = match ctx {
                MetaContext::BaseAllocation => available.base_allocation,
                MetaContext::AllocationDepth => available.allocation_depth,
            };
            if offered {
                out.insert(ctx);
            }
        }
    }
    out
}

fn matches(query: &[u8], mode: QueryMode) -> &'static [MetaContext] {
    let Some(colon) = query.iter().position(|&b| b == b':') else {
        return &[];
    };
    let (namespace, leaf) = (&query[..colon], &query[colon + 1..]);
    match (namespace, leaf, mode) {
        (b"base", b"", QueryMode::List) => &[MetaContext::BaseAllocation],
        (b"base", b"allocation", _) => &[MetaContext::BaseAllocation],
        (b"qemu", b"", QueryMode::List) => &[MetaContext::AllocationDepth],
        (b"qemu", b"allocation-depth", _) => &[MetaContext::AllocationDepth],
        _ => &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: MetaSelection = MetaSelection {
        base_allocation: true,
        allocation_depth: true,
    };
    const BASE_ONLY: MetaSelection = MetaSelection {
        base_allocation: true,
        allocation_depth: false,
    };

    fn names(sel: MetaSelection) -> Vec<&'static str> {
        sel.contexts().into_iter().map(MetaContext::name).collect()
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
}
