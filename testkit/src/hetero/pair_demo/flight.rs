//! The requests in flight: each started in a free memory slot of every rank (its arenas copied
//! in, P's pieces filed, every rank's call made in a seeded order), its events gathered from
//! every rank's connector while later requests start and earlier ones end, then finished (D's
//! memory read back, D's staging jobs, every byte checked) and its slot freed.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvhandoff::{ConnectorEvent, KvCache, KvConnector, KvTransferParams};
use kvhandoff_protocol::hetero::{PairPlan, SideName, Space};
use kvhandoff_protocol::machine::{ExportEnd, ExportOutcome, ImportOutcome};
use kvhandoff_protocol::{PairingKey, RequestId};
use rand::seq::SliceRandom;

mod filing;
mod finish;

use super::router::{Decision, RouterClient};
use super::{HeteroFault, Tally, PREFILL};
use crate::hetero::handoff::Handoff;
use filing::{file_at_post, file_routes, withdraw};
use finish::{finish, settle};
use kvhandoff::route::PlannedRoute;

/// A request's plan and arenas, shared by the flight loop and the P routes that stage for it.
pub(super) type Shared = Arc<Mutex<Handoff>>;

pub(super) fn lock(h: &Shared) -> Result<std::sync::MutexGuard<'_, Handoff>, String> {
    h.lock()
        .map_err(|_| "a request's arenas are poisoned".to_string())
}

/// What a read-back's reader adds to the request's id: the conversation's next turn.
const TURN_SUFFIX: &str = "-turn-2";

/// One rank as the demo drives it.
pub(super) struct Rank {
    pub(super) side: SideName,
    /// Index in its side's `ranks`.
    pub(super) index: usize,
    /// Its [`rank_index`](kvhandoff_protocol::KvGeometry::rank_index) in its engine.
    pub(super) id: u32,
    pub(super) conn: KvConnector,
    /// The engine's memory: per slot, its KV tensors, then its staging ([`region`]).
    pub(super) kv: KvCache,
    pub(super) route: Arc<PlannedRoute>,
    /// D over side channels: where P's engine listens (its base port: rank `p` at + `p`).
    pub(super) remote: Option<std::net::SocketAddr>,
}

/// How P's route learns where D's memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Placing {
    /// P's engine knows D's memory (one process) and files each link's pieces ahead.
    Ahead,
    /// D's route names its request's buffers in its registration (`Register::memory`) and P's
    /// route places the pieces there at post time: what a pair across processes needs.
    AtPost,
}

/// The region of `slot`'s KV tensors (`space` 0) or staging (`space` 1) in a rank's
/// [`KvCache`].
pub(super) fn region(slot: usize, space: usize) -> usize {
    2 * slot + space
}

impl Rank {
    /// Where `slot`'s `space` (0: KV, 1: staging) starts in the transport's address space.
    pub(super) fn base(&self, slot: usize, space: usize) -> Result<u64, String> {
        self.kv
            .region_addr(region(slot, space))
            .map_err(|e| format!("{} rank {}: {e}", self.side, self.id))
    }
}

/// How one rank's part of a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Ready,
    Failed,
    Sent,
    Released,
}

/// A request in flight.
struct Flight {
    /// Its index in the run.
    r: usize,
    slot: usize,
    /// D reads it (a pull or a read-back) instead of P writing it.
    pull: bool,
    /// Per rank, its event.
    ended: Vec<Option<Ended>>,
    /// When the last rank called.
    called: Instant,
}

/// Runs every request, at most `window` at a time, until all ended or `deadline`.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_all(
    handoffs: &[Shared],
    pair: &PairPlan,
    ranks: &mut [Rank],
    window: usize,
    seed: u64,
    fault: Option<(usize, HeteroFault)>,
    placing: Placing,
    pulled: &[bool],
    turn: Option<Duration>,
    router: Option<&RouterClient>,
    pace: Pace,
    chaos: &mut dyn FnMut(&mut rand_chacha::ChaCha8Rng) -> bool,
    deadline: Instant,
    tally: &mut Tally,
) {
    let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed);
    let mut chaos_rng =
        <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed ^ 0xc4a0_5000);
    let mut free: Vec<usize> = (0..window).rev().collect();
    let mut flights: BTreeMap<RequestId, Flight> = BTreeMap::new();
    let mut next = pace.first;
    let started = Instant::now();
    while (next < handoffs.len() || !flights.is_empty()) && Instant::now() < deadline {
        while next < handoffs.len() {
            let due = u32::try_from(next - pace.first)
                .ok()
                .and_then(|n| pace.gap.checked_mul(n))
                .map(|after| started + after);
            if due.is_some_and(|due| Instant::now() < due) {
                break;
            }
            // Across processes a reader (D, or P's ranks reading a turn back) starts a request
            // only once the router handed it the holders' answer; no rank starts one the
            // router abandoned (a holder refused it or will never serve it).
            let reads = ranks.iter().all(|rank| rank.side == SideName::Decode);
            let decided = match (router, router.and_then(|router| router.decision(next))) {
                (None, _) => None,
                (Some(_), Some(Decision::Abandoned)) => {
                    tally.outcome("Abandoned".into());
                    if reads {
                        tally.failed += 1;
                    } else {
                        tally.released += 1;
                    }
                    tally.error(format!(
                        "request {next}: abandoned by the router (a holder rank refused it, \
                         restarted past it or went away)"
                    ));
                    next += 1;
                    continue;
                }
                (Some(_), Some(Decision::Read(params))) => reads.then_some(*params),
                (Some(_), None) if reads => break,
                (Some(_), None) => None,
            };
            let Some(slot) = free.pop() else { break };
            let r = next;
            next += 1;
            let fault = fault.filter(|(at, _)| *at == r).map(|(_, f)| f);
            tally.faults_injected += u64::from(chaos(&mut chaos_rng));
            let pull = pulled.get(r).copied().unwrap_or(false) || turn.is_some();
            let call = Call {
                fault,
                placing,
                pull,
                turn,
                router,
                decided,
            };
            match start(r, slot, &handoffs[r], pair, ranks, &mut rng, call, tally) {
                Ok((request, ended)) => {
                    flights.insert(
                        request,
                        Flight {
                            r,
                            slot,
                            pull,
                            ended,
                            called: Instant::now(),
                        },
                    );
                }
                Err(error) => {
                    tally.error(format!("request {r}: {error}"));
                    free.push(slot);
                }
            }
        }
        let quiet = !gather(ranks, &mut flights, tally);
        let done: Vec<RequestId> = flights
            .iter()
            .filter(|(_, f)| f.ended.iter().all(Option::is_some))
            .map(|(id, _)| id.clone())
            .collect();
        for id in done {
            if let Some(flight) = flights.remove(&id) {
                let r = flight.r;
                if let Err(error) = finish(&flight, &handoffs[r], pair, ranks, tally) {
                    tally.error(format!("request {r}: {error}"));
                }
                free.push(flight.slot);
            }
        }
        if quiet {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    if next < handoffs.len() {
        tally.timed_out = true;
        tally.error(format!("requests {next}.. not started: the run timed out"));
    }
    for flight in flights.into_values() {
        // Timed out in flight: whichever side has no event still holds its blocks.
        tally.timed_out = true;
        withdraw(flight.r, pair, ranks);
        match lock(&handoffs[flight.r]) {
            Ok(h) => {
                settle(&flight, &h, ranks, tally);
            }
            Err(error) => tally.error(error),
        }
        tally.error(format!(
            "request {}: not every rank had its event",
            flight.r
        ));
    }
}

/// Which requests a run starts, and how fast: requests `first..` of the plan, request
/// `first + n` no earlier than `n × gap` after the run began (a gap of zero: as slots free up).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Pace {
    pub(super) first: usize,
    pub(super) gap: Duration,
}

/// How one request is started: its deliberate fault, how the routes place its pieces, and
/// whether D reads them (pull) instead of P writing them (push); across processes, the router
/// P's answers go to and what it handed D.
struct Call<'a> {
    fault: Option<HeteroFault>,
    placing: Placing,
    pull: bool,
    /// A later turn's read-back: the ranks' sides are swapped (D's engine holds, P's reads),
    /// the holders keep their blocks for the next turn, for this long, and the readers read
    /// them back.
    turn: Option<Duration>,
    router: Option<&'a RouterClient>,
    decided: Option<KvTransferParams>,
}

/// Starts request `r` in `slot`: every arena into the slot's memory, P's pieces and staging
/// work filed with its routes, every rank's call in a seeded order. Returns the request's id, and per rank
/// its end if its call was refused (the rank never exposed its blocks: D failed, P released).
#[allow(clippy::too_many_arguments)]
fn start(
    r: usize,
    slot: usize,
    shared: &Shared,
    pair: &PairPlan,
    ranks: &mut [Rank],
    rng: &mut rand_chacha::ChaCha8Rng,
    Call {
        fault,
        placing,
        pull,
        turn: keep,
        router,
        decided,
    }: Call<'_>,
    tally: &mut Tally,
) -> Result<(RequestId, Vec<Option<Ended>>), String> {
    let request = RequestId::new(format!("req-{r}")).map_err(|e| e.to_string())?;
    let key = PairingKey::from_request_id(&request);
    // A read-back is the conversation's next turn: another request on the readers, pairing by
    // the kept turn's key.
    let read_back = keep.is_some();
    let reader_request = if read_back {
        RequestId::new(format!("req-{r}{TURN_SUFFIX}")).map_err(|e| e.to_string())?
    } else {
        request.clone()
    };
    // Released before any call: a P route locks the arenas to stage when a registration comes.
    let (tokens, prefill_blocks, decode_blocks) = {
        let h = lock(shared)?;
        h.check_no_overlap().map_err(|e| e.to_string())?;
        for rank in ranks.iter() {
            for (i, space) in [Space::Kv, Space::Staging].into_iter().enumerate() {
                let bytes = &h.arenas[h.arena(rank.side, rank.index, space)].bytes;
                rank.kv
                    .write(region(slot, i), 0, bytes)
                    .map_err(|e| format!("{} rank {}: {e}", rank.side, rank.id))?;
            }
        }
        match (pull, placing) {
            (true, _) => super::pull::file_reads(&h, shared, pair, ranks, slot, &key, placing)?,
            (false, Placing::Ahead) => file_routes(&h, shared, pair, ranks, slot, &key, fault)?,
            (false, Placing::AtPost) => file_at_post(&h, shared, pair, ranks, slot, &key)?,
        }
        tally.descriptors += h.plan.descriptors() as u64;
        (
            h.shape.tokens,
            h.prefill_blocks.clone(),
            h.decode_blocks.clone(),
        )
    };
    tally.sub_requests += 2 * pair.links.len() as u64;

    let mut order: Vec<usize> = (0..ranks.len()).collect();
    order.shuffle(rng);
    let abort = fault == Some(HeteroFault::DecodeAborts);
    if pull {
        // The router hands P's answer to D: every P rank exported before any D rank reads.
        order.sort_by_key(|&i| ranks[i].side == SideName::Decode);
    }
    let mut answer: Option<KvTransferParams> = None;
    if abort {
        // Every D rank registers first, so that the abort below comes before any write.
        order.sort_by_key(|&i| ranks[i].side == SideName::Prefill);
    }
    let mut called: BTreeMap<(SideName, u32), usize> = BTreeMap::new();
    let mut ended = vec![None; ranks.len()];
    for (turn, &i) in order.iter().enumerate() {
        if abort
            && ranks[i].side == SideName::Prefill
            && !called.keys().any(|k| k.0 == SideName::Prefill)
        {
            if let Some(rank) = ranks.iter_mut().find(|r| r.side == SideName::Decode) {
                if let Err(error) = rank.conn.abort(&request) {
                    tally.error(format!("request {r}: D rank {} abort: {error}", rank.id));
                }
            }
        }
        let rank = &mut ranks[i];
        let result = match rank.side {
            SideName::Prefill if read_back => {
                let reply = rank.conn.keep_for_next_turn(
                    &request,
                    prefill_blocks.clone(),
                    tokens,
                    keep.unwrap_or(super::pull::KEEP_TTL),
                    &KvTransferParams::default(),
                );
                if let Some(router) = router {
                    if let Err(error) = router.answered(r, reply.as_ref().ok()) {
                        tally.error(format!("request {r}: {error}"));
                    }
                }
                reply.map(|reply| {
                    answer.get_or_insert(reply);
                })
            }
            SideName::Decode if read_back => {
                let params = {
                    let h = lock(shared)?;
                    super::pull::decode_params(decided.as_ref().or(answer.as_ref()), &h, pair, None)
                };
                rank.conn.next_turn_allocated(
                    &reader_request,
                    decode_blocks.clone(),
                    tokens,
                    &params,
                )
            }
            SideName::Prefill => {
                let params = if pull {
                    super::pull::prefill_params()
                } else {
                    KvTransferParams {
                        do_remote_decode: true,
                        ..KvTransferParams::default()
                    }
                };
                let reply =
                    rank.conn
                        .request_finished(&request, prefill_blocks.clone(), tokens, &params);
                if let Some(router) = router {
                    if let Err(error) = router.answered(r, reply.as_ref().ok()) {
                        tally.error(format!("request {r}: {error}"));
                    }
                }
                reply.map(|reply| {
                    answer.get_or_insert(reply);
                })
            }
            SideName::Decode if pull || decided.is_some() => {
                // Pull, or a push through the router: P's answer, as vLLM's proxy hands it.
                let params = {
                    let h = lock(shared)?;
                    let from_p = decided.as_ref().or(answer.as_ref());
                    super::pull::decode_params(from_p, &h, pair, rank.remote)
                };
                rank.conn
                    .request_allocated(&request, decode_blocks.clone(), tokens, &params)
            }
            // A push without a router: D knows P from the plan.
            SideName::Decode => rank.conn.request_allocated(
                &request,
                decode_blocks.clone(),
                tokens,
                &KvTransferParams {
                    do_remote_prefill: true,
                    remote_engine_id: Some(PREFILL.into()),
                    tp_size: Some(pair.prefill.spec.tp),
                    remote_host: rank.remote.map(|a| a.ip().to_string()),
                    remote_port: rank.remote.map(|a| a.port()),
                    ..KvTransferParams::default()
                },
            ),
        };
        if let Err(error) = result {
            tally.error(format!(
                "request {r}: {} rank {}: {error}",
                rank.side, rank.id
            ));
            ended[i] = Some(match rank.side {
                SideName::Decode => Ended::Failed,
                SideName::Prefill => Ended::Released,
            });
        }
        called.insert((rank.side, rank.id), turn);
    }
    for link in &pair.links {
        let p = pair.prefill.ranks[link.prefill].geometry.rank_index();
        let d = pair.decode.ranks[link.decode].geometry.rank_index();
        match (
            called.get(&(SideName::Prefill, p)),
            called.get(&(SideName::Decode, d)),
        ) {
            (Some(a), Some(b)) if b < a => tally.call_order.decode_registers_first += 1,
            (Some(_), Some(_)) => tally.call_order.prefill_finishes_first += 1,
            _ => {}
        }
    }
    Ok((request, ended))
}

/// Polls every rank's connector once and files each event with its request. Returns whether
/// anything came.
fn gather(
    ranks: &mut [Rank],
    flights: &mut BTreeMap<RequestId, Flight>,
    tally: &mut Tally,
) -> bool {
    let mut any = false;
    for (i, rank) in ranks.iter_mut().enumerate() {
        for event in rank.conn.poll_events() {
            any = true;
            let (request, end) = match &event {
                ConnectorEvent::BlocksReady { request, .. } => {
                    tally.outcome("Ready".into());
                    (request, Ended::Ready)
                }
                ConnectorEvent::DecodeFenced { request, reason } => {
                    // Not an end: the request's `Failed` follows with its blocks.
                    tally.error(format!(
                        "{request}: D rank {} failed early: {reason:?}",
                        rank.id
                    ));
                    continue;
                }
                ConnectorEvent::Failed {
                    request, reason, ..
                } => {
                    tally.error(format!("{request}: D rank {} failed: {reason:?}", rank.id));
                    tally.outcome(format!("Failed({reason:?})"));
                    (request, Ended::Failed)
                }
                ConnectorEvent::Imported {
                    request, outcome, ..
                } => match outcome {
                    ImportOutcome::Loaded => {
                        tally.outcome("Loaded".into());
                        (request, Ended::Ready)
                    }
                    ImportOutcome::Recompute { failure, .. } | ImportOutcome::Failed(failure) => {
                        tally.error(format!(
                            "{request}: D rank {} read failed: {failure:?}",
                            rank.id
                        ));
                        tally.outcome(format!("Failed({failure:?})"));
                        (request, Ended::Failed)
                    }
                },
                ConnectorEvent::ExportEnded {
                    request, outcome, ..
                } => match outcome {
                    // A replica's blocks were needed by no D rank: as sent.
                    ExportOutcome::Read | ExportOutcome::Released(ExportEnd::FullPrefixHit) => {
                        tally.outcome(format!("{outcome:?}"));
                        (request, Ended::Sent)
                    }
                    ExportOutcome::Released(end) => {
                        tally.outcome(format!("Released({end:?})"));
                        tally.error(format!(
                            "{request}: P rank {} export unread: {end:?}",
                            rank.id
                        ));
                        (request, Ended::Released)
                    }
                },
                ConnectorEvent::BlocksFree {
                    request, released, ..
                } => match released {
                    None => {
                        tally.outcome("Sent".into());
                        (request, Ended::Sent)
                    }
                    Some(cause) => {
                        tally.outcome(format!("Released({cause:?})"));
                        tally.error(format!(
                            "{request}: P rank {} released unsent: {cause:?}",
                            rank.id
                        ));
                        (request, Ended::Released)
                    }
                },
                other => {
                    tally.unknown += 1;
                    tally.error(format!(
                        "{} rank {}: unexpected {other:?}",
                        rank.side, rank.id
                    ));
                    continue;
                }
            };
            // A read-back's reader runs the conversation's next turn under its own id.
            let turn_of = request
                .as_str()
                .strip_suffix(TURN_SUFFIX)
                .and_then(|first| RequestId::new(first).ok());
            let request = turn_of.as_ref().unwrap_or(request);
            match flights.get_mut(request) {
                None => tally.unknown += 1,
                Some(flight) if flight.ended[i].is_some() => tally.duplicates += 1,
                Some(flight) => flight.ended[i] = Some(end),
            }
        }
    }
    any
}
