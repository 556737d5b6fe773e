//! AWS's `application/vnd.amazon.eventstream` framing, the body of `converse-stream`. One frame:
//!
//! ```text
//! total length u32 BE | headers length u32 BE | CRC32 of those 8 bytes
//! headers: name length u8, name, value type u8 (7 = string), value length u16 BE, value
//! payload (JSON)
//! CRC32 of everything above
//! ```
//!
//! The SDKs check both CRCs and drop the connection on a mismatch, so they are the proof that a
//! frame is whole. Only string headers are written: that is all Converse uses.

use axum::body::Bytes;
use serde_json::Value;

/// Header value type 7: a UTF-8 string with a u16 length.
const STRING_VALUE: u8 = 7;
/// Prelude (two lengths + its CRC) and the trailing message CRC.
const PRELUDE_LEN: usize = 12;
const TRAILER_LEN: usize = 4;

/// Encodes Converse stream events and exceptions as eventstream frames.
#[derive(Debug, Clone, Copy, Default)]
pub struct ConverseStreamEncoder;

impl ConverseStreamEncoder {
    /// An event: `:event-type` names it (`messageStart`, `contentBlockDelta`, ...).
    pub fn event(&self, event_type: &'static str, payload: &Value) -> Bytes {
        frame(
            &[
                (":event-type", event_type),
                (":content-type", "application/json"),
                (":message-type", "event"),
            ],
            payload.to_string().as_bytes(),
        )
    }

    /// A modelled exception sent in place of further events (`internalServerException`, ...).
    pub fn exception(&self, exception_type: &'static str, payload: &Value) -> Bytes {
        frame(
            &[
                (":exception-type", exception_type),
                (":content-type", "application/json"),
                (":message-type", "exception"),
            ],
            payload.to_string().as_bytes(),
        )
    }
}

/// One frame. Header names and values are this module's constants (short, so their lengths fit
/// their u8 / u16 fields); a payload is one event's JSON, far below the u32 total length.
fn frame(headers: &[(&'static str, &'static str)], payload: &[u8]) -> Bytes {
    let headers_len: usize = headers
        .iter()
        .map(|(name, value)| 1 + name.len() + 1 + 2 + value.len())
        .sum();
    let total = PRELUDE_LEN + headers_len + payload.len() + TRAILER_LEN;
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(&length(total).to_be_bytes());
    out.extend_from_slice(&length(headers_len).to_be_bytes());
    let prelude_crc = crc32fast::hash(&out);
    out.extend_from_slice(&prelude_crc.to_be_bytes());
    for (name, value) in headers {
        out.push(u8::try_from(name.len()).expect("header names are short constants"));
        out.extend_from_slice(name.as_bytes());
        out.push(STRING_VALUE);
        let value_len = u16::try_from(value.len()).expect("header values are short constants");
        out.extend_from_slice(&value_len.to_be_bytes());
        out.extend_from_slice(value.as_bytes());
    }
    out.extend_from_slice(payload);
    let message_crc = crc32fast::hash(&out);
    out.extend_from_slice(&message_crc.to_be_bytes());
    Bytes::from(out)
}

fn length(n: usize) -> u32 {
    u32::try_from(n).expect("one event's frame is far below 4 GiB")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A decoder written from the format description, independent of the encoder: every length
    /// and both CRCs are checked (the CRC by a bitwise reference, not `crc32fast`).
    fn decode(frame: &[u8]) -> Result<(Vec<(String, String)>, Value), String> {
        let be32 = |at: usize| -> Result<u32, String> {
            let b = frame.get(at..at + 4).ok_or(format!("short at {at}"))?;
            Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        };
        let total = be32(0)? as usize;
        let headers_len = be32(4)? as usize;
        if total != frame.len() {
            return Err(format!("total length {total} != {}", frame.len()));
        }
        if be32(8)? != reference_crc32(&frame[..8]) {
            return Err("prelude CRC mismatch".into());
        }
        if be32(total - 4)? != reference_crc32(&frame[..total - 4]) {
            return Err("message CRC mismatch".into());
        }
        let mut at = 12;
        let end = 12 + headers_len;
        let mut headers = Vec::new();
        while at < end {
            let name_len = frame[at] as usize;
            let name = std::str::from_utf8(&frame[at + 1..at + 1 + name_len]).unwrap();
            at += 1 + name_len;
            if frame[at] != 7 {
                return Err(format!("header {name}: value type {}", frame[at]));
            }
            let value_len = u16::from_be_bytes([frame[at + 1], frame[at + 2]]) as usize;
            let value = std::str::from_utf8(&frame[at + 3..at + 3 + value_len]).unwrap();
            at += 3 + value_len;
            headers.push((name.to_string(), value.to_string()));
        }
        if at != end {
            return Err(format!("headers end at {at}, not {end}"));
        }
        let payload = serde_json::from_slice(&frame[end..total - 4]).map_err(|e| e.to_string())?;
        Ok((headers, payload))
    }

    /// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320), one bit at a time.
    fn reference_crc32(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &byte in data {
            crc ^= u32::from(byte);
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    #[test]
    fn reference_crc_matches_the_standard_check_value() {
        assert_eq!(reference_crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn an_event_frame_decodes_with_its_headers_and_payload() {
        let payload = json!({"contentBlockIndex": 0, "delta": {"text": "héllo"}});
        let frame = ConverseStreamEncoder.event("contentBlockDelta", &payload);
        let (headers, decoded) = decode(&frame).unwrap();
        assert_eq!(
            headers,
            [
                (":event-type", "contentBlockDelta"),
                (":content-type", "application/json"),
                (":message-type", "event"),
            ]
            .map(|(n, v)| (n.to_string(), v.to_string()))
        );
        assert_eq!(decoded, payload);
    }

    #[test]
    fn an_exception_frame_names_its_type() {
        let frame =
            ConverseStreamEncoder.exception("internalServerException", &json!({"message": "x"}));
        let (headers, payload) = decode(&frame).unwrap();
        assert!(headers.contains(&(":exception-type".into(), "internalServerException".into())));
        assert!(headers.contains(&(":message-type".into(), "exception".into())));
        assert_eq!(payload["message"], "x");
    }

    /// Canary: the decoder's CRC checks can fail, in the prelude and in the body.
    #[test]
    fn a_flipped_byte_fails_the_crc_check() {
        let frame = ConverseStreamEncoder.event("messageStop", &json!({"stopReason": "end_turn"}));
        let mut prelude = frame.to_vec();
        prelude[5] ^= 0x01;
        assert_eq!(decode(&prelude).unwrap_err(), "prelude CRC mismatch");
        let mut body = frame.to_vec();
        let at = body.len() - 8;
        body[at] ^= 0x01;
        assert_eq!(decode(&body).unwrap_err(), "message CRC mismatch");
    }
}
