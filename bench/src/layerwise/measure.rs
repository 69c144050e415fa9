//! The measurement: both ranks in this process, P's forward pass emulated, every byte checked.

use std::thread;
use std::time::{Duration, Instant};

use kvhandoff::{
    ConnectorError, ConnectorEvent, ConnectorSettings, KvTransferParams, TransportKind,
};
use kvhandoff_actors::system::ShellConfig;
use kvhandoff_actors::transport::mem::MemFabric;
use kvhandoff_protocol::machine::Config;
use kvhandoff_protocol::{BlockIds, KvGeometry, KvLayout, RequestId};
use kvhandoff_testkit::pattern::mix;
use kvhandoff_testkit::stats::median;

use super::{LayerwiseBenchError, LayerwiseOptions, LayerwiseRow, LayerwiseTransport};
use crate::pair::{check_blocks, start_pair, wait_for, EnginePair, PairError, PairSpec};

/// Tokens per block.
const BLOCK_TOKENS: u32 = 16;

/// A Llama-3-8B-like rank: 8 KV heads of 128, bf16, `layers` layers, 16-token blocks.
pub(super) fn geometry(layers: u32) -> KvGeometry {
    KvGeometry::dense(layers, 8, 128, 2, BLOCK_TOKENS, KvLayout::Nhd)
}

fn run_error(why: impl Into<String>) -> LayerwiseBenchError {
    LayerwiseBenchError::Run(why.into())
}

fn connector(what: &'static str) -> impl Fn(ConnectorError) -> LayerwiseBenchError {
    move |e| run_error(format!("{what}: {e}"))
}

fn transport(kind: LayerwiseTransport) -> Result<TransportKind, LayerwiseBenchError> {
    match kind {
        LayerwiseTransport::Mem => Ok(TransportKind::Mem(MemFabric::new())),
        #[cfg(feature = "nixl")]
        LayerwiseTransport::Nixl => {
            kvhandoff_actors::transport::nixl::nixl_runtime_available()
                .map_err(|e| LayerwiseBenchError::Start(e.to_string()))?;
            Ok(TransportKind::nixl())
        }
        #[cfg(not(feature = "nixl"))]
        LayerwiseTransport::Nixl => Err(LayerwiseBenchError::NixlFeatureMissing),
    }
}

/// How P hands a request over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Whole,
    Layerwise,
}

/// The two ranks and what a handoff needs around them.
struct Bench<'a> {
    options: &'a LayerwiseOptions,
    pair: EnginePair,
    /// Region indices of each layer.
    layer_regions: Vec<Vec<usize>>,
    block_len: usize,
    /// D's parameters as P answers them (the router's, for D's leg), once one handoff ran.
    answer: Option<KvTransferParams>,
    handoffs: u64,
    buf: Vec<u8>,
}

/// What one handoff gave.
struct Handoff {
    exposed_ms: f64,
    verified_bytes: u64,
}

pub(super) fn run(options: &LayerwiseOptions) -> Result<Vec<LayerwiseRow>, LayerwiseBenchError> {
    let geometry = geometry(options.layers);
    let specs = geometry
        .regions()
        .map_err(|e| LayerwiseBenchError::Options(e.to_string()))?;
    let max_tokens = options.tokens.iter().copied().max().unwrap_or(BLOCK_TOKENS);
    let pool_blocks = max_tokens.div_ceil(BLOCK_TOKENS);
    let mut settings = ConnectorSettings::new(&Config::default(), &geometry);
    settings.layerwise_parts = options.parts;
    settings.layerwise_min_tokens = options.min_tokens;
    let pair = start_pair(PairSpec {
        geometry: &geometry,
        pool_blocks,
        transport: transport(options.transport)?,
        settings,
        shell: ShellConfig::default(),
        suffix: "-layerwise",
    })
    .map_err(|e| match e {
        PairError::Setup(why) => LayerwiseBenchError::Start(why),
        PairError::Start(e) => LayerwiseBenchError::Start(e.to_string()),
    })?;
    let mut layer_regions = vec![Vec::new(); options.layers as usize];
    for (region, spec) in specs.iter().enumerate() {
        layer_regions[spec.layer as usize].push(region);
    }
    let block_len = usize::try_from(specs[0].block_len)
        .map_err(|_| LayerwiseBenchError::Options("block too large".into()))?;
    let mut bench = Bench {
        options,
        pair,
        layer_regions,
        block_len,
        answer: None,
        handoffs: 0,
        buf: vec![0; block_len],
    };
    // The first handoff pays the handshake and learns P's answer for D: not timed.
    bench.handoff(Mode::Layerwise, options.tokens[0])?;
    let mut rows = Vec::new();
    for &tokens in &options.tokens {
        let (mut whole, mut layerwise, mut verified) = (Vec::new(), Vec::new(), 0);
        for _ in 0..options.rounds {
            for (mode, into) in [(Mode::Whole, &mut whole), (Mode::Layerwise, &mut layerwise)] {
                let handoff = bench.handoff(mode, tokens)?;
                into.push(handoff.exposed_ms);
                verified += handoff.verified_bytes;
            }
        }
        let blocks = u64::from(tokens.div_ceil(BLOCK_TOKENS));
        let (exposed_whole, exposed_layerwise) = (median(&whole), median(&layerwise));
        let reduction = if exposed_whole > 0.0 {
            1.0 - exposed_layerwise / exposed_whole
        } else {
            0.0
        };
        let parts = if u64::from(tokens) < options.min_tokens {
            1
        } else {
            options.parts
        };
        rows.push(LayerwiseRow {
            tokens,
            bytes: blocks * block_len as u64 * specs.len() as u64,
            compute_ms: compute(options, tokens).as_secs_f64() * 1e3,
            parts,
            exposed_ms_whole: exposed_whole,
            exposed_ms_layerwise: exposed_layerwise,
            reduction,
            rounds_ms_whole: whole,
            rounds_ms_layerwise: layerwise,
            verified_bytes: verified,
        });
    }
    bench.pair.runtime.shutdown();
    Ok(rows)
}

/// The emulated prefill's compute time for a prompt of `tokens`.
fn compute(options: &LayerwiseOptions, tokens: u32) -> Duration {
    Duration::from_secs_f64(f64::from(tokens) / options.prefill_tokens_per_s)
}

/// Block `block` of region `region` as P's forward pass writes it in handoff `seed`: every
/// 8-byte word a function of the four.
fn fill(buf: &mut [u8], seed: u64, region: usize, block: u32) {
    let mut word = mix(seed ^ ((region as u64) << 32) ^ u64::from(block));
    for chunk in buf.chunks_exact_mut(8) {
        word = word.wrapping_add(0x9e37_79b9_7f4a_7c15);
        chunk.copy_from_slice(&word.to_le_bytes());
    }
}

impl Bench<'_> {
    /// One handoff of a `tokens`-token prompt: D allocates (and registers), P runs the
    /// emulated prefill and hands the request over by `mode`; the exposed time is from the end
    /// of the last layer's compute to D's `BlocksReady`.
    fn handoff(&mut self, mode: Mode, tokens: u32) -> Result<Handoff, LayerwiseBenchError> {
        self.handoffs += 1;
        let seed = mix(self.handoffs);
        let n = tokens.div_ceil(BLOCK_TOKENS);
        let blocks = BlockIds::single_group((0..n).collect());
        let num_tokens = u64::from(tokens);
        let id = |side: &str| {
            RequestId::new(format!("lw-{side}-{}", self.handoffs))
                .map_err(|e| run_error(e.to_string()))
        };
        let (p_id, d_id) = (id("p")?, id("d")?);
        let key = format!("layerwise-{}", self.handoffs);
        let p_params = KvTransferParams {
            transfer_id: Some(key.clone()),
            ..KvTransferParams::default()
        };
        // D registers first when it knows P's answer already (every handoff but the first).
        let d_params = self.answer.clone().map(|answer| KvTransferParams {
            transfer_id: Some(key.clone()),
            ..answer
        });
        if let Some(params) = &d_params {
            self.pair
                .d_conn
                .request_allocated(&d_id, blocks.clone(), num_tokens, params)
                .map_err(connector("D allocates"))?;
        }
        let started = Instant::now();
        if mode == Mode::Layerwise {
            let answer = self
                .pair
                .p_conn
                .prefill_started(&p_id, blocks.clone(), num_tokens, &p_params)
                .map_err(connector("P starts"))?;
            self.answer.get_or_insert(answer);
        }
        let layers = self.options.layers;
        let per_layer = compute(self.options, tokens) / layers;
        let mut compute_end = started;
        for layer in 0..layers {
            self.write_layer(layer, seed, n)?;
            let due = started + per_layer * (layer + 1);
            thread::sleep(due.saturating_duration_since(Instant::now()));
            compute_end = Instant::now();
            if mode == Mode::Layerwise {
                self.pair
                    .p_conn
                    .layers_ready(&p_id, layer + 1)
                    .map_err(connector("P reports a layer"))?;
            }
        }
        if mode == Mode::Whole {
            let answer = self
                .pair
                .p_conn
                .request_finished(&p_id, blocks.clone(), num_tokens, &p_params)
                .map_err(connector("P finishes"))?;
            self.answer.get_or_insert(answer);
        }
        if d_params.is_none() {
            let params = self.answer.clone().ok_or_else(|| run_error("no answer"))?;
            self.pair
                .d_conn
                .request_allocated(&d_id, blocks.clone(), num_tokens, &params)
                .map_err(connector("D allocates"))?;
        }
        let deadline = compute_end + self.options.timeout;
        let ready = wait_for(&mut self.pair.d_conn, deadline, |event| match event {
            ConnectorEvent::BlocksReady {
                request,
                blocks: got,
            } if *request == d_id => Some(check_blocks(got, &blocks)),
            other => Some(Err(format!("D: unexpected event {other:?}"))),
        })
        .map_err(run_error)?;
        wait_for(&mut self.pair.p_conn, deadline, |event| match event {
            ConnectorEvent::BlocksFree {
                request,
                released: None,
                blocks: got,
            } if *request == p_id => Some(check_blocks(got, &blocks)),
            other => Some(Err(format!("P: unexpected event {other:?}"))),
        })
        .map_err(run_error)?;
        let verified_bytes = self.verify(seed, n)?;
        Ok(Handoff {
            exposed_ms: ready.saturating_duration_since(compute_end).as_secs_f64() * 1e3,
            verified_bytes,
        })
    }

    /// P's forward pass writes layer `layer` of blocks `0 .. n`.
    fn write_layer(&mut self, layer: u32, seed: u64, n: u32) -> Result<(), LayerwiseBenchError> {
        for &region in &self.layer_regions[layer as usize] {
            for block in 0..n {
                fill(&mut self.buf, seed, region, block);
                self.pair
                    .p_kv
                    .write_block(region, block, &self.buf)
                    .map_err(|e| run_error(format!("P writes: {e}")))?;
            }
        }
        Ok(())
    }

    /// Checks every byte of D's blocks `0 .. n` in every region; the bytes checked.
    fn verify(&mut self, seed: u64, n: u32) -> Result<u64, LayerwiseBenchError> {
        let mut want = vec![0u8; self.block_len];
        let regions = self.layer_regions.iter().flatten().count();
        for region in 0..regions {
            for block in 0..n {
                self.pair
                    .d_kv
                    .read_block(region, block, &mut self.buf)
                    .map_err(|e| run_error(format!("D reads: {e}")))?;
                fill(&mut want, seed, region, block);
                if self.buf != want {
                    return Err(run_error(format!(
                        "D's block {block} of region {region} differs from what P wrote"
                    )));
                }
            }
        }
        Ok(u64::from(n) * self.block_len as u64 * regions as u64)
    }
}
