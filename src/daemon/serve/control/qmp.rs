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
///
/// Input is scanned once, byte by byte, as it arrives (string and escape state, bracket
/// depth), and a value is handed to the JSON parser only when it is complete, so a client
/// trickling a command costs time linear in its length. Like QEMU's lexer, a byte that
/// cannot appear outside a string is an error at once; a badly structured value is one
/// when it is complete.
#[derive(Debug)]
pub struct Framer {
    buf: Vec<u8>,
    limit: usize,
    /// After bad input: dropping bytes up to the next newline.
    skipping: bool,
    scan: Scan,
}

/// How far the value at the start of the buffer has been scanned.
#[derive(Debug, Default, Clone, Copy)]
struct Scan {
    /// Bytes of the buffer already scanned.
    pos: usize,
    /// Open brackets and braces outside strings.
    depth: usize,
    in_string: bool,
    escape: bool,
    /// A number or keyword at depth 0 has begun: it ends at the next delimiter.
    in_scalar: bool,
}

/// What one scanned byte means for the value being scanned.
enum Step {
    More,
    /// The value ends before this byte.
    EndsBefore,
    /// The value ends with this byte.
    EndsWith,
    /// This byte cannot be here.
    Invalid,
}

impl Scan {
    fn step(&mut self, b: u8) -> Step {
        if self.in_string {
            match (self.escape, b) {
                (true, _) => self.escape = false,
                (false, b'\\') => self.escape = true,
                (false, b'"') => {
                    self.in_string = false;
                    if self.depth == 0 {
                        return Step::EndsWith;
                    }
                }
                _ => {}
            }
            return Step::More;
        }
        let top = self.depth == 0;
        match b {
            b'"' | b'{' | b'[' | b',' | b':' | b'}' | b']' if top && self.in_scalar => {
                Step::EndsBefore
            }
            _ if b.is_ascii_whitespace() => match top && self.in_scalar {
                true => Step::EndsBefore,
                false => Step::More,
            },
            b'"' => {
                self.in_string = true;
                Step::More
            }
            b'{' | b'[' => {
                self.depth += 1;
                Step::More
            }
            b'}' | b']' if top => Step::Invalid,
            b'}' | b']' => {
                self.depth -= 1;
                match self.depth {
                    0 => Step::EndsWith,
                    _ => Step::More,
                }
            }
            b',' | b':' if top => Step::Invalid,
            b',' | b':' => Step::More,
            b'0'..=b'9'
            | b'-'
            | b'+'
            | b'.'
            | b'e'
            | b'E'
            | b'a'
            | b'f'
            | b'l'
            | b'n'
            | b'r'
            | b's'
            | b't'
            | b'u' => {
                self.in_scalar |= top;
                Step::More
            }
            _ => Step::Invalid,
        }
    }
}

impl Framer {
    /// A framer refusing values longer than `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self {
            buf: Vec::new(),
            limit,
            skipping: false,
            scan: Scan::default(),
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
        if self.scan.pos == 0 {
            let start = self.buf.iter().position(|b| !b.is_ascii_whitespace());
            self.buf.drain(..start.unwrap_or(self.buf.len()));
        }
        while self.scan.pos < self.buf.len() {
            let at = self.scan.pos;
            self.scan.pos += 1;
            match self.scan.step(self.buf[at]) {
                Step::More => {}
                Step::EndsBefore => return Some(self.take(at)),
                Step::EndsWith => return Some(self.take(at + 1)),
                Step::Invalid => return Some(self.bad_byte(at)),
            }
        }
        self.too_large()
    }

    /// The complete value in the first `end` bytes, parsed.
    fn take(&mut self, end: usize) -> Frame {
        self.scan = Scan::default();
        match serde_json::from_slice(&self.buf[..end]) {
            Ok(v) => {
                self.buf.drain(..end);
                Frame::Value(v)
            }
            Err(e) => self.bad(e.to_string()),
        }
    }

    /// A byte that no JSON value can hold where it is.
    fn bad_byte(&mut self, at: usize) -> Frame {
        self.scan = Scan::default();
        let byte = self.buf[at];
        let what = match byte {
            b' '..=b'~' => format!("'{}'", byte as char),
            _ => format!("byte 0x{byte:02x}"),
        };
        self.bad(format!("unexpected {what} at offset {at} of the command"))
    }

    fn bad(&mut self, why: String) -> Frame {
        self.skipping = true;
        Frame::Bad(format!("JSON parse error, {why}"))
    }

    /// An incomplete value over the limit: dropped, like the rest of its line (whoever
    /// reads from us normally closes the stream then).
    fn too_large(&mut self) -> Option<Frame> {
        if self.buf.len() <= self.limit {
            return None;
        }
        self.buf.clear();
        self.scan = Scan::default();
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

/// The `BLOCK_EXPORT_DELETED` event for export `id`, as text.
pub fn deleted_event(id: &str) -> String {
    let event = event("BLOCK_EXPORT_DELETED", json!({ "id": id }));
    String::from_utf8_lossy(&line(&event)).into_owned()
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
    fn strings_may_hold_brackets_and_escaped_quotes() {
        let input = br#"{"a":"}]{[\"\\"} ["x",{"b":[]}] "s\"" 12 true null"#;
        let got = frames(&[&input[..], b"\n"], 1024);
        assert_eq!(
            got,
            [
                Frame::Value(json!({"a": "}]{[\"\\"})),
                Frame::Value(json!(["x", {"b": []}])),
                Frame::Value(json!("s\"")),
                Frame::Value(json!(12)),
                Frame::Value(json!(true)),
                Frame::Value(json!(null)),
            ]
        );
    }

    #[test]
    fn a_byte_at_a_time_frames_like_all_at_once() {
        let input: &[u8] = b"{\"execute\":\"x\",\"arguments\":{\"k\":[1,2,{\"s\":\"}\\\"\"}]}}\n\
            {\"a\" 1}\n{\"ok\":1} [1] oops\n\"t\" ";
        let whole = frames(&[input], 1024);
        let bytes: Vec<&[u8]> = input.chunks(1).collect();
        assert_eq!(frames(&bytes, 1024), whole);
        assert_eq!(whole.len(), 6, "{whole:?}");
        assert!(matches!(whole[1], Frame::Bad(_)) && matches!(whole[4], Frame::Bad(_)));
        assert_eq!(whole[5], Frame::Value(json!("t")));
    }

    #[test]
    fn a_stray_byte_is_an_error_before_the_value_ends() {
        // Nothing closes the object, but no JSON can continue this way.
        let got = frames(&[b"{\"a\": x"], 1024);
        assert_eq!(got.len(), 1);
        let Frame::Bad(desc) = &got[0] else {
            panic!("{got:?}")
        };
        assert!(desc.contains("'x' at offset 6"), "{desc}");
        for stray in [&b"}"[..], b"]", b",", b":", b"\x01", b"\xff"] {
            let got = frames(&[stray, b"\n{}"], 1024);
            assert!(matches!(got[0], Frame::Bad(_)), "{stray:?}: {got:?}");
            assert_eq!(got[1..], [Frame::Value(json!({}))], "{stray:?}");
        }
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
