//! The engine model's layer-wise prefills: P's engine starts the prefill into its blocks
//! (`PrefillStarted`, in `prefill_start`) and reports its layers one at a time as the forward
//! pass produces them (`LayersReady`), whatever happened to the request meanwhile: a real
//! engine goes on computing after D gave up, and its later reports must be taken.

use kvhandoff_protocol::session::{ConnectorCall, ConnectorError};

use super::Status;
use crate::transport::LAYERS;
use crate::world::{micros, Ev, World};

impl World {
    /// Schedules the report of layer `ready + 1` of P's attempt `attempt` of `request`, run by
    /// P's incarnation `inc`, after the layer's compute (`WorldConfig::layer_compute_us`; slow
    /// prefills much longer).
    pub(super) fn next_layer(&mut self, request: usize, attempt: usize, inc: u32, ready: u32) {
        let (lo, hi) = self.cfg.layer_compute_us;
        let mut compute = micros(&mut self.rng, lo, hi);
        if self.chance(self.rates.slow_prefill) {
            compute += micros(&mut self.rng, 200_000, 1_500_000);
        }
        let ev = Ev::LayersReady {
            request,
            attempt,
            inc,
            ready: ready + 1,
        };
        self.schedule(compute, ev);
    }

    /// P's engine reports layers `0 .. ready` of a layer-wise prefill.
    pub(crate) fn layers_ready(&mut self, request: usize, attempt: usize, inc: u32, ready: u32) {
        if !self.alive(0) || self.nodes[0].incarnation != inc {
            // The process that ran the prefill died: so did the prefill.
            return;
        }
        let a = &self.requests[request].p[attempt];
        let (id, live, epoch) = (
            a.id.clone(),
            matches!(a.status, Status::Live { .. }),
            a.epoch,
        );
        self.lease_layers(request, epoch);
        let call = ConnectorCall::LayersReady {
            request: id.clone(),
            ready,
        };
        match self.call(0, call) {
            Ok(_) => {}
            // A request that ended long ago may have left the record of its prefill.
            Err(ConnectorError::Rejected(_)) if !live => self.mark("layers_after_end_refused"),
            Err(error) => self.violate(format!("layers {ready} of {id} refused: {error}")),
        }
        if ready < LAYERS {
            self.next_layer(request, attempt, inc, ready);
            if live && self.cfg.abort_mid_layers > 0.0 && self.chance(self.cfg.abort_mid_layers) {
                // D's engine gives up while the write is partly sent.
                let at = micros(&mut self.rng, 0, 2_000);
                self.schedule(
                    at,
                    Ev::Abort {
                        request,
                        decode: true,
                    },
                );
            }
        }
        self.last_progress = self.now;
        self.drain(0);
    }

    /// The coverage marks of a layer-wise request's D attempt that ended (`ready` or not).
    pub(super) fn layerwise_marks(&mut self, request: usize, epoch: u64, ready: bool) {
        if !self.requests[request].transfer.layerwise {
            return;
        }
        let landed = self
            .parts_landed
            .get(&(request, epoch))
            .copied()
            .unwrap_or(0);
        if ready && landed > 0 {
            self.mark("layerwise_ready");
        }
        if !ready && landed > 0 && landed < LAYERS {
            self.mark("layerwise_partial_then_cancel");
        }
    }
}
