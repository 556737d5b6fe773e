//! Request bodies into typed requests. JSON has one number type: `128.0` and `128` are the same
//! number, and clients built on dynamic languages send either (pydantic-based servers such as
//! vLLM take both). serde's integer types refuse the first, so a body goes through a JSON value
//! whose integral floats (within the 64-bit range) are made integers before the typed request is
//! read from it. Fields typed as floats take integers unchanged, so nothing else moves.

use serde::de::DeserializeOwned;
use serde_json::{Number, Value};

/// `body` as a `T`, integral floats read as integers; serde's error on a malformed or mistyped
/// body.
pub fn from_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, serde_json::Error> {
    let mut value: Value = serde_json::from_slice(body)?;
    integral_floats_to_integers(&mut value);
    serde_json::from_value(value)
}

fn integral_floats_to_integers(value: &mut Value) {
    match value {
        Value::Number(n) => {
            if let Some(f) = n.as_f64().filter(|_| n.is_f64())
                && f.fract() == 0.0
            {
                let as_int = if f >= 0.0 && f < u64::MAX as f64 {
                    Some(Number::from(f as u64))
                } else if f < 0.0 && f >= i64::MIN as f64 {
                    Some(Number::from(f as i64))
                } else {
                    None
                };
                if let Some(int) = as_int {
                    *n = int;
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(integral_floats_to_integers),
        Value::Object(map) => map.values_mut().for_each(integral_floats_to_integers),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct Request {
        max_tokens: u32,
        seed: Option<i64>,
        temperature: f32,
    }

    #[test]
    fn integral_floats_read_as_integers_and_the_rest_stays() {
        let r: Request =
            from_json(br#"{"max_tokens": 128.0, "seed": -3.0, "temperature": 1}"#).unwrap();
        assert_eq!(
            r,
            Request {
                max_tokens: 128,
                seed: Some(-3),
                temperature: 1.0
            }
        );
        // Canaries: a fraction, or a value beyond the type, is still refused.
        assert!(from_json::<Request>(br#"{"max_tokens": 1.5, "temperature": 0}"#).is_err());
        assert!(from_json::<Request>(br#"{"max_tokens": 1e12, "temperature": 0}"#).is_err());
        assert!(from_json::<Request>(br#"{"max_tokens": -1.0, "temperature": 0}"#).is_err());
    }
}
