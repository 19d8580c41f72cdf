//! `--export name=NAME,file=PATH[,readonly=on|off][,format=qcow2|raw][,description=TEXT]
//! [,bitmap=B]...[,untrusted=on|off]`: one export of a server that offers several images. The text follows
//! QEMU's key=value rules (`,,` is a comma inside a value, on/off/yes/no/true/false), read
//! strictly: an unknown or repeated key (only `bitmap` repeats), a missing `name` or `file`
//! or a value that does not parse is refused, so a typo never serves the wrong thing.

use std::path::PathBuf;

use clap::ValueEnum;
use qcow2::engine::Format;

use crate::common::options;

/// Most `--export` definitions one server takes: each holds an open image, its files, its
/// caches and a task per connection, so a command line cannot make the server hold
/// thousands of images.
pub const MAX_EXPORTS: usize = 64;

/// The keys an `--export` definition takes, as the error messages list them.
const KEYS: &str = "name, file, readonly, format, description, bitmap, untrusted";

/// One parsed `--export` definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportSpec {
    /// The name clients select the export with (may be empty: the default export).
    pub name: String,
    /// The image file.
    pub file: PathBuf,
    /// Served read-only (`readonly=on`); read-write by default, as qemu-nbd.
    pub read_only: bool,
    /// The image format; without it only qcow2 is accepted, as with `serve -f`.
    pub format: Option<FormatArg>,
    /// Sent to clients with the export list and `NBD_INFO_DESCRIPTION`; none by default,
    /// as QEMU sends none (so a listing does not reveal file paths).
    pub description: String,
    /// Persistent dirty bitmaps offered as `qemu:dirty-bitmap:NAME`, as `serve -B`.
    pub bitmaps: Vec<String>,
    /// The image is untrusted (`untrusted=on`): the files it names must resolve inside an
    /// `--allow-dir`, as under `--untrusted`.
    pub untrusted: bool,
}

/// Why an `--export` definition is refused (clap prints the definition before it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportSpecError {
    /// Empty, or a stray comma at either end.
    #[error("expected name=NAME,file=PATH[,key=value]... ({KEYS})")]
    Malformed,
    /// A part without `=`.
    #[error("{0:?} is not key=value")]
    NotKeyValue(String),
    /// A key we do not know.
    #[error("unknown key {0:?} (the keys are {KEYS})")]
    UnknownKey(String),
    /// A key other than `bitmap` given twice.
    #[error("key {0:?} is given twice")]
    Repeated(&'static str),
    /// `name` or `file` is missing.
    #[error("key {0:?} is missing")]
    Missing(&'static str),
    /// `file=` with nothing after it.
    #[error("key \"file\" is empty")]
    EmptyFile,
    /// `bitmap=` with nothing after it.
    #[error("key \"bitmap\" is empty")]
    EmptyBitmap,
    /// `readonly` is not a boolean.
    #[error("readonly={0:?}: expected on or off")]
    BadBool(String),
    /// `untrusted` is not a boolean.
    #[error("untrusted={0:?}: expected on or off")]
    BadUntrusted(String),
    /// `format` is neither qcow2 nor raw.
    #[error("format={0:?}: expected qcow2 or raw")]
    BadFormat(String),
}

/// Parses one `--export` definition.
pub fn parse_export_spec(text: &str) -> Result<ExportSpec, ExportSpecError> {
    options::check_list(text).map_err(|_| ExportSpecError::Malformed)?;
    let mut fields = Fields::default();
    for (key, value) in options::split(text) {
        let value = value.ok_or_else(|| ExportSpecError::NotKeyValue(key.clone()))?;
        fields.set(&key, value)?;
    }
    fields.finish()
}

/// The values read so far; each key may be set once (bitmaps accumulate).
#[derive(Default)]
struct Fields {
    name: Option<String>,
    file: Option<String>,
    readonly: Option<String>,
    format: Option<String>,
    description: Option<String>,
    untrusted: Option<String>,
    bitmaps: Vec<String>,
}

impl Fields {
    fn set(&mut self, key: &str, value: String) -> Result<(), ExportSpecError> {
        let (slot, key) = match key {
            "name" => (&mut self.name, "name"),
            "file" => (&mut self.file, "file"),
            "readonly" => (&mut self.readonly, "readonly"),
            "format" => (&mut self.format, "format"),
            "description" => (&mut self.description, "description"),
            "untrusted" => (&mut self.untrusted, "untrusted"),
            "bitmap" if value.is_empty() => return Err(ExportSpecError::EmptyBitmap),
            "bitmap" => {
                self.bitmaps.push(value);
                return Ok(());
            }
            other => return Err(ExportSpecError::UnknownKey(other.to_owned())),
        };
        if slot.replace(value).is_some() {
            return Err(ExportSpecError::Repeated(key));
        }
        Ok(())
    }

    fn finish(self) -> Result<ExportSpec, ExportSpecError> {
        let name = self.name.ok_or(ExportSpecError::Missing("name"))?;
        let file = self.file.ok_or(ExportSpecError::Missing("file"))?;
        if file.is_empty() {
            return Err(ExportSpecError::EmptyFile);
        }
        let read_only = match self.readonly {
            None => false,
            Some(v) => options::parse_bool(&v).ok_or(ExportSpecError::BadBool(v))?,
        };
        let untrusted = match self.untrusted {
            None => false,
            Some(v) => options::parse_bool(&v).ok_or(ExportSpecError::BadUntrusted(v))?,
        };
        let format = match self.format {
            None => None,
            Some(name) => {
                Some(FormatArg::from_name(&name).ok_or(ExportSpecError::BadFormat(name))?)
            }
        };
        Ok(ExportSpec {
            name,
            file: PathBuf::from(file),
            read_only,
            format,
            description: self.description.unwrap_or_default(),
            bitmaps: self.bitmaps,
            untrusted,
        })
    }
}

/// `-f`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatArg {
    /// qcow2 (versions 2 and 3).
    Qcow2,
    /// A raw disk image.
    Raw,
}

impl FormatArg {
    /// The format's name, as `-f` takes it.
    pub fn name(self) -> &'static str {
        match self {
            FormatArg::Qcow2 => "qcow2",
            FormatArg::Raw => "raw",
        }
    }

    /// The format `name` names, if it is one `serve` exports.
    pub fn from_name(name: &str) -> Option<FormatArg> {
        match name {
            "qcow2" => Some(FormatArg::Qcow2),
            "raw" => Some(FormatArg::Raw),
            _ => None,
        }
    }
}

impl From<FormatArg> for Format {
    fn from(f: FormatArg) -> Format {
        match f {
            FormatArg::Qcow2 => Format::Qcow2,
            FormatArg::Raw => Format::Raw,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_definition_with_escaped_commas() {
        let s = parse_export_spec(
            "name=disk,file=/img/a,,b.qcow2,readonly=on,format=raw,description=the a,, b disk,bitmap=b1,bitmap=b2",
        )
        .unwrap();
        assert_eq!(s.name, "disk");
        assert_eq!(s.file, PathBuf::from("/img/a,b.qcow2"));
        assert!(s.read_only);
        assert_eq!(s.format, Some(FormatArg::Raw));
        assert_eq!(s.description, "the a, b disk");
        assert_eq!(s.bitmaps, ["b1", "b2"]);
    }

    #[test]
    fn defaults_are_read_write_qcow2_without_description() {
        let s = parse_export_spec("file=x.qcow2,name=").unwrap();
        assert_eq!(s.name, "");
        assert!(!s.read_only);
        assert_eq!((s.format, s.description.as_str()), (None, ""));
        assert!(s.bitmaps.is_empty());
        assert!(!s.untrusted);
        assert!(
            parse_export_spec("name=a,file=f,untrusted=on")
                .unwrap()
                .untrusted
        );
        for (v, ro) in [("off", false), ("no", false), ("yes", true), ("true", true)] {
            let s = parse_export_spec(&format!("name=a,file=f,readonly={v}")).unwrap();
            assert_eq!(s.read_only, ro, "readonly={v}");
        }
    }

    #[test]
    fn every_mistake_is_named() {
        use ExportSpecError::*;
        for (text, want) in [
            ("", Malformed),
            (",name=a,file=f", Malformed),
            ("name=a,file=f,", Malformed),
            ("name=a,file", NotKeyValue("file".into())),
            ("name=a,file=f,size=1G", UnknownKey("size".into())),
            ("name=a,file=f,name=b", Repeated("name")),
            ("name=a,file=f,file=g", Repeated("file")),
            (
                "name=a,file=f,readonly=on,readonly=off",
                Repeated("readonly"),
            ),
            ("file=f", Missing("name")),
            ("name=a", Missing("file")),
            ("name=a,file=", EmptyFile),
            ("name=a,file=f,bitmap=", EmptyBitmap),
            ("name=a,file=f,readonly=maybe", BadBool("maybe".into())),
            ("name=a,file=f,untrusted=1x", BadUntrusted("1x".into())),
            (
                "name=a,file=f,untrusted=on,untrusted=on",
                Repeated("untrusted"),
            ),
            ("name=a,file=f,format=vmdk", BadFormat("vmdk".into())),
        ] {
            assert_eq!(parse_export_spec(text), Err(want), "{text:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_text_parses_or_is_refused(text in "[a-z=,/.]{0,48}") {
            let _ = parse_export_spec(&text);
        }
    }
}
