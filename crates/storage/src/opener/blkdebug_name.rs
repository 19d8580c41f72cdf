//! The names a blkdebug fault-injection node goes by: QEMU's `blkdebug:CONFIG:FILE`, and the
//! JSON name a node given by options travels as ([`Node::name`]), which the opener reads back
//! when it opens the name ([`Node::parse`]). The rules themselves are `crate::blkdebug`'s.

use crate::blkdebug::Node;

/// The start of every name [`Node::name`] makes.
const NODE_PREFIX: &str = "json:{\"driver\":\"blkdebug\"";

impl Node {
    /// The node's JSON name, which [`Node::parse`] reads back.
    pub fn name(&self) -> String {
        use serde_json::{Map, Value};
        let list = |rules: &[Vec<(String, String)>]| {
            Value::Array(
                rules
                    .iter()
                    .map(|pairs| {
                        Value::Object(
                            pairs
                                .iter()
                                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                                .collect(),
                        )
                    })
                    .collect(),
            )
        };
        let mut members = Map::new();
        if let Some(c) = &self.config {
            members.insert("config".into(), Value::String(c.clone()));
        }
        members.insert("inject-error".into(), list(&self.inject));
        members.insert("set-state".into(), list(&self.set_state));
        let mut image = Map::new();
        image.insert("driver".into(), Value::String("file".into()));
        image.insert("filename".into(), Value::String(self.image.clone()));
        members.insert("image".into(), Value::Object(image));
        let rest = Value::Object(members).to_string();
        // The driver first, so that the name says what it is.
        format!("{NODE_PREFIX},{}", &rest[1..])
    }

    /// Reads a name [`Node::name`] made; `None` for any other name.
    pub fn parse(name: &str) -> Option<Node> {
        use serde_json::Value;
        if !name.starts_with(NODE_PREFIX) {
            return None;
        }
        let Value::Object(mut map) = serde_json::from_str(name.strip_prefix("json:")?).ok()? else {
            return None;
        };
        let list = |v: Option<Value>| -> Option<Vec<Vec<(String, String)>>> {
            let Value::Array(items) = v? else { return None };
            items
                .into_iter()
                .map(|item| match item {
                    Value::Object(m) => m
                        .into_iter()
                        .map(|(k, v)| match v {
                            Value::String(s) => Some((k, s)),
                            _ => None,
                        })
                        .collect(),
                    _ => None,
                })
                .collect()
        };
        let config = match map.remove("config") {
            None => None,
            Some(Value::String(c)) => Some(c),
            Some(_) => return None,
        };
        let inject = list(map.remove("inject-error"))?;
        let set_state = list(map.remove("set-state"))?;
        let image = match map.remove("image")? {
            Value::Object(mut m) => match m.remove("filename")? {
                Value::String(f) => f,
                _ => return None,
            },
            _ => return None,
        };
        Some(Node {
            config,
            inject,
            set_state,
            image,
        })
    }
}

/// The file under a blkdebug name (`blkdebug:CONFIG:FILE` or a [`Node`] name), which names
/// relative to the image are relative to; `None` for any other name.
pub fn image_file(name: &str) -> Option<String> {
    if let Some((_, file)) = split_name(name) {
        return Some(file.to_string());
    }
    Node::parse(name).map(|n| n.image)
}

/// Splits a `blkdebug:CONFIG:FILE` name into its configuration file and image file.
pub fn split_name(name: &str) -> Option<(&str, &str)> {
    name.strip_prefix("blkdebug:")?.split_once(':')
}
