//! A D sub-request's early failure ([`EndpointEvent::DecodeFenced`](super::EndpointEvent)): the
//! request fails at once, the engine is told once, and the shared blocks wait.

use crate::{PairingKey, RequestId};

use super::{DecodeFailure, FanIn, FanInError, FanInStep, FanOutcome, SubFailure, SubState};

impl FanIn {
    /// A D sub-request failed, fenced by its peer rank's death: the request fails now (the
    /// first failure decides the outcome and aborts the live siblings, as a final event does),
    /// and the engine hears it once, but the shared blocks wait for the sub-request's final
    /// event.
    pub(super) fn on_fenced(
        &mut self,
        request: &RequestId,
        key: &PairingKey,
        failure: DecodeFailure,
    ) -> Result<FanInStep, FanInError> {
        let expected = self.live_key(request)?;
        if expected != key {
            return Err(FanInError::KeyMismatch {
                request: request.clone(),
                expected: expected.clone(),
                got: key.clone(),
            });
        }
        let Some(slot) = self.subs.get_mut(request) else {
            return Err(FanInError::UnknownRequest(request.clone()));
        };
        if matches!(slot.1, SubState::Fenced(_)) {
            return Err(FanInError::AlreadyFenced(request.clone()));
        }
        let failure = SubFailure::Decode(failure);
        slot.1 = SubState::Fenced(failure);
        let mut step = FanInStep::default();
        if self.outcome.is_none() {
            let outcome = FanOutcome::Failed {
                request: request.clone(),
                failure,
            };
            self.outcome = Some(outcome.clone());
            step.outcome = Some(outcome);
            step.abort = self.abort_all();
        }
        if !self.fenced && !self.handed_back {
            self.fenced = true;
            step.fenced = true;
        }
        self.check_invariants();
        Ok(step)
    }
}
