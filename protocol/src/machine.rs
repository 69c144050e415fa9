//! The sans-IO state machines of kvhandoff.
//!
//! One [`Endpoint`] per engine rank hosts every machine of that rank: a `DecodeRequest` per D
//! request, P's `PrefillTable` (the table that matches D's registrations with P's finished blocks) and
//! its `PrefillRequest`s, and a `Peer` per remote rank. The endpoint is driven the way
//! quinn-proto and str0m are: [`Endpoint::handle_call`] (engine calls),
//! [`Endpoint::handle_event`] (network and transport reports) and [`Endpoint::handle_timeout`]
//! take the current [`Time`], [`Endpoint::poll_output`] yields what to do, and
//! [`Endpoint::poll_timeout`] says when to call again. No I/O, clock, randomness or async
//! lives here, so the simulator and the actix shells run the very same code.

mod config;
mod decode;
mod effects;
mod endpoint;
mod mutation;
mod peer;
mod prefill;
mod prefill_table;
mod tables;
mod types;

pub use config::{Config, ConfigError};
pub use endpoint::{Endpoint, EndpointStats};
pub(crate) use mutation::ActiveMutation;
pub use mutation::Mutation;
pub use types::{
    ConnectFailure, Counters, DecodeFailure, DecodeOutcome, DecodeStart, DropReason, EngineCall,
    EngineEvent, FreeProof, NetEvent, Output, PrefillOutcome, PrefillStart, Rejected, ReleaseCause,
    Time, WriteOrder,
};
