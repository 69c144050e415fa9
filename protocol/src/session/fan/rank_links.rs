//! [`RankLinks`]: which ranks of the other engine one rank of a heterogeneous pair exchanges
//! KV with, taken from the pair's plan and checked before any request fans out over them.

use crate::hetero::{PairPlan, SideName};
use crate::session::{ConnectorError, KvTransferParams};

/// The ranks of the other engine this rank exchanges every request's KV with, when the two
/// engines' geometries differ (a heterogeneous pair, planned by
/// [`plan_pair`](crate::hetero::plan_pair)).
///
/// ```
/// use kvhandoff_protocol::session::RankLinks;
/// use kvhandoff_protocol::hetero::{model, plan_pair, SideSpec};
/// let gqa8 = model("gqa8").unwrap();
/// let p: SideSpec = "tp=2,block=16,layout=NHD".parse().unwrap();
/// let d: SideSpec = "tp=4,block=16,layout=NHD".parse().unwrap();
/// let plan = plan_pair(gqa8, p, d).unwrap();
/// // D rank 3 holds heads 6..8, all on P rank 1.
/// assert_eq!(RankLinks::decode(&plan, 3).unwrap().peers, vec![1]);
/// // P rank 0 holds heads 0..4: D ranks 0 and 1.
/// assert_eq!(RankLinks::prefill(&plan, 0).unwrap().peers, vec![0, 1]);
/// // Pipeline stages: ranks are indexed stage by stage (`KvGeometry::rank_index`); D at one
/// // stage takes layers from both of P's, so its rank 0 is fed by P ranks 0 (stage 0) and 2.
/// let staged = plan_pair(gqa8, "tp=2,block=16,layout=NHD,pp=2".parse().unwrap(), d).unwrap();
/// assert_eq!(RankLinks::decode(&staged, 0).unwrap().peers, vec![0, 2]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankLinks {
    /// This rank's side of the pair.
    pub side: SideName,
    /// This rank, as the pair's plan numbers it
    /// ([`rank_index`](crate::KvGeometry::rank_index)): the sub-requests' pair keys and ids
    /// name it.
    pub rank: u32,
    /// The other engine's TP size (what the router's `tp_size` must say on D).
    pub remote_tp: u32,
    /// The other engine's ranks, over all its pipeline stages.
    pub remote_ranks: u32,
    /// The other engine's ranks this rank exchanges with, by
    /// [`rank_index`](crate::KvGeometry::rank_index), ascending (D: the P ranks
    /// writing to it; P: the D ranks it writes to; empty for a P replica that writes nothing).
    pub peers: Vec<u32>,
}

impl RankLinks {
    /// The links in `plan` of D's rank `rank` (its
    /// [`rank_index`](crate::KvGeometry::rank_index): the TP rank with one
    /// pipeline stage).
    ///
    /// # Errors
    /// [`ConnectorError::InvalidParam`] for a rank outside D's.
    pub fn decode(plan: &PairPlan, rank: u32) -> Result<RankLinks, ConnectorError> {
        Self::for_rank(plan, SideName::Decode, rank)
    }

    /// P rank `rank`'s links in `plan` (see [`RankLinks::decode`]).
    ///
    /// # Errors
    /// As [`RankLinks::decode`].
    pub fn prefill(plan: &PairPlan, rank: u32) -> Result<RankLinks, ConnectorError> {
        Self::for_rank(plan, SideName::Prefill, rank)
    }

    /// The links of `side`'s rank `rank` in `plan` (see [`RankLinks::decode`]).
    ///
    /// # Errors
    /// As [`RankLinks::decode`].
    pub fn for_rank(
        plan: &PairPlan,
        side: SideName,
        rank: u32,
    ) -> Result<RankLinks, ConnectorError> {
        let (own, other) = match side {
            SideName::Prefill => (&plan.prefill, &plan.decode),
            SideName::Decode => (&plan.decode, &plan.prefill),
        };
        let index = own
            .ranks
            .iter()
            .position(|r| r.geometry.rank_index() == rank)
            .ok_or_else(|| ConnectorError::InvalidParam {
                name: "rank",
                why: format!("{side} has no rank {rank}"),
            })?;
        let mut peers: Vec<u32> = match side {
            SideName::Prefill => plan
                .links_from(index)
                .map(|(_, l)| plan.decode.ranks[l.decode].geometry.rank_index())
                .collect(),
            SideName::Decode => plan
                .links_into(index)
                .map(|(_, l)| plan.prefill.ranks[l.prefill].geometry.rank_index())
                .collect(),
        };
        peers.sort_unstable();
        peers.dedup();
        Ok(RankLinks {
            side,
            rank,
            remote_tp: other.spec.tp,
            remote_ranks: u32::try_from(other.ranks.len()).unwrap_or(u32::MAX),
            peers,
        })
    }
}

impl RankLinks {
    /// Checks that the peers are distinct, ascending ranks of the other engine (at most
    /// [`MAX_SUB_REQUESTS`](crate::machine::MAX_SUB_REQUESTS)), whose TP size
    /// divides its ranks.
    ///
    /// # Errors
    /// [`ConnectorError::InvalidParam`] naming the rule.
    pub fn validate(&self) -> Result<(), ConnectorError> {
        let bad = |why: String| Err(ConnectorError::InvalidParam { name: "links", why });
        if self.remote_tp == 0 || self.remote_ranks % self.remote_tp != 0 {
            return bad(format!(
                "{} ranks are no whole number of TP {} stages",
                self.remote_ranks, self.remote_tp
            ));
        }
        if self.peers.len() > crate::machine::MAX_SUB_REQUESTS {
            return bad(format!("{} peers", self.peers.len()));
        }
        if let Some(&p) = self.peers.iter().find(|&&p| p >= self.remote_ranks) {
            return bad(format!(
                "rank {p} is not one of the other engine's {} ranks",
                self.remote_ranks
            ));
        }
        if self.peers.windows(2).any(|w| w[0] >= w[1]) {
            return bad(format!(
                "peers {:?} are not distinct and ascending",
                self.peers
            ));
        }
        Ok(())
    }
}

impl RankLinks {
    /// The router's `tp_size` names the other engine this rank is linked to.
    pub(in crate::session) fn check_remote_tp(
        &self,
        params: &KvTransferParams,
    ) -> Result<(), ConnectorError> {
        let tp = params
            .tp_size
            .ok_or(ConnectorError::MissingParam("tp_size"))?;
        if tp != self.remote_tp {
            return Err(ConnectorError::InvalidParam {
                name: "tp_size",
                why: format!(
                    "the other engine runs TP {tp}, this rank is linked to TP {}",
                    self.remote_tp
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
