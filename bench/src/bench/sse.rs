//! An incremental Server-Sent Events decoder: bytes in as the network delivers them, whole
//! events out.
//!
//! A read may end anywhere, inside a line or even inside a multi-byte character, so bytes are
//! buffered until a line is complete; an event is dispatched at the blank line that ends it, its
//! `data:` lines joined by `\n` (the SSE rules). Comment lines (`:`) and the other fields (`event`,
//! `id`, `retry`) are skipped: an OpenAI stream carries everything in `data`.

/// Buffers partial lines and the data of the event being read; both buffers are reused, so a
/// long stream allocates only while an event is longer than any before it.
#[derive(Default)]
pub struct SseDecoder {
    line: Vec<u8>,
    data: String,
    has_data: bool,
}

impl SseDecoder {
    /// Feeds one read's bytes; calls `on_event` with the data of each event they complete.
    pub fn feed(&mut self, bytes: &[u8], mut on_event: impl FnMut(&str)) {
        for chunk in bytes.split_inclusive(|&b| b == b'\n') {
            self.line.extend_from_slice(chunk);
            if self.line.last() != Some(&b'\n') {
                // The read ended inside this line: keep it for the next read.
                return;
            }
            self.line.pop();
            if self.line.last() == Some(&b'\r') {
                self.line.pop();
            }
            self.take_line(&mut on_event);
            self.line.clear();
        }
    }

    fn take_line(&mut self, on_event: &mut impl FnMut(&str)) {
        if self.line.is_empty() {
            if self.has_data {
                on_event(&self.data);
            }
            self.data.clear();
            self.has_data = false;
            return;
        }
        let line = String::from_utf8_lossy(&self.line);
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_ref(), ""),
        };
        if field == "data" {
            if self.has_data {
                self.data.push('\n');
            }
            self.data.push_str(value);
            self.has_data = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(reads: &[&[u8]]) -> Vec<String> {
        let mut decoder = SseDecoder::default();
        let mut events = Vec::new();
        for read in reads {
            decoder.feed(read, |data| events.push(data.to_string()));
        }
        events
    }

    #[test]
    fn whole_events_in_one_read() {
        let events = decode(&[b"data: {\"a\":1}\n\ndata: [DONE]\n\n"]);
        assert_eq!(events, ["{\"a\":1}", "[DONE]"]);
    }

    #[test]
    fn an_event_split_across_reads_at_every_byte_is_the_same_event() {
        let stream = "data: {\"text\":\"h\u{e9}llo\"}\r\n\r\ndata: [DONE]\r\n\r\n".as_bytes();
        for cut in 0..=stream.len() {
            let events = decode(&[&stream[..cut], &stream[cut..]]);
            assert_eq!(
                events,
                ["{\"text\":\"h\u{e9}llo\"}", "[DONE]"],
                "cut at {cut}"
            );
        }
        let bytewise: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(decode(&bytewise), ["{\"text\":\"h\u{e9}llo\"}", "[DONE]"]);
    }

    #[test]
    fn no_event_before_its_blank_line() {
        let mut decoder = SseDecoder::default();
        let mut events = Vec::new();
        decoder.feed(b"data: [DONE]\n", |d| events.push(d.to_string()));
        assert!(events.is_empty());
        decoder.feed(b"\n", |d| events.push(d.to_string()));
        assert_eq!(events, ["[DONE]"]);
    }

    #[test]
    fn comments_and_other_fields_are_skipped_and_data_lines_join() {
        let events = decode(&[b": keep-alive\n\nevent: message\nid: 7\ndata: a\ndata:b\n\n"]);
        assert_eq!(events, ["a\nb"]);
    }

    #[test]
    fn a_stream_cut_inside_an_event_yields_nothing_for_it() {
        let events = decode(&[b"data: {\"a\":1}\n\ndata: {\"b\""]);
        assert_eq!(events, ["{\"a\":1}"]);
    }
}
