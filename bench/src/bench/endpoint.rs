//! The server a benchmark talks to, parsed from `--url`: host, port and a base path.
//!
//! Only plain `http://` is accepted: the client has no TLS, and a benchmark that silently fell
//! back to another scheme would measure a different server path than the one asked for.

use std::fmt;
use std::str::FromStr;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EndpointError {
    #[error(
        "https is not supported: `strata bench serve` speaks plain http only (no TLS); \
         benchmark the server's http port, or a TLS-terminating proxy's plain side"
    )]
    Https,
    #[error("the URL must start with http:// (got `{0}`)")]
    Scheme(String),
    #[error("the URL has no host")]
    NoHost,
    #[error("bad port `{0}`")]
    Port(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Endpoint {
    /// What `connect` resolves: a name, an IPv4 address or an IPv6 address without brackets.
    pub host: String,
    pub port: u16,
    /// The `Host` header: the URL's authority as written.
    pub authority: String,
    /// Prefix of every request path, without a trailing `/` (empty for a server at the root).
    base_path: String,
}

impl Endpoint {
    /// The request path (origin form) for an API path such as `/v1/completions`.
    pub fn path(&self, api_path: &str) -> String {
        format!("{}{api_path}", self.base_path)
    }
}

impl FromStr for Endpoint {
    type Err = EndpointError;

    fn from_str(url: &str) -> Result<Self, EndpointError> {
        let lower = url.to_ascii_lowercase();
        if lower.starts_with("https://") {
            return Err(EndpointError::Https);
        }
        if !lower.starts_with("http://") {
            return Err(EndpointError::Scheme(url.to_string()));
        }
        let rest = &url["http://".len()..];
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let (host, port) = split_host_port(authority)?;
        if host.is_empty() {
            return Err(EndpointError::NoHost);
        }
        // OpenAI SDK base URLs end in `/v1`; the API paths here carry it themselves.
        let path = path.trim_end_matches('/');
        let base_path = path.strip_suffix("/v1").unwrap_or(path).to_string();
        Ok(Self {
            host: host.to_string(),
            port,
            authority: authority.to_string(),
            base_path,
        })
    }
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`; port 80 when absent.
fn split_host_port(authority: &str) -> Result<(&str, u16), EndpointError> {
    let parse_port = |p: &str| p.parse().map_err(|_| EndpointError::Port(p.to_string()));
    if let Some(bracketed) = authority.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']').ok_or(EndpointError::NoHost)?;
        return match after.strip_prefix(':') {
            Some(port) => Ok((host, parse_port(port)?)),
            None if after.is_empty() => Ok((host, 80)),
            None => Err(EndpointError::Port(after.to_string())),
        };
    }
    match authority.rsplit_once(':') {
        Some((host, port)) => Ok((host, parse_port(port)?)),
        None => Ok((authority, 80)),
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}{}", self.authority, self.base_path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_and_base_path() {
        let e: Endpoint = "http://127.0.0.1:8080".parse().unwrap();
        assert_eq!((e.host.as_str(), e.port), ("127.0.0.1", 8080));
        assert_eq!(e.path("/v1/completions"), "/v1/completions");
        let e: Endpoint = "http://gpu-box/serving/v1/".parse().unwrap();
        assert_eq!((e.host.as_str(), e.port), ("gpu-box", 80));
        assert_eq!(e.path("/v1/models"), "/serving/v1/models");
        assert_eq!(e.to_string(), "http://gpu-box/serving");
        let e: Endpoint = "http://[::1]:9000/".parse().unwrap();
        assert_eq!((e.host.as_str(), e.port), ("::1", 9000));
        assert_eq!(e.authority, "[::1]:9000");
    }

    #[test]
    fn https_and_other_schemes_are_refused() {
        assert_eq!("https://a:1".parse::<Endpoint>(), Err(EndpointError::Https));
        assert_eq!("HTTPS://a".parse::<Endpoint>(), Err(EndpointError::Https));
        assert!(matches!(
            "127.0.0.1:8080".parse::<Endpoint>(),
            Err(EndpointError::Scheme(_))
        ));
        assert!(matches!(
            "http://a:port".parse::<Endpoint>(),
            Err(EndpointError::Port(_))
        ));
        assert_eq!("http://:80".parse::<Endpoint>(), Err(EndpointError::NoHost));
    }
}
