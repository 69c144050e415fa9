//! `kvhandoff cluster --model M --prefill SPEC --decode SPEC`: the ranks of a heterogeneous pair
//! (engines of different TP, PP, block size, layout or cache kind), each its own
//! `kvhandoff node --model … --rank R` process over NIXL.

use kvhandoff_protocol::hetero::{model, plan_pair, SideSpec};

use crate::cli::pair_args::PairSpecs;
use serde_json::Value;

/// A heterogeneous pair to run, checked: the planner accepts it.
#[derive(Debug, Clone)]
pub(super) struct PairRun {
    model: String,
    prefill: SideSpec,
    decode: SideSpec,
    /// Ranks of P's engine and of D's (`TP × PP` each).
    pub(super) prefill_ranks: u32,
    pub(super) decode_ranks: u32,
    window: u32,
}

impl PairRun {
    /// The pair `specs`, refused with the planner's reason when it cannot run.
    pub(super) fn new(specs: PairSpecs, window: u32) -> Result<PairRun, String> {
        let found = model(&specs.model).map_err(|e| e.to_string())?;
        let pair = plan_pair(found, specs.prefill, specs.decode).map_err(|e| e.to_string())?;
        let count = |n: usize| {
            u32::try_from(n)
                .ok()
                .filter(|&n| n as usize <= super::MAX_SIDE_RANKS)
                .ok_or_else(|| format!("{n} ranks: at most {} per engine", super::MAX_SIDE_RANKS))
        };
        Ok(PairRun {
            model: specs.model,
            prefill: specs.prefill,
            decode: specs.decode,
            prefill_ranks: count(pair.prefill.ranks.len())?,
            decode_ranks: count(pair.decode.ranks.len())?,
            window,
        })
    }

    /// Ranks of `engine`.
    pub(super) fn ranks(&self, engine: &str) -> u32 {
        match engine {
            "decode" => self.decode_ranks,
            _ => self.prefill_ranks,
        }
    }

    /// The node flags that make a rank of this pair.
    pub(super) fn node_args(&self) -> Vec<String> {
        vec![
            "--model".into(),
            self.model.clone(),
            "--prefill".into(),
            self.prefill.to_string(),
            "--decode".into(),
            self.decode.to_string(),
            "--window".into(),
            self.window.to_string(),
        ]
    }

    /// The pair in words.
    pub(super) fn describe(&self) -> String {
        format!("{}: P {} -> D {}", self.model, self.prefill, self.decode)
    }
}

/// What a pair rank's report (`node --model … --json`) says: requests done (D: verified, P:
/// sent), byte errors, leaked blocks, whether it is ok, and its verdict.
pub(super) fn rank_counts(report: &Value) -> (u64, u64, u64, bool, Option<String>) {
    let count = |v: &Value| v.as_u64().unwrap_or(0);
    (
        count(&report["done"]),
        count(&report["byte_errors"]),
        count(&report["leaked_blocks"]),
        report["ok"] == true,
        report["verdict"].as_str().map(str::to_string),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(model: &str, prefill: &str, decode: &str) -> Result<PairSpecs, String> {
        Ok(PairSpecs {
            model: model.into(),
            prefill: prefill.parse().map_err(|e| format!("{e}"))?,
            decode: decode.parse().map_err(|e| format!("{e}"))?,
        })
    }

    #[test]
    fn a_pair_is_planned_or_refused_with_the_planners_reason() {
        let pair = PairRun::new(
            specs(
                "gqa8",
                "tp=2,block=16,layout=NHD,pp=2",
                "tp=1,block=32,layout=HND",
            )
            .unwrap(),
            4,
        )
        .unwrap();
        assert_eq!((pair.prefill_ranks, pair.decode_ranks), (4, 1));
        assert_eq!(pair.ranks("decode"), 1);
        assert!(pair
            .node_args()
            .contains(&"tp=1,block=32,layout=HND".to_string()));
        let unknown = specs(
            "nope",
            "tp=1,block=16,layout=NHD",
            "tp=1,block=16,layout=NHD",
        );
        assert!(PairRun::new(unknown.unwrap(), 4).is_err());
        let three = specs(
            "gqa8",
            "tp=3,block=16,layout=NHD",
            "tp=1,block=16,layout=NHD",
        );
        let bad = PairRun::new(three.unwrap(), 4).unwrap_err();
        assert!(bad.contains('3'), "{bad}");
    }
}
