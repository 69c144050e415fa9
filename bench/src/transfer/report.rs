//! What `bench transfer` reports, and how it renders as a table.

use super::*;

/// The shape of the request moved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestShape {
    /// Layers.
    pub num_layers: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Tokens per kernel block.
    pub block_tokens: u32,
    /// Logical blocks moved.
    pub blocks: u32,
    /// Regions per rank (K and V per layer).
    pub regions: usize,
    /// Bytes of one block in one region.
    pub block_bytes: u64,
    /// Bytes moved per request.
    pub request_bytes: u64,
    /// Blocks in each side's pool.
    pub pool_blocks: u32,
}

/// Raw NIXL on one block table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RawNumbers {
    /// Request bytes over the time to the target's notification, GB/s (median).
    pub gbps: f64,
    /// Request bytes over the time to the initiator's completion, GB/s (median).
    pub complete_gbps: f64,
    /// Building the two descriptor lists, µs (median).
    pub build_us: f64,
    /// Inside `create_xfer_req` + `post_xfer_req`, µs (median).
    pub post_us: f64,
    /// First list entry to the initiator's `Success`, µs (median).
    pub complete_us: f64,
    /// First list entry to the notification at the target, µs (median).
    pub total_us: f64,
    /// The same, 99th percentile (nearest rank).
    pub total_p99_us: f64,
    /// Repetitions whose post already finished the transfer.
    pub done_in_post: usize,
}

/// kvhandoff on one block table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushNumbers {
    /// Request bytes over the handoff latency, GB/s (median).
    pub gbps: f64,
    /// Start of D's call to D's `BlocksReady`, µs: median.
    pub latency_p50_us: f64,
    /// The same, 99th percentile (nearest rank).
    pub latency_p99_us: f64,
    /// The same, fastest.
    pub latency_min_us: f64,
    /// D's `request_allocated` call itself, µs (median).
    pub d_call_us: f64,
    /// P's `request_finished` call itself, µs (median).
    pub p_call_us: f64,
}

/// One block table moved both ways.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TableNumbers {
    /// `contiguous` or `fragmented`.
    pub table: String,
    /// Descriptors the planner makes for it (and both paths post).
    pub descriptors: usize,
    /// Raw NIXL.
    pub raw: RawNumbers,
    /// kvhandoff end to end.
    pub kvhandoff: PushNumbers,
    /// `kvhandoff.gbps / raw.gbps`.
    pub ratio: f64,
    /// Median over the repetitions of raw time ÷ kvhandoff latency, each pair run back to back
    /// (less sensitive to slow drifts in machine load).
    pub paired_ratio: f64,
    /// Median kvhandoff latency minus median raw total, µs: what kvhandoff adds.
    pub overhead_us: f64,
    /// kvhandoff end to end (default configuration) in the second pass, alternating with
    /// [`TableNumbers::kvhandoff_dynamic`].
    pub kvhandoff_prepared: PushNumbers,
    /// kvhandoff end to end with prepared block lists off
    /// ([`NixlConfig::prepared_lists`] `= false`: every post builds dynamic lists), in a second
    /// pass after the raw vs kvhandoff one, alternating with [`TableNumbers::kvhandoff_prepared`]
    /// (which of the two runs first swaps every repetition).
    ///
    /// [`NixlConfig::prepared_lists`]: kvhandoff_actors::transport::nixl::NixlConfig::prepared_lists
    pub kvhandoff_dynamic: PushNumbers,
    /// `kvhandoff_dynamic.latency_p50_us / kvhandoff_prepared.latency_p50_us`: the gain from prepared
    /// lists (about 1 where every post takes the dynamic path anyway: coalesced descriptors).
    pub prepared_gain: f64,
    /// The request alone (raw nixl-sys, created and released unposted), dynamic vs prepared.
    pub prepared_request: PreparedRequest,
}

/// Creating the request of one post with raw nixl-sys, not posting it: two dynamic lists +
/// `create_xfer_req` against block indices + `make_xfer_req` on block-granular lists prepared
/// once, alternating, medians. A descriptor of `k` blocks is `k` prepared entries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreparedRequest {
    /// Two `XferDescList`s + `create_xfer_req`, µs (median).
    pub create_us: f64,
    /// Block indices + `make_xfer_req`, µs (median).
    pub make_us: f64,
    /// Entries of the prepared request (= descriptors when every descriptor is one block).
    pub entries: usize,
    /// `create_us / make_us`.
    pub gain: f64,
}

/// The fixed cost of one handoff: a one-block request, kvhandoff end to end against one raw
/// NIXL WRITE of the same descriptors with its notification, alternating in the same run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatencyNumbers {
    /// Blocks moved (1).
    pub blocks: u32,
    /// Descriptors of the request (one per region: nothing merges across regions).
    pub descriptors: usize,
    /// Bytes moved.
    pub bytes: u64,
    /// Raw NIXL: first list entry to the notification at the target, µs (median).
    pub raw_us: f64,
    /// kvhandoff: start of D's call to D's `BlocksReady`, µs (median).
    pub kvhandoff_us: f64,
    /// `kvhandoff_us / raw_us`: how many raw WRITEs one handoff costs.
    pub ratio: f64,
    /// Raw, 99th percentile, µs.
    pub raw_p99_us: f64,
    /// kvhandoff, 99th percentile, µs.
    pub kvhandoff_p99_us: f64,
    /// kvhandoff, fastest, µs.
    pub kvhandoff_min_us: f64,
    /// [`TARGET_LATENCY_RATIO`].
    pub target_ratio: f64,
    /// `ratio <= target_ratio`.
    pub met: bool,
    /// kvhandoff with prepared block lists off (dynamic lists only), µs (median of the second
    /// pass, [`TableNumbers::kvhandoff_dynamic`]).
    pub dynamic_us: f64,
    /// kvhandoff with prepared lists, µs (median of the second pass,
    /// [`TableNumbers::kvhandoff_prepared`]).
    pub prepared_us: f64,
    /// `dynamic_us / prepared_us`: the gain from prepared lists on a one-block handoff.
    pub prepared_gain: f64,
    /// The one-block request created both ways (raw nixl-sys, not posted).
    pub prepared_request: PreparedRequest,
    /// Repetitions timed (each path).
    pub repeats: usize,
    /// Every timed repetition of both paths, for distributions (`bench report`'s CDF); not in
    /// the JSON (the summaries above are).
    #[serde(skip)]
    pub samples: LatencySamples,
}

/// The one-block handoff's timed repetitions, in the order they ran (raw and kvhandoff
/// alternating, so `raw_us[i]` ran right before `kvhandoff_us[i]`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LatencySamples {
    /// Raw NIXL: first list entry to the notification at the target, µs.
    pub raw_us: Vec<f64>,
    /// kvhandoff: start of D's call to D's `BlocksReady`, µs.
    pub kvhandoff_us: Vec<f64>,
}

/// CPU time of the bench's process while its two ranks sit idle.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IdleCpu {
    /// Wall time measured, s.
    pub seconds: f64,
    /// User + system time of the whole process over it, s (`/proc/self/stat`, 10 ms ticks).
    pub cpu_seconds: f64,
    /// `cpu_seconds / seconds`, in % of one core.
    pub cpu_percent: f64,
}

/// The fragmented Llama-70B planning case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fragmented70b {
    /// Descriptors planned.
    pub descriptors: usize,
    /// The least any valid plan has (118 × 160).
    pub minimum: usize,
    /// One plan with a reused planner, µs (median).
    pub plan_us: f64,
    /// The same, 99th percentile.
    pub plan_us_p99: f64,
    /// Plans timed.
    pub plans: usize,
    /// Minimal, and the median under [`TARGET_PLAN_US`].
    pub met: bool,
}

/// The notification round trip with one agent setting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NotifyPoint {
    /// Whether the agents run NIXL's progress thread.
    pub progress_thread: bool,
    /// `pthr_delay_us` (meaningless without the progress thread).
    pub pthr_delay_us: u64,
    /// Round trip A → B → A, µs: median.
    pub rtt_p50_us: f64,
    /// The same, 99th percentile.
    pub rtt_p99_us: f64,
    /// The same, fastest.
    pub rtt_min_us: f64,
    /// A 32 MiB single-descriptor WRITE with a notification, to the target's notification,
    /// GB/s (median of 5).
    pub write_32mib_gbps: f64,
    /// Round trips timed.
    pub rounds: usize,
}

/// What `bench transfer` measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferReport {
    /// One thread copying the request's bytes, GB/s (median).
    pub memcpy_gbps: f64,
    /// Raw NIXL on the headline table, GB/s.
    pub raw_nixl_gbps: f64,
    /// kvhandoff end to end on the headline table, GB/s.
    pub kvhandoff_gbps: f64,
    /// `kvhandoff_gbps / raw_nixl_gbps`.
    pub ratio: f64,
    /// Descriptors of the headline table.
    pub descriptors: usize,
    /// The headline table (`fragmented`: the realistic, harder one).
    pub headline_table: String,
    /// The lower ratio of the two tables.
    pub ratio_min: f64,
    /// [`TARGET_RATIO`].
    pub target_ratio: f64,
    /// Both tables at or above the target ratio.
    pub ratio_met: bool,
    /// The headline table's [`TableNumbers::prepared_gain`]: kvhandoff's latency with dynamic
    /// lists only over its latency with prepared block lists, same run.
    pub prepared_gain: f64,
    /// The headline table's [`PreparedRequest::gain`]: creating the request (raw nixl-sys, not
    /// posted) with dynamic lists over with prepared lists.
    pub prepared_request_gain: f64,
    /// The one-block handoff: kvhandoff's latency against one raw WRITE with its notification.
    pub latency: LatencyNumbers,
    /// Whether the kvhandoff ranks ran NIXL's arrival poller.
    pub arrival_poller: bool,
    /// The idle ranks' CPU, when measured ([`TransferOptions::idle_secs`]).
    pub idle_cpu: Option<IdleCpu>,
    /// Handoff latency of the headline table, µs: median.
    pub handoff_latency_p50_us: f64,
    /// The same, 99th percentile.
    pub handoff_latency_p99_us: f64,
    /// Raw create + post of the headline table, µs (median).
    pub raw_post_us: f64,
    /// Notification round trip with [`NixlConfig::default`]'s agent settings, µs (median).
    ///
    /// [`NixlConfig::default`]: kvhandoff_actors::transport::nixl::NixlConfig
    pub notification_rtt_us: f64,
    /// The planning case.
    pub fragmented_70b: Fragmented70b,
    /// The request moved.
    pub request: RequestShape,
    /// Timed repetitions per table and path.
    pub repeats: usize,
    /// The kvhandoff ranks' settings: progress thread, its delay, the transport actor's poll interval.
    pub progress_thread: bool,
    /// `pthr_delay_us` of both paths.
    pub pthr_delay_us: u64,
    /// The transport actor's poll interval, µs.
    pub writer_poll_us: f64,
    /// Per table.
    pub tables: Vec<TableNumbers>,
    /// The notification round trip per agent setting.
    pub notification_sweep: Vec<NotifyPoint>,
}

impl TransferReport {
    /// The report as a table for people.
    pub fn render_table(&self) -> String {
        let r = &self.request;
        let mut out = format!(
            "kvhandoff bench transfer: {} blocks x {} regions x {} = {} per request, \
             {} repetitions (medians)\n",
            r.blocks,
            r.regions,
            human_bytes(r.block_bytes),
            human_bytes(r.request_bytes),
            self.repeats
        );
        let _ = writeln!(
            out,
            "  {:<12} {:>6} {:>9} {:>9} {:>10} {:>7} {:>7} {:>11} {:>11} {:>11} {:>11} {:>9}",
            "table",
            "descs",
            "raw GB/s",
            "kvh GB/s",
            "kvh/raw",
            "paired",
            "post ms",
            "raw ms",
            "kvh p50 ms",
            "kvh p99 ms",
            "dyn p50 ms",
            "prep gain"
        );
        for t in &self.tables {
            let _ = writeln!(
                out,
                "  {:<12} {:>6} {:>9.2} {:>9.2} {:>10.3} {:>7.3} {:>7.2} {:>11.2} {:>11.2} {:>11.2} {:>11.2} {:>9.3}",
                t.table,
                t.descriptors,
                t.raw.gbps,
                t.kvhandoff.gbps,
                t.ratio,
                t.paired_ratio,
                t.raw.post_us / 1e3,
                t.raw.total_us / 1e3,
                t.kvhandoff.latency_p50_us / 1e3,
                t.kvhandoff.latency_p99_us / 1e3,
                t.kvhandoff_dynamic.latency_p50_us / 1e3,
                t.prepared_gain,
            );
        }
        let verdict = |met: bool| if met { "met" } else { "NOT met" };
        let _ = writeln!(
            out,
            "  memcpy (one thread)       {:>8.2} GB/s",
            self.memcpy_gbps
        );
        let _ = writeln!(
            out,
            "  kvhandoff / raw NIXL      {:>8.3} ({} table; lowest {:.3}; target >= {:.2}: {})",
            self.ratio,
            self.headline_table,
            self.ratio_min,
            self.target_ratio,
            verdict(self.ratio_met)
        );
        let l = &self.latency;
        let _ = writeln!(
            out,
            "  one-block handoff         {:>8.3} ms p50 (p99 {:.3}, min {:.3}) vs raw WRITE + \
             notification {:.3} ms (p99 {:.3}): kvhandoff/raw {:.2} ({} descriptors, {}; \
             target <= {:.1}: {}; arrival poller {})",
            l.kvhandoff_us / 1e3,
            l.kvhandoff_p99_us / 1e3,
            l.kvhandoff_min_us / 1e3,
            l.raw_us / 1e3,
            l.raw_p99_us / 1e3,
            l.ratio,
            l.descriptors,
            human_bytes(l.bytes),
            l.target_ratio,
            verdict(l.met),
            if self.arrival_poller { "on" } else { "off" },
        );
        let _ = writeln!(
            out,
            "  prepared lists            {:>8.3} x ({} table: dynamic-only p50 / prepared p50; \
             one-block handoff {:.3} x: {:.3} ms dynamic-only / {:.3} ms prepared)",
            self.prepared_gain,
            self.headline_table,
            l.prepared_gain,
            l.dynamic_us / 1e3,
            l.prepared_us / 1e3,
        );
        for t in &self.tables {
            let p = &t.prepared_request;
            let _ = writeln!(
                out,
                "  request only, {:<11} create_xfer_req {:>9.1} us, make_xfer_req {:>9.1} us \
                 ({} entries): {:.2} x",
                t.table, p.create_us, p.make_us, p.entries, p.gain
            );
        }
        let p = &l.prepared_request;
        let _ = writeln!(
            out,
            "  request only, {:<11} create_xfer_req {:>9.1} us, make_xfer_req {:>9.1} us \
             ({} entries): {:.2} x",
            "one-block", p.create_us, p.make_us, p.entries, p.gain
        );
        if let Some(idle) = &self.idle_cpu {
            let _ = writeln!(
                out,
                "  idle ranks (P + D)        {:>8.2} % of a core ({:.2} s CPU in {:.1} s)",
                idle.cpu_percent, idle.cpu_seconds, idle.seconds
            );
        }
        let f = &self.fragmented_70b;
        let _ = writeln!(
            out,
            "  fragmented 70B plan       {:>8.1} us median, p99 {:.1} us, {} descriptors \
             (minimum {}; target < {TARGET_PLAN_US} us: {})",
            f.plan_us,
            f.plan_us_p99,
            f.descriptors,
            f.minimum,
            verdict(f.met)
        );
        let _ = writeln!(
            out,
            "  notification round trip  {:>8.1} us (progress thread {}, pthr_delay_us {}; \
             writer polls every {:.0} us)",
            self.notification_rtt_us,
            if self.progress_thread { "on" } else { "off" },
            self.pthr_delay_us,
            self.writer_poll_us
        );
        if !self.notification_sweep.is_empty() {
            let _ = writeln!(
                out,
                "  {:<28} {:>10} {:>10} {:>10} {:>14}",
                "agent setting", "rtt p50 us", "p99 us", "min us", "32 MiB GB/s"
            );
            for p in &self.notification_sweep {
                let setting = if p.progress_thread {
                    format!("progress thread, delay {}", p.pthr_delay_us)
                } else {
                    "no progress thread, polling".to_string()
                };
                let _ = writeln!(
                    out,
                    "  {:<28} {:>10.1} {:>10.1} {:>10.1} {:>14.2}",
                    setting, p.rtt_p50_us, p.rtt_p99_us, p.rtt_min_us, p.write_32mib_gbps
                );
            }
        }
        out
    }
}
