//! QUIC plumbing shared by every strata endpoint (DESIGN.md §6, transport): the topology group's
//! members and the nodes' RPC service both speak QUIC with TLS 1.3 whose only root is the
//! cluster CA, one call per bidirectional stream, in length-prefixed JSON frames.
//!
//! - [`tls`]: server configurations (a client certificate required, or none asked for) and
//!   client configurations (with or without a certificate), for a given ALPN.
//! - [`frame`]: writing and reading one frame on a stream.
//!
//! The certificates themselves (the CA, member and operator identities) belong to
//! `strata-topology`, which issues them; this crate only uses them.

pub mod frame;
pub mod tls;

pub use frame::{
    FrameError, MAX_FRAME, read_frame, read_frame_bytes, write_frame, write_frame_bytes,
};
pub use tls::{Chain, LiveIdentity, TlsError};
