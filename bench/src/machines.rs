//! The machines part of `bench control`: two pure endpoints stepped in one thread.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Order {
    DecodeFirst,
    PrefillFirst,
}

/// Two endpoints and the wire between them.
pub(super) struct Pair {
    pub(super) p: Endpoint,
    pub(super) d: Endpoint,
    pub(super) p_addr: PeerAddr,
    pub(super) d_addr: PeerAddr,
    pub(super) ready: u64,
    pub(super) sent: u64,
    pub(super) other: u64,
}

#[derive(Clone, Copy)]
pub(super) enum Side {
    P,
    D,
}

impl Pair {
    pub(super) fn side(
        &mut self,
        side: Side,
    ) -> (&mut Endpoint, &mut Endpoint, &PeerAddr, &PeerAddr) {
        match side {
            Side::P => (&mut self.p, &mut self.d, &self.p_addr, &self.d_addr),
            Side::D => (&mut self.d, &mut self.p, &self.d_addr, &self.p_addr),
        }
    }

    /// Delivers every output of both endpoints until neither has any.
    pub(super) fn pump(&mut self, now: Time) -> Result<(), BenchError> {
        loop {
            let mut moved = false;
            for side in [Side::P, Side::D] {
                while let Some(output) = self.side(side).0.poll_output() {
                    moved = true;
                    self.deliver(side, now, output)?;
                }
            }
            if !moved {
                return Ok(());
            }
        }
    }

    pub(super) fn deliver(
        &mut self,
        side: Side,
        now: Time,
        output: Output,
    ) -> Result<(), BenchError> {
        match output {
            Output::Send { message, .. } => {
                let (_, other, me, _) = self.side(side);
                let from = me.clone();
                other.handle_event(now, NetEvent::Received { from, message });
            }
            Output::Connect { .. } => {
                let (this, other, me, them) = self.side(side);
                let (me, them) = (me.clone(), them.clone());
                // One process run each for the whole bench.
                let incarnation = Incarnation(1);
                this.handle_event(
                    now,
                    NetEvent::PeerConnected {
                        peer: them,
                        incarnation,
                    },
                );
                other.handle_event(
                    now,
                    NetEvent::PeerConnected {
                        peer: me,
                        incarnation,
                    },
                );
            }
            Output::PostWrite(order) => {
                let (this, other, me, _) = self.side(side);
                let from = me.clone();
                other.handle_event(
                    now,
                    NetEvent::Received {
                        from,
                        message: order.notification,
                    },
                );
                this.handle_event(now, NetEvent::WriteCompleted { write: order.write });
            }
            Output::PostRead(order) => {
                return Err(BenchError::Machine(format!(
                    "read {} in a push bench",
                    order.read
                )));
            }
            Output::AbandonWrite { write } => {
                return Err(BenchError::Machine(format!("abandoned {write}")));
            }
            Output::ExtendWrite { write, .. } => {
                return Err(BenchError::Machine(format!("layer-wise part of {write}")));
            }
            Output::Invalidate { peer } => {
                return Err(BenchError::Machine(format!("invalidated {peer}")));
            }
            Output::Event(event) => match event {
                EndpointEvent::Decode {
                    outcome: DecodeOutcome::Ready,
                    ..
                } => self.ready += 1,
                EndpointEvent::Prefill {
                    outcome: PrefillOutcome::Sent,
                    ..
                } => self.sent += 1,
                _ => self.other += 1,
            },
        }
        Ok(())
    }

    pub(super) fn timers(&mut self, now: Time) {
        for e in [&mut self.p, &mut self.d] {
            if e.poll_timeout().is_some_and(|at| at <= now) {
                e.handle_timeout(now);
            }
        }
    }
}

/// `cmpl-<32 hex>-0`: a vLLM-like request id base, distinct per `i` and random-looking, so that
/// id comparisons in the machines' ordered maps cost what they cost with real uuids (a shared
/// prefix such as `cmpl-bench-0000` would make every comparison scan it).
pub(super) fn vllm_like_base(i: usize) -> String {
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let (hi, lo) = (mix(i as u64), mix(!(i as u64)));
    format!("cmpl-{hi:016x}{lo:016x}-0")
}

/// ns per request lifecycle over `n` requests in `order`.
pub(super) fn machine_loop(n: usize, order: Order) -> Result<f64, BenchError> {
    let bug = |e: kvhandoff_protocol::machine::Rejected| BenchError::Machine(e.to_string());
    let (p_engine, d_engine, config) = engines_and_config(n)?;
    let mut pair = Pair {
        p: Endpoint::new(p_engine.clone(), 0, config.clone())
            .map_err(|e| BenchError::Options(e.to_string()))?,
        d: Endpoint::new(d_engine.clone(), 0, config)
            .map_err(|e| BenchError::Options(e.to_string()))?,
        p_addr: PeerAddr::new(p_engine, 0),
        d_addr: PeerAddr::new(d_engine, 0),
        ready: 0,
        sent: 0,
        other: 0,
    };
    // Ids and inputs are made before the clock starts: the loop measures the machines.
    let mut inputs = Vec::with_capacity(n);
    for i in 0..n {
        let base = vllm_like_base(i);
        let p_id = RequestId::new(format!("{base}-{:08x}", i as u32 ^ 0xaaaa_aaaa))
            .map_err(|e| BenchError::Options(e.to_string()))?;
        let d_id = RequestId::new(format!("{base}-{:08x}", i as u32 ^ 0x5555_5555))
            .map_err(|e| BenchError::Options(e.to_string()))?;
        let key = PairingKey::from_request_id(&p_id);
        let block = (i % 1024) as u32;
        let decode = EndpointCall::DecodeAllocated(DecodeStart {
            request: d_id,
            key: key.clone(),
            epoch: Epoch::FIRST,
            prefill: pair.p_addr.clone(),
            blocks: BlockIds::single_group(vec![block]),
            num_tokens: 16,
            expected_writes: 1,
        });
        let prefill = EndpointCall::PrefillFinished(PrefillStart {
            request: p_id,
            key,
            blocks: BlockIds::single_group(vec![block]),
        });
        inputs.push((decode, prefill));
    }
    let start = Instant::now();
    for (decode, prefill) in inputs {
        let now = Time::from_duration(start.elapsed());
        pair.timers(now);
        let (first, second, first_is_d) = match order {
            Order::DecodeFirst => (decode, prefill, true),
            Order::PrefillFirst => (prefill, decode, false),
        };
        let (a, b) = if first_is_d {
            (Side::D, Side::P)
        } else {
            (Side::P, Side::D)
        };
        pair.side(a).0.handle_call(now, first).map_err(bug)?;
        pair.pump(now)?;
        pair.side(b).0.handle_call(now, second).map_err(bug)?;
        pair.pump(now)?;
    }
    let elapsed = start.elapsed();
    if pair.ready != n as u64 || pair.sent != n as u64 || pair.other != 0 {
        return Err(BenchError::Machine(format!(
            "{n} requests: {} ready, {} sent, {} other events",
            pair.ready, pair.sent, pair.other
        )));
    }
    let counters = pair.p.counters();
    let (d_first, p_first) = (
        counters.decode_registered_first,
        counters.prefill_finished_first,
    );
    let expected = match order {
        Order::DecodeFirst => (n as u64, 0),
        Order::PrefillFirst => (0, n as u64),
    };
    if (d_first, p_first) != expected {
        return Err(BenchError::Machine(format!(
            "{order:?}: P counted {d_first} D-first and {p_first} P-first races"
        )));
    }
    Ok(elapsed.as_nanos() as f64 / n as f64)
}
