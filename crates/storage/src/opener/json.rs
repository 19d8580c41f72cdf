//! `json:{...}` image names: QEMU's JSON dialect (which also takes single-quoted strings)
//! read into the flattened `a.b.c` options an `--image-opts` list gives, bounded in size and
//! nesting because a name is untrusted input.

use std::collections::BTreeMap;

use super::image_opts::Val;
use super::name::{Reason, MAX_JSON_DEPTH, MAX_JSON_LEN};

/// Parses `json:` text (QEMU's JSON, which also takes single-quoted strings) into flattened
/// `a.b.c` keys.
pub(super) fn flatten_json(json: &str) -> Result<BTreeMap<String, Val>, Reason> {
    if json.len() > MAX_JSON_LEN {
        return Err(Reason::TooLong);
    }
    let standard = requote(json).map_err(Reason::Json)?;
    let value: serde_json::Value =
        serde_json::from_str(&standard).map_err(|e| Reason::Json(e.to_string()))?;
    let serde_json::Value::Object(map) = value else {
        return Err(Reason::NotObject);
    };
    let mut flat = BTreeMap::new();
    for (k, v) in map {
        flatten_value(&k, v, 1, &mut flat)?;
    }
    Ok(flat)
}

fn flatten_value(
    key: &str,
    v: serde_json::Value,
    depth: usize,
    flat: &mut BTreeMap<String, Val>,
) -> Result<(), Reason> {
    use serde_json::Value as J;
    if depth > MAX_JSON_DEPTH {
        return Err(Reason::TooDeep);
    }
    let leaf = match v {
        J::Object(map) => {
            for (k, v) in map {
                flatten_value(&format!("{key}.{k}"), v, depth + 1, flat)?;
            }
            return Ok(());
        }
        J::Array(items) => {
            for (i, v) in items.into_iter().enumerate() {
                flatten_value(&format!("{key}.{i}"), v, depth + 1, flat)?;
            }
            return Ok(());
        }
        J::Null => Val::Null,
        J::Bool(b) => Val::Text(if b { "on" } else { "off" }.to_string()),
        J::Number(n) => Val::Text(n.to_string()),
        J::String(s) => Val::Text(s),
    };
    if flat.insert(key.to_string(), leaf).is_some() {
        return Err(Reason::Conflict(key.to_string()));
    }
    Ok(())
}

/// Rewrites QEMU's JSON dialect into standard JSON: single-quoted strings become
/// double-quoted ones (a `"` inside is escaped, `\'` becomes `'`).
pub fn requote(json: &str) -> Result<String, String> {
    let mut out = String::with_capacity(json.len() + 16);
    let mut chars = json.chars();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, '\'') => {
                quote = Some('\'');
                out.push('"');
            }
            (None, '"') => {
                quote = Some('"');
                out.push('"');
            }
            (None, c) => out.push(c),
            (Some(q), '\\') => {
                let Some(next) = chars.next() else {
                    return Err("unterminated escape at the end".to_string());
                };
                if q == '\'' && next == '\'' {
                    out.push('\'');
                } else {
                    out.push('\\');
                    out.push(next);
                }
            }
            (Some(q), c) if c == q => {
                quote = None;
                out.push('"');
            }
            (Some('\''), '"') => out.push_str("\\\""),
            (Some(_), c) => out.push(c),
        }
    }
    Ok(out)
}
