//! A command's arguments and what its handler yields: the checks every handler shares, in
//! QEMU's words for a missing, unexpected or mistyped parameter.

use std::future::Future;
use std::pin::Pin;

use serde_json::{Map, Value};

use super::qmp::QmpError;

/// What a handler's future yields.
pub type Outcome = Result<Value, QmpError>;

/// A command's running handler.
pub type Running = Pin<Box<dyn Future<Output = Outcome>>>;

/// A command's arguments, taken one by one; [`Args::finish`] refuses what is left.
pub struct Args(pub Map<String, Value>);

impl Args {
    /// A required string.
    pub fn string(&mut self, key: &str) -> Result<String, QmpError> {
        self.opt_string(key)?
            .ok_or_else(|| QmpError::generic(format!("Parameter '{key}' is missing")))
    }

    /// An optional string.
    pub fn opt_string(&mut self, key: &str) -> Result<Option<String>, QmpError> {
        self.take(key, "string", |v| match v {
            Value::String(s) => Some(s),
            _ => None,
        })
    }

    /// An optional boolean.
    pub fn opt_bool(&mut self, key: &str) -> Result<Option<bool>, QmpError> {
        self.take(key, "boolean", |v| v.as_bool())
    }

    /// An optional unsigned integer.
    pub fn opt_u64(&mut self, key: &str) -> Result<Option<u64>, QmpError> {
        self.take(key, "integer", |v| v.as_u64())
    }

    /// An optional list of strings.
    pub fn opt_strings(&mut self, key: &str) -> Result<Option<Vec<String>>, QmpError> {
        self.take(key, "array of strings", |v| match v {
            Value::Array(items) => items
                .into_iter()
                .map(|i| match i {
                    Value::String(s) => Some(s),
                    _ => None,
                })
                .collect(),
            _ => None,
        })
    }

    fn take<T>(
        &mut self,
        key: &str,
        expected: &str,
        convert: impl FnOnce(Value) -> Option<T>,
    ) -> Result<Option<T>, QmpError> {
        let Some(value) = self.0.remove(key) else {
            return Ok(None);
        };
        convert(value).map(Some).ok_or_else(|| {
            QmpError::generic(format!(
                "Invalid parameter type for '{key}', expected: {expected}"
            ))
        })
    }

    /// Refuses any argument not taken.
    pub fn finish(self) -> Result<(), QmpError> {
        match self.0.keys().next() {
            Some(key) => Err(QmpError::generic(format!(
                "Parameter '{key}' is unexpected"
            ))),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(v: Value) -> Args {
        match v {
            Value::Object(m) => Args(m),
            _ => unreachable!("test arguments are objects"),
        }
    }

    #[test]
    fn arguments_are_checked_with_qemus_words() {
        let mut a = args(json!({"id": 1, "w": true, "b": ["x", 2], "extra": 0}));
        assert_eq!(
            a.string("id").unwrap_err().desc,
            "Invalid parameter type for 'id', expected: string"
        );
        assert_eq!(a.opt_bool("w").unwrap(), Some(true));
        assert_eq!(
            a.opt_strings("b").unwrap_err().desc,
            "Invalid parameter type for 'b', expected: array of strings"
        );
        assert_eq!(
            a.string("file").unwrap_err().desc,
            "Parameter 'file' is missing"
        );
        assert_eq!(a.opt_u64("g").unwrap(), None);
        assert_eq!(
            a.finish().unwrap_err().desc,
            "Parameter 'extra' is unexpected"
        );
    }
}
