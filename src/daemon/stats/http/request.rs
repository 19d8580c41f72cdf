//! The request head of the `--metrics` endpoint, from untrusted bytes: where it ends and
//! what it asks for. Pure, so it is unit-tested and fuzzed on its own.

/// What a request asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    /// `GET /metrics` (`head`: HEAD, no body).
    Metrics { head: bool },
    /// Another path.
    NotFound,
    /// Another method.
    BadMethod,
    /// Not an HTTP request line.
    Malformed,
}

/// Finds the blank line that ends a request head, looking at each byte once however the
/// head arrives.
#[derive(Debug, Default)]
pub struct HeadEnd {
    /// Bytes already looked at.
    seen: usize,
    /// Newlines in a row so far, a `\r` before a `\n` not breaking the row.
    newlines: u8,
}

impl HeadEnd {
    /// Looks at what `head` holds beyond what was seen before: true once a line is empty.
    pub fn scan(&mut self, head: &[u8]) -> bool {
        for &b in head.get(self.seen..).unwrap_or_default() {
            self.seen += 1;
            match b {
                b'\n' => self.newlines += 1,
                b'\r' => {}
                _ => self.newlines = 0,
            }
            if self.newlines >= 2 {
                return true;
            }
        }
        false
    }
}

/// The request line's method and path decide.
pub fn parse(head: &[u8]) -> Request {
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let Ok(line) = std::str::from_utf8(line) else {
        return Request::Malformed;
    };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Request::Malformed;
    };
    if !version.starts_with("HTTP/1.") {
        return Request::Malformed;
    }
    let path = target.split('?').next().unwrap_or_default();
    match method {
        "GET" | "HEAD" if path == "/metrics" => Request::Metrics {
            head: method == "HEAD",
        },
        "GET" | "HEAD" => Request::NotFound,
        _ => Request::BadMethod,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_line_decides() {
        let p = |s: &str| parse(s.as_bytes());
        assert_eq!(
            p("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Request::Metrics { head: false }
        );
        assert_eq!(
            p("GET /metrics?x=1 HTTP/1.0\r\n\r\n"),
            Request::Metrics { head: false }
        );
        assert_eq!(
            p("HEAD /metrics HTTP/1.1\r\n\r\n"),
            Request::Metrics { head: true }
        );
        assert_eq!(p("GET / HTTP/1.1\r\n\r\n"), Request::NotFound);
        assert_eq!(p("GET /metricsx HTTP/1.1\r\n\r\n"), Request::NotFound);
        assert_eq!(p("POST /metrics HTTP/1.1\r\n\r\n"), Request::BadMethod);
        assert_eq!(p("DELETE / HTTP/1.1\r\n\r\n"), Request::BadMethod);
        assert_eq!(p(""), Request::Malformed);
        assert_eq!(p("\r\n\r\n"), Request::Malformed);
        assert_eq!(p("GET /metrics\r\n\r\n"), Request::Malformed);
        assert_eq!(p("GET /metrics SPDY/3\r\n\r\n"), Request::Malformed);
        assert_eq!(p("GET  /metrics HTTP/1.1\r\n\r\n"), Request::Malformed);
        assert_eq!(parse(b"GET /\xff HTTP/1.1\r\n\r\n"), Request::Malformed);
    }

    #[test]
    fn the_head_ends_at_the_first_empty_line_however_it_arrives() {
        let ends = |chunks: &[&[u8]]| {
            let (mut end, mut head) = (HeadEnd::default(), Vec::new());
            chunks.iter().any(|c| {
                head.extend_from_slice(c);
                end.scan(&head)
            })
        };
        for head in [
            &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
            b"GET / HTTP/1.0\n\n",
        ] {
            assert!(ends(&[head]));
            assert!(ends(&head.chunks(1).collect::<Vec<_>>()));
            assert!(!ends(&[&head[..head.len() - 1]]), "{head:?}");
        }
        assert!(!ends(&[b"GET / HTTP/1.1\r\nA: \r\n", b"B\r", b"\n"]));
    }
}
