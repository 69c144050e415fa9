//! The scripted world's checks: the ghost that judges every hand-back of D's blocks (through
//! the ledger's [`judge_hand_back`], as the seeded world does) and every landing, and the
//! end-of-scenario leak check.

use std::collections::BTreeMap;

use kvhandoff_protocol::machine::{DecodeFailure, DecodeOutcome, EndpointEvent};
use kvhandoff_protocol::{Message, PeerAddr, RequestId, WriteId};

use super::Harness;
use crate::ledger::{judge_hand_back, HandBack};

impl Drop for Harness {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            assert!(
                self.violations.is_empty(),
                "safety violations: {:#?}",
                self.violations
            );
        }
    }
}

impl Harness {
    /// The ledger: every request an engine started got exactly one event and nothing else did;
    /// no live request, pending registration or write is left on any live endpoint; the
    /// transport has nothing pending; the ghost saw no violation.
    pub fn assert_no_leak(&self) {
        for (addr, node) in &self.nodes {
            if !node.alive {
                continue;
            }
            let mut counts: BTreeMap<&RequestId, usize> = BTreeMap::new();
            for (_, event) in &node.events {
                *counts.entry(event.request()).or_insert(0) += 1;
            }
            for request in &node.started {
                assert_eq!(
                    counts.remove(request),
                    Some(1),
                    "{addr}: request {request} must end in exactly one event; events: {:#?}",
                    node.events
                );
            }
            assert!(
                counts.is_empty(),
                "{addr}: events for requests the engine never started: {counts:?}"
            );
            for (_, early) in &node.early {
                assert!(
                    node.started.contains(early.request()),
                    "{addr}: an early failure for a request the engine never started: {early:?}"
                );
            }
            let stats = node.ep.stats();
            assert_eq!(
                stats.decode_requests, 0,
                "{addr}: live D requests: {stats:?}"
            );
            assert_eq!(
                stats.prefill_requests, 0,
                "{addr}: live P requests: {stats:?}"
            );
            assert_eq!(
                stats.pending_registrations, 0,
                "{addr}: pending registrations: {stats:?}"
            );
            assert_eq!(
                stats.writes_in_flight, 0,
                "{addr}: writes in flight: {stats:?}"
            );
            assert_eq!(
                (stats.exports, stats.imports, stats.reads_in_flight),
                (0, 0, 0),
                "{addr}: live exports, imports or reads: {stats:?}"
            );
            assert_eq!(
                stats.queued_outputs, 0,
                "{addr}: unpolled outputs: {stats:?}"
            );
            assert!(
                !node.ep.has_pending_work(),
                "{addr}: still has pending work"
            );
        }
        assert!(
            self.writes.is_empty(),
            "writes still pending: {:?}",
            self.writes
        );
        assert!(
            self.reads.is_empty(),
            "reads still pending: {:?}",
            self.reads
        );
        assert!(
            self.violations.is_empty(),
            "violations: {:#?}",
            self.violations
        );
    }

    /// An early failure (`DecodeFenced`) comes once per request, before its end, and hands
    /// nothing back: the blocks stay the request's.
    fn check_early(&mut self, at: &PeerAddr, request: &RequestId, failure: DecodeFailure) {
        let node = self.node(at);
        let told = node.early.iter().any(|(_, e)| e.request() == request);
        let ended = node.events.iter().any(|(_, e)| e.request() == request);
        if told || ended {
            self.violations.push(format!(
                "at {}: {at} told {request} fenced ({failure:?}) again or after its end",
                self.now
            ));
        }
    }

    /// A request told fenced ends `Failed` with the failure it was told.
    fn check_told_end(&mut self, at: &PeerAddr, request: &RequestId, outcome: DecodeOutcome) {
        let told = self.node(at).early.iter().find_map(|(_, e)| match e {
            EndpointEvent::DecodeFenced {
                request: r,
                failure,
                ..
            } if r == request => Some(*failure),
            EndpointEvent::DecodeFenced { .. }
            | EndpointEvent::Decode { .. }
            | EndpointEvent::Prefill { .. }
            | EndpointEvent::Export { .. }
            | EndpointEvent::Import { .. } => None,
        });
        if let Some(failure) = told {
            if outcome != DecodeOutcome::Failed(failure) {
                self.violations.push(format!(
                    "at {}: {at} told {request} fenced ({failure:?}), then it ended {outcome:?}",
                    self.now
                ));
            }
        }
    }

    /// Takes the violations the ghost saw (so that a test that provokes one on purpose, a
    /// mutation check, can inspect it and the harness does not panic when dropped).
    pub fn take_violations(&mut self) -> Vec<String> {
        std::mem::take(&mut self.violations)
    }

    /// An engine event hands blocks back: P's may not be read by a write any more (NIXL reads
    /// the source until the write ends, as the seeded world's pins say); D's are judged as the
    /// seeded world's ledger judges them.
    pub(super) fn check_event(&mut self, at: &PeerAddr, event: &EndpointEvent) {
        let (key, epoch, proof) = match event {
            EndpointEvent::Decode {
                key,
                epoch,
                proof,
                outcome,
                request,
                ..
            } => {
                self.check_told_end(at, request, *outcome);
                (key, epoch, proof)
            }
            EndpointEvent::DecodeFenced {
                request, failure, ..
            } => {
                self.check_early(at, request, *failure);
                return;
            }
            EndpointEvent::Prefill {
                request, blocks, ..
            } => {
                let incarnation = self.node(at).incarnation;
                let freed: Vec<u32> = blocks.groups.concat();
                let reading: Vec<WriteId> = self
                    .writes
                    .values()
                    .filter(|w| &w.from == at && w.incarnation == incarnation)
                    .filter(|w| {
                        w.order
                            .local
                            .groups
                            .iter()
                            .flatten()
                            .any(|b| freed.contains(b))
                    })
                    .map(|w| w.order.write)
                    .collect();
                if !reading.is_empty() {
                    self.violations.push(format!(
                        "at {}: {at} freed the source blocks {freed:?} of {request} while write(s) {reading:?} may still read them",
                        self.now
                    ));
                }
                return;
            }
            EndpointEvent::Export { key, request, .. } => {
                let reading: Vec<WriteId> = self
                    .reads
                    .values()
                    .filter(|r| &r.order.from == at && &r.order.key == key)
                    .map(|r| r.order.read)
                    .collect();
                if !reading.is_empty() {
                    self.violations.push(format!(
                        "at {}: {at} handed back the exported blocks of {request} while read(s) {reading:?} may still read them",
                        self.now
                    ));
                }
                return;
            }
            EndpointEvent::Import {
                key,
                epoch,
                request,
                ..
            } => {
                let incarnation = self.node(at).incarnation;
                let landing: Vec<WriteId> = self
                    .reads
                    .values()
                    .filter(|r| &r.reader == at && r.incarnation == incarnation)
                    .filter(|r| &r.order.key == key && r.order.epoch == *epoch)
                    .map(|r| r.order.read)
                    .collect();
                if !landing.is_empty() {
                    self.violations.push(format!(
                        "at {}: {at} handed back the blocks of {request} while read(s) {landing:?} may still land in them",
                        self.now
                    ));
                }
                return;
            }
        };
        let writes_in_flight = self
            .writes
            .values()
            .filter(|w| &w.order.to == at && &w.order.key == key && w.order.epoch == *epoch)
            .filter(|w| !w.landed)
            .count();
        let registered = self.sent.iter().any(|(_, e)| {
            &e.from == at
                && matches!(&e.message, Message::Register(r) if &r.key == key && r.epoch == *epoch)
        });
        let incarnation = self.node(at).incarnation;
        let now = self.now;
        let p_holds_registration = self.nodes.iter().any(|(p, node)| {
            node.alive
                && p != at
                && self
                    .known
                    .get(&(p.clone(), at.clone()))
                    .is_none_or(|&inc| inc == incarnation)
                && node
                    .ep
                    .pending_registration(key)
                    .is_some_and(|(from, e, expires)| from == at && e == *epoch && expires > now)
        });
        let hand_back = HandBack {
            proof: *proof,
            registered,
            writes_in_flight,
            p_holds_registration,
        };
        for fault in judge_hand_back(&hand_back) {
            self.violations
                .push(format!("at {now}: {at} {key} {epoch}: {fault}"));
        }
    }
}
