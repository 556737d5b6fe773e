//! CORS for browser clients (`--allowed-origins`, vLLM's flag): off unless origins are given.
//! With origins, a preflight `OPTIONS` is answered before any key is asked for (browsers send
//! it without credentials), and `Access-Control-Allow-Origin` is echoed only to a listed origin;
//! `*` allows every origin and must be given explicitly. The layer wraps every route and every
//! refusal (401, 413, 429), so a page can read why it was refused.

use std::time::Duration;

use axum::http::{HeaderName, HeaderValue, Method};
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

/// How long a browser may cache a preflight answer.
const PREFLIGHT_MAX_AGE: Duration = Duration::from_secs(600);

/// The origins that get CORS headers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AllowedOrigins {
    /// No CORS headers at all: browsers keep their same-origin policy.
    #[default]
    None,
    /// `*`: every origin.
    Any,
    /// Exactly these origins (`scheme://host[:port]`, as browsers send them).
    List(Vec<HeaderValue>),
}

#[derive(Debug, thiserror::Error)]
#[error(
    "--allowed-origins: {0:?} is not an origin; give `*` or scheme://host[:port] without a \
     path, e.g. https://app.example.com"
)]
pub struct OriginError(pub String);

impl AllowedOrigins {
    /// The origins given; `*` among them allows every origin.
    pub fn parse<S: AsRef<str>>(origins: &[S]) -> Result<Self, OriginError> {
        if origins.is_empty() {
            return Ok(Self::None);
        }
        if origins.iter().any(|o| o.as_ref() == "*") {
            return Ok(Self::Any);
        }
        origins
            .iter()
            .map(|origin| {
                let origin = origin.as_ref();
                let bad = || OriginError(origin.to_string());
                let (scheme, authority) = origin.split_once("://").ok_or_else(bad)?;
                let spaced = origin.chars().any(char::is_whitespace);
                if scheme.is_empty() || authority.is_empty() || authority.contains('/') || spaced {
                    return Err(bad());
                }
                HeaderValue::from_str(origin).map_err(|_| bad())
            })
            .collect::<Result<_, _>>()
            .map(Self::List)
    }

    /// The layer answering for these origins; `None` when CORS is off.
    pub fn layer(&self) -> Option<CorsLayer> {
        let origin = match self {
            Self::None => return None,
            Self::Any => AllowOrigin::any(),
            Self::List(origins) => AllowOrigin::list(origins.iter().cloned()),
        };
        // `Authorization` is never covered by a `*` in Access-Control-Allow-Headers, so the
        // headers a preflight asks for are echoed instead.
        Some(
            CorsLayer::new()
                .allow_origin(origin)
                .allow_methods([Method::GET, Method::POST])
                .allow_headers(AllowHeaders::mirror_request())
                .expose_headers([HeaderName::from_static("x-request-id")])
                .max_age(PREFLIGHT_MAX_AGE),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_parse_and_bad_ones_are_named() {
        assert_eq!(
            AllowedOrigins::parse::<&str>(&[]).unwrap(),
            AllowedOrigins::None
        );
        assert_eq!(
            AllowedOrigins::parse(&["https://a.example", "*"]).unwrap(),
            AllowedOrigins::Any
        );
        let list = AllowedOrigins::parse(&["https://a.example", "http://127.0.0.1:3000"]);
        assert!(matches!(list, Ok(AllowedOrigins::List(ref o)) if o.len() == 2));
        for bad in ["a.example", "https://a.example/", "https://", "https://a b"] {
            let err = AllowedOrigins::parse(&[bad]).unwrap_err().to_string();
            assert!(err.contains(bad), "{bad}: {err}");
        }
        assert!(AllowedOrigins::None.layer().is_none());
    }
}
