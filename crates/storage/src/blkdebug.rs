//! Fault injection for users, compatible with QEMU's `blkdebug` driver: a wrapper over an
//! image's file that fails chosen I/O once the format driver above it reaches a named point.
//!
//! The format engine announces those points with [`Storage::event`] (a no-op for every other
//! storage). An `inject-error` rule whose event is announced becomes *active*: from then on,
//! the first active rule that matches an I/O request (its type and, when given, an offset the
//! request covers) fails it with the rule's errno, once or every time. Each announcement of an
//! event that has `inject-error` rules replaces the active set with that event's rules, as in
//! QEMU. `set-state` rules move a small state machine (starting at state 1) so that rules can
//! be limited to a state. Rules for the event `none` are announced when the file is opened.
//!
//! A name `blkdebug:CONFIG:FILE` wraps FILE with the rules of the INI-like CONFIG file
//! (`[inject-error]` and `[set-state]` sections of `key = "value"` lines). A node given by
//! options instead (`inject-error` / `set-state` lists, an optional `config`, and the `image`
//! file) travels as its JSON name, `json:{"driver":"blkdebug",...}` ([`Node`]), which is also
//! how QEMU shows such a node: the rules cannot be put into a plain file name.

use std::cell::RefCell;
use std::io;
use std::path::Path;

pub use crate::event::Event;
use crate::{BufResult, Slice, Storage};

/// The longest configuration file read (QEMU has no limit; this only bounds memory).
pub const MAX_CONFIG_LEN: u64 = 1 << 20;

/// The most rules one configuration may hold.
pub const MAX_RULES: usize = 4096;

/// The limits a blkdebug node takes (QEMU checks their values): they change how requests
/// are cut, never what they return.
pub const LIMITS: &[&str] = &[
    "align",
    "max-transfer",
    "opt-write-zero",
    "max-write-zero",
    "opt-discard",
    "max-discard",
];

/// The kinds of request a rule can fail, by QEMU's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoType {
    /// `read`.
    Read,
    /// `write`.
    Write,
    /// `write-zeroes`.
    WriteZeroes,
    /// `discard`.
    Discard,
    /// `flush`.
    Flush,
    /// `block-status`.
    BlockStatus,
}

impl IoType {
    fn bit(self) -> u8 {
        1 << self as u8
    }

    /// The type QEMU names `name`.
    pub fn from_name(name: &str) -> Option<IoType> {
        Some(match name {
            "read" => IoType::Read,
            "write" => IoType::Write,
            "write-zeroes" => IoType::WriteZeroes,
            "discard" => IoType::Discard,
            "flush" => IoType::Flush,
            "block-status" => IoType::BlockStatus,
            _ => return None,
        })
    }
}

/// Every type but block status, which a rule fails only when it names it.
const DEFAULT_IOTYPES: u8 = 0b01_1111;

/// An `inject-error` rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InjectError {
    /// The event that activates it.
    pub event: Event,
    /// The state it is limited to (`0`: any).
    pub state: u64,
    /// The errno it fails requests with (`0`: it matches and fails nothing).
    pub errno: i32,
    /// Whether it is dropped after failing one request.
    pub once: bool,
    /// The byte a request must cover to fail (`None`: any request).
    pub offset: Option<u64>,
    iotypes: u8,
}

/// A `set-state` rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetState {
    /// The event that fires it.
    pub event: Event,
    /// The state it is limited to (`0`: any).
    pub state: u64,
    /// The state it moves to.
    pub new_state: u64,
}

/// The rules of one blkdebug node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules {
    /// `inject-error` rules, in the order given.
    pub inject: Vec<InjectError>,
    /// `set-state` rules, in the order given.
    pub set_state: Vec<SetState>,
}

/// What is wrong with a blkdebug configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A section other than `[inject-error]` and `[set-state]`.
    #[error("There is no option group '{name}'")]
    Section {
        /// The line (from 1).
        line: usize,
        /// The section's name.
        name: String,
    },
    /// A line that is neither a section, a `key = value` pair nor a comment.
    #[error("line {line}: not a section or a key = value pair")]
    Syntax {
        /// The line (from 1).
        line: usize,
    },
    /// A key before any section.
    #[error("line {line}: option outside a section")]
    Orphan {
        /// The line (from 1).
        line: usize,
    },
    /// A rule without its event.
    #[error("Missing event name for rule")]
    NoEvent,
    /// An event name QEMU does not have.
    #[error("invalid parameter value: {0}")]
    UnknownEvent(String),
    /// A key a rule does not take.
    #[error("Invalid parameter '{0}'")]
    UnknownKey(String),
    /// A value that does not parse.
    #[error("Parameter '{key}' expects {what}")]
    Value {
        /// The key.
        key: String,
        /// What it takes.
        what: &'static str,
    },
    /// More than [`MAX_RULES`] rules.
    #[error("more than {MAX_RULES} rules")]
    TooMany,
    /// The configuration file could not be read.
    #[error("Could not read blkdebug config file: {0}")]
    Read(String),
}

/// Which kind of rule a section or an option list describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleKind {
    /// `inject-error`.
    InjectError,
    /// `set-state`.
    SetState,
}

impl Rules {
    /// Reads an INI-like configuration file's text.
    pub fn parse_config(text: &str) -> Result<Rules, ConfigError> {
        let mut rules = Rules::default();
        let mut section: Option<(RuleKind, Vec<(String, String)>)> = None;
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                if let Some((kind, pairs)) = section.take() {
                    rules.add(kind, &pairs)?;
                }
                let kind = match name.trim() {
                    "inject-error" => RuleKind::InjectError,
                    "set-state" => RuleKind::SetState,
                    other => {
                        return Err(ConfigError::Section {
                            line: i + 1,
                            name: other.into(),
                        })
                    }
                };
                section = Some((kind, Vec::new()));
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                return Err(ConfigError::Syntax { line: i + 1 });
            };
            let value = value.trim();
            let value = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(value);
            let Some((_, pairs)) = section.as_mut() else {
                return Err(ConfigError::Orphan { line: i + 1 });
            };
            pairs.push((key.trim().to_string(), value.to_string()));
        }
        if let Some((kind, pairs)) = section {
            rules.add(kind, &pairs)?;
        }
        Ok(rules)
    }

    /// Reads the configuration file at `path` (at most [`MAX_CONFIG_LEN`] bytes).
    pub fn read_config(path: &Path) -> Result<Rules, ConfigError> {
        use std::io::Read;
        let read_err = |e: io::Error| {
            // strerror's words, as QEMU prints them.
            let text = e.to_string();
            let words = text.find(" (os error ").map_or(&text[..], |i| &text[..i]);
            ConfigError::Read(words.to_string())
        };
        let mut text = String::new();
        std::fs::File::open(path)
            .map_err(read_err)?
            .take(MAX_CONFIG_LEN + 1)
            .read_to_string(&mut text)
            .map_err(read_err)?;
        if text.len() as u64 > MAX_CONFIG_LEN {
            return Err(ConfigError::Read(format!(
                "longer than {MAX_CONFIG_LEN} bytes"
            )));
        }
        Rules::parse_config(&text)
    }

    /// Adds one rule given as `key`/`value` pairs (a config section, or the members of one
    /// `inject-error.N` / `set-state.N` option).
    pub fn add(&mut self, kind: RuleKind, pairs: &[(String, String)]) -> Result<(), ConfigError> {
        if self.inject.len() + self.set_state.len() >= MAX_RULES {
            return Err(ConfigError::TooMany);
        }
        let mut event = None;
        let mut state = 0;
        let mut errno = libc::EIO;
        let mut once = false;
        let mut offset = None;
        let mut iotypes = DEFAULT_IOTYPES;
        let mut new_state = None;
        for (key, value) in pairs {
            let number = |what| {
                value.parse::<u64>().map_err(|_| ConfigError::Value {
                    key: key.clone(),
                    what,
                })
            };
            match (kind, key.as_str()) {
                (_, "event") => {
                    event = Some(
                        Event::from_name(value)
                            .ok_or_else(|| ConfigError::UnknownEvent(value.clone()))?,
                    )
                }
                (_, "state") => state = number("a number")?,
                (RuleKind::InjectError, "errno") => {
                    errno = i32::try_from(number("an errno")?).map_err(|_| ConfigError::Value {
                        key: key.clone(),
                        what: "an errno",
                    })?
                }
                (RuleKind::InjectError, "once") => once = parse_bool(key, value)?,
                (RuleKind::InjectError, "immediately") => {
                    // Whether the failure waits for the next turn of the event loop: the
                    // same failure either way here.
                    parse_bool(key, value)?;
                }
                (RuleKind::InjectError, "sector") => {
                    offset = Some(number("a sector number")?.checked_mul(512).ok_or(
                        ConfigError::Value {
                            key: key.clone(),
                            what: "a sector number",
                        },
                    )?)
                }
                (RuleKind::InjectError, "offset") => offset = Some(number("a byte offset")?),
                (RuleKind::InjectError, "iotype") => {
                    iotypes = IoType::from_name(value)
                        .ok_or_else(|| ConfigError::Value {
                            key: key.clone(),
                            what: "an I/O type",
                        })?
                        .bit()
                }
                (RuleKind::SetState, "new_state") => new_state = Some(number("a number")?),
                _ => return Err(ConfigError::UnknownKey(key.clone())),
            }
        }
        let event = event.ok_or(ConfigError::NoEvent)?;
        match kind {
            RuleKind::InjectError => self.inject.push(InjectError {
                event,
                state,
                errno,
                once,
                offset,
                iotypes,
            }),
            RuleKind::SetState => self.set_state.push(SetState {
                event,
                state,
                new_state: new_state.unwrap_or(0),
            }),
        }
        Ok(())
    }
}

fn parse_bool(key: &str, value: &str) -> Result<bool, ConfigError> {
    match value {
        "on" | "yes" | "true" => Ok(true),
        "off" | "no" | "false" => Ok(false),
        _ => Err(ConfigError::Value {
            key: key.into(),
            what: "'on' or 'off'",
        }),
    }
}

/// A blkdebug node given by options: its rules (as key/value pairs, each checked by
/// [`Rules::add`]), an optional configuration file, and the file it wraps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Node {
    /// The `config` file, read before the rules given inline.
    pub config: Option<String>,
    /// The `inject-error` rules, each as key/value pairs.
    pub inject: Vec<Vec<(String, String)>>,
    /// The `set-state` rules, each as key/value pairs.
    pub set_state: Vec<Vec<(String, String)>>,
    /// The wrapped file.
    pub image: String,
}

impl Node {
    /// The rules, checked: the configuration file's, then those given inline.
    pub fn rules(&self) -> Result<Rules, ConfigError> {
        let mut rules = match &self.config {
            Some(c) => Rules::read_config(Path::new(c))?,
            None => Rules::default(),
        };
        for pairs in &self.inject {
            rules.add(RuleKind::InjectError, pairs)?;
        }
        for pairs in &self.set_state {
            rules.add(RuleKind::SetState, pairs)?;
        }
        Ok(rules)
    }
}

pub use crate::opener::blkdebug_name::{image_file, split_name};

/// Rules and the state they act on.
#[derive(Debug)]
struct Machine {
    rules: Rules,
    state: u64,
    /// Indexes into `rules.inject` of the active rules, in the order they are checked.
    active: Vec<usize>,
}

impl Machine {
    fn event(&mut self, event: Event) {
        let state = self.state;
        let applies = |rule_state: u64| rule_state == 0 || rule_state == state;
        let fired: Vec<usize> = (0..self.rules.inject.len())
            .filter(|&i| {
                let r = &self.rules.inject[i];
                r.event == event && applies(r.state)
            })
            .collect();
        if !fired.is_empty() {
            self.active = fired;
        }
        for r in &self.rules.set_state {
            if r.event == event && applies(r.state) {
                self.state = r.new_state;
            }
        }
    }

    /// The error the first active rule matching the request fails it with.
    fn check(&mut self, kind: IoType, offset: u64, len: u64) -> io::Result<()> {
        let hit = self.active.iter().position(|&i| {
            let r = &self.rules.inject[i];
            let covered = r
                .offset
                .is_none_or(|o| len > 0 && o >= offset && o - offset < len);
            covered && r.iotypes & kind.bit() != 0
        });
        let Some(at) = hit else { return Ok(()) };
        let index = self.active[at];
        let errno = self.rules.inject[index].errno;
        if errno == 0 {
            return Ok(());
        }
        if self.rules.inject[index].once {
            // Dropped for good: it never fires again, even when its event comes back.
            self.active.remove(at);
            self.rules.inject.remove(index);
            for i in &mut self.active {
                if *i > index {
                    *i -= 1;
                }
            }
        }
        Err(io::Error::from_raw_os_error(errno))
    }
}

/// A storage that fails requests as its rules say (see the module documentation).
#[derive(Debug)]
pub struct BlkdebugStorage<S> {
    inner: S,
    machine: RefCell<Machine>,
}

impl<S: Storage> BlkdebugStorage<S> {
    /// Wraps `inner` with `rules`; the rules of the event `none` are active at once.
    pub fn new(inner: S, rules: Rules) -> BlkdebugStorage<S> {
        let mut machine = Machine {
            rules,
            state: 1,
            active: Vec::new(),
        };
        machine.event(Event::None);
        BlkdebugStorage {
            inner,
            machine: RefCell::new(machine),
        }
    }

    /// The wrapped storage.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The current state of the rules' state machine.
    pub fn state(&self) -> u64 {
        self.machine.borrow().state
    }

    fn check(&self, kind: IoType, offset: u64, len: u64) -> io::Result<()> {
        self.machine.borrow_mut().check(kind, offset, len)
    }
}

// The inner calls are boxed: the inner storage may itself be a type that holds a
// `BlkdebugStorage` (the run-time choice of backend does), and an async call cycle needs
// an indirection to have a size.
impl<S: Storage> Storage for BlkdebugStorage<S> {
    async fn read_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        if let Err(e) = self.check(IoType::Read, offset, buf.len() as u64) {
            return (Err(e), buf);
        }
        Box::pin(self.inner.read_at(buf, offset)).await
    }
    async fn write_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        if let Err(e) = self.check(IoType::Write, offset, buf.len() as u64) {
            return (Err(e), buf);
        }
        Box::pin(self.inner.write_at(buf, offset)).await
    }
    async fn write_zeroes_at(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        self.check(IoType::WriteZeroes, offset, len)?;
        Box::pin(self.inner.write_zeroes_at(offset, len, unmap)).await
    }
    async fn discard_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(IoType::Discard, offset, len)?;
        Box::pin(self.inner.discard_at(offset, len)).await
    }
    async fn data_run(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        self.check(IoType::BlockStatus, offset, len)?;
        Box::pin(self.inner.data_run(offset, len)).await
    }
    fn allocated_size(&self) -> Option<u64> {
        self.inner.allocated_size()
    }
    async fn flush(&self) -> io::Result<()> {
        self.check(IoType::Flush, 0, 0)?;
        Box::pin(self.inner.flush()).await
    }
    async fn len(&self) -> io::Result<u64> {
        Box::pin(self.inner.len()).await
    }
    async fn set_len(&self, len: u64) -> io::Result<()> {
        Box::pin(self.inner.set_len(len)).await
    }
    fn zeroes_are_cheap(&self) -> bool {
        self.inner.zeroes_are_cheap()
    }
    fn alignment(&self) -> usize {
        self.inner.alignment()
    }
    fn event(&self, event: Event) {
        self.machine.borrow_mut().event(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IoBuf, MemStorage};

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    async fn read(s: &impl Storage, offset: u64, len: usize) -> io::Result<()> {
        s.read_at(IoBuf::zeroed(len).slice(0..len), offset).await.0
    }

    #[test]
    fn config_file_sections_and_defaults() {
        let rules = Rules::parse_config(
            "# c\n[inject-error]\nevent = \"read_aio\"\nerrno = \"28\"\nonce =\"on\"\n\
             sector = \"2\"\n\n[set-state]\nevent = \"l1_update\"\nstate = \"1\"\n\
             new_state = \"2\"\n[inject-error]\nevent = \"cluster_free\"\n",
        )
        .unwrap();
        assert_eq!(rules.inject.len(), 2);
        let r = &rules.inject[0];
        assert_eq!(
            (r.event, r.errno, r.once, r.offset),
            (Event::ReadAio, 28, true, Some(1024))
        );
        assert_eq!(rules.inject[1].errno, libc::EIO);
        assert_eq!(
            rules.set_state,
            vec![SetState {
                event: Event::L1Update,
                state: 1,
                new_state: 2
            }]
        );
    }

    #[test]
    fn bad_configs_are_refused() {
        for (text, want) in [
            ("[inject-error]\nerrno = 5\n", ConfigError::NoEvent),
            (
                "[inject-error]\nevent = \"nope\"\n",
                ConfigError::UnknownEvent("nope".into()),
            ),
            ("event = \"read_aio\"\n", ConfigError::Orphan { line: 1 }),
            (
                "[inject-error]\nevent = \"read_aio\"\nnew_state = 2\n",
                ConfigError::UnknownKey("new_state".into()),
            ),
        ] {
            assert_eq!(Rules::parse_config(text), Err(want), "{text}");
        }
    }

    #[test]
    fn rules_fire_after_their_event_and_once_rules_fire_once() {
        run(async {
            let rules = Rules::parse_config(
                "[inject-error]\nevent = \"read_aio\"\nonce = \"on\"\n\
                 [inject-error]\nevent = \"write_aio\"\niotype = \"write\"\noffset = \"4096\"\n",
            )
            .unwrap();
            let s = BlkdebugStorage::new(MemStorage::new(), rules);
            read(&s, 0, 512).await.unwrap();
            s.event(Event::ReadAio);
            let e = read(&s, 0, 512).await.unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EIO));
            read(&s, 0, 512).await.unwrap();
            s.event(Event::ReadAio);
            read(&s, 0, 512).await.unwrap();
            s.event(Event::WriteAio);
            read(&s, 4096, 512).await.unwrap();
            let w = |off| s.write_at(IoBuf::zeroed(512).slice(0..512), off);
            w(0).await.0.unwrap();
            assert_eq!(w(4096).await.0.unwrap_err().raw_os_error(), Some(libc::EIO));
            assert!(w(4096).await.0.is_err(), "not a once rule");
        });
    }

    #[test]
    fn states_limit_rules() {
        run(async {
            let rules = Rules::parse_config(
                "[set-state]\nevent = \"l1_update\"\nstate = \"1\"\nnew_state = \"2\"\n\
                 [inject-error]\nevent = \"none\"\nstate = \"2\"\n\
                 [inject-error]\nevent = \"l2_load\"\nstate = \"2\"\n",
            )
            .unwrap();
            let s = BlkdebugStorage::new(MemStorage::new(), rules);
            read(&s, 0, 512).await.unwrap();
            s.event(Event::L2Load);
            read(&s, 0, 512).await.unwrap();
            s.event(Event::L1Update);
            assert_eq!(s.state(), 2);
            s.event(Event::L2Load);
            assert!(read(&s, 0, 512).await.is_err());
        });
    }
}
