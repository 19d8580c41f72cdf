//! `--image-opts` lists (`key=value,...`, `,,` escaping a comma) and what every node of an
//! image name shares once flattened: values kept apart from JSON `null`, nodes taken out by
//! prefix, and the refusal of options left over.

use std::collections::BTreeMap;

use super::name::Reason;

/// Splits a list into raw `(key, value)` pairs in order; `None` for a key without `=`.
pub fn split(list: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut rest = list;
    while !rest.is_empty() {
        // The name ends at '=' or ','; names have no escapes.
        let name_end = rest.find(['=', ',']).unwrap_or(rest.len());
        let name = rest[..name_end].to_string();
        rest = &rest[name_end..];
        if let Some(after_eq) = rest.strip_prefix('=') {
            // The value ends at a ',' that is not doubled; ",," is a literal ','.
            let mut value = String::new();
            let mut chars = after_eq.char_indices().peekable();
            let mut consumed = after_eq.len();
            while let Some((i, c)) = chars.next() {
                if c == ',' {
                    if matches!(chars.peek(), Some((_, ','))) {
                        chars.next();
                        value.push(',');
                        continue;
                    }
                    consumed = i;
                    break;
                }
                value.push(c);
            }
            out.push((name, Some(value)));
            rest = &after_eq[consumed..];
        } else {
            out.push((name, None));
        }
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
    out
}

/// QEMU's boolean spellings (`qapi_bool_parse`): lower case only.
pub fn parse_bool(s: &str) -> Option<bool> {
    match s {
        "on" | "yes" | "true" | "y" => Some(true),
        "off" | "no" | "false" | "n" => Some(false),
        _ => None,
    }
}

/// A flattened option value: JSON `null` is kept apart from text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Val {
    Text(String),
    Null,
}

/// A `key=value,...` list as `--image-opts` takes it: `,,` escapes a comma, a first item
/// without `=` names the file, and a later bare key means `on`.
pub(super) fn flatten_list(list: &str) -> BTreeMap<String, Val> {
    let mut flat = BTreeMap::new();
    for (i, (key, value)) in split(list).into_iter().enumerate() {
        let (key, value) = match value {
            Some(v) => (key, v),
            None if i == 0 => ("file".to_string(), key),
            None => (key, "on".to_string()),
        };
        flat.insert(key, Val::Text(value));
    }
    flat
}

/// Takes `key` and every `key.*` member out of `flat`: the value given directly, and the
/// members with the prefix removed.
pub(super) fn take_node(
    flat: &mut BTreeMap<String, Val>,
    key: &str,
) -> Result<(Option<Val>, BTreeMap<String, Val>), Reason> {
    let direct = flat.remove(key);
    let prefix = format!("{key}.");
    let keys: Vec<String> = flat
        .keys()
        .filter(|k| k.starts_with(&prefix))
        .cloned()
        .collect();
    let mut members = BTreeMap::new();
    for k in keys {
        if let Some(v) = flat.remove(&k) {
            members.insert(k[prefix.len()..].to_string(), v);
        }
    }
    if direct.is_some() && !members.is_empty() {
        return Err(Reason::Conflict(key.to_string()));
    }
    Ok((direct, members))
}

pub(super) fn text(v: Option<Val>) -> Option<String> {
    match v {
        Some(Val::Text(s)) => Some(s),
        _ => None,
    }
}

/// Options every node takes in QEMU; none changes what this tool reads or writes.
pub(super) const NODE_NOOP_OPTIONS: &[&str] = &[
    "node-name",
    "cache.direct",
    "cache.no-flush",
    "discard",
    "detect-zeroes",
    "read-only",
    "auto-read-only",
    "force-share",
];

/// Refuses any option left that is neither a node option nor one of `noops`.
pub(super) fn check_leftover(
    flat: &BTreeMap<String, Val>,
    driver: &str,
    noops: &[&str],
) -> Result<(), Reason> {
    match flat
        .keys()
        .find(|k| !noops.contains(&k.as_str()) && !NODE_NOOP_OPTIONS.contains(&k.as_str()))
    {
        Some(k) if driver == "file" => Err(Reason::FileOption(k.clone())),
        Some(k) => Err(Reason::FormatOption {
            driver: driver.to_string(),
            option: k.clone(),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_handles_escapes_and_bare_keys() {
        assert_eq!(
            split("a=1,,2,b,c=,d=x,,"),
            vec![
                ("a".into(), Some("1,2".into())),
                ("b".into(), None),
                ("c".into(), Some(String::new())),
                ("d".into(), Some("x,".into())),
            ]
        );
        assert_eq!(split("=4k"), vec![(String::new(), Some("4k".into()))]);
    }
}
