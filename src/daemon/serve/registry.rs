//! The images a running server offers, each with its id: those of the command line, and
//! those the control socket adds and removes at run time. One owner for every open image
//! of the server: it builds their NBD exports, starts their cache cleaners, closes an
//! image once its export is deleted and its last client gone (flush, bitmaps stored, lock
//! released), announces that to the control clients, and closes all that remain when the
//! server stops.
//!
//! Ids: an `--export` definition's id is its name (`export0`, `export1`, ... by position
//! for an empty name); the positional IMAGE's export is `export0`.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use nbd_server::{CloseMode, ExportEntry, ExportState, Exports};
use qcow2::engine::{Image, OpenOptions};
use storage::{AnyStorage, FileOpener};
use tokio::sync::broadcast;
use tokio::task::JoinHandle;

use super::cleaner::Cleaner;
use super::error::ServeError;
use super::export_option::MAX_EXPORTS;
use super::served_images::{close_all, ImageSpec, OpenImage, Origin};
use crate::daemon::image_export::{ExportPolicy, ImageExport};
use crate::daemon::stats::{Gauges, StatsRegistry};

/// Events kept for a control client that reads them slowly; one further behind misses the
/// oldest (it is told how many, see the control session).
const EVENT_BACKLOG: usize = 64;

/// An export served and the image behind it.
pub struct Record {
    /// The id the control socket names it by.
    pub id: String,
    /// What it was opened from.
    pub spec: ImageSpec,
    /// The image (until it is closed).
    pub image: Image<AnyStorage>,
    /// Its clients, shared with the NBD server.
    pub state: Arc<ExportState>,
    /// Its key in the NBD export set.
    key: usize,
    cleaner: Option<Cleaner>,
}

/// What opening another image at run time needs: the settings the command line gave every
/// export.
pub struct OpenSettings {
    /// How files are opened (aio, O_DIRECT, locking).
    pub opener: FileOpener,
    /// The open options of every export: a run-time export's cache gets the share of
    /// `--cache-size` each command-line export got.
    pub open: OpenOptions,
    /// The export policy of every export.
    pub policy: ExportPolicy,
    /// Where each export counts its requests, if anything reads the numbers.
    pub stats: Option<Rc<StatsRegistry>>,
}

/// Why an export cannot be added or deleted; the control socket reports it.
#[derive(Debug, thiserror::Error)]
pub enum ChangeError {
    /// The id is taken.
    #[error("Export id '{0}' is already in use")]
    IdInUse(String),
    /// The name is taken.
    #[error("Export name '{0}' is already in use")]
    NameInUse(String),
    /// The server holds as many exports as it takes.
    #[error("the server already has {MAX_EXPORTS} exports, the most it serves")]
    Full,
    /// No export has this id.
    #[error("Export '{0}' is not found")]
    NotFound(String),
    /// A delete of this export is under way.
    #[error("Export '{0}' is already shutting down")]
    ShuttingDown(String),
    /// Anything else (the image cannot be opened, a bitmap cannot be exported).
    #[error("{0}")]
    Other(String),
}

/// The served images: a cheap handle, shared by the server and the control sessions.
#[derive(Clone)]
pub struct Registry {
    inner: Rc<RefCell<Inner>>,
    exports: Exports<ImageExport>,
    settings: Rc<OpenSettings>,
    events: broadcast::Sender<String>,
}

struct Inner {
    records: Vec<Record>,
    /// Deletes waiting for their last client, then closing the image.
    deleting: Vec<JoinHandle<()>>,
}

impl Registry {
    /// Builds the exports of the images opened at start; on failure the images come back
    /// with the error, for the caller to close.
    pub async fn start(
        images: Vec<OpenImage>,
        settings: OpenSettings,
    ) -> Result<Registry, (ServeError, Vec<OpenImage>)> {
        let mut entries = Vec::with_capacity(images.len());
        for open in &images {
            match entry(open, &settings).await {
                Ok(e) => entries.push(e),
                Err(e) => return Err((e, images)),
            }
        }
        let exports = match Exports::new(entries) {
            Ok(e) => e,
            Err(e) => return Err((nbd_server::ServerError::from(e).into(), images)),
        };
        let single = images.len() == 1 && images[0].spec.origin == Origin::Image;
        let records = images
            .into_iter()
            .enumerate()
            .map(|(i, open)| {
                let id = match open.spec.name.as_str() {
                    name if !name.is_empty() && !single => name.to_owned(),
                    _ => format!("export{i}"),
                };
                let key = exports.find(open.spec.name.as_bytes()).unwrap_or(i);
                record(id, open, key, &exports)
            })
            .collect();
        Ok(Registry {
            inner: Rc::new(RefCell::new(Inner {
                records,
                deleting: Vec::new(),
            })),
            exports,
            settings: Rc::new(settings),
            events: broadcast::channel(EVENT_BACKLOG).0,
        })
    }

    /// The NBD export set, for the server.
    pub fn exports(&self) -> Exports<ImageExport> {
        self.exports.clone()
    }

    /// Events for a control client, as JSON text.
    pub fn subscribe(&self) -> broadcast::Receiver<String> {
        self.events.subscribe()
    }

    /// Calls `f` with the records, in the order they were added.
    pub fn with_records<T>(&self, f: impl FnOnce(&[Record]) -> T) -> T {
        f(&self.inner.borrow().records)
    }

    /// Calls `f` with the record `id`, if there is one.
    pub fn with_record<T>(&self, id: &str, f: impl FnOnce(&Record) -> T) -> Option<T> {
        self.inner
            .borrow()
            .records
            .iter()
            .find(|r| r.id == id)
            .map(f)
    }

    /// Opens `spec`'s image with its locks and serves it as export `id`. Nothing is
    /// served, and nothing stays open or locked, if any step fails. The files are opened
    /// off this thread within the open bound, and only regular files and block devices
    /// are taken, so a path that never answers or names a FIFO cannot stall the server.
    pub async fn add(&self, id: String, spec: ImageSpec) -> Result<(), ChangeError> {
        self.check_new(&id, &spec.name)?;
        // Errors speak of the command that asked, not of the command line.
        let command = format!("block-export-add id={id} file={}", spec.path.display());
        let options = OpenOptions {
            snapshot: None,
            ..spec.open_options(&self.settings.open)
        };
        let image = Image::open(&self.settings.opener, &spec.path, &options)
            .await
            .map_err(|e| ChangeError::Other(format!("{command}: {e}")))?;
        let open = OpenImage { spec, image };
        let added = match entry(&open, &self.settings).await {
            Ok(entry) => self.insert(&id, &open, entry),
            Err(e) => Err(ChangeError::Other(format!("{command}: {e}"))),
        };
        match added {
            Ok(key) => {
                tracing::info!(export = %open.spec.name, %id, "export added");
                let r = record(id, open, key, &self.exports);
                self.inner.borrow_mut().records.push(r);
                Ok(())
            }
            Err(e) => {
                self.forget_stats(&open.spec.name);
                if let Err(c) = close_all(vec![open]).await {
                    tracing::error!(error = %c, "closing an image not served failed");
                }
                Err(e)
            }
        }
    }

    /// Offers an opened image to clients: its NBD key. Checked again and done without a
    /// pause, so that another control client adding the same id meanwhile is refused.
    fn insert(
        &self,
        id: &str,
        open: &OpenImage,
        entry: ExportEntry<ImageExport>,
    ) -> Result<usize, ChangeError> {
        self.check_new(id, &open.spec.name)?;
        match self.exports.add(entry) {
            Ok(key) => Ok(key),
            Err(nbd_server::ExportsError::DuplicateName(n)) => Err(ChangeError::NameInUse(n)),
            Err(e) => Err(ChangeError::Other(e.to_string())),
        }
    }

    /// Refuses a new export when the id or name is taken, or the server is full.
    fn check_new(&self, id: &str, name: &str) -> Result<(), ChangeError> {
        let inner = self.inner.borrow();
        if inner.records.iter().any(|r| r.id == id) {
            return Err(ChangeError::IdInUse(id.to_owned()));
        }
        if inner.records.iter().any(|r| r.spec.name == name) {
            return Err(ChangeError::NameInUse(name.to_owned()));
        }
        if inner.records.len() >= MAX_EXPORTS {
            return Err(ChangeError::Full);
        }
        Ok(())
    }

    /// Closes export `id` to new clients (ending its connections in `Hard` mode); once
    /// its last client is gone its image is closed and `BLOCK_EXPORT_DELETED` sent.
    /// A `Hard` delete may follow a `Safe` one still waiting for its clients: it ends them.
    /// Returns at once.
    pub fn delete(&self, id: &str, mode: CloseMode) -> Result<(), ChangeError> {
        let (name, key, state) = {
            let inner = self.inner.borrow();
            let r = inner
                .records
                .iter()
                .find(|r| r.id == id)
                .ok_or_else(|| ChangeError::NotFound(id.to_owned()))?;
            (r.spec.name.clone(), r.key, Arc::clone(&r.state))
        };
        if state.is_closing() {
            if mode == CloseMode::Hard && self.exports.end_connections(key) {
                tracing::info!(export = %name, %id, "export closing, its clients ended");
                return Ok(());
            }
            return Err(ChangeError::ShuttingDown(id.to_owned()));
        }
        let (_, state) = self
            .exports
            .close(&name, mode)
            .map_err(|e| ChangeError::Other(e.to_string()))?;
        tracing::info!(export = %name, %id, ?mode, "export closing");
        let task = tokio::task::spawn_local(self.clone().finish_delete(id.to_owned(), state));
        let mut inner = self.inner.borrow_mut();
        // A finished delete's task is dropped here rather than kept until the server stops:
        // a server that adds and deletes exports for months keeps only those under way.
        inner.deleting.retain(|t| !t.is_finished());
        inner.deleting.push(task);
        Ok(())
    }

    /// Waits for the last client of a closed export, then closes its image and tells the
    /// control clients. The export stays listed (shutting down) until its file is flushed,
    /// closed and unlocked: once its id is gone, the same file can be added again.
    async fn finish_delete(self, id: String, state: Arc<ExportState>) {
        state.detached().await;
        let Some((key, name, cleaner, image)) = self.with_record_mut(&id, |r| {
            (
                r.key,
                r.spec.name.clone(),
                r.cleaner.take(),
                r.image.clone(),
            )
        }) else {
            return;
        };
        // With worker threads this also waits for their calls to the export to end, so
        // nothing but the record (and the clone here) holds the image when it is closed.
        drop(self.exports.forget(key).await);
        self.forget_stats(&name);
        if let Some(c) = cleaner {
            c.stop().await;
        }
        let closed = image.close().await;
        // No await from here on: the record and the last clone of the image go together, so
        // the file is closed (and its locks released) by the time the id leaves the list.
        let record = self.take(&id);
        drop((image, record));
        match closed {
            Ok(()) => tracing::info!(%id, "export deleted, image closed"),
            Err(e) => tracing::error!(%id, error = %e, "export deleted, closing its image failed"),
        }
        let _ = self.events.send(super::control::qmp::deleted_event(&id));
    }

    /// Calls `f` with the record `id`, if there is one, allowed to change it.
    fn with_record_mut<T>(&self, id: &str, f: impl FnOnce(&mut Record) -> T) -> Option<T> {
        self.inner
            .borrow_mut()
            .records
            .iter_mut()
            .find(|r| r.id == id)
            .map(f)
    }

    /// Where the exports count their requests, if anything reads the numbers.
    pub fn stats(&self) -> Option<&Rc<StatsRegistry>> {
        self.settings.stats.as_ref()
    }

    /// Stops reporting an export on its own (its numbers stay in the total) and lets go of
    /// the image clone its cache statistics came from, so that closing releases the lock.
    fn forget_stats(&self, name: &str) {
        if let Some(stats) = &self.settings.stats {
            stats.remove(name);
        }
    }

    fn take(&self, id: &str) -> Option<Record> {
        let mut inner = self.inner.borrow_mut();
        let at = inner.records.iter().position(|r| r.id == id)?;
        Some(inner.records.remove(at))
    }

    /// After the server stopped: lets every delete finish, then closes the remaining
    /// images (the first failure is returned).
    pub async fn close_all(self) -> Result<(), ServeError> {
        let deleting = std::mem::take(&mut self.inner.borrow_mut().deleting);
        for task in deleting {
            let _ = task.await;
        }
        let records = std::mem::take(&mut self.inner.borrow_mut().records);
        let mut opened = Vec::with_capacity(records.len());
        for r in records {
            if let Some(c) = r.cleaner {
                c.stop().await;
            }
            opened.push(OpenImage {
                spec: r.spec,
                image: r.image,
            });
        }
        close_all(opened).await
    }
}

/// The NBD export of an open image, with its bitmaps, counting its requests when the
/// server keeps statistics.
async fn entry(
    open: &OpenImage,
    settings: &OpenSettings,
) -> Result<ExportEntry<ImageExport>, ServeError> {
    let spec = &open.spec;
    let bitmaps = crate::daemon::image_export::exported_bitmaps(&open.image, &spec.bitmaps)
        .await
        .map_err(|reason| spec.bitmap_error(reason))?;
    let policy = ExportPolicy {
        // Writes under `-s` go to the overlay, whose format is known.
        probed_raw: spec.probed && spec.overlay.is_none(),
        compressed_writes: crate::common::image_name::compressed_writes(&spec.path),
        ..settings.policy
    };
    let mut export = ImageExport::new(open.image.clone(), policy).with_bitmaps(bitmaps);
    let state = Arc::new(ExportState::new());
    if let Some(stats) = &settings.stats {
        let (image, state) = (open.image.clone(), Arc::clone(&state));
        let now = move || Gauges {
            attached: u64::try_from(state.attached()).unwrap_or(u64::MAX),
            caches: image.meta_cache_stats(),
        };
        export = export.with_stats(stats.add(&spec.name, Box::new(now))?);
    }
    Ok(ExportEntry::new(spec.name.clone(), Rc::new(export))
        .with_description(spec.description.clone())
        .sharing(state))
}

fn record(id: String, open: OpenImage, key: usize, exports: &Exports<ImageExport>) -> Record {
    let state = exports
        .get(key)
        .map(|e| Arc::clone(e.state()))
        .unwrap_or_default();
    let interval = open.image.cache_sizes().clean_interval_secs;
    Record {
        id,
        cleaner: Cleaner::start(open.image.clone(), interval),
        spec: open.spec,
        image: open.image,
        state,
        key,
    }
}
