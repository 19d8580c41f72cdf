//! qemu-img style option lists (`-o key=value,key=value`): `,,` stands for a literal comma in a
//! value, a key without `=` means `key=on`, the last occurrence of a key wins, sizes take
//! QEMU's suffixes (`size_string::parse_size`), and `help` or `?` anywhere asks for the option
//! list. Error messages follow qemu-img's wording, so scripts and people see what they know.

use std::collections::BTreeMap;

use crate::common::size_string;

/// Lists are split, and booleans read, as image names' option lists are (storage's opener
/// owns that syntax).
pub use storage::opener::image_opts::{parse_bool, split};

/// The type of an option's value, as qemu-img names it in `-o help`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Free text (`<str>`).
    Str,
    /// A size with an optional suffix (`<size>`).
    Size,
    /// An unsigned number, decimal or `0x` hexadecimal (`<num>`).
    Number,
    /// `on` or `off` (`<bool (on/off)>`).
    Bool,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Str => "<str>",
            Kind::Size => "<size>",
            Kind::Number => "<num>",
            Kind::Bool => "<bool (on/off)>",
        }
    }
}

/// One option a command accepts.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// Its name (`cluster_size`).
    pub name: &'static str,
    /// Its value type.
    pub kind: Kind,
    /// The one-line description `-o help` prints.
    pub help: &'static str,
}

/// A typed option value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// Text as given (with `,,` unescaped).
    Str(String),
    /// Bytes, or a plain number.
    Num(u64),
    /// `on`/`off` and their synonyms.
    Bool(bool),
}

/// Why an option list was refused; the messages are qemu-img's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    /// Empty list, leading comma or a dangling trailing comma.
    #[error("Invalid option list: {0}")]
    InvalidList(String),
    /// A key the command does not know.
    #[error("Invalid parameter '{0}'")]
    UnknownParameter(String),
    /// A QEMU option this tool does not implement.
    #[error("Parameter '{0}' is not supported by qcow2-nbd")]
    Unsupported(String),
    /// A boolean that is not on/off (or yes/no, true/false, y/n).
    #[error("Parameter '{0}' expects 'on' or 'off'")]
    ExpectsBool(String),
    /// A size that does not parse.
    #[error(
        "Parameter '{0}' expects a non-negative number below 2^64\nOptional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta-\nand exabytes, respectively."
    )]
    ExpectsSize(String),
    /// A number that does not parse.
    #[error("Parameter '{0}' expects a number")]
    ExpectsNumber(String),
    /// A value outside the allowed set (QEMU names some options differently here, e.g.
    /// `version` for `compat`).
    #[error("Parameter '{name}' does not accept value '{value}'")]
    BadValue {
        /// The option as QEMU names it in this message.
        name: &'static str,
        /// The value given.
        value: String,
    },
}

/// Checks a list the way qemu-img does before parsing it: not empty, no leading comma, and no
/// unescaped trailing comma.
pub fn check_list(list: &str) -> Result<(), OptionsError> {
    let trailing = list.bytes().rev().take_while(|&b| b == b',').count();
    if list.is_empty() || list.starts_with(',') || trailing % 2 == 1 {
        return Err(OptionsError::InvalidList(list.to_string()));
    }
    Ok(())
}

/// Joins several `-o` arguments into one list, as qemu-img does, checking each.
pub fn join_lists(lists: &[String]) -> Result<Option<String>, OptionsError> {
    for l in lists {
        check_list(l)?;
    }
    Ok((!lists.is_empty()).then(|| lists.join(",")))
}

/// True when the list asks for help (`help` or `?` as a key without a value).
pub fn wants_help(list: &str) -> bool {
    split(list)
        .iter()
        .any(|(k, v)| v.is_none() && (k == "help" || k == "?"))
}

/// Options parsed against a table of [`Spec`]s: the last value given for each key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parsed {
    values: BTreeMap<&'static str, (Value, String)>,
}

impl Parsed {
    /// Parses `list` against `specs`. Keys in `unsupported` are QEMU options this tool does
    /// not implement and get a message saying so.
    pub fn parse(list: &str, specs: &[Spec], unsupported: &[&str]) -> Result<Parsed, OptionsError> {
        check_list(list)?;
        let mut values = BTreeMap::new();
        for (key, value) in split(list) {
            let Some(spec) = specs.iter().find(|s| s.name == key) else {
                if unsupported.contains(&key.as_str()) {
                    return Err(OptionsError::Unsupported(key));
                }
                return Err(OptionsError::UnknownParameter(key));
            };
            // A bare key means "on" (QEMU's implied value), whatever the type.
            let text = value.unwrap_or_else(|| "on".to_string());
            let typed = match spec.kind {
                Kind::Str => Value::Str(text.clone()),
                Kind::Bool => Value::Bool(
                    parse_bool(&text).ok_or_else(|| OptionsError::ExpectsBool(key.clone()))?,
                ),
                Kind::Size => Value::Num(
                    size_string::parse_size(&text)
                        .map_err(|_| OptionsError::ExpectsSize(key.clone()))?,
                ),
                Kind::Number => Value::Num(
                    parse_number(&text).ok_or_else(|| OptionsError::ExpectsNumber(key.clone()))?,
                ),
            };
            values.insert(spec.name, (typed, text));
        }
        Ok(Parsed { values })
    }

    /// The value of a string option.
    pub fn str(&self, name: &str) -> Option<&str> {
        match self.values.get(name) {
            Some((Value::Str(s), _)) => Some(s),
            _ => None,
        }
    }

    /// The value of a size or number option.
    pub fn num(&self, name: &str) -> Option<u64> {
        match self.values.get(name) {
            Some((Value::Num(n), _)) => Some(*n),
            _ => None,
        }
    }

    /// The value of a boolean option.
    pub fn bool(&self, name: &str) -> Option<bool> {
        match self.values.get(name) {
            Some((Value::Bool(b), _)) => Some(*b),
            _ => None,
        }
    }

    /// The value of an option with the text it was given as (`,,` unescaped).
    pub fn given(&self, name: &str) -> Option<(&Value, &str)> {
        self.values.get(name).map(|(v, t)| (v, t.as_str()))
    }

    /// True when the option was given.
    pub fn has(&self, name: &str) -> bool {
        self.values.contains_key(name)
    }

    /// Sets an option from its text as if it had been given (typed as `spec` says; a value
    /// that does not parse is left out).
    pub fn set_raw(&mut self, spec: &Spec, text: &str) {
        if let Ok(p) = Parsed::parse(
            &format!("{}={}", spec.name, text.replace(',', ",,")),
            std::slice::from_ref(spec),
            &[],
        ) {
            self.values.extend(p.values);
        }
    }

    /// Sets a string option as if it had been given (qemu-img turns `-b`/`-F` into options).
    pub fn set_str(&mut self, spec: &Spec, value: &str) {
        self.values.insert(
            spec.name,
            (Value::Str(value.to_string()), value.to_string()),
        );
    }
}

/// An unsigned number the way QEMU's number options read it (C's `strtoull`): decimal, or
/// hexadecimal with `0x`, or octal with a leading `0`; a leading `-` negates modulo 2^64, so
/// `-1` is the largest value (which the option's own check then refuses, with its message).
pub fn parse_number(s: &str) -> Option<u64> {
    let s = s.trim_start();
    if let Some(rest) = s.strip_prefix('-') {
        return parse_magnitude(rest).map(u64::wrapping_neg);
    }
    parse_magnitude(s.strip_prefix('+').unwrap_or(s))
}

fn parse_magnitude(s: &str) -> Option<u64> {
    if s.starts_with(['+', '-']) {
        return None;
    }
    if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        return u64::from_str_radix(hex, 16).ok();
    }
    if s.len() > 1 && s.starts_with('0') {
        return u64::from_str_radix(&s[1..], 8).ok();
    }
    s.parse().ok()
}

/// The `-o help` text: qemu-img's "Supported options:" layout.
pub fn help_text(specs: &[Spec]) -> String {
    let mut out = String::from("Supported options:\n");
    let mut sorted: Vec<&Spec> = specs.iter().collect();
    sorted.sort_by_key(|s| s.name);
    for s in sorted {
        let lhs = format!("{}={}", s.name, s.kind.label());
        out.push_str(&format!("  {lhs:<22} - {}\n", s.help));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPECS: &[Spec] = &[
        Spec {
            name: "cluster_size",
            kind: Kind::Size,
            help: "qcow2 cluster size",
        },
        Spec {
            name: "lazy_refcounts",
            kind: Kind::Bool,
            help: "Postpone refcount updates",
        },
        Spec {
            name: "refcount_bits",
            kind: Kind::Number,
            help: "Width of a reference count entry in bits",
        },
        Spec {
            name: "backing_file",
            kind: Kind::Str,
            help: "File name of a base image",
        },
    ];

    fn parse(list: &str) -> Result<Parsed, OptionsError> {
        Parsed::parse(list, SPECS, &["data_file"])
    }

    #[test]
    fn typed_values_and_last_one_wins() {
        let p =
            parse("cluster_size=4k,lazy_refcounts,refcount_bits=0x10,cluster_size=128k").unwrap();
        assert_eq!(p.num("cluster_size"), Some(128 << 10));
        assert_eq!(p.bool("lazy_refcounts"), Some(true));
        assert_eq!(p.num("refcount_bits"), Some(16));
        assert!(!p.has("backing_file"));
        let p = parse("backing_file=a,,b,lazy_refcounts=n").unwrap();
        assert_eq!(p.str("backing_file"), Some("a,b"));
        assert_eq!(p.bool("lazy_refcounts"), Some(false));
    }

    #[test]
    fn qemu_img_error_messages() {
        let e = |l: &str| parse(l).unwrap_err().to_string();
        assert_eq!(e(""), "Invalid option list: ");
        assert_eq!(
            e(",cluster_size=4k"),
            "Invalid option list: ,cluster_size=4k"
        );
        assert_eq!(
            e("cluster_size=4k,"),
            "Invalid option list: cluster_size=4k,"
        );
        assert_eq!(e("foo=bar"), "Invalid parameter 'foo'");
        assert_eq!(e("=4k"), "Invalid parameter ''");
        assert_eq!(
            e("data_file=x"),
            "Parameter 'data_file' is not supported by qcow2-nbd"
        );
        assert_eq!(
            e("lazy_refcounts=On"),
            "Parameter 'lazy_refcounts' expects 'on' or 'off'"
        );
        assert!(e("cluster_size=abc")
            .starts_with("Parameter 'cluster_size' expects a non-negative number below 2^64"));
        assert_eq!(
            e("refcount_bits=abc"),
            "Parameter 'refcount_bits' expects a number"
        );
        // A doubled trailing comma is an escaped comma, not a dangling one.
        assert!(parse("backing_file=x,,").is_ok());
    }

    #[test]
    fn help_detection_and_text() {
        assert!(wants_help("help"));
        assert!(wants_help("cluster_size=4k,?"));
        assert!(!wants_help("backing_file=help"));
        let text = help_text(SPECS);
        assert!(text.starts_with("Supported options:\n  backing_file=<str>     - File name"));
        assert!(text.contains("\n  lazy_refcounts=<bool (on/off)> - Postpone refcount updates\n"));
        assert!(text.contains("\n  cluster_size=<size>    - qcow2 cluster size\n"));
    }

    #[test]
    fn numbers_and_booleans() {
        assert_eq!(parse_number("16"), Some(16));
        assert_eq!(parse_number("0x40"), Some(64));
        assert_eq!(parse_number("010"), Some(8));
        assert_eq!(parse_number("-1"), Some(u64::MAX));
        assert_eq!(parse_number("-0x10"), Some(16u64.wrapping_neg()));
        assert_eq!(parse_number("--1"), None);
        assert_eq!(parse_number("-"), None);
        assert_eq!(parse_number("1k"), None);
        for (s, b) in [
            ("on", true),
            ("yes", true),
            ("off", false),
            ("false", false),
        ] {
            assert_eq!(parse_bool(s), Some(b));
        }
        assert_eq!(parse_bool("ON"), None);
        assert_eq!(parse_bool("1"), None);
    }
}
