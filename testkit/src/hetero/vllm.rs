//! What vLLM 0.33's NIXL connector does with a cell of the matrix, read off the references
//! (`/work/shared/reference/vllm-0.33-nixl.md` §4.1, §6; `vllm-nixl-protocol.md` §5–§7): a
//! small function of the two geometries, no run.
//!
//! Push (P writes; "local" is P): rejected when the kernel block sizes differ (P asserts
//! `P/D`, D asserts `D/P` on completion), when the layouts differ for a non-MLA model (D's
//! notification-only handshake never enables `enable_permute_local_kv`), when D's TP exceeds
//! P's and the heads (a KV-replicated remote; the check skips MLA and Mamba models), when TP
//! differs with an NHD layout (heterogeneous TP needs block-contiguous HND, unless no rank holds
//! more than one head so nothing is sliced — our reading of "unless replicated"), and with
//! decode-side PP or producer PP with Mamba. Pull (D reads; "local" is D) is the fallback:
//! block sizes may differ only with D's a multiple of P's, no hybrid allocator and HND (the
//! regroup on receive is written for block-contiguous layouts); layouts may differ only P HND →
//! D NHD with `enable_permute_local_kv` and no hybrid allocator; P's TP may exceed D's and the
//! heads only for MLA and Mamba; heterogeneous TP again needs HND on P (or D NHD with the
//! permute flag). A cell push refuses but pull accepts is "pull only"; an engine that cannot
//! shard the model at all (heads, mamba heads or layers that do not divide) is rejected first.

use kvhandoff_protocol::hetero::{Model, SideSpec};
use kvhandoff_protocol::KvLayout;
use serde::Serialize;

/// vLLM 0.33's verdict on a pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum VllmVerdict {
    /// Works in push mode (`NixlPushConnector`); the string notes redundant writes, if any.
    Push(String),
    /// Push refuses it (the reason); pull (`NixlConnector`) accepts it.
    PullOnly(String),
    /// Both refuse it (push's reason; pull's reason).
    Rejected(String),
}

impl VllmVerdict {
    /// `"push"`, `"pull only"` or `"rejected"`.
    pub fn label(&self) -> &'static str {
        match self {
            VllmVerdict::Push(_) => "push",
            VllmVerdict::PullOnly(_) => "pull only",
            VllmVerdict::Rejected(_) => "rejected",
        }
    }

    /// The reason or note.
    pub fn reason(&self) -> &str {
        match self {
            VllmVerdict::Push(s) | VllmVerdict::PullOnly(s) | VllmVerdict::Rejected(s) => s,
        }
    }
}

fn heads(model: &Model, tp: u32) -> u32 {
    if model.mla {
        1
    } else {
        (model.kv_heads / tp.max(1)).max(1)
    }
}

/// Why vLLM could not run `spec` at all (before any connector): KV heads that neither split
/// over nor replicate across the TP ranks, mamba state heads that do not shard evenly, or
/// layers that do not split over the PP stages.
pub fn engine_refusal(model: &Model, spec: &SideSpec) -> Option<String> {
    let h = model.kv_heads;
    if !model.mla && h % spec.tp != 0 && spec.tp % h != 0 {
        return Some(format!(
            "{h} KV heads neither split over nor replicate across tp={}",
            spec.tp
        ));
    }
    if let Some((state_heads, _, _)) = model.mamba() {
        if spec.tp > state_heads || state_heads % spec.tp != 0 {
            return Some(format!(
                "{state_heads} mamba heads do not shard over tp={}",
                spec.tp
            ));
        }
    }
    if model.num_layers % spec.pp != 0 {
        return Some(format!(
            "{} layers do not split over pp={}",
            model.num_layers, spec.pp
        ));
    }
    None
}

/// Why push refuses the pair, if it does.
pub fn push_refusal(model: &Model, p: &SideSpec, d: &SideSpec) -> Option<String> {
    let mamba = model.mamba().is_some();
    let h = model.kv_heads;
    if d.pp > 1 {
        return Some("decode-side PP > 1 is rejected".into());
    }
    if p.pp > 1 && mamba {
        return Some("producer PP with Mamba is rejected in push".into());
    }
    if p.block != d.block {
        return Some(
            "push needs equal kernel block sizes (P asserts P/D divides, D asserts D/P)".into(),
        );
    }
    if !model.mla && p.layout != d.layout {
        return Some(
            "push needs equal layouts (D's handshake never enables permute on receive)".into(),
        );
    }
    if !model.mla && !mamba && d.tp > p.tp && d.tp > h {
        return Some(
            "D TP above P's with D KV-replicated (D TP > KV heads) is rejected at P's handshake"
                .into(),
        );
    }
    let sliced = !(heads(model, p.tp) == 1 && heads(model, d.tp) == 1);
    if !model.mla && p.tp != d.tp && sliced && p.layout == KvLayout::Nhd {
        return Some("heterogeneous TP needs the block-contiguous HND layout".into());
    }
    None
}

/// Why pull refuses the pair, if it does.
pub fn pull_refusal(model: &Model, p: &SideSpec, d: &SideSpec) -> Option<String> {
    let mamba = model.mamba().is_some();
    let hybrid = model.is_hybrid();
    let h = model.kv_heads;
    if d.pp > 1 {
        return Some("decode-side PP > 1 is rejected".into());
    }
    if p.pp > 1 {
        return Some("pull addresses only PP rank 0 of a PP > 1 producer".into());
    }
    if p.block != d.block {
        if d.block % p.block != 0 {
            return Some("pull needs D's kernel block to be a multiple of P's".into());
        }
        if hybrid {
            return Some(
                "different block sizes are not supported with the hybrid allocator".into(),
            );
        }
        if !model.mla && p.layout == KvLayout::Nhd {
            return Some("the regroup on receive needs the block-contiguous HND layout".into());
        }
    }
    if !model.mla && p.layout != d.layout && (p.layout != KvLayout::Hnd || hybrid) {
        return Some(
            "layouts may differ only as P HND → D NHD with enable_permute_local_kv, without the \
             hybrid allocator"
                .into(),
        );
    }
    if !model.mla && !mamba && p.tp > d.tp && p.tp > h {
        return Some(
            "P TP above D's with P KV-replicated (P TP > KV heads) is rejected at D's handshake"
                .into(),
        );
    }
    let sliced = !(heads(model, p.tp) == 1 && heads(model, d.tp) == 1);
    if !model.mla && p.tp != d.tp && sliced && p.layout == KvLayout::Nhd {
        return Some("heterogeneous TP needs the block-contiguous HND layout on P".into());
    }
    None
}

/// vLLM 0.33's verdict on `p` → `d` for `model` (see the module documentation).
///
/// ```
/// use kvhandoff_testkit::hetero::vllm::{vllm_verdict, VllmVerdict};
/// use kvhandoff_protocol::hetero::model;
/// let gqa8 = model("gqa8").unwrap();
/// let v = vllm_verdict(gqa8, &"tp=2,block=16,layout=HND".parse().unwrap(),
///     &"tp=1,block=32,layout=HND".parse().unwrap());
/// assert_eq!(v.label(), "pull only");
/// ```
pub fn vllm_verdict(model: &Model, p: &SideSpec, d: &SideSpec) -> VllmVerdict {
    for (side, spec) in [("P", p), ("D", d)] {
        if let Some(why) = engine_refusal(model, spec) {
            return VllmVerdict::Rejected(format!("the {side} engine cannot run: {why}"));
        }
    }
    match (push_refusal(model, p, d), pull_refusal(model, p, d)) {
        (None, _) => {
            let h = if model.mla { 1 } else { model.kv_heads };
            let copies = p.tp / h.max(d.tp).max(1);
            let note = if copies > 1 {
                format!(
                    "{} P ranks write each D rank, each head {copies} times (redundant writes); D \
                     counts {} notifications",
                    p.tp / d.tp,
                    p.tp / d.tp
                )
            } else {
                String::new()
            };
            VllmVerdict::Push(note)
        }
        (Some(push), None) => VllmVerdict::PullOnly(push),
        (Some(push), Some(pull)) => VllmVerdict::Rejected(format!("push: {push}; pull: {pull}")),
    }
}
