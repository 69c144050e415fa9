//! kvhandoff's shells: the actix actors that host the sans-IO machines of
//! [`kvhandoff_protocol::machine`], the TCP side channel, and the transports (in-memory and
//! NIXL) that implement [`kvhandoff_protocol::transport::Transport`].
#![warn(missing_docs)]

pub mod metrics;
pub mod system;
pub mod transport;
