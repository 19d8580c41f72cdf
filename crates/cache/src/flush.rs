//! What one cache owes before its next write-back, and the object-safe flush handle through
//! which caches of different types wait for each other. How obligations are recorded and
//! honoured is in [`crate::dependency`].

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;

use crate::error::CacheError;

/// A boxed, non-`Send` future of a flush.
pub type FlushFuture<'a> = Pin<Box<dyn Future<Output = Result<(), CacheError>> + 'a>>;

/// Object-safe flush handle so caches of different key/backend types can depend on each
/// other.
pub trait Flush {
    /// Write back every dirty entry (honouring this cache's own dependency), then flush the
    /// backend.
    fn flush(&self) -> FlushFuture<'_>;
    /// Whether this cache waits for another cache to be flushed before its next write-back.
    fn has_dependency(&self) -> bool;
    /// Honour that dependency now (flush the other cache) and clear it.
    fn flush_dependency(&self) -> FlushFuture<'_>;
    /// The cache's name, for errors.
    fn name(&self) -> &str;
}

/// The pending obligations of one cache.
#[derive(Default)]
pub(crate) struct Dependencies {
    pub(crate) target: Option<Rc<dyn Flush>>,
    /// Bumped on every `set_dependency`, so that an honour that started earlier does not
    /// clear an obligation recorded while it ran.
    pub(crate) target_generation: u64,
    pub(crate) flush_first: bool,
    pub(crate) flush_generation: u64,
}

impl Dependencies {
    /// Something must happen before the next write-back.
    pub(crate) fn pending(&self) -> bool {
        self.target.is_some() || self.flush_first
    }
}
