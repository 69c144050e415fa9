//! The endpoint's events as the engine gets them, one for one (a multi-rank request's
//! sub-requests' are folded in `fan` first).

use crate::machine::{DecodeOutcome, EndpointEvent, PrefillOutcome};

use super::ConnectorEvent;

impl From<EndpointEvent> for ConnectorEvent {
    /// One request's event in the engine's terms (what a request that is not a multi-rank
    /// request's part gets as it is).
    fn from(event: EndpointEvent) -> Self {
        match event {
            EndpointEvent::Decode {
                request,
                outcome: DecodeOutcome::Ready,
                blocks,
                ..
            } => ConnectorEvent::BlocksReady { request, blocks },
            EndpointEvent::Decode {
                request,
                outcome: DecodeOutcome::Failed(reason),
                proof,
                blocks,
                ..
            } => ConnectorEvent::Failed {
                request,
                reason,
                proof,
                blocks,
            },
            EndpointEvent::DecodeFenced {
                request, failure, ..
            } => ConnectorEvent::DecodeFenced {
                request,
                reason: failure,
            },
            EndpointEvent::Prefill {
                request,
                outcome,
                blocks,
                ..
            } => ConnectorEvent::BlocksFree {
                request,
                released: match outcome {
                    PrefillOutcome::Sent => None,
                    PrefillOutcome::Released(cause) => Some(cause),
                },
                blocks,
            },
            EndpointEvent::Export {
                request,
                outcome,
                proof,
                blocks,
                ..
            } => ConnectorEvent::ExportEnded {
                request,
                outcome,
                proof,
                blocks,
            },
            EndpointEvent::Import {
                request,
                outcome,
                blocks,
                ..
            } => ConnectorEvent::Imported {
                request,
                outcome,
                blocks,
            },
        }
    }
}
