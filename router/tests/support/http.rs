//! Raw HTTP/1.1 over loopback, for the suites that check status lines, headers and exact body
//! bytes: a request is written by hand, the answer read to the end (or incrementally for a
//! stream) and its chunked body reassembled. Every read has a deadline, so a server that hangs
//! fails the test instead of stalling it.

#![allow(dead_code)] // each test crate includes this module; not all use every helper

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use strata_router::state::AppState;
use strata_router::{Access, serve_on_with};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long any one answer may take before the server is declared hung.
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(30);

/// Serves `state` behind `access` on an ephemeral loopback port until the runtime ends.
pub async fn serve(state: AppState, access: Access) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        async move { serve_on_with(listener, state, &access, std::future::pending()).await },
    );
    addr
}

/// A whole answer: status, the head as text, the body with any chunked framing removed.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.head, name)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON, or `None` when it is not JSON.
    pub fn try_json(&self) -> Option<Value> {
        serde_json::from_slice(&self.body).ok()
    }

    pub fn json(&self) -> Value {
        self.try_json()
            .unwrap_or_else(|| panic!("not JSON:\n{}\n\n{}", self.head, self.text()))
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        sse_data(&self.text())
    }

    /// Status line, headers and body, for failure messages.
    pub fn describe(&self) -> String {
        let mut body = self.text();
        if body.len() > 600 {
            let cut = (0..=600)
                .rev()
                .find(|&i| body.is_char_boundary(i))
                .unwrap_or(0);
            body.truncate(cut);
            body.push('…');
        }
        format!("{}\n\n{body}", self.head)
    }
}

pub fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().skip(1).find_map(|line| {
        let (k, v) = line.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// A request with `Connection: close`, a JSON content type and an exact `Content-Length`.
pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// One request on a fresh connection, read to the end.
pub async fn send(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Answer {
    send_raw(addr, &request_bytes(method, path, &[], body))
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// POSTs a JSON value.
pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> Answer {
    send(addr, "POST", path, body.to_string().as_bytes()).await
}

/// Writes `raw` (the whole request, as bytes) and reads the answer to the end. A write the
/// server cut short (it answered before reading everything) is not an error: its answer is.
pub async fn send_raw(addr: SocketAddr, raw: &[u8]) -> Result<Answer, String> {
    let mut conn = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = conn.write_all(raw).await;
    read_answer(&mut conn, ANSWER_DEADLINE).await
}

/// Reads what the server sends until it closes, within `deadline`; parses it as an answer.
pub async fn read_answer(conn: &mut TcpStream, deadline: Duration) -> Result<Answer, String> {
    let mut raw = Vec::new();
    let read = tokio::time::timeout(deadline, async {
        let mut buf = [0u8; 16 << 10];
        loop {
            match conn.read(&mut buf).await {
                Ok(0) => return Ok(()),
                Ok(n) => raw.extend_from_slice(&buf[..n]),
                // A reset after the answer (the server closed with our bytes unread) keeps it.
                Err(e) if !raw.is_empty() => {
                    let _ = e;
                    return Ok(());
                }
                Err(e) => return Err(format!("read: {e}")),
            }
        }
    })
    .await;
    match read {
        Err(_) => Err(format!(
            "no complete answer within {deadline:?} (received {} bytes: {:?})",
            raw.len(),
            String::from_utf8_lossy(&raw)
        )),
        Ok(Err(e)) => Err(e),
        Ok(Ok(())) => parse_answer(&raw),
    }
}

/// Status, head and (de-chunked) body of a complete raw answer.
pub fn parse_answer(raw: &[u8]) -> Result<Answer, String> {
    let split = find(raw, b"\r\n\r\n")
        .ok_or_else(|| format!("not an HTTP answer: {:?}", String::from_utf8_lossy(raw)))?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status in {head:?}"))?;
    let body = &raw[split + 4..];
    let chunked = header(&head, "transfer-encoding").is_some_and(|v| v.contains("chunked"));
    let body = if chunked {
        dechunk(body).0
    } else {
        body.to_vec()
    };
    Ok(Answer { status, head, body })
}

/// The payload of the complete chunks at the front of a chunked body, and whether the
/// terminating zero-length chunk was among them.
pub fn dechunk(mut body: &[u8]) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    loop {
        let Some(line_end) = find(body, b"\r\n") else {
            return (out, false);
        };
        let size_text = String::from_utf8_lossy(&body[..line_end]);
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let Ok(size) = usize::from_str_radix(size_text, 16) else {
            return (out, false);
        };
        if size == 0 {
            return (out, true);
        }
        let start = line_end + 2;
        if body.len() < start + size + 2 {
            return (out, false);
        }
        out.extend_from_slice(&body[start..start + size]);
        body = &body[start + size + 2..];
    }
}

/// The `data:` payloads of an SSE text, in order.
pub fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

pub fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}
