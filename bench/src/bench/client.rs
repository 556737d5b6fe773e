//! The HTTP/1.1 client of the benchmark: streamed `/v1/completions` requests, timed from the
//! client's side, over kept-alive or fresh connections.
//!
//! With `reuse`, connections go back to an idle pool after a response has been read to its end
//! and the next request takes one from there (what OpenAI SDKs do); with `fresh`, every request
//! connects anew, so its TTFT includes the TCP handshake. A request's clock starts before it
//! takes or opens its connection, so the connection cost is in the numbers either way. Sockets
//! set TCP_NODELAY: small SSE chunks must not wait for Nagle's algorithm.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::{SendRequest, handshake};
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST, HeaderValue};
use hyper::{Method, Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::endpoint::Endpoint;
use super::sse::SseDecoder;
use super::stream::{Completion, StreamError, StreamRecord, clip};
use super::workload::Prompt;

/// How requests get their connection (`--connection`).
#[derive(Clone, Copy, Debug, PartialEq, clap::ValueEnum)]
pub enum ConnectionMode {
    /// One kept-alive HTTP/1.1 connection per in-flight request, reused.
    Reuse,
    /// A new TCP connection for every request.
    Fresh,
}

impl ConnectionMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Reuse => "reuse",
            Self::Fresh => "fresh",
        }
    }
}

/// Why one request failed; counted in the report, never fatal to the run. The report groups
/// failures by their one-line message, so each variant's message carries its cause's text
/// rather than pointing to it as a `source`.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("HTTP: {0}")]
    Http(hyper::Error),
    #[error("building the request: {0}")]
    Build(hyper::http::Error),
    #[error("HTTP {status}: {body}")]
    Status { status: u16, body: String },
    #[error(transparent)]
    Stream(#[from] StreamError),
    #[error("no complete response within {0:?}")]
    Timeout(Duration),
    #[error("GET /v1/models named no model: {0}")]
    NoModel(String),
}

impl From<hyper::Error> for RequestError {
    fn from(e: hyper::Error) -> Self {
        Self::Http(e)
    }
}

impl From<hyper::http::Error> for RequestError {
    fn from(e: hyper::http::Error) -> Self {
        Self::Build(e)
    }
}

/// One request as the client saw it.
pub struct RequestOutcome {
    pub sent: Instant,
    pub finished: Instant,
    pub result: Result<Completion, RequestError>,
}

type Sender = SendRequest<Full<Bytes>>;

/// The JSON of one streamed completion for `prompt`: at `(temperature, top_p)`, exactly
/// `output_len` tokens (`ignore_eos` and `min_tokens`, which vLLM and strata honour and others
/// ignore), with the usage chunk at the end.
pub fn completion_body(model: &str, prompt: &Prompt, (temperature, top_p): (f32, f32)) -> Bytes {
    let body = serde_json::json!({
        "model": model,
        "prompt": prompt.tokens,
        "max_tokens": prompt.output_len,
        "min_tokens": prompt.output_len,
        "ignore_eos": true,
        "temperature": temperature,
        "top_p": top_p,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    Bytes::from(body.to_string())
}

pub struct Client {
    endpoint: Endpoint,
    auth: Option<HeaderValue>,
    mode: ConnectionMode,
    timeout: Duration,
    idle: Mutex<Vec<Sender>>,
}

impl Client {
    pub fn new(
        endpoint: Endpoint,
        api_key: Option<&str>,
        mode: ConnectionMode,
        timeout: Duration,
    ) -> Result<Self, RequestError> {
        let auth = api_key
            .map(|key| HeaderValue::try_from(format!("Bearer {key}")))
            .transpose()
            .map_err(hyper::http::Error::from)?;
        Ok(Self {
            endpoint,
            auth,
            mode,
            timeout,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// The first model id `GET /v1/models` lists.
    pub async fn first_model(&self) -> Result<String, RequestError> {
        let request = self
            .request(Method::GET, "/v1/models")
            .body(Full::new(Bytes::new()))?;
        let response = tokio::time::timeout(self.timeout, async {
            let mut sender = self.connect().await?;
            Ok::<_, RequestError>(sender.send_request(request).await?)
        })
        .await
        .map_err(|_| RequestError::Timeout(self.timeout))??;
        let body = read_body(response).await?;
        let listing: serde_json::Value =
            serde_json::from_str(&body).map_err(|_| RequestError::NoModel(clip(&body)))?;
        listing["data"][0]["id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| RequestError::NoModel(clip(&body)))
    }

    /// The server's `GET /metrics` text, or `None` where it has none (not strata, or refused).
    pub async fn metrics(&self) -> Option<String> {
        let request = self
            .request(Method::GET, "/metrics")
            .body(Full::new(Bytes::new()))
            .ok()?;
        let response = tokio::time::timeout(self.timeout, async {
            let mut sender = self.connect().await?;
            Ok::<_, RequestError>(sender.send_request(request).await?)
        })
        .await
        .ok()?
        .ok()?;
        if !response.status().is_success() {
            return None;
        }
        read_body(response).await.ok()
    }

    /// Sends one streamed completion (`body` is its JSON) and reads the stream to its end.
    pub async fn complete(&self, body: Bytes, prompt_len: u64) -> RequestOutcome {
        let sent = Instant::now();
        let result = tokio::time::timeout(self.timeout, self.stream(body, sent, prompt_len))
            .await
            .unwrap_or(Err(RequestError::Timeout(self.timeout)));
        RequestOutcome {
            sent,
            finished: Instant::now(),
            result,
        }
    }

    async fn stream(
        &self,
        body: Bytes,
        sent: Instant,
        prompt_len: u64,
    ) -> Result<Completion, RequestError> {
        let request = self
            .request(Method::POST, "/v1/completions")
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, "text/event-stream")
            .body(Full::new(body))?;
        let mut sender = self.checkout().await?;
        let response = sender.send_request(request).await?;
        if !response.status().is_success() {
            let status = response.status().as_u16();
            let body = read_body(response).await.unwrap_or_default();
            return Err(RequestError::Status {
                status,
                body: clip(body.trim()),
            });
        }
        let mut body = response.into_body();
        let mut decoder = SseDecoder::default();
        let mut record = StreamRecord::default();
        let mut failure = None;
        while let Some(frame) = body.frame().await {
            let frame = frame?;
            let at = Instant::now();
            let Ok(data) = frame.into_data() else {
                continue; // trailers carry no events
            };
            decoder.feed(&data, |event| {
                if failure.is_none() {
                    failure = record.on_event(event, at).err();
                }
            });
            if let Some(error) = failure {
                return Err(error.into());
            }
        }
        let completion = record.finish(sent, Instant::now(), prompt_len)?;
        self.checkin(sender);
        Ok(completion)
    }

    fn request(&self, method: Method, api_path: &str) -> hyper::http::request::Builder {
        let mut builder = Request::builder()
            .method(method)
            .uri(self.endpoint.path(api_path))
            .header(HOST, &self.endpoint.authority);
        if let Some(auth) = &self.auth {
            builder = builder.header(AUTHORIZATION, auth);
        }
        builder
    }

    /// An idle kept-alive connection that is still open, or a new one.
    async fn checkout(&self) -> Result<Sender, RequestError> {
        if self.mode == ConnectionMode::Reuse {
            while let Some(mut sender) = self.pop_idle() {
                // A connection the server closed while idle fails `ready`: drop it, try the next.
                if sender.ready().await.is_ok() {
                    return Ok(sender);
                }
            }
        }
        self.connect().await
    }

    /// Returns a connection whose response was read to the end, so it can carry another.
    fn checkin(&self, sender: Sender) {
        if self.mode == ConnectionMode::Reuse {
            self.lock_idle().push(sender);
        }
    }

    /// Takes one idle connection; the lock is released before the caller awaits anything.
    fn pop_idle(&self) -> Option<Sender> {
        self.lock_idle().pop()
    }

    fn lock_idle(&self) -> std::sync::MutexGuard<'_, Vec<Sender>> {
        // The pool is a plain list: a panic while it was held cannot leave it inconsistent.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn connect(&self) -> Result<Sender, RequestError> {
        let stream = TcpStream::connect((self.endpoint.host.as_str(), self.endpoint.port))
            .await
            .map_err(RequestError::Connect)?;
        stream.set_nodelay(true).map_err(RequestError::Connect)?;
        let (sender, connection) = handshake(TokioIo::new(stream)).await?;
        // The connection's driver; its failures reach the request through `send_request`.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }
}

/// A whole (small) response body as text.
async fn read_body(response: Response<Incoming>) -> Result<String, RequestError> {
    let bytes = response.into_body().collect().await?.to_bytes();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::{SocketAddr, TcpListener};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A blocking HTTP/1.1 server on 127.0.0.1 that answers every request with `status` and the
    /// body written in `pieces` (flushed apart, so they reach the client as separate reads) and
    /// keeps connections alive; counts the connections it accepted.
    fn server(status: &'static str, pieces: Vec<&'static str>) -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                count.fetch_add(1, Ordering::SeqCst);
                let pieces = pieces.clone();
                std::thread::spawn(move || answer(conn, status, &pieces));
            }
        });
        (addr, accepted)
    }

    fn answer(conn: std::net::TcpStream, status: &str, pieces: &[&str]) {
        conn.set_nodelay(true).unwrap();
        let mut reader = BufReader::new(conn.try_clone().unwrap());
        let mut writer = conn;
        loop {
            let mut content_length = 0;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    return; // the client closed the connection
                }
                if line == "\r\n" {
                    break;
                }
                if let Some((name, value)) = line.split_once(':')
                    && name.eq_ignore_ascii_case("content-length")
                {
                    content_length = value.trim().parse().unwrap();
                }
            }
            let mut body = vec![0; content_length];
            reader.read_exact(&mut body).unwrap();
            let len: usize = pieces.iter().map(|p| p.len()).sum();
            let head = format!("HTTP/1.1 {status}\r\nContent-Length: {len}\r\n\r\n");
            writer.write_all(head.as_bytes()).unwrap();
            for piece in pieces {
                writer.write_all(piece.as_bytes()).unwrap();
                writer.flush().unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    /// A stream whose events are cut mid-line across writes.
    const STREAM: [&str; 5] = [
        "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choi",
        "ces\":[{\"text\":\"b\"}]}\n",
        "\ndata: {\"choices\":[{\"text\":\"c\"}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":3}}\n\n",
        "data: [DONE]\n\n",
    ];

    fn client(addr: SocketAddr, mode: ConnectionMode) -> Client {
        let endpoint = format!("http://{addr}").parse().unwrap();
        Client::new(endpoint, Some("sk-test"), mode, Duration::from_secs(10)).unwrap()
    }

    async fn complete_three(client: &Client) -> Vec<Result<Completion, RequestError>> {
        let mut results = Vec::new();
        for _ in 0..3 {
            results.push(client.complete(Bytes::from_static(b"{}"), 4).await.result);
        }
        results
    }

    #[tokio::test]
    async fn reuse_keeps_one_connection_and_fresh_opens_one_per_request() {
        for (mode, connections) in [(ConnectionMode::Reuse, 1), (ConnectionMode::Fresh, 3)] {
            let (addr, accepted) = server("200 OK", STREAM.to_vec());
            let client = client(addr, mode);
            for result in complete_three(&client).await {
                let c = result.unwrap();
                assert_eq!((c.prompt_tokens, c.completion_tokens), (4, 3));
                assert_eq!(c.itls.len(), 2);
                assert!(c.ttft.unwrap() <= c.e2e);
            }
            assert_eq!(accepted.load(Ordering::SeqCst), connections, "{mode:?}");
        }
    }

    #[tokio::test]
    async fn an_error_status_or_a_stream_without_done_is_a_failed_request() {
        let (addr, _) = server("503 Service Unavailable", vec!["{\"error\":\"busy\"}"]);
        let result = client(addr, ConnectionMode::Reuse)
            .complete(Bytes::new(), 1)
            .await
            .result;
        assert!(
            matches!(&result, Err(RequestError::Status { status: 503, body }) if body.contains("busy")),
            "{result:?}"
        );

        let (addr, _) = server("200 OK", STREAM[..4].to_vec());
        let result = client(addr, ConnectionMode::Reuse)
            .complete(Bytes::new(), 1)
            .await
            .result;
        assert!(
            matches!(result, Err(RequestError::Stream(StreamError::NoDone))),
            "{result:?}"
        );
    }

    #[tokio::test]
    async fn nothing_listening_is_a_connect_error() {
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let result = client(addr, ConnectionMode::Fresh)
            .complete(Bytes::new(), 1)
            .await
            .result;
        assert!(
            matches!(result, Err(RequestError::Connect(_))),
            "{result:?}"
        );
    }
}
