//! `kvhandoff node`: its arguments and its run.

use std::process::ExitCode;

use clap::Args;
use kvhandoff::metrics::MetricsServer;
use kvhandoff::Psk;
use kvhandoff_testkit::demo::DemoOptions;
use kvhandoff_testkit::node::{self, NodeOptions, NodeRole};

use super::logging::LogArgs;
use super::{conclude, demo_mode, ModeArg};

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum RoleArg {
    /// `prefill-0`: fills the blocks and sends them.
    Prefill,
    /// `decode-0`: receives the blocks and checks every byte.
    Decode,
}

#[derive(Debug, Args)]
pub(crate) struct NodeArgs {
    /// This process's engine.
    #[arg(long, value_enum)]
    role: RoleArg,
    /// Where this rank's TCP side channel listens, HOST:PORT (port 0 picks one; printed on
    /// stderr).
    #[arg(long, value_parser = parse_addr)]
    listen: std::net::SocketAddr,
    /// The other role's side channel, HOST:PORT.
    #[arg(long, value_parser = parse_addr)]
    peer: std::net::SocketAddr,
    /// TP ranks of each engine (give every node the same): the demo model's 8 KV heads split
    /// over this many ranks, each its own process; rank R of D pairs with rank R of P. 1, 2,
    /// 4 or 8.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=8), conflicts_with = "model")]
    tp: u32,
    /// This process's rank in its engine, below `--tp` (with `--model`: its rank index in its
    /// side's spec, `pp_rank × tp + tp_rank`). `--listen`, `--peer` and `--router` name rank
    /// 0's ports: rank R listens on `--listen`'s port + R and finds the other engine's rank R
    /// at `--peer`'s port + R (vLLM's side-channel convention).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=63))]
    rank: u32,
    /// With `--model`: every process of the pair must be given the same pair, `--requests`,
    /// `--seed`, `--window` and `--max-prompt-tokens`; this one runs rank `--rank` of `--role`'s
    /// side over NIXL and pairs with the other side's ranks over their side channels.
    #[command(flatten)]
    pair: super::pair_args::PairArgs,
    /// Requests to hand off (both processes must agree, as on every schedule option).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    requests: u32,
    /// Seed of the schedule (prompt lengths, arrivals, ids).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Longest prompt, in tokens (prompts are 16 tokens at least, or this many if fewer).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    max_prompt_tokens: u32,
    /// Logical blocks (512 KiB each) in this side's pool.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pool_blocks: u32,
    /// Mean gap between prompt arrivals at P, ms (exponential). P's fills must keep up with
    /// the arrivals for both races to happen (P's report counts late finishes). With
    /// `--model`: the fixed gap between this rank's request starts, from when it met its peers.
    #[arg(long, default_value_t = 20.0, value_parser = parse_gap_ms)]
    mean_arrival_gap_ms: f64,
    /// The most P's `request_finished` and D's `request_allocated` of a request are drawn
    /// apart, ms (each uniform in 0..=this after the prefill is due). Which side calls first
    /// decides the race; a side lagging its schedule by more than this runs only one race, so
    /// give a loaded machine more.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=10_000))]
    max_call_skew_ms: u64,
    /// The whole process's limit, waiting for the peer included; past it the node reports
    /// FAILED.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    timeout_secs: u64,
    /// Run requests K.. of the seeded plan (a restarted node continues its predecessor's
    /// plan); request K arrives when the handshake completes.
    #[arg(long, default_value_t = 0, value_name = "K")]
    start_at: u32,
    /// Heartbeat interval, ms; the peer is declared dead after 1.5 intervals of silence
    /// (default: the protocol's 2000 ms, peer timeout 3000 ms).
    #[arg(long, value_parser = clap::value_parser!(u64).range(10..=600_000))]
    heartbeat_ms: Option<u64>,
    /// How long P holds finished blocks that no D registered, ms (default 30000).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    lease_ms: Option<u64>,
    /// How long D waits for P's data after allocating, ms (default 120000).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    decode_deadline_ms: Option<u64>,
    /// How long P keeps a registration whose prefill has not finished without renewal, ms
    /// (default 120000). Give both nodes the same value: D's fence is sized on it.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    registration_ttl_ms: Option<u64>,
    /// The longest a posted write may stay in flight, ms (default 60000); P's write deadline
    /// and abandon wait fit inside it. Give both nodes the same value.
    #[arg(long, value_parser = clap::value_parser!(u64).range(3..=3_600_000))]
    max_write_life_ms: Option<u64>,
    /// The longest a control message may travel, ms (default 10000). Give both nodes the same
    /// value.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    max_message_delay_ms: Option<u64>,
    /// How long P stays after its last event waiting for D to exit, ms.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    linger_ms: u64,
    /// With `--model --mode bidir`: how long D's ranks keep each turn for P's read-back, ms
    /// (default 30 s).
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    keep_ttl_ms: u64,
    /// The peer may die during the run (a kill test's survivor): exit 0 when every request has
    /// exactly one typed outcome, no ready request has a wrong byte and every block is back,
    /// even if requests failed.
    #[arg(long)]
    expect_peer_loss: bool,
    /// How the requests move their KV (both processes must agree): `push`, `pull`, `mixed` or
    /// `bidir`. Every mode but push needs `--router`.
    #[arg(long, value_enum, default_value_t = ModeArg::Push)]
    mode: ModeArg,
    /// The router link, HOST:PORT. Without `--model` (D listens, P connects; give both the
    /// same): P's answers (a pulled request's block ids) reach D over it, and D's answers for a
    /// conversation's next turn reach P. With `--model`: the pair's router (`kvhandoff
    /// router`), which holder ranks tell their answers and readers get them from (needed by
    /// pull and bidir; a push without it derives P's parameters from the plan).
    #[arg(long, value_parser = parse_addr)]
    router: Option<std::net::SocketAddr>,
    /// TEST HOOK of the kill tests: right after this node's last engine call for request K of
    /// the plan (P: request_finished; D: keep_for_next_turn for a turn it keeps,
    /// request_allocated otherwise), stop this process with SIGSTOP (for the test to kill it
    /// there).
    #[cfg(feature = "test-hooks")]
    #[arg(long, value_name = "K")]
    stop_self_after: Option<u32>,
    /// TEST HOOK: this many ms into the schedule, send this rank's handshake to the peer again, twice: a
    /// second dial through the link and a raw copy from a plain socket (a test of repeated
    /// handshakes: the peer must change nothing).
    #[cfg(feature = "test-hooks")]
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    repeat_handshake_ms: Option<u64>,
    /// Serve the runtime's Prometheus metrics on `http://HOST:PORT/metrics` while the node
    /// runs (port 0 picks one; the address is printed on stderr). A taken address exits 2.
    #[arg(long, value_parser = parse_addr, value_name = "HOST:PORT")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// With `--metrics-addr`: keep serving this many ms after the report is printed, so that
    /// a last scrape sees the run's final figures.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    metrics_linger_ms: u64,
    /// The side channel's pre-shared key: the handshake is authenticated with it (HMAC-SHA256
    /// challenge-response) and refused by a peer with another key or none. The file holds the
    /// key (16 to 1024 bytes; one trailing newline is trimmed), e.g. `openssl rand -hex 32`.
    /// Give both nodes the same file. A bad file exits 2.
    #[arg(long, value_name = "PATH")]
    psk_file: Option<std::path::PathBuf>,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// vLLM's `--kv-transfer-config` JSON: `kv_role` (`kv_producer` = prefill, `kv_consumer` =
    /// decode) and `kv_connector_extra_config` (this command's options, as in a `[node]` table
    /// of `--config`); checked before the node starts. Options on the command line win.
    #[arg(long, value_name = "JSON")]
    kv_transfer_config: Option<String>,
    #[command(flatten)]
    log: LogArgs,
}

fn parse_gap_ms(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(ms) if ms.is_finite() && (0.0..=60_000.0).contains(&ms) => Ok(ms),
        _ => Err(format!("{text}: expected milliseconds between 0 and 60000")),
    }
}

fn parse_addr(text: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::ToSocketAddrs;
    text.to_socket_addrs()
        .map_err(|e| format!("{text}: {e}"))?
        .next()
        .ok_or_else(|| format!("{text} resolves to no address"))
}

pub(crate) fn run_node(args: NodeArgs) -> ExitCode {
    let psk = match args.psk_file.as_deref().map(Psk::from_file).transpose() {
        Ok(psk) => psk,
        Err(error) => {
            eprintln!("error: --psk-file: {error}");
            return ExitCode::from(2);
        }
    };
    let _logs = match args.log.init() {
        Ok(guard) => guard,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    // Up before the rank, so that a scrape during the run (the handshake included) finds it.
    let metrics = match args.metrics_addr.map(MetricsServer::start).transpose() {
        Ok(server) => server,
        Err(error) => {
            eprintln!("error: --metrics-addr: {error}");
            return ExitCode::from(2);
        }
    };
    if let Some(server) = &metrics {
        eprintln!(
            "kvhandoff node: metrics on http://{}/metrics",
            server.local_addr()
        );
    }
    let linger = std::time::Duration::from_millis(args.metrics_linger_ms);
    let code = run_schedule(args, psk);
    if let Some(server) = metrics {
        if !linger.is_zero() {
            // The report is out (and flushed): what a scrape reads now is the run's last word.
            let _ = std::io::Write::flush(&mut std::io::stdout());
            eprintln!(
                "kvhandoff node: report printed; serving metrics for {} ms more",
                linger.as_millis()
            );
            std::thread::sleep(linger);
        }
        drop(server);
    }
    code
}

fn run_schedule(args: NodeArgs, psk: Option<Psk>) -> ExitCode {
    if args.pair.model.is_some() {
        return run_pair_rank(&args, psk);
    }
    let role = match args.role {
        RoleArg::Prefill => NodeRole::Prefill,
        RoleArg::Decode => NodeRole::Decode,
    };
    let mut options = NodeOptions::new(role, args.listen, args.peer);
    options.schedule = DemoOptions {
        requests: args.requests as usize,
        seed: args.seed,
        min_prompt_tokens: args.max_prompt_tokens.min(16),
        max_prompt_tokens: args.max_prompt_tokens,
        pool_blocks: args.pool_blocks,
        mean_arrival_gap: std::time::Duration::from_secs_f64(args.mean_arrival_gap_ms / 1e3),
        max_call_skew: std::time::Duration::from_millis(args.max_call_skew_ms),
        timeout: std::time::Duration::from_secs(args.timeout_secs),
        mode: demo_mode(args.mode),
        ..options.schedule
    };
    options.router = args.router;
    options.psk = psk;
    options.tp = args.tp;
    options.rank = args.rank;
    let ms = std::time::Duration::from_millis;
    #[cfg(feature = "test-hooks")]
    {
        options.stop_self_after = args.stop_self_after.map(|k| k as usize);
        options.repeat_handshake_after = args.repeat_handshake_ms.map(ms);
    }
    options.start_at = args.start_at as usize;
    options.linger = ms(args.linger_ms);
    options.expect_peer_loss = args.expect_peer_loss;
    options.timing = timing(&args);
    conclude(
        node::run_full(&options),
        args.json,
        "the node",
        |r| r.render_table(),
        |r| r.verdict_ok(),
    )
}

/// The protocol's timing the flags set.
fn timing(args: &NodeArgs) -> node::NodeTiming {
    let ms = std::time::Duration::from_millis;
    node::NodeTiming {
        heartbeat: args.heartbeat_ms.map(ms),
        lease: args.lease_ms.map(ms),
        decode_deadline: args.decode_deadline_ms.map(ms),
        registration_ttl: args.registration_ttl_ms.map(ms),
        max_write_life: args.max_write_life_ms.map(ms),
        max_message_delay: args.max_message_delay_ms.map(ms),
    }
}

/// One rank of a heterogeneous pair (`--model`), as a process of its own.
fn run_pair_rank(args: &NodeArgs, psk: Option<Psk>) -> ExitCode {
    use kvhandoff_protocol::hetero::SideName;
    use kvhandoff_testkit::demo::{DemoError, DemoTransport};
    use kvhandoff_testkit::hetero::pair_demo::{run_rank, HeteroDemoOptions, RankProcess};
    let refuse = |error: String| super::pair_args::refuse(args.json, &error);
    let pair = match args.pair.specs() {
        Ok(Some(pair)) => pair,
        Ok(None) => return refuse("--model names the pair".into()),
        Err(e) => return refuse(e),
    };
    let mode = match super::pair_args::PairMode::of(args.mode, args.pair.first_turn) {
        Ok(mode) => mode,
        Err(why) => return refuse(why),
    };
    if mode.needs_router() && args.router.is_none() {
        return refuse(
            "a pair's ranks pull or read back across processes through its router \
             (`kvhandoff router`): --router"
                .into(),
        );
    }
    let options = HeteroDemoOptions {
        transport: DemoTransport::Nixl,
        pull: mode.pull,
        mixed: mode.mixed,
        bidir: mode.bidir,
        requests: args.requests as usize,
        window: args.pair.window as usize,
        seed: args.seed,
        max_prompt_tokens: u64::from(args.max_prompt_tokens),
        timeout: std::time::Duration::from_secs(args.timeout_secs),
        ..HeteroDemoOptions::new(&pair.model, pair.prefill, pair.decode)
    };
    let (side, prefill_base, decode_base) = match args.role {
        RoleArg::Prefill => (SideName::Prefill, args.listen, args.peer),
        RoleArg::Decode => (SideName::Decode, args.peer, args.listen),
    };
    if args.start_at >= args.requests {
        return refuse(format!(
            "--start-at {} is not below --requests {}",
            args.start_at, args.requests
        ));
    }
    let ms = std::time::Duration::from_millis;
    let config = match timing(args).config() {
        Ok(config) => config,
        Err(why) => return refuse(why),
    };
    let process = RankProcess {
        side,
        rank: args.rank,
        prefill_base,
        decode_base,
        linger: ms(args.linger_ms.min(2_000)),
        start_at: args.start_at as usize,
        gap: std::time::Duration::from_secs_f64(args.mean_arrival_gap_ms / 1e3),
        expect_peer_loss: args.expect_peer_loss,
        config,
        psk,
        router: args.router,
        keep_ttl: ms(args.keep_ttl_ms),
    };
    match run_rank(&options, &process) {
        Err(DemoError::Options(why)) => refuse(why),
        result => conclude(
            result,
            args.json,
            "the node",
            |r| r.render_table(),
            |r| r.ok,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        node: NodeArgs,
    }

    /// The flags' defaults are the node's own: a different one would change every seeded plan
    /// the end-to-end tests were written against (a 10 ms call skew once did).
    #[test]
    fn schedule_defaults_are_the_nodes() {
        let argv = [
            "x",
            "--role",
            "prefill",
            "--listen",
            "127.0.0.1:1",
            "--peer",
            "127.0.0.1:2",
        ];
        let args = Cli::try_parse_from(argv).expect("parses").node;
        let own = NodeOptions::new(NodeRole::Prefill, args.listen, args.peer).schedule;
        assert_eq!(
            std::time::Duration::from_millis(args.max_call_skew_ms),
            own.max_call_skew
        );
        assert_eq!(
            std::time::Duration::from_secs_f64(args.mean_arrival_gap_ms / 1e3),
            own.mean_arrival_gap
        );
        assert_eq!(args.max_prompt_tokens as u64, own.max_prompt_tokens as u64);
    }
}
