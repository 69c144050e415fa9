//! The seeded workload: each seed's fault rates, its requests and when they start, and the
//! faults scheduled over them (partitions, crashes, late handshakes, second decodes).

use super::*;
use crate::mode::Mode;

/// Swarm testing: each seed draws its own fault rates.
pub(crate) fn draw_rates(rng: &mut ChaCha8Rng, faults: Faults) -> Rates {
    let mut pick = |choices: &[f64]| choices[rng.gen_range(0..choices.len())];
    let mut rates = Rates::default();
    if matches!(faults, Faults::Network | Faults::Chaos) {
        rates.slow_msg = pick(&[0.0, 0.01, 0.05]);
        rates.slow_prefill = pick(&[0.0, 0.05, 0.1]);
    }
    if faults == Faults::Chaos {
        rates.drop = pick(&[0.0, 0.005, 0.02]);
        rates.dup = pick(&[0.0, 0.01, 0.05]);
        rates.post_fail = pick(&[0.0, 0.02, 0.05]);
        rates.fail_later = pick(&[0.0, 0.02, 0.05]);
        rates.hang = pick(&[0.0, 0.01, 0.03]);
        rates.slow_write = pick(&[0.0, 0.05, 0.2]);
        // Once the chance of an abandon the transport does not confirm; every abandon is one
        // now (NIXL cannot stop a posted write). Still drawn, so that seeds keep their streams
        // and the regressions found before replay the same faults.
        let _ = pick(&[0.0, 0.2]);
        rates.abort = pick(&[0.0, 0.03, 0.1]);
        rates.retry = pick(&[0.0, 0.3, 0.6]);
        rates.connect_fail = pick(&[0.0, 0.02, 0.1]);
        rates.mute_answers = pick(&[0.0, 0.02, 0.05]);
    }
    rates
}

impl World {
    /// How request `i` moves its KV in this world's mode.
    fn draw_transfer(&mut self, trng: &mut ChaCha8Rng, i: usize) -> Transfer {
        let mode = self.cfg.mode;
        let none = Transfer {
            pull: false,
            policy: LoadFailurePolicy::Fail,
            gate: false,
            second: None,
            sibling_decline: None,
            layerwise: false,
        };
        if mode == Mode::Push {
            return none;
        }
        let pull = trng.gen_bool(mode.pull_share());
        let policy = if trng.gen_bool(0.5) {
            LoadFailurePolicy::Recompute
        } else {
            LoadFailurePolicy::Fail
        };
        let gate = trng.gen_bool(0.5);
        let second = trng.gen_bool(mode.second_turn_share()).then(|| {
            // Short TTLs (the fast configuration's scale) so that expiry races happen; most
            // second turns come soon, some near or past the export's hard end (2 × TTL).
            let ttl = Duration::from_millis([2_500, 4_000, 6_000][trng.gen_range(0..3)]);
            let end = 2 * ttl.as_micros() as u64;
            let delay = match trng.gen_range(0..10) {
                0..=6 => micros(trng, 0, 50_000),
                7 | 8 => micros(trng, end.saturating_sub(4_000_000), end),
                _ => micros(trng, end, end + 500_000),
            };
            SecondTurn {
                key: PairingKey::new(format!("k{i}t2")).expect("valid key"),
                ttl,
                delay,
                blocks: trng.gen_range(1..=4),
                decline: trng.gen_bool(0.1),
                gate: trng.gen_bool(0.5),
            }
        });
        Transfer {
            pull,
            policy,
            gate,
            second,
            sibling_decline: None,
            layerwise: false,
        }
    }

    /// Draws the workload (seeded mode) or lays it out plainly (explore mode).
    pub(crate) fn setup_requests(&mut self) {
        // The transfer of each request is drawn from a stream of its own, so that a seed's
        // faults and timings are the same in every mode (and push seeds replay unchanged).
        let mut trng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x7472_616e_7366_6572);
        // Which requests are multi-rank, and their pairs: a stream of their own too, so that
        // the other requests' shapes and transfers are drawn as without them.
        let mut mrng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x6d75_6c74_6972_616e);
        if self.cfg.mode.reads() && self.cfg.faults == Faults::Chaos {
            self.rates.lose_ask = [0.0, 0.1, 0.3][trng.gen_range(0..3)];
        }
        // Siblings that decline the export a read is reading: a stream of their own, so that
        // every other draw of the seed stays as it was.
        let mut srng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x7369_626c_696e_6773);
        // Layer-wise hand-overs: a stream of their own too.
        let mut lrng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x6c61_7965_7277_6973);
        // Routers late to D at P's lease end (`WorldConfig::late_register`): one more.
        let mut late = ChaCha8Rng::seed_from_u64(self.seed ^ 0x6c61_7465_5f64_5f31);
        let mut orphans = ChaCha8Rng::seed_from_u64(self.seed ^ 0x6f72_7068_616e_7331);
        let sibling_rate = if self.cfg.mode.reads() && self.cfg.faults == Faults::Chaos {
            [0.0, 0.1, 0.3][srng.gen_range(0..3)]
        } else {
            0.0
        };
        for i in 0..self.cfg.requests {
            let key = PairingKey::new(format!("k{i}")).expect("valid key");
            let (d_node, p_blocks, d_blocks) = if self.cfg.explore {
                (1 + i % self.cfg.decode_engines, 2, 1 + i % 2)
            } else {
                let n = self.rng.gen_range(1..=4);
                let m = if self.rng.gen_bool(0.05) {
                    0
                } else {
                    self.rng.gen_range(1..=n)
                };
                (1 + self.rng.gen_range(0..self.cfg.decode_engines), n, m)
            };
            self.keys.insert(key.clone(), i);
            let multi = self.draw_multi(&mut mrng, &key, self.multi_decode_node(d_node));
            let d_node = match multi {
                Some(_) => self.multi_decode_node(d_node),
                None => d_node,
            };
            let mut transfer = self.draw_transfer(&mut trng, i);
            if srng.gen_bool(sibling_rate) {
                transfer.sibling_decline = Some(micros(&mut srng, 0, 20_000));
            }
            // Drawn as for any request (the stream stays aligned). A multi-rank request is
            // pushed or pulled as drawn, and keeps its second turn only where turns are read
            // back across the pair with turn links (`multi/turn.rs`).
            let drawn_pull = transfer.pull;
            let mut multi = multi;
            if let Some(multi) = multi.as_mut() {
                if !self.cfg.reads_turns_back_across_ranks() {
                    transfer.second = None;
                }
                // A pulled one keeps its sibling's decline where siblings decline multi-rank
                // pulls (the session declines at every holder, all or none).
                if !(drawn_pull && self.cfg.siblings_decline_across_ranks()) {
                    transfer.sibling_decline = None;
                }
                if drawn_pull {
                    self.draw_replicas(&mut mrng, multi);
                }
            }
            transfer.layerwise = self.cfg.layerwise > 0.0
                && lrng.gen_bool(self.cfg.layerwise)
                && !transfer.pull
                && multi.is_none();
            self.requests.push(Request {
                key,
                d_node,
                p_blocks,
                d_blocks,
                d: vec![Attempt {
                    id: rid("d", i, 1),
                    node: d_node,
                    epoch: 1,
                    blocks: vec![],
                    status: Status::Pending,
                    kind: AttemptKind::Push,
                    sub: None,
                }],
                p: vec![Attempt {
                    id: rid("p", i, 1),
                    node: 0,
                    epoch: 1,
                    blocks: vec![],
                    status: Status::Pending,
                    kind: AttemptKind::Push,
                    sub: None,
                }],
                transfer,
                multi: None,
            });
            let span = self.cfg.span.as_micros() as u64;
            let base = if span > 0 {
                self.rng.gen_range(0..span)
            } else {
                0
            };
            if self.cfg.one_key_across_turns {
                let key = self.requests[i].key.clone();
                if let Some(second) = self.requests[i].transfer.second.as_mut() {
                    second.key = key;
                }
            }
            if let Some(second) = &self.requests[i].transfer.second {
                self.keys.insert(second.key.clone(), i);
            }
            let mut d_at = Duration::from_micros(base) + micros(&mut self.rng, 0, 10_000);
            if drawn_pull && !self.cfg.explore {
                let lease = self.cfg.machine.lease_duration.as_micros() as u64;
                match trng.gen_range(0..20) {
                    // The router hands P's answer to D late: D asks about when P's lease
                    // ends.
                    0 => d_at += micros(&mut trng, lease.saturating_sub(300_000), lease + 300_000),
                    // A slow router: D asks well into P's lease, where a lost ask leaves it
                    // waiting long enough for its heartbeats to renew the lease.
                    1 | 2 => d_at += micros(&mut trng, lease / 3, lease * 5 / 6),
                    _ => {}
                }
            }
            let mut p_at = Duration::from_micros(base) + micros(&mut self.rng, 0, 10_000);
            if !self.cfg.explore && self.rng.gen_bool(self.rates.slow_prefill) {
                // A long prefill: D's deadline may fire while the write is in flight.
                p_at += micros(&mut self.rng, 4_700_000, 5_000_000);
                self.heal = self
                    .heal
                    .max(Time::ZERO + p_at + Duration::from_millis(500));
            }
            let late_register = self.cfg.late_register > 0.0
                && !self.cfg.explore
                && !drawn_pull
                && multi.is_none()
                && !self.requests[i].transfer.layerwise
                && late.gen_bool(self.cfg.late_register.min(1.0));
            if late_register {
                // D registers a little before P's lease ends (if P finishes at once), within
                // what P may stop for with D still looking alive: the aimed stall
                // (`engine/leases.rs`) then spans the lease's end.
                let m = &self.cfg.machine;
                let budget = crate::engine::quiet_stall_budget(m).as_micros() as u64;
                let early = micros(&mut late, 0, budget * 4 / 5);
                d_at = p_at + m.lease_duration.saturating_sub(early);
                self.late_registers.insert(i);
                let after = d_at + m.peer_timeout + Duration::from_millis(500);
                self.heal = self.heal.max(Time::ZERO + after);
            }
            let orphan = self.cfg.orphaned_registrations > 0.0
                && !self.cfg.explore
                && !late_register
                && !drawn_pull
                && multi.is_none()
                && !self.requests[i].transfer.layerwise
                && self.cfg.decode_engines >= 2
                && orphans.gen_bool(self.cfg.orphaned_registrations.min(1.0));
            if orphan {
                if let Some(at) = self.draw_orphan(&mut orphans, i, d_at) {
                    p_at = at;
                }
            }
            match multi {
                None => {
                    self.schedule(d_at, Ev::DecodeStart { request: i });
                    self.schedule(p_at, Ev::PrefillStart { request: i });
                }
                Some(multi) => self.setup_multi(&mut mrng, i, multi, d_at, p_at),
            }
            if !self.cfg.explore {
                for decode in [true, false] {
                    if self.rng.gen_bool(self.rates.abort) {
                        let at = Duration::from_micros(base) + micros(&mut self.rng, 0, 50_000);
                        self.schedule(at, Ev::Abort { request: i, decode });
                    }
                }
            }
        }
        if self.cfg.explore {
            return;
        }
        let span = self.cfg.span.as_micros() as u64;
        if matches!(self.cfg.faults, Faults::Network | Faults::Chaos) {
            for _ in 0..self.rng.gen_range(0..=2) {
                let d = 1 + self.rng.gen_range(0..self.cfg.decode_engines);
                let from = Time::from_nanos(self.rng.gen_range(0..span.max(1)) * 1_000);
                let until = from + micros(&mut self.rng, 50_000, 400_000);
                self.partitions.push((d, from, until));
                self.heal = self.heal.max(until);
            }
        }
        if self.cfg.faults == Faults::Chaos {
            for _ in 0..self.rng.gen_range(0..=2) {
                let node = self.rng.gen_range(0..self.nodes.len());
                let at = micros(&mut self.rng, 0, span.max(1));
                self.schedule(at, Ev::Crash { node });
            }
            // Late copies of handshakes (a concurrent dial finishing late, a replay), from a
            // stream of their own so the rest of a seed's schedule stays as it was.
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x6861_6e64_7368_616b);
            for _ in 0..rng.gen_range(0..=3) {
                let d = 1 + rng.gen_range(0..self.cfg.decode_engines);
                let (a, b) = if rng.gen_bool(0.5) { (0, d) } else { (d, 0) };
                let at = micros(&mut rng, 0, span.max(1));
                self.schedule(at, Ev::RepeatHandshake { a, b });
            }
            // Second decodes of a key on another D engine, from a stream of their own too.
            if self.cfg.decode_engines >= 2 {
                let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ 0x7365_636f_6e64_6431);
                let rate = [0.0, 0.02, 0.05][rng.gen_range(0..3)];
                for request in 0..self.requests.len() {
                    if rng.gen_bool(rate) {
                        let at = micros(&mut rng, 0, span.max(1) + 20_000);
                        self.schedule(at, Ev::SecondDecode { request });
                    }
                }
            }
            // Process stalls, from a stream of their own too.
            self.draw_stalls();
        }
    }
}
