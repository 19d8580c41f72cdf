//! QMP's wire format, as QEMU speaks it on its monitor socket: a stream of JSON objects
//! (back to back, newlines optional), the greeting, replies that echo the request's `id`,
//! errors with a class and a description, and events with a timestamp. Pure: no I/O, so
//! the framing and every error text are unit-tested.

use serde_json::{json, Map, Value};

/// The error classes QEMU reports, by the name it gives them on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Anything without a class of its own.
    GenericError,
    /// No such command (or not before capabilities negotiation).
    CommandNotFound,
    /// No such export.
    DeviceNotFound,
}

impl ErrorClass {
    fn as_str(self) -> &'static str {
        match self {
            Self::GenericError => "GenericError",
            Self::CommandNotFound => "CommandNotFound",
            Self::DeviceNotFound => "DeviceNotFound",
        }
    }
}

/// A command's failure, as the client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QmpError {
    /// Its class.
    pub class: ErrorClass,
    /// What went wrong, for a person.
    pub desc: String,
}

impl QmpError {
    /// A `GenericError`.
    pub fn generic(desc: impl Into<String>) -> Self {
        Self {
            class: ErrorClass::GenericError,
            desc: desc.into(),
        }
    }

    /// An error of `class`.
    pub fn new(class: ErrorClass, desc: impl Into<String>) -> Self {
        Self {
            class,
            desc: desc.into(),
        }
    }
}

/// One command a client sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The command name.
    pub execute: String,
    /// Its arguments (empty when none were given).
    pub arguments: Map<String, Value>,
    /// Echoed in the reply.
    pub id: Option<Value>,
}

/// Checks one input object the way QEMU's dispatcher does. The `id`, when there is one, is
/// returned with the error too, so even a refused request is answered with it.
pub fn parse_request(input: Value) -> Result<Request, (QmpError, Option<Value>)> {
    let Value::Object(mut members) = input else {
        return Err((QmpError::generic("QMP input must be a JSON object"), None));
    };
    let id = members.remove("id");
    let fail = |desc: String| Err((QmpError::generic(desc), id.clone()));
    let execute = match members.remove("execute") {
        Some(Value::String(s)) => s,
        Some(_) => return fail("QMP input member 'execute' must be a string".into()),
        None => return fail("QMP input lacks member 'execute'".into()),
    };
    let arguments = match members.remove("arguments") {
        None => Map::new(),
        Some(Value::Object(a)) => a,
        Some(_) => return fail("QMP input member 'arguments' must be an object".into()),
    };
    if let Some(other) = members.keys().next() {
        return fail(format!("QMP input member '{other}' is unexpected"));
    }
    Ok(Request {
        execute,
        arguments,
        id,
    })
}

/// The greeting sent on connect. We are no QEMU: the version is 0.0.0 and the package
/// names us.
pub fn greeting() -> Value {
    json!({"QMP": {
        "version": {
            "qemu": {"micro": 0, "minor": 0, "major": 0},
            "package": concat!("qcow2-nbd ", env!("CARGO_PKG_VERSION")),
        },
        "capabilities": [],
    }})
}

/// The answer to a request: its return value or its error, with its `id` when given.
pub fn reply(result: Result<Value, QmpError>, id: Option<Value>) -> Value {
    let mut out = Map::new();
    match result {
        Ok(ret) => {
            out.insert("return".into(), ret);
        }
        Err(e) => {
            out.insert(
                "error".into(),
                json!({"class": e.class.as_str(), "desc": e.desc}),
            );
        }
    }
    if let Some(id) = id {
        out.insert("id".into(), id);
    }
    Value::Object(out)
}

/// An event, stamped with the time now.
pub fn event(name: &str, data: Value) -> Value {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    json!({
        "event": name,
        "data": data,
        "timestamp": {"seconds": now.as_secs(), "microseconds": now.subsec_micros()},
    })
}

/// A message as one line of text.
pub fn line(message: &Value) -> Vec<u8> {
    let mut out = message.to_string().into_bytes();
    out.extend_from_slice(b"\r\n");
    out
}

/// What the framer found in the input.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// One complete JSON value.
    Value(Value),
    /// Input that is not JSON: it was skipped up to the end of its line, and reading goes
    /// on after it.
    Bad(String),
    /// A value longer than the limit: it was dropped, and the connection should end.
    TooLarge,
}

/// Splits a byte stream into JSON values, with a bound on the size of one.
#[derive(Debug)]
pub struct Framer {
    buf: Vec<u8>,
    limit: usize,
    /// After bad input: dropping bytes up to the next newline.
    skipping: bool,
}

impl Framer {
    /// A framer refusing values longer than `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self {
            buf: Vec::new(),
            limit,
            skipping: false,
        }
    }

    /// The most bytes one value may take.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Appends input.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next frame, or `None` until more input arrives.
    pub fn next_frame(&mut self) -> Option<Frame> {
        if self.skipping && !self.skip_line() {
            return None;
        }
        let start = self.buf.iter().position(|b| !b.is_ascii_whitespace());
        self.buf.drain(..start.unwrap_or(self.buf.len()));
        if self.buf.is_empty() {
            return None;
        }
        let mut values = serde_json::Deserializer::from_slice(&self.buf).into_iter::<Value>();
        match values.next() {
            Some(Ok(v)) => {
                let used = values.byte_offset();
                self.buf.drain(..used);
                Some(Frame::Value(v))
            }
            Some(Err(e)) if e.is_eof() => self.too_large(),
            Some(Err(e)) => {
                self.skipping = true;
                Some(Frame::Bad(format!("JSON parse error, {e}")))
            }
            None => None,
        }
    }

    /// An incomplete value over the limit: dropped, like the rest of its line (whoever
    /// reads from us normally closes the stream then).
    fn too_large(&mut self) -> Option<Frame> {
        if self.buf.len() <= self.limit {
            return None;
        }
        self.buf.clear();
        self.skipping = true;
        Some(Frame::TooLarge)
    }

    /// Drops input up to and including the next newline: true once one was found.
    fn skip_line(&mut self) -> bool {
        match self.buf.iter().position(|&b| b == b'\n') {
            Some(at) => {
                self.buf.drain(..=at);
                self.skipping = false;
                true
            }
            None => {
                self.buf.clear();
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(input: &[&[u8]], limit: usize) -> Vec<Frame> {
        let mut f = Framer::new(limit);
        let mut out = Vec::new();
        for chunk in input {
            f.push(chunk);
            while let Some(frame) = f.next_frame() {
                out.push(frame);
            }
        }
        out
    }

    #[test]
    fn objects_back_to_back_split_anywhere() {
        let got = frames(&[b"{\"a\":1}{\"b\"", b":2}\n  {\"c\":", b"3}"], 1024);
        assert_eq!(
            got,
            [
                Frame::Value(json!({"a": 1})),
                Frame::Value(json!({"b": 2})),
                Frame::Value(json!({"c": 3})),
            ]
        );
    }

    #[test]
    fn bad_input_is_skipped_to_the_end_of_its_line() {
        let got = frames(&[b"{\"a\" oops}", b" more junk\n{\"ok\":true}\n"], 1024);
        assert!(matches!(got[0], Frame::Bad(_)), "{got:?}");
        assert_eq!(got[1..], [Frame::Value(json!({"ok": true}))]);
    }

    #[test]
    fn a_value_over_the_limit_is_too_large() {
        let long = format!("{{\"a\":\"{}", "x".repeat(100));
        assert_eq!(frames(&[long.as_bytes()], 64), [Frame::TooLarge]);
        // A complete value is taken even if the buffer held more than the limit.
        let got = frames(&[b"{\"a\":1}"], 4);
        assert_eq!(got, [Frame::Value(json!({"a": 1}))]);
    }

    #[test]
    fn requests_are_checked_like_qemu() {
        let r = parse_request(json!({"execute": "x", "arguments": {"a": 1}, "id": 7})).unwrap();
        assert_eq!(
            (r.execute.as_str(), r.id, r.arguments["a"].clone()),
            ("x", Some(json!(7)), json!(1))
        );
        for (input, desc, id) in [
            (json!([1]), "QMP input must be a JSON object", None),
            (
                json!({"id": "i"}),
                "QMP input lacks member 'execute'",
                Some(json!("i")),
            ),
            (
                json!({"execute": 1}),
                "QMP input member 'execute' must be a string",
                None,
            ),
            (
                json!({"execute": "x", "arguments": []}),
                "QMP input member 'arguments' must be an object",
                None,
            ),
            (
                json!({"execute": "x", "extra": 1}),
                "QMP input member 'extra' is unexpected",
                None,
            ),
        ] {
            let (e, got_id) = parse_request(input.clone()).unwrap_err();
            assert_eq!((e.desc.as_str(), got_id), (desc, id), "{input}");
            assert_eq!(e.class, ErrorClass::GenericError);
        }
    }

    #[test]
    fn replies_echo_the_id_and_events_carry_a_timestamp() {
        assert_eq!(
            reply(Ok(json!({})), Some(json!("a"))),
            json!({"return": {}, "id": "a"})
        );
        assert_eq!(
            reply(Err(QmpError::new(ErrorClass::DeviceNotFound, "no")), None),
            json!({"error": {"class": "DeviceNotFound", "desc": "no"}})
        );
        let e = event("BLOCK_EXPORT_DELETED", json!({"id": "d"}));
        assert_eq!(e["data"]["id"], "d");
        assert!(e["timestamp"]["seconds"].as_u64().unwrap() > 0);
        assert!(e["timestamp"]["microseconds"].as_u64().unwrap() < 1_000_000);
        assert!(greeting()["QMP"]["version"]["package"]
            .as_str()
            .unwrap()
            .starts_with("qcow2-nbd "));
    }
}
