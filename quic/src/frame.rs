//! One frame: a 4-byte big-endian length, then that many bytes: JSON, or a binary payload
//! (rkyv) where a call says so.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The largest frame either side accepts: a snapshot chunk or a KV dump, with room to spare.
pub const MAX_FRAME: usize = 16 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("stream read: {0}")]
    Read(#[from] quinn::ReadExactError),
    #[error("stream write: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("stream closed: {0}")]
    Closed(#[from] quinn::ClosedStream),
    #[error("frame of {0} bytes exceeds the limit of {MAX_FRAME}")]
    Oversize(u64),
    #[error("frame does not decode: {0}")]
    Decode(serde_json::Error),
    #[error("frame does not encode: {0}")]
    Encode(serde_json::Error),
}

/// Writes `value` as one frame.
pub async fn write_frame<T: Serialize>(
    send: &mut quinn::SendStream,
    value: &T,
) -> Result<(), FrameError> {
    let body = serde_json::to_vec(value).map_err(FrameError::Encode)?;
    write_frame_bytes(send, &body).await
}

/// Writes `body` (already encoded, JSON or not) as one frame.
pub async fn write_frame_bytes(
    send: &mut quinn::SendStream,
    body: &[u8],
) -> Result<(), FrameError> {
    if body.len() > MAX_FRAME {
        return Err(FrameError::Oversize(body.len() as u64));
    }
    let len = u32::try_from(body.len()).map_err(|_| FrameError::Oversize(body.len() as u64))?;
    send.write_all(&len.to_be_bytes()).await?;
    send.write_all(body).await?;
    Ok(())
}

/// The next frame's bytes, or `None` when the peer finished the stream between frames.
pub async fn read_frame_bytes(recv: &mut quinn::RecvStream) -> Result<Option<Vec<u8>>, FrameError> {
    let mut len = [0u8; 4];
    match recv.read_exact(&mut len).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::Oversize(len as u64));
    }
    let mut body = vec![0u8; len];
    recv.read_exact(&mut body).await?;
    Ok(Some(body))
}

/// The next frame decoded, or `None` when the peer finished the stream between frames.
pub async fn read_frame<T: DeserializeOwned>(
    recv: &mut quinn::RecvStream,
) -> Result<Option<T>, FrameError> {
    match read_frame_bytes(recv).await? {
        None => Ok(None),
        Some(body) => serde_json::from_slice(&body)
            .map(Some)
            .map_err(FrameError::Decode),
    }
}
