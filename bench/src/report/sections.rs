//! Each bench's part of the generated section: its tables, the command that produces the same
//! figures on its own, and its plots.

use std::fmt::Write as _;

use kvhandoff_testkit::stats::{human_bytes, percentile, spread};

use crate::model::render_pairs;
use crate::turns::TableKind;

use super::{
    Outcome, ReportData, BANDWIDTH_PLOT, FRAGMENTATION_PLOT, LATENCY_CDF_PLOT, LAYERWISE_PLOT,
    MODEL_PLOT,
};

/// `![alt](plots/file)` if the plot was written, else a note that it was not.
fn plot_link(out: &mut String, data: &ReportData, file: &str, alt: &str) {
    if data.plots.iter().any(|p| p == file) {
        let _ = writeln!(out, "![{alt}](plots/{file})\n");
    } else {
        let _ = writeln!(out, "(No `plots/{file}` in this run.)\n");
    }
}

fn skipped(out: &mut String, why: &str) {
    let _ = writeln!(out, "Skipped: {why}.\n");
}

fn command(out: &mut String, text: &str) {
    let _ = writeln!(out, "```sh\n{text}\n```\n");
}

pub(super) fn control(out: &mut String, data: &ReportData) {
    let o = &data.plan.control;
    let _ = writeln!(out, "### Control path (`bench control`)\n");
    command(
        out,
        &format!(
            "kvhandoff bench control --requests {} --actix-requests {} --rounds {} \
             --actix-pool-blocks {} --actix-batch {} --json",
            o.requests, o.actix_requests, o.rounds, o.actix_pool_blocks, o.actix_batch
        ),
    );
    let r = match &data.control {
        Outcome::Ran(r) => r,
        Outcome::Skipped(why) => return skipped(out, why),
    };
    let range = |v: &[f64]| {
        let (lo, hi) = spread(v);
        format!("{lo:.0}–{hi:.0}")
    };
    let _ = writeln!(
        out,
        "| measure | median of the rounds | range | rounds × requests |\n|---|---|---|---|"
    );
    let _ = writeln!(
        out,
        "| machines, D registers first | {:.0} ns/request | {} | {} × {} |",
        r.machine_ns_per_request,
        range(&r.machine.decode_registers_first_rounds_ns),
        r.machine.decode_registers_first_rounds_ns.len(),
        r.machine.requests
    );
    let _ = writeln!(
        out,
        "| machines, P finishes first | {:.0} ns/request | {} | {} × {} |",
        r.machine_ns_per_request_prefill_first,
        range(&r.machine.prefill_finishes_first_rounds_ns),
        r.machine.prefill_finishes_first_rounds_ns.len(),
        r.machine.requests
    );
    let _ = writeln!(
        out,
        "| actix over the in-memory transport | {:.0} requests/s | {} | {} × {} |\n",
        r.actix_requests_per_sec,
        range(&r.actix.rounds_requests_per_sec),
        r.actix.rounds_requests_per_sec.len(),
        r.actix.requests
    );
}

pub(super) fn transfer(out: &mut String, data: &ReportData) {
    let o = &data.plan.transfer;
    let _ = writeln!(
        out,
        "### Transfer: raw NIXL vs kvhandoff (`bench transfer`)\n"
    );
    command(
        out,
        &format!(
            "kvhandoff bench transfer --tokens {} --repeats {} --plan-repeats {} \
             --notify-rounds {}{} --latency-repeats {} --json   # --features nixl",
            o.tokens,
            o.repeats,
            o.plan_repeats,
            o.notify_rounds,
            if o.notify_sweep {
                ""
            } else {
                " --no-notify-sweep"
            },
            o.latency_repeats
        ),
    );
    let r = match &data.transfer {
        Outcome::Ran(r) => r,
        Outcome::Skipped(why) => {
            skipped(out, why);
            return plot_link(out, data, LATENCY_CDF_PLOT, "one-block handoff latency CDF");
        }
    };
    let q = &r.request;
    let _ = writeln!(
        out,
        "One request: {} blocks × {} regions × {} = {}; {} timed repetitions per table and path \
         (medians); memcpy (one thread) {:.2} GB/s.\n",
        q.blocks,
        q.regions,
        human_bytes(q.block_bytes),
        human_bytes(q.request_bytes),
        r.repeats,
        r.memcpy_gbps
    );
    let _ = writeln!(
        out,
        "| table | descriptors | raw NIXL GB/s | kvhandoff GB/s | kvhandoff/raw | paired ratio | \
         raw ms | kvhandoff p50 ms | kvhandoff p99 ms |\n|---|---|---|---|---|---|---|---|---|"
    );
    for t in &r.tables {
        let _ = writeln!(
            out,
            "| {} | {} | {:.2} | {:.2} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} |",
            t.table,
            t.descriptors,
            t.raw.gbps,
            t.kvhandoff.gbps,
            t.ratio,
            t.paired_ratio,
            t.raw.total_us / 1e3,
            t.kvhandoff.latency_p50_us / 1e3,
            t.kvhandoff.latency_p99_us / 1e3
        );
    }
    let l = &r.latency;
    let _ = writeln!(
        out,
        "\nThe one-block handoff ({} descriptors, {}; {} repetitions each, alternating): kvhandoff \
         {:.3} ms p50 against one raw WRITE with its notification {:.3} ms p50, ratio {:.2} \
         (target ≤ {:.1}: {}). Planning the fragmented 70B case: {:.1} µs median ({} \
         descriptors). Notification round trip: {:.1} µs.\n",
        l.descriptors,
        human_bytes(l.bytes),
        l.repeats,
        l.kvhandoff_us / 1e3,
        l.raw_us / 1e3,
        l.ratio,
        l.target_ratio,
        if l.met { "met" } else { "not met" },
        r.fragmented_70b.plan_us,
        r.fragmented_70b.descriptors,
        r.notification_rtt_us
    );
    let s = &l.samples;
    if !s.raw_us.is_empty() && !s.kvhandoff_us.is_empty() {
        let _ = writeln!(
            out,
            "| one-block latency, ms | p10 | p50 | p90 | p99 | max |\n|---|---|---|---|---|---|"
        );
        for (name, v) in [("raw NIXL", &s.raw_us), ("kvhandoff", &s.kvhandoff_us)] {
            let p = |q: f64| percentile(v, q) / 1e3;
            let _ = writeln!(
                out,
                "| {name} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
                p(10.0),
                p(50.0),
                p(90.0),
                p(99.0),
                p(100.0)
            );
        }
        out.push('\n');
    }
    plot_link(out, data, LATENCY_CDF_PLOT, "one-block handoff latency CDF");
}

pub(super) fn sweep(out: &mut String, data: &ReportData) {
    let o = &data.plan.sweep;
    let _ = writeln!(
        out,
        "### Bandwidth by descriptor size (raw NIXL vs kvhandoff)\n"
    );
    let _ = writeln!(
        out,
        "`kvhandoff bench report`'s own sweep (`kvhandoff_bench::transfer::descriptor_sweep`, \
         feature `nixl`): one request of {} blocks ({} layers, {} KV head(s) of {}, bf16, 16-token \
         blocks), both sides' blocks in runs of `k` adjacent blocks with a free block between \
         runs, so each descriptor is `k` blocks; {} timed repetitions per point and path after a \
         warm-up, alternating; medians.\n",
        o.blocks, o.num_layers, o.kv_heads, o.head_dim, o.repeats
    );
    let r = match &data.sweep {
        Outcome::Ran(r) => r,
        Outcome::Skipped(why) => {
            skipped(out, why);
            return plot_link(out, data, BANDWIDTH_PLOT, "bandwidth by descriptor size");
        }
    };
    let _ = writeln!(
        out,
        "| run (blocks) | descriptors | bytes per descriptor | raw NIXL GB/s | kvhandoff GB/s | \
         kvhandoff/raw | raw ms | kvhandoff ms |\n|---|---|---|---|---|---|---|---|"
    );
    for p in &r.points {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.2} | {:.2} | {:.3} | {:.2} | {:.2} |",
            p.run_blocks,
            p.descriptors,
            human_bytes(p.descriptor_bytes),
            p.raw_gbps,
            p.kvhandoff_gbps,
            p.ratio,
            p.raw_p50_us / 1e3,
            p.kvhandoff_p50_us / 1e3
        );
    }
    out.push('\n');
    plot_link(out, data, BANDWIDTH_PLOT, "bandwidth by descriptor size");
}

pub(super) fn fragmentation(out: &mut String, data: &ReportData) {
    let f = &data.fragmentation;
    let _ = writeln!(out, "### Descriptors vs fragmentation (the planner)\n");
    let _ = writeln!(
        out,
        "`kvhandoff_bench::report::fragmentation_sweep`: {} blocks of `bench transfer`'s \
         geometry ({} regions); at each level that fraction of the request's block boundaries is \
         broken (the next block is not adjacent), P's alone or each side's by its own shuffle; \
         the planner merges only runs adjacent on both sides. {} descriptors at least (one per \
         region), {} at most (one per block and region).\n",
        f.blocks, f.regions, f.minimum, f.maximum
    );
    let _ = writeln!(
        out,
        "| broken boundaries | fraction | P scattered, D contiguous | both scattered |\n|---|---|---|---|"
    );
    for p in &f.points {
        let _ = writeln!(
            out,
            "| {} | {:.0}% | {} | {} |",
            p.breaks,
            p.fraction * 100.0,
            p.p_scattered,
            p.both_scattered
        );
    }
    out.push('\n');
    plot_link(
        out,
        data,
        FRAGMENTATION_PLOT,
        "descriptors vs fragmentation",
    );
}

pub(super) fn turns(out: &mut String, data: &ReportData) {
    let o = &data.plan.turns;
    let _ = writeln!(
        out,
        "### Turn 2: read from D vs recompute (`bench turns`)\n"
    );
    let prefixes: Vec<String> = o.prefixes.iter().map(u32::to_string).collect();
    command(
        out,
        &format!(
            "kvhandoff bench turns --prefixes {} --repeats {} --tp {} --max-read-mib {} --table {} \
             --json",
            prefixes.join(","),
            o.repeats,
            o.geometry.tp_size,
            o.max_read_bytes >> 20,
            match o.table {
                TableKind::Contiguous => "contiguous",
                TableKind::Fragmented => "fragmented",
            }
        ),
    );
    let r = match &data.turns {
        Outcome::Ran(r) => r,
        Outcome::Skipped(why) => return skipped(out, why),
    };
    let _ = writeln!(
        out,
        "{} at TP {} ({} per token per rank); reads over {}, {} table; recompute is a model ({:.0} \
         tokens/s, {}).\n",
        r.model.name,
        r.model.tp_size,
        human_bytes(r.model.bytes_per_token_per_rank),
        r.transport_note,
        r.table,
        r.compute_model.tokens_per_s,
        r.compute_model.source
    );
    let _ = writeln!(
        out,
        "| prefix tokens | bytes | descriptors | read ms | GB/s | recompute ms | read/recompute | \
         measured |\n|---|---|---|---|---|---|---|---|"
    );
    for row in &r.rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.3} | {} |",
            row.prefix_tokens,
            human_bytes(row.bytes),
            row.descriptors,
            row.read_ms,
            row.read_gbps,
            row.recompute_ms,
            row.ratio,
            if row.measured {
                "yes"
            } else {
                "no (fitted line)"
            }
        );
    }
    let _ = writeln!(
        out,
        "\nReading wins from {} (rows).\n",
        r.threshold_tokens
            .map_or("no measured prefix".to_string(), |t| format!("{t} tokens"))
    );
}

pub(super) fn model(out: &mut String, data: &ReportData) {
    let o = &data.plan.model;
    let _ = writeln!(
        out,
        "### The deployment model vs the seed's TP 4 table (`kvhandoff model`)\n"
    );
    command(
        out,
        &format!(
            "kvhandoff model --mode pull|push --tp {} --input-len IN --output-len OUT --qps QPS \
             --requests {} --runs {} --seed {}",
            o.deployment.tp, o.requests, o.runs, o.seed
        ),
    );
    if data.model.is_empty() {
        return skipped(out, "the model returned no rows");
    }
    let _ = writeln!(
        out,
        "Each row: the seed's measured figures (`kvhandoff_bench::model::SEED_TP4_ROWS`) beside \
         the model's under the fitted parameters (prefill MFU {:.2}, D max running {}, post {:.2} \
         µs/descriptor), in ms; `docs/model.md` says what the model is.\n",
        o.deployment.prefill_mfu,
        o.deployment.decode_max_running,
        o.deployment.post_per_descriptor_s * 1e6
    );
    out.push_str(&render_pairs(&data.model));
    out.push('\n');
    plot_link(out, data, MODEL_PLOT, "model vs seed mean TTFT");
}

pub(super) fn layerwise(out: &mut String, data: &ReportData) {
    let _ = writeln!(
        out,
        "### Layer-wise vs whole-request push: exposed transfer time\n"
    );
    let rows = match &data.layerwise {
        Outcome::Ran(rows) => rows,
        Outcome::Skipped(why) => {
            let _ = writeln!(out, "Not run: {why}.\n");
            return;
        }
    };
    let o = &data.plan.layerwise;
    let _ = writeln!(
        out,
        "`kvhandoff bench layerwise --rounds {}` over NIXL: a {}-layer rank (8 KV heads of 128, \
         bf16), P's forward pass emulated at {:.0} tokens/s, {} parts above {} tokens; exposed = \
         from the end of the last layer's compute to D's `BlocksReady`, median round; every \
         byte checked on D.\n",
        o.rounds, o.layers, o.prefill_tokens_per_s, o.parts, o.min_tokens
    );
    let _ = writeln!(
        out,
        "| prompt tokens | exposed ms, whole request | exposed ms, layer-wise | reduction |\n\
         |---|---|---|---|"
    );
    for r in rows {
        let reduction = if r.exposed_ms_whole > 0.0 {
            format!(
                "{:.0}%",
                100.0 * (1.0 - r.exposed_ms_layerwise / r.exposed_ms_whole)
            )
        } else {
            "—".to_string()
        };
        let _ = writeln!(
            out,
            "| {} | {:.3} | {:.3} | {reduction} |",
            r.tokens, r.exposed_ms_whole, r.exposed_ms_layerwise
        );
    }
    out.push('\n');
    plot_link(
        out,
        data,
        LAYERWISE_PLOT,
        "exposed transfer time by prompt length",
    );
}

pub(super) fn kernels(out: &mut String, data: &ReportData) {
    let o = &data.plan.kernels;
    let _ = writeln!(out, "### KV block kernels (`bench kernels`)\n");
    command(
        out,
        &format!(
            "kvhandoff bench kernels --blocks {} --rounds {} --threads {} --json   # --features cuda",
            o.workload.blocks, o.rounds, o.threads
        ),
    );
    let r = match &data.kernels {
        Outcome::Ran(r) => r,
        Outcome::Skipped(why) => return skipped(out, why),
    };
    let _ = writeln!(
        out,
        "{} buffer, {} threads, {} rounds; memcpy {:.2} GB/s. Ratio: the kernel's GB/s over a \
         copy of as many bytes run just before it (median over rounds).\n",
        human_bytes(r.buffer_bytes as u64),
        r.threads,
        r.rounds,
        r.memcpy_gbps
    );
    let _ = writeln!(
        out,
        "| kernel | bytes out | GB/s | copy GB/s | ratio |\n|---|---|---|---|---|"
    );
    for k in &r.kernels {
        let _ = writeln!(
            out,
            "| `{}` | {} | {:.2} | {:.2} | {:.2} |",
            k.name,
            human_bytes(k.bytes as u64),
            k.gbps,
            k.memcpy_gbps,
            k.ratio
        );
    }
    let c = &r.cuda;
    let _ = writeln!(
        out,
        "\nCUDA: {}compiled to PTX; {}.\n",
        if c.compiled { "" } else { "not " },
        if c.ran {
            format!("ran on {}", c.device.as_deref().unwrap_or("a GPU"))
        } else {
            format!(
                "not run ({})",
                c.reason.as_deref().unwrap_or("no reason given")
            )
        }
    );
}
