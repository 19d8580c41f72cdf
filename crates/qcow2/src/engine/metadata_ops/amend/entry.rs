//! `amend`: QEMU's checks, then the changes in QEMU's order (upgrade first, so that the
//! features it allows can be turned on; the refcount width; lazy refcounts; size; downgrade
//! last, once what version 2 cannot hold is gone, so `compat=0.10,refcount_bits=16` works on
//! an image of another width). What the options themselves get wrong is refused before
//! anything is written. Two refusals come later, as in QEMU: a narrower refcount width, which
//! only the count of every reference can refuse (after an upgrade asked for with it), and
//! what version 2 cannot hold, checked where the downgrade starts, so the changes before it
//! (a new size, say) stay made. Each change leaves a valid image.

use super::progress::{Operation, Steps};
pub use crate::engine::infra::error::AmendError;
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use crate::engine::metadata_ops::create::Preallocation;
use crate::format::features::COMPAT_LAZY_REFCOUNTS;
use crate::format::header;
use storage::Storage;

/// What to change; `None` leaves it as it is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AmendOptions {
    /// 2 (compat=0.10) or 3 (compat=1.1).
    pub version: Option<u32>,
    /// Lazy refcounts on or off.
    pub lazy_refcounts: Option<bool>,
    /// Bits per refcount.
    pub refcount_bits: Option<u64>,
    /// New virtual size (may shrink, as amend's exact resize does in QEMU).
    pub size: Option<u64>,
    /// The backing file name given (only the current one is accepted).
    pub backing_file: Option<String>,
    /// The backing format given (only the current one is accepted).
    pub backing_fmt: Option<String>,
    /// A new name for the external data file (empty: the name is dropped, and the data
    /// file must then be named when the image is opened); only for images that have one.
    pub data_file: Option<String>,
    /// `false` drops the promise that the data file is a valid raw image; `true` is
    /// accepted only where it already holds, as nothing else could make it hold.
    pub data_file_raw: Option<bool>,
}

impl<S: Storage + 'static> Image<S> {
    /// Changes what `opts` asks for, as `qemu-img amend -o` does.
    pub async fn amend(&self, opts: &AmendOptions) -> Result<()> {
        self.amend_with_progress(opts, &|_| {}).await
    }

    /// As [`amend`](Self::amend), telling `progress` how far it has come (percentages, as
    /// QEMU's driver reports them to `qemu-img amend -p`).
    pub async fn amend_with_progress(
        &self,
        opts: &AmendOptions,
        progress: &dyn Fn(f64),
    ) -> Result<()> {
        self.inner.check_writable()?;
        let top = self.inner.top();
        let refuse = |source| EngineError::Amend {
            image: top.name.clone(),
            source,
        };
        let meta = top.qcow2().ok_or_else(|| EngineError::Unsupported {
            image: top.name.clone(),
            what: "amending a raw image".into(),
        })?;
        let (old_version, old_bits, lazy_now) = {
            let h = meta.header.borrow();
            (
                h.version,
                meta.refcount_geom.get().refcount_bits(),
                h.compatible_features & COMPAT_LAZY_REFCOUNTS != 0,
            )
        };
        let version = opts.version.unwrap_or(old_version);
        if let Some(bits) = opts.refcount_bits {
            if bits == 0 || bits > 64 || !bits.is_power_of_two() {
                return Err(refuse(AmendError::RefcountWidth));
            }
        }
        self.check_backing(opts).map_err(refuse)?;
        let (has_data_file, data_file_raw) = {
            let h = meta.header.borrow();
            (h.has_data_file(), h.data_file_is_raw())
        };
        if opts.data_file.is_some() && !has_data_file {
            return Err(refuse(AmendError::DataFileNotUsed));
        }
        if opts.data_file_raw == Some(true) && !data_file_raw {
            return Err(refuse(AmendError::DataFileRawOnExisting));
        }
        let bits = opts.refcount_bits.unwrap_or(u64::from(old_bits));
        // Keeping another width while downgrading is the downgrade's refusal, not this one.
        if bits != u64::from(old_bits) && bits != 16 && version < 3 {
            return Err(refuse(AmendError::RefcountNeedsV3));
        }
        // A power of two up to 64, checked above.
        let order = bits.trailing_zeros();
        let lazy = opts.lazy_refcounts.unwrap_or(lazy_now);
        if lazy && !lazy_now && version < 3 {
            return Err(refuse(AmendError::LazyNeedsV3));
        }
        let steps = Steps::new(
            progress,
            u64::from(version != old_version) + u64::from(bits != u64::from(old_bits)),
        );
        if version > old_version {
            steps.start(Operation::Upgrade);
            self.upgrade(&steps).await?;
        }
        if bits != u64::from(old_bits) {
            steps.start(Operation::RefcountWidth);
            self.change_refcount_width(order, &steps).await?;
        }
        if lazy != lazy_now {
            self.set_lazy_refcounts(lazy).await?;
        }
        let raw = opts.data_file_raw.unwrap_or(data_file_raw);
        if opts.data_file.is_some() || raw != data_file_raw {
            self.set_data_file(opts.data_file.as_deref(), raw).await?;
        }
        if let Some(size) = opts.size.filter(|&s| s != top.size.get()) {
            self.resize(size, Preallocation::Off).await?;
        }
        if version < old_version {
            // QEMU checks what version 2 cannot hold only here, after the other changes
            // (a new size included) are made; a refusal leaves them made, as it does.
            self.check_downgrade(order).await?;
            steps.start(Operation::Downgrade);
            self.downgrade(&steps).await?;
        }
        self.inner.flush().await
    }

    /// QEMU 10 no longer changes the backing file through amend: naming the current one
    /// (file and format both) is accepted, anything else refused.
    fn check_backing(&self, opts: &AmendOptions) -> std::result::Result<(), AmendError> {
        if opts.backing_file.is_none() && opts.backing_fmt.is_none() {
            return Ok(());
        }
        // A raw image has no backing file to name.
        let Some(meta) = self.inner.top().qcow2() else {
            return Err(AmendError::Backing);
        };
        let h = meta.header.borrow();
        let current = |v: Option<&[u8]>| v.map(|b| String::from_utf8_lossy(b).into_owned());
        let same = opts.backing_file == current(h.backing_file.as_deref())
            && opts.backing_fmt == current(h.backing_format());
        if same {
            Ok(())
        } else {
            Err(AmendError::Backing)
        }
    }

    /// Turns lazy refcounts on, or off once every refcount is on disk and the dirty bit is
    /// clear (a dirty image was already repaired when it was opened read-write).
    async fn set_lazy_refcounts(&self, on: bool) -> Result<()> {
        let w = self.inner.alloc()?;
        let meta = self.inner.top().qcow2_required()?;
        if !on {
            // No write may set the dirty bit again once it is cleared.
            w.disable_lazy_refcounts();
            self.inner.flush().await?;
            w.mark_clean().await?;
        }
        let bits = {
            let mut h = meta.header.borrow_mut();
            if on {
                h.compatible_features |= COMPAT_LAZY_REFCOUNTS;
            } else {
                h.compatible_features &= !COMPAT_LAZY_REFCOUNTS;
            }
            h.compatible_features
        };
        w.update_header(header::compatible_update(bits)).await?;
        w.sync().await
    }
}
