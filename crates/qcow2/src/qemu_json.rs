//! JSON laid out as QEMU's tools print it with `--output=json`: four spaces per level, an
//! empty array or object still opened and closed on lines of their own, strings escaped as
//! QEMU escapes them, and an object's members in the order QEMU's dictionary iterates them.
//! That order is not the insertion order: QEMU keeps members in 512 hash buckets (the
//! gdbm/tdb string hash) and walks the buckets in turn, the most recently inserted member
//! of a bucket first. Scripts that compare output line by line see the same text.

use serde_json::Value;

/// Buckets in QEMU's dictionary.
const BUCKETS: u32 = 512;

/// Members of the structures `qemu-img` prints, in the order QEMU inserts them (its schema
/// order): two members that share a bucket come out latest first. Only the relative order
/// of members of one object matters; a member not listed sorts as if inserted first.
const INSERTION_ORDER: &[&str] = &[
    "filename",
    "format",
    "dirty-flag",
    "actual-size",
    "virtual-size",
    "cluster-size",
    "encrypted",
    "compressed",
    "backing-filename",
    "full-backing-filename",
    "backing-filename-format",
    "snapshots",
    "format-specific",
    "backing-image",
    "children",
];

/// The gdbm/tdb string hash QEMU's dictionary uses to pick a member's bucket.
fn bucket(key: &str) -> u32 {
    let bytes = key.as_bytes();
    let mut value = 0x238F_13AFu32.wrapping_mul(bytes.len() as u32);
    for (i, &b) in bytes.iter().enumerate() {
        value = value.wrapping_add(u32::from(b) << ((i * 5) % 24));
    }
    1_103_515_243u32.wrapping_mul(value).wrapping_add(12345) % BUCKETS
}

/// `v` as QEMU's tools print it (no trailing newline).
pub fn to_pretty(v: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, v, Some(0));
    out
}

/// `v` on one line, as QEMU writes it inside a `json:{...}` file name: members and items
/// separated by `, `, in the same order as [`to_pretty`].
pub fn to_compact(v: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, v, None);
    out
}

/// Starts a member or item: a line of its own at `depth` when pretty, else after a space
/// unless it is the first.
fn separate(out: &mut String, depth: Option<usize>, first: bool) {
    match depth {
        Some(depth) => {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', depth * 4));
        }
        None if !first => out.push(' '),
        None => {}
    }
}

/// Writes `v`; `depth` is the nesting level when pretty, `None` for one line.
fn write_value(out: &mut String, v: &Value, depth: Option<usize>) {
    let inner = depth.map(|d| d + 1);
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => out.push_str(&string(s)),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                separate(out, inner, i == 0);
                write_value(out, item, inner);
            }
            separate(out, depth, true);
            out.push(']');
        }
        Value::Object(members) => {
            let rank = |k: &str| INSERTION_ORDER.iter().position(|m| *m == k);
            let mut keys: Vec<(&String, &Value)> = members.iter().collect();
            // Bucket order; within a bucket the later insertion first.
            keys.sort_by(|(a, _), (b, _)| {
                bucket(a)
                    .cmp(&bucket(b))
                    .then_with(|| rank(b).cmp(&rank(a)))
                    .then_with(|| a.cmp(b))
            });
            out.push('{');
            for (i, (key, value)) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                separate(out, inner, i == 0);
                out.push_str(&string(key));
                out.push_str(": ");
                write_value(out, value, inner);
            }
            separate(out, depth, true);
            out.push('}');
        }
    }
}

/// A JSON string as QEMU writes one: quotes, backslashes and the usual control characters
/// escaped by name, anything else outside printable ASCII as `\uXXXX` (surrogate pairs past
/// the basic plane).
pub fn string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04X}"));
                }
            }
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_come_in_bucket_order_and_empty_containers_take_two_lines() {
        let v = serde_json::json!({
            "backing-filename-format": "qcow2",
            "children": [],
            "filename": "a\u{e9}\"",
            "virtual-size": 1,
            "format-specific": {"data": {}, "type": "file"},
        });
        assert_eq!(
            to_pretty(&v),
            "{\n    \"children\": [\n    ],\n    \"backing-filename-format\": \"qcow2\",\n    \"virtual-size\": 1,\n    \"filename\": \"a\\u00E9\\\"\",\n    \"format-specific\": {\n        \"type\": \"file\",\n        \"data\": {\n        }\n    }\n}"
        );
    }

    #[test]
    fn compact_is_one_line_in_the_same_order() {
        let v = serde_json::json!({
            "driver": "qcow2",
            "encrypt.key-secret": "s",
            "file": {"filename": "a.qcow2", "driver": "file"},
            "list": [1, 2],
        });
        assert_eq!(
            to_compact(&v),
            "{\"list\": [1, 2], \"encrypt.key-secret\": \"s\", \"driver\": \"qcow2\", \"file\": {\"driver\": \"file\", \"filename\": \"a.qcow2\"}}"
        );
    }
}
