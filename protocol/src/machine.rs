//! The sans-IO state machines of kvhandoff.
//!
//! One [`Endpoint`] per engine rank hosts every machine of that rank: a `DecodeRequest` per D
//! request (in D's table), a `PrefillRequest` per P request (in P's `PrefillTable`, which also
//! matches D's registrations with P's finished blocks, whichever comes first), and a `Peer` per
//! remote rank. All three have one shape (the crate-private `Machine` trait: a state enum whose
//! transition consumes the state, an input type, one timer), live in one kind of table with one
//! timer queue, and write their outputs and counters to one outbox. The endpoint is driven the way
//! quinn-proto and str0m are: [`Endpoint::handle_call`] (engine calls),
//! [`Endpoint::handle_event`] (network and transport reports) and [`Endpoint::handle_timeout`]
//! take the current [`Time`], [`Endpoint::poll_output`] yields what to do, and
//! [`Endpoint::poll_timeout`] says when to call again. No I/O, clock, randomness or async
//! lives here, so the simulator and the actix shells run the very same code.

mod config;
mod counters;
mod decode;
mod decode_table;
mod effects;
mod endpoint;
mod export;
mod fan_in;
mod import;
pub(crate) mod mutation;
mod peer;
mod prefill;
mod prefill_table;
mod read_tables;
mod read_types;
mod shape;
mod spans;
mod tables;
mod types;

pub use config::{BlockPairing, Config, ConfigError};
pub use counters::Gauges;
pub use endpoint::{Endpoint, EndpointStats};
pub use fan_in::{
    FanCounts, FanIn, FanInError, FanInStep, FanOutcome, FanSide, SubFailure, SubRequest,
    MAX_SUB_REQUESTS,
};
pub(crate) use mutation::ActiveMutation;
pub use mutation::Mutation;
pub use read_types::{
    export_hard_end, is_read, read_span, ExportEnd, ExportOutcome, ExportStart, ImportFailure,
    ImportOutcome, ImportStart, LoadFailurePolicy, ReadOrder, ReadProof, FIRST_READ_ID,
    MAX_EXPORT_LEASE,
};
pub use types::{
    ConnectFailure, Counters, DecodeFailure, DecodeOutcome, DecodeStart, DropReason, EndpointCall,
    EndpointEvent, FreeProof, LayerPlan, NetEvent, Output, PrefillOutcome, PrefillStart, Rejected,
    ReleaseCause, StreamedLayers, Time, WriteOrder,
};
