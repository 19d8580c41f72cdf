//! `qcow2-nbd ctl --socket PATH COMMAND [KEY=VALUE ...]`: one command on a `serve
//! --control` socket (or any QMP socket): the greeting, capabilities negotiation, the
//! command, and its return value printed as JSON.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::{json, Map, Value};

use crate::daemon::serve::qmp::{Frame, Framer};

/// Largest message `ctl` reads from the server.
const MAX_MESSAGE: usize = 16 << 20;

/// How `KEY=VALUE` arguments become JSON, shown after `ctl --help`.
const CONVERSIONS: &str = "\
Arguments: KEY=VALUE, where `true` and `false` are booleans, `granularity` takes a number,
`bitmaps` a comma-separated list of names (`bitmaps=a,b`; `bitmaps=` for none), and every
other value is a string; KEY:=JSON gives any JSON value as is (`id:=7`, `bitmaps:=[\"a,b\"]`);
--json '{...}' gives all arguments as one object.

Examples:
  qcow2-nbd ctl --socket ctl.sock block-export-add id=data file=data.qcow2 writable=true
  qcow2-nbd ctl --socket ctl.sock --wait block-export-del id=data mode=safe
  qcow2-nbd ctl --socket ctl.sock query-block-exports";

/// Send one command to a running server's control socket (`serve --control`).
#[derive(Args, Debug)]
#[command(after_help = CONVERSIONS)]
pub struct CtlArgs {
    /// The control socket.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// Give up after SECS seconds (connecting, the command, and `--wait`).
    #[arg(long, value_name = "SECS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    timeout: u64,
    /// After `block-export-del`, wait until the export is gone (its
    /// `BLOCK_EXPORT_DELETED` event).
    #[arg(long)]
    wait: bool,
    /// The arguments as one JSON object.
    #[arg(long, value_name = "OBJECT", conflicts_with = "args")]
    json: Option<String>,
    /// The command (e.g. query-block-exports, block-export-add, block-export-del).
    command: String,
    /// KEY=VALUE or KEY:=JSON arguments.
    args: Vec<String>,
}

/// Why `ctl` failed.
#[derive(Debug, thiserror::Error)]
enum CtlError {
    #[error("{0}")]
    Args(String),
    #[error("{}: {source}", socket.display())]
    Io {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error("no answer within {0} s")]
    Timeout(u64),
    #[error("the server closed the connection")]
    Closed,
    #[error("the server sent something that is not QMP: {0}")]
    Protocol(String),
    /// The command failed: its description.
    #[error("{0}")]
    Command(String),
}

/// Runs `ctl`: exit 0 with the return value on stdout, or 1 with the error on stderr.
pub fn main(args: &CtlArgs) -> ExitCode {
    match run(args) {
        Ok(ret) => {
            let text = serde_json::to_string_pretty(&ret).unwrap_or_default();
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}: {e}", crate::common::prog::name());
            ExitCode::FAILURE
        }
    }
}

fn run(args: &CtlArgs) -> Result<Value, CtlError> {
    let arguments = match &args.json {
        Some(text) => match serde_json::from_str(text) {
            Ok(Value::Object(m)) => m,
            _ => return Err(CtlError::Args("--json must be a JSON object".into())),
        },
        None => parse_arguments(&args.args)?,
    };
    let mut session = Session::connect(args)?;
    session.expect_greeting()?;
    session.execute("qmp_capabilities", Map::new())?;
    let ret = session.execute(&args.command, arguments.clone())?;
    if args.wait && args.command == "block-export-del" {
        let id = arguments.get("id").cloned().unwrap_or(Value::Null);
        session.wait_deleted(&id)?;
    }
    Ok(ret)
}

/// The arguments given as KEY=VALUE and KEY:=JSON.
fn parse_arguments(args: &[String]) -> Result<Map<String, Value>, CtlError> {
    let mut out = Map::new();
    for arg in args {
        let (key, value) = parse_argument(arg)?;
        if out.insert(key.clone(), value).is_some() {
            return Err(CtlError::Args(format!("argument {key:?} is given twice")));
        }
    }
    Ok(out)
}

fn parse_argument(arg: &str) -> Result<(String, Value), CtlError> {
    let Some((key, value)) = arg.split_once('=') else {
        return Err(CtlError::Args(format!("{arg:?} is not KEY=VALUE")));
    };
    if let Some(key) = key.strip_suffix(':') {
        let value = serde_json::from_str(value)
            .map_err(|e| CtlError::Args(format!("{key}:= takes JSON: {e}")))?;
        return Ok((key.to_owned(), value));
    }
    if key.is_empty() {
        return Err(CtlError::Args(format!("{arg:?} has no key")));
    }
    let value = match (key, value) {
        (_, "true") => json!(true),
        (_, "false") => json!(false),
        ("granularity", v) => v
            .parse::<u64>()
            .map(Value::from)
            .map_err(|_| CtlError::Args(format!("granularity={v:?} is not a number")))?,
        ("bitmaps", "") => json!([]),
        ("bitmaps", v) => json!(v.split(',').collect::<Vec<_>>()),
        (_, v) => json!(v),
    };
    Ok((key.to_owned(), value))
}

/// A connection to a QMP socket with a deadline for everything.
struct Session {
    stream: UnixStream,
    framer: Framer,
    deadline: Instant,
    timeout: u64,
    socket: PathBuf,
    next_id: u64,
}

impl Session {
    fn connect(args: &CtlArgs) -> Result<Session, CtlError> {
        let io = |source| CtlError::Io {
            socket: args.socket.clone(),
            source,
        };
        let stream = UnixStream::connect(&args.socket).map_err(io)?;
        Ok(Session {
            stream,
            framer: Framer::new(MAX_MESSAGE),
            deadline: Instant::now() + Duration::from_secs(args.timeout),
            timeout: args.timeout,
            socket: args.socket.clone(),
            next_id: 0,
        })
    }

    fn io(&self, source: std::io::Error) -> CtlError {
        if matches!(
            source.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            return CtlError::Timeout(self.timeout);
        }
        CtlError::Io {
            socket: self.socket.clone(),
            source,
        }
    }

    /// The next message, within the deadline.
    fn receive(&mut self) -> Result<Map<String, Value>, CtlError> {
        let mut chunk = [0u8; 8192];
        loop {
            match self.framer.next_frame() {
                Some(Frame::Value(Value::Object(m))) => return Ok(m),
                Some(Frame::Value(v)) => return Err(CtlError::Protocol(v.to_string())),
                Some(Frame::Bad(e)) => return Err(CtlError::Protocol(e)),
                Some(Frame::TooLarge) => {
                    return Err(CtlError::Protocol("a message too long".into()))
                }
                None => {}
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CtlError::Timeout(self.timeout));
            }
            self.stream
                .set_read_timeout(Some(left))
                .map_err(|e| self.io(e))?;
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(CtlError::Closed),
                Ok(n) => self.framer.push(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io(e)),
            }
        }
    }

    fn expect_greeting(&mut self) -> Result<(), CtlError> {
        let greeting = self.receive()?;
        if greeting.contains_key("QMP") {
            return Ok(());
        }
        Err(match error_desc(&greeting) {
            Some(desc) => CtlError::Command(desc),
            None => CtlError::Protocol(Value::Object(greeting).to_string()),
        })
    }

    /// Sends a command and waits for its answer (events meanwhile are skipped).
    fn execute(&mut self, command: &str, arguments: Map<String, Value>) -> Result<Value, CtlError> {
        self.next_id += 1;
        let id = json!(format!("ctl-{}", self.next_id));
        let request = json!({"execute": command, "arguments": arguments, "id": id});
        let left = self.deadline.saturating_duration_since(Instant::now());
        self.stream
            .set_write_timeout(Some(left.max(Duration::from_millis(1))))
            .map_err(|e| self.io(e))?;
        let mut text = request.to_string().into_bytes();
        text.push(b'\n');
        self.stream.write_all(&text).map_err(|e| self.io(e))?;
        loop {
            let mut answer = self.receive()?;
            if answer.contains_key("event") || answer.get("id").is_some_and(|i| i != &id) {
                continue;
            }
            if let Some(desc) = error_desc(&answer) {
                return Err(CtlError::Command(desc));
            }
            return answer
                .remove("return")
                .ok_or_else(|| CtlError::Protocol(Value::Object(answer).to_string()));
        }
    }

    /// Waits for `BLOCK_EXPORT_DELETED` of export `id`.
    fn wait_deleted(&mut self, id: &Value) -> Result<(), CtlError> {
        loop {
            let message = self.receive()?;
            if message.get("event").and_then(Value::as_str) == Some("BLOCK_EXPORT_DELETED")
                && message.get("data").and_then(|d| d.get("id")) == Some(id)
            {
                return Ok(());
            }
        }
    }
}

fn error_desc(message: &Map<String, Value>) -> Option<String> {
    let error = message.get("error")?;
    let desc = error.get("desc").and_then(Value::as_str).unwrap_or("error");
    Some(desc.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_follow_the_documented_rules() {
        let args: Vec<String> = [
            "id=7",
            "writable=true",
            "granularity=65536",
            "bitmaps=a,b",
            "description=x=y",
            "n:=[1]",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let got = parse_arguments(&args).unwrap();
        assert_eq!(
            Value::Object(got),
            json!({"id": "7", "writable": true, "granularity": 65536,
                   "bitmaps": ["a", "b"], "description": "x=y", "n": [1]})
        );
        for bad in ["noequals", "=v", "granularity=big", "k:=nojson"] {
            assert!(parse_argument(bad).is_err(), "{bad}");
        }
        let twice = ["a=1".to_string(), "a=2".to_string()];
        assert!(parse_arguments(&twice).is_err());
    }
}
