//! Warming a rank's connections up before its first request: the handshake (side channel, NIXL
//! metadata load) then happens at start instead of inside the first request's time to first
//! token.

use std::time::Duration;

use kvhandoff_actors::system::{blocking, Connect, QuerySideChannel, SideChannelStats};
use kvhandoff_protocol::PeerAddr;

use crate::{EngineRank, StartError};

impl EngineRank {
    /// Makes the handshake with `peer` now (over the TCP side channel, to the address given
    /// with [`RankBuilder::peer`](crate::RankBuilder::peer) or [`EngineRank::add_peer`]), so
    /// that the first request for it does not wait for one. Waits for the handshake's end, at
    /// most `timeout`. A handshake with a peer already connected changes nothing. In process
    /// (no side channel) it returns once the attempt ended: the directory has no failure to
    /// report apart from the request's own.
    ///
    /// # Errors
    /// [`StartError::WarmUp`]: the peer refused or did not answer within `timeout`. The rank is
    /// unaffected: a request for the peer tries again by itself.
    ///
    /// ```no_run
    /// # fn f(rank: &kvhandoff::EngineRank) -> Result<(), kvhandoff::StartError> {
    /// use kvhandoff::{EngineId, PeerAddr};
    /// let prefill = PeerAddr::new(EngineId::new("prefill").unwrap(), 0);
    /// rank.warm_up(&prefill, std::time::Duration::from_secs(10))?;
    /// # Ok(()) }
    /// ```
    pub fn warm_up(&self, peer: &PeerAddr, timeout: Duration) -> Result<(), StartError> {
        let link = &self.connector().rank().link;
        let stats = || blocking::ask(link, QuerySideChannel, timeout);
        let failed = |s: &SideChannelStats| s.outgoing_failed.values().sum::<u64>();
        let before = stats();
        let attempt = blocking::ask(link, Connect(peer.clone()), timeout);
        let refused = |why: String| StartError::WarmUp {
            peer: peer.clone(),
            why,
        };
        if attempt.is_none() {
            return Err(refused(format!("no handshake within {timeout:?}")));
        }
        match (before, stats()) {
            (Some(before), Some(after)) if before.listen.is_some() => {
                if after.outgoing_ok > before.outgoing_ok {
                    Ok(())
                } else if failed(&after) > failed(&before) {
                    let reasons: Vec<String> = after
                        .outgoing_failed
                        .iter()
                        .filter(|(reason, n)| before.outgoing_failed.get(reason) != Some(n))
                        .map(|(reason, _)| format!("{reason:?}"))
                        .collect();
                    Err(refused(format!("refused: {}", reasons.join(", "))))
                } else {
                    Err(refused("the handshake ended without an outcome".into()))
                }
            }
            _ => Ok(()),
        }
    }

    /// What the rank's TCP side channel did so far (handshakes in and out, rejections by
    /// reason); `None` in process or if the link did not answer within a few seconds.
    pub fn side_channel_stats(&self) -> Option<SideChannelStats> {
        let stats = blocking::ask(
            &self.connector().rank().link,
            QuerySideChannel,
            Duration::from_secs(5),
        )?;
        stats.listen.is_some().then_some(stats)
    }
}
