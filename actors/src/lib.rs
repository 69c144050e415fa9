//! kvhandoff's actors: the sans-IO state machines, their actix shells and the transports.
#![warn(missing_docs)]

mod addr;
pub mod machine;
pub mod system;
pub mod transport;

pub use addr::{PeerAddr, WriteId};
