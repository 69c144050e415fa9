//! The connection tasks: what both sides know about this rank ([`Local`]), the state they share
//! with the link actor ([`Shared`]), the listener's accept loop and the initiator's half.

use std::collections::BTreeSet;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::clock::Instant;
use actix::Recipient;
use kvhandoff_protocol::{EngineId, TraceId};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::auth::{self, AuthFailure, Nonces, Step, NONCE_LEN};
use super::handshake::{
    decode_handshake, read_frame, read_handshake, validate_handshake, write_frame,
};
use super::psk::Psk;
use super::{
    wire, AcceptPolicy, ClockEstimate, HandshakeError, LinkUp, Message, RejectReason,
    SideChannelConfig, SideChannelStats,
};
use kvhandoff_protocol::driver::{PeerInfo, SharedRoute};
use kvhandoff_protocol::Handshake;
use kvhandoff_protocol::PeerAddr;

/// What both sides of a handshake know about this rank.
pub(crate) struct Local {
    pub(crate) info: PeerInfo,
    pub(crate) config: SideChannelConfig,
    /// The rank's budget for one handshake, each side's part whole: the listener's from the
    /// accept to its answer, the initiator's from the dial to its rank's load of the peer
    /// ([`ShellConfig::handshake_timeout`](crate::system::ShellConfig::handshake_timeout)).
    pub(crate) handshake_timeout: Duration,
    /// The rank's transfer route, which decides on peers of another geometry.
    pub(crate) route: Option<SharedRoute>,
}

impl Local {
    pub(crate) fn new(
        info: PeerInfo,
        config: SideChannelConfig,
        handshake_timeout: Duration,
        route: Option<SharedRoute>,
    ) -> Self {
        Local {
            info,
            config,
            handshake_timeout,
            route,
        }
    }

    /// When a handshake begun now must be done.
    pub(crate) fn handshake_deadline(&self) -> Instant {
        Instant::now() + self.handshake_timeout
    }

    fn now_us(&self) -> u64 {
        u64::try_from(crate::system::process_clock().as_micros()).unwrap_or(u64::MAX)
    }

    /// This rank's handshake for the connection traced by `trace_id`, and when it was stamped.
    fn frame(&self, trace_id: TraceId) -> (Vec<u8>, u64) {
        let now = self.now_us();
        let handshake = self
            .info
            .handshake(self.config.modes.clone(), now, trace_id);
        (wire::encode(&Message::Handshake(Box::new(handshake))), now)
    }

    /// Checks that this rank's own handshake is valid (so that encoding it cannot panic).
    pub(crate) fn check_own(&self) -> io::Result<()> {
        let handshake = self
            .info
            .handshake(self.config.modes.clone(), 0, TraceId::random());
        Message::Handshake(Box::new(handshake))
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("own handshake: {e}")))
    }
}

/// State shared by the link actor and its connection tasks.
pub(crate) struct Shared {
    stats: Mutex<SideChannelStats>,
    /// Engines in the link's peer book: the listener takes their handshakes.
    known: Mutex<BTreeSet<EngineId>>,
    max_clocks: usize,
}

impl Shared {
    pub(crate) fn new(listen: Option<SocketAddr>, max_clocks: usize) -> Self {
        Shared {
            stats: Mutex::new(SideChannelStats {
                listen,
                ..SideChannelStats::default()
            }),
            known: Mutex::new(BTreeSet::new()),
            max_clocks,
        }
    }

    /// `engine` is in the peer book now.
    pub(crate) fn know(&self, engine: &EngineId) {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        known.insert(engine.clone());
    }

    fn accepts(&self, policy: &AcceptPolicy, engine: &EngineId) -> bool {
        policy.lists(engine)
            || self
                .known
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(engine)
    }

    fn with<R>(&self, f: impl FnOnce(&mut SideChannelStats) -> R) -> R {
        let mut stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut stats)
    }

    pub(crate) fn snapshot(&self) -> SideChannelStats {
        self.with(|s| s.clone())
    }

    fn record_clock(&self, engine: &EngineId, estimate: ClockEstimate) {
        let max = self.max_clocks;
        self.with(|s| match s.clocks.get_mut(engine) {
            Some(kept) => {
                if estimate.replaces(kept) {
                    *kept = estimate;
                }
            }
            None => {
                if s.clocks.len() < max {
                    s.clocks.insert(engine.clone(), estimate);
                }
            }
        });
    }

    fn rejected(&self, reason: RejectReason) {
        self.with(|s| *s.rejected.entry(reason).or_insert(0) += 1);
        // The process's figures too, for `/metrics` (they outlive the link).
        crate::metrics::count_rejection(reason);
    }

    pub(crate) fn outgoing_failed(&self, reason: RejectReason) {
        self.with(|s| *s.outgoing_failed.entry(reason).or_insert(0) += 1);
    }
}

/// Binds the listener (synchronously, inside the actix system's runtime).
pub(crate) fn bind(listen: SocketAddr) -> io::Result<(TcpListener, SocketAddr)> {
    let std_listener = std::net::TcpListener::bind(listen)?;
    std_listener.set_nonblocking(true)?;
    let listener = TcpListener::from_std(std_listener)?;
    let addr = listener.local_addr()?;
    Ok((listener, addr))
}

/// Accepts connections forever, each served in its own task, at most `max_concurrent` at once.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    local: Arc<Local>,
    shared: Arc<Shared>,
    up: Recipient<LinkUp>,
) {
    let permits = Arc::new(Semaphore::new(
        local.config.max_concurrent.min(Semaphore::MAX_PERMITS),
    ));
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of descriptors and the like: back off a little and keep serving.
                tracing::warn!(%error, "side channel accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        shared.with(|s| s.accepted += 1);
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::debug!(%from, "side channel busy; connection closed");
            shared.rejected(RejectReason::Busy);
            drop(stream);
            continue;
        };
        let (local, shared, up) = (local.clone(), shared.clone(), up.clone());
        actix::spawn(async move {
            let mut stream = stream;
            let started = std::time::Instant::now();
            match serve(&local, &shared, &mut stream, &up).await {
                Ok((info, clock, trace_id)) => {
                    crate::metrics::observe_handshake(started.elapsed());
                    tracing::info!(peer = %info.peer, %from, %trace_id, "side channel handshake served");
                    shared.record_clock(&info.peer.engine, clock);
                    shared.with(|s| s.incoming_ok += 1);
                    let _ = stream.shutdown().await;
                }
                Err(error) => {
                    // Mismatched peers are worth a warning; noise (scanners, garbage, stalls)
                    // is only counted and logged at debug level.
                    if error.is_mismatch() {
                        tracing::warn!(%from, %error, "side channel handshake rejected");
                    } else {
                        tracing::debug!(%from, %error, "side channel connection rejected");
                    }
                    shared.rejected(error.reason());
                }
            }
            // Counted before the close, so whoever sees the close sees the count.
            drop(stream);
            drop(permit);
        });
    }
}

/// The listener's half: read, validate, hand to the rank, answer.
async fn serve(
    local: &Local,
    shared: &Shared,
    stream: &mut TcpStream,
    up: &Recipient<LinkUp>,
) -> Result<(PeerInfo, ClockEstimate, TraceId), HandshakeError> {
    let deadline = local.handshake_deadline();
    let (handshake, auth) = match &local.config.psk {
        None => (read_handshake(stream, deadline).await?, None),
        Some(key) => {
            let (handshake, theirs, nonces) = serve_auth(key, stream, deadline).await?;
            (handshake, Some((key, theirs, nonces)))
        }
    };
    // The dialler made the connection's trace id; the answer repeats it.
    let trace_id = handshake.trace_id;
    let t_recv = local.now_us();
    validate_handshake(
        &local.info,
        &local.config.modes,
        &handshake,
        None,
        local.route.as_ref(),
    )?;
    if !shared.accepts(&local.config.accept, &handshake.engine_id) {
        return Err(HandshakeError::NotAccepted(handshake.engine_id));
    }
    let clock = ClockEstimate::one_way(handshake.clock_sample_us, t_recv);
    let info = PeerInfo::from_handshake(handshake);
    link_up(up, info.clone(), remaining(deadline)).await?;
    let (mut answer, _) = local.frame(trace_id);
    if let Some((key, theirs, nonces)) = auth {
        let tag = auth::listener_tag(key, &nonces, &theirs, &answer);
        answer.extend_from_slice(&auth::frame(Step::Tag, &[&tag]));
    }
    write_frame(stream, &answer, deadline).await?;
    Ok((info, clock, trace_id))
}

/// The listener's authentication, before it decodes anything of the initiator's handshake:
/// reads the hello, answers with a fresh nonce and its proof of the key, reads the handshake
/// frame and its tag and verifies the tag. Returns the handshake, its bytes (the answer's tag
/// binds them) and the nonces.
async fn serve_auth(
    key: &Psk,
    stream: &mut TcpStream,
    deadline: Instant,
) -> Result<(Handshake, Vec<u8>, Nonces), HandshakeError> {
    let hello = auth::read_auth(stream, Step::Hello, deadline).await?;
    let mut nonces = Nonces {
        initiator: [0; NONCE_LEN],
        listener: auth::nonce()?,
    };
    nonces.initiator.copy_from_slice(&hello);
    let proof = auth::proof(key, &nonces);
    let challenge = auth::frame(Step::Challenge, &[&nonces.listener, &proof]);
    write_frame(stream, &challenge, deadline).await?;
    let theirs = match read_frame(stream, deadline).await {
        Ok(frame) => frame,
        // Only an initiator that refused our proof (or gave up) closes here.
        Err(HandshakeError::Closed) => return Err(AuthFailure::Abandoned.into()),
        Err(HandshakeError::Authentication(_)) => return Err(AuthFailure::BadFrame.into()),
        Err(error) => return Err(error),
    };
    let tag = auth::read_auth(stream, Step::Tag, deadline)
        .await
        .map_err(|error| match error {
            // A plain frame where the tag belongs: the handshake is not authenticated.
            HandshakeError::Closed | HandshakeError::Authentication(_) => {
                AuthFailure::BadMac.into()
            }
            other => other,
        })?;
    auth::verify_initiator(key, &nonces, &theirs, &tag)?;
    Ok((decode_handshake(&theirs)?, theirs, nonces))
}

/// Hands a handshaken peer to the rank, which loads it and feeds `PeerConnected` (or, if the
/// load fails, `PeerConnectFailed`) atomically. Waits at most `limit` for the rank's answer:
/// past it the handshake is reported failed here, and the rank may still complete the load
/// (its `LinkUp` is already queued) — harmless, since the peer's next handshake repeats the
/// incarnation the rank then holds and changes nothing.
pub(crate) async fn link_up(
    up: &Recipient<LinkUp>,
    info: PeerInfo,
    limit: Duration,
) -> Result<(), HandshakeError> {
    match tokio::time::timeout(limit, up.send(LinkUp(info))).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(failure))) => Err(HandshakeError::Load(format!("{failure:?}"))),
        Ok(Err(_)) => Err(HandshakeError::Load("rank unavailable".into())),
        Err(_) => Err(HandshakeError::Load(format!(
            "the rank did not load the peer within {limit:?}"
        ))),
    }
}

/// What is left of the time to `deadline` (zero once it passed).
pub(crate) fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// The initiator's half, all by `deadline` (the TCP connect by the side channel's
/// `connect_timeout` too): connect, send ours (under a new trace id for the connection), read
/// and validate theirs. Loading is the caller's.
pub(crate) async fn initiate(
    local: &Local,
    addr: SocketAddr,
    expected: &PeerAddr,
    deadline: Instant,
) -> Result<(PeerInfo, ClockEstimate, TraceId), HandshakeError> {
    let connect_by = deadline.min(Instant::now() + local.config.connect_timeout);
    let mut stream = match tokio::time::timeout_at(connect_by, TcpStream::connect(addr)).await {
        Err(_) => return Err(HandshakeError::ConnectTimedOut(addr)),
        Ok(Err(error)) if error.kind() == io::ErrorKind::TimedOut => {
            return Err(HandshakeError::ConnectTimedOut(addr))
        }
        Ok(Err(error)) => {
            return Err(HandshakeError::Connect {
                addr,
                detail: error.to_string(),
            })
        }
        Ok(Ok(stream)) => stream,
    };
    let trace_id = TraceId::random();
    let (handshake, t_send) = match &local.config.psk {
        None => {
            let (frame, t_send) = local.frame(trace_id);
            write_frame(&mut stream, &frame, deadline).await?;
            (read_handshake(&mut stream, deadline).await?, t_send)
        }
        Some(key) => initiate_auth(local, key, trace_id, &mut stream, deadline).await?,
    };
    let t_recv = local.now_us();
    validate_handshake(
        &local.info,
        &local.config.modes,
        &handshake,
        Some(expected),
        local.route.as_ref(),
    )?;
    if handshake.trace_id != trace_id {
        // Not a reason to refuse the peer (the trace id only joins logs), but worth knowing.
        tracing::debug!(%trace_id, answer = %handshake.trace_id, "peer answered under another trace id");
    }
    let clock = ClockEstimate::round_trip(handshake.clock_sample_us, t_send, t_recv);
    Ok((PeerInfo::from_handshake(handshake), clock, trace_id))
}

/// The initiator's authenticated exchange: hello, the listener's challenge (its proof checked
/// before anything of ours is sent), our handshake and its tag, then the answer and its tag,
/// verified before the answer is decoded. Returns the answer and when ours was made.
async fn initiate_auth(
    local: &Local,
    key: &Psk,
    trace_id: TraceId,
    stream: &mut TcpStream,
    deadline: Instant,
) -> Result<(Handshake, u64), HandshakeError> {
    let mut nonces = Nonces {
        initiator: auth::nonce()?,
        listener: [0; NONCE_LEN],
    };
    write_frame(
        stream,
        &auth::frame(Step::Hello, &[&nonces.initiator]),
        deadline,
    )
    .await?;
    let challenge = match auth::read_auth(stream, Step::Challenge, deadline).await {
        Ok(body) => body,
        // A listener without a key closes on our hello (with it unread: often a reset).
        Err(HandshakeError::Closed)
        | Err(HandshakeError::Io {
            kind: io::ErrorKind::ConnectionReset,
            ..
        }) => return Err(AuthFailure::NoChallenge.into()),
        // A listener without a key never writes first; anything but a challenge is noise.
        Err(HandshakeError::Authentication(AuthFailure::PeerHasNoKey)) => {
            return Err(AuthFailure::BadFrame.into())
        }
        Err(error) => return Err(error),
    };
    let (listener_nonce, proof) = challenge.split_at(NONCE_LEN);
    nonces.listener.copy_from_slice(listener_nonce);
    auth::verify_proof(key, &nonces, proof)?;
    let (mut ours, t_send) = local.frame(trace_id);
    let tag = auth::initiator_tag(key, &nonces, &ours);
    let sent = ours.len();
    ours.extend_from_slice(&auth::frame(Step::Tag, &[&tag]));
    write_frame(stream, &ours, deadline).await?;
    ours.truncate(sent);
    let theirs = read_frame(stream, deadline).await?;
    let tag = auth::read_auth(stream, Step::Tag, deadline)
        .await
        .map_err(|error| match error {
            HandshakeError::Closed | HandshakeError::Authentication(_) => {
                AuthFailure::BadMac.into()
            }
            other => other,
        })?;
    auth::verify_listener(key, &nonces, &ours, &theirs, &tag)?;
    Ok((decode_handshake(&theirs)?, t_send))
}

/// Records a completed outgoing handshake.
pub(crate) fn outgoing_ok(shared: &Shared, engine: &EngineId, clock: ClockEstimate) {
    shared.record_clock(engine, clock);
    shared.with(|s| s.outgoing_ok += 1);
}
