//! The report's plots, drawn with `plotters` into SVG text (its SVG backend only: text is SVG
//! `<text>`, laid out by plotters' built-in estimate, so no font library is involved).
//!
//! Each `*_svg` function turns one bench's figures into a complete SVG document; [`write_svg`]
//! puts it on disk. Logarithmic axes are drawn as linear axes over the logarithm of the values,
//! with tick marks placed at round values of the original quantity (powers of two for bytes,
//! 1-2-5 steps for times).

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::model::{FitPair, SeedRow};
use crate::transfer::{LatencySamples, SweepPoint};
use kvhandoff_testkit::stats::human_bytes;

use super::fragmentation::FragmentationSweep;
use super::LayerwisePoint;

mod chart;

use chart::{
    draw, format_number, format_us, line_chart, one_two_five, LineChart, Scale, Series, Ticked,
    SIZE,
};
#[cfg(test)]
pub(super) use chart::{linear_ticks, one_two_five as ticks_one_two_five};

/// Why a plot could not be drawn or written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// Nothing to draw (an empty sweep or no samples).
    #[error("{plot}: no data to plot")]
    NoData {
        /// The plot's file name.
        plot: &'static str,
    },
    /// plotters refused to draw.
    #[error("{plot}: drawing failed: {message}")]
    Draw {
        /// The plot's file name.
        plot: &'static str,
        /// plotters' error.
        message: String,
    },
    /// The SVG file could not be written.
    #[error("{}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// The bandwidth-by-descriptor-size plot's file name.
pub const BANDWIDTH_PLOT: &str = "bandwidth_vs_descriptor_size.svg";
/// The one-block handoff latency CDF's file name.
pub const LATENCY_CDF_PLOT: &str = "handoff_latency_cdf.svg";
/// The descriptors-by-fragmentation plot's file name.
pub const FRAGMENTATION_PLOT: &str = "descriptors_vs_fragmentation.svg";
/// The model-vs-seed TTFT plot's file name.
pub const MODEL_PLOT: &str = "model_ttft_vs_seed.svg";
/// The layer-wise vs whole-request exposed transfer plot's file name.
pub const LAYERWISE_PLOT: &str = "layerwise_exposed.svg";

const RAW: RGBColor = RGBColor(31, 119, 180);
const KVH: RGBColor = RGBColor(214, 39, 40);
const SEED_PULL: RGBColor = RGBColor(31, 119, 180);
const MODEL_PULL: RGBColor = RGBColor(158, 202, 225);
const SEED_PUSH: RGBColor = RGBColor(214, 39, 40);
const MODEL_PUSH: RGBColor = RGBColor(252, 174, 145);

/// Writes `svg` to `dir/name`.
///
/// # Errors
/// [`PlotError::Write`] if the file cannot be written.
pub fn write_svg(dir: &Path, name: &str, svg: &str) -> Result<PathBuf, PlotError> {
    let path = dir.join(name);
    std::fs::write(&path, svg).map_err(|source| PlotError::Write {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// GB/s against bytes per descriptor (log scale), raw NIXL and kvhandoff.
///
/// # Errors
/// [`PlotError::NoData`] without points; [`PlotError::Draw`] if plotters fails.
pub fn bandwidth_svg(points: &[SweepPoint], subtitle: &str) -> Result<String, PlotError> {
    let series = |name, color, f: fn(&SweepPoint) -> f64| Series {
        name,
        color,
        points: points
            .iter()
            .map(|p| (p.descriptor_bytes as f64, f(p)))
            .collect(),
        markers: true,
    };
    line_chart(&LineChart {
        plot: BANDWIDTH_PLOT,
        title: format!("Bandwidth by descriptor size — {subtitle}"),
        x_label: "bytes per descriptor (log scale)",
        y_label: "GB/s (10^9 bytes/s), median",
        x_scale: Scale::Log2,
        x_format: |v| human_bytes(v.round() as u64),
        legend: SeriesLabelPosition::UpperLeft,
        y_top: None,
        series: vec![
            series("raw NIXL", RAW, |p| p.raw_gbps),
            series("kvhandoff", KVH, |p| p.kvhandoff_gbps),
        ],
    })
}

/// The CDF of the one-block handoff's latency, raw NIXL and kvhandoff (log-scale time).
///
/// # Errors
/// [`PlotError::NoData`] without samples; [`PlotError::Draw`] if plotters fails.
pub fn latency_cdf_svg(samples: &LatencySamples, subtitle: &str) -> Result<String, PlotError> {
    let cdf = |values: &[f64]| {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| *x > 0.0).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len() as f64;
        let mut points = Vec::with_capacity(2 * v.len());
        for (i, x) in v.iter().enumerate() {
            points.push((*x, i as f64 / n));
            points.push((*x, (i + 1) as f64 / n));
        }
        points
    };
    line_chart(&LineChart {
        plot: LATENCY_CDF_PLOT,
        title: format!("One-block handoff latency, CDF — {subtitle}"),
        x_label: "latency (log scale)",
        y_label: "fraction of handoffs at or below",
        x_scale: Scale::Log10,
        x_format: format_us,
        legend: SeriesLabelPosition::LowerRight,
        y_top: Some(1.04),
        series: vec![
            Series {
                name: "raw NIXL WRITE + notification",
                color: RAW,
                points: cdf(&samples.raw_us),
                markers: false,
            },
            Series {
                name: "kvhandoff handoff",
                color: KVH,
                points: cdf(&samples.kvhandoff_us),
                markers: false,
            },
        ],
    })
}

/// Descriptors of one request against the fraction of its blocks not adjacent to the one
/// before, for P alone scattered and for both sides scattered.
///
/// # Errors
/// [`PlotError::NoData`] without points; [`PlotError::Draw`] if plotters fails.
pub fn fragmentation_svg(sweep: &FragmentationSweep) -> Result<String, PlotError> {
    let series = |name, color, f: fn(&super::FragmentationPoint) -> usize| Series {
        name,
        color,
        points: sweep
            .points
            .iter()
            .map(|p| (p.fraction, f(p) as f64))
            .collect(),
        markers: true,
    };
    line_chart(&LineChart {
        plot: FRAGMENTATION_PLOT,
        title: format!(
            "Descriptors by fragmentation — {} blocks x {} regions (planner)",
            sweep.blocks, sweep.regions
        ),
        x_label: "fraction of blocks not adjacent to the previous one",
        y_label: "descriptors per request",
        x_scale: Scale::Linear,
        x_format: |v| format!("{:.0}%", v * 100.0),
        legend: SeriesLabelPosition::UpperLeft,
        y_top: None,
        series: vec![
            series("P scattered, D contiguous", RAW, |p| p.p_scattered),
            series("both scattered", KVH, |p| p.both_scattered),
        ],
    })
}

/// Exposed transfer time against prompt tokens, whole-request push and layer-wise push.
///
/// # Errors
/// [`PlotError::NoData`] without rows; [`PlotError::Draw`] if plotters fails.
pub fn layerwise_svg(rows: &[LayerwisePoint], subtitle: &str) -> Result<String, PlotError> {
    let series = |name, color, f: fn(&LayerwisePoint) -> f64| Series {
        name,
        color,
        points: rows.iter().map(|r| (f64::from(r.tokens), f(r))).collect(),
        markers: true,
    };
    line_chart(&LineChart {
        plot: LAYERWISE_PLOT,
        title: format!("Exposed transfer time by prompt length — {subtitle}"),
        x_label: "prompt tokens (log scale)",
        y_label: "exposed transfer, ms",
        x_scale: Scale::Log2,
        x_format: |v| format!("{:.0}", v),
        legend: SeriesLabelPosition::UpperLeft,
        y_top: None,
        series: vec![
            series("whole request", RAW, |r| r.exposed_ms_whole),
            series("layer-wise", KVH, |r| r.exposed_ms_layerwise),
        ],
    })
}

/// Mean TTFT of the seed's TP 4 rows beside the model's, pull and push, per workload (log
/// scale bars).
///
/// # Errors
/// [`PlotError::NoData`] without pairs; [`PlotError::Draw`] if plotters fails.
pub fn model_svg(pairs: &[FitPair]) -> Result<String, PlotError> {
    let plot = MODEL_PLOT;
    if pairs.is_empty() {
        return Err(PlotError::NoData { plot });
    }
    let bars: [Bar; 4] = [
        ("seed, pull", SEED_PULL, |p| p.seed_pull.mean_ttft_ms),
        ("model, pull", MODEL_PULL, |p| p.model_pull.mean_ttft_ms),
        ("seed, push", SEED_PUSH, |p| p.seed_push.mean_ttft_ms),
        ("model, push", MODEL_PUSH, |p| p.model_push.mean_ttft_ms),
    ];
    let values: Vec<f64> = pairs
        .iter()
        .flat_map(|p| bars.iter().map(move |(_, _, f)| f(p)))
        .filter(|v| *v > 0.0)
        .collect();
    if values.is_empty() {
        return Err(PlotError::NoData { plot });
    }
    let (lo, hi) = values
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(l, h), v| (l.min(*v), h.max(*v)));
    let (y0, y1) = (
        10f64.powf((lo / 2.0).log10().floor()),
        10f64.powf((hi * 2.0).log10().ceil()),
    );
    let y_keys: Vec<f64> = one_two_five(y0, y1).iter().map(|v| v.log10()).collect();
    let x_keys: Vec<f64> = (0..pairs.len()).map(|i| i as f64).collect();
    let labels: Vec<String> = pairs.iter().map(|p| workload(&p.seed_pull)).collect();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(draw(plot))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "Mean TTFT, seed (measured) vs model — Llama-3.3-70B, 1P1D, TP 4",
                ("sans-serif", 20),
            )
            .margin(15)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(
                Ticked::new(-0.5..pairs.len() as f64 - 0.5, x_keys),
                Ticked::new(y0.log10()..y1.log10(), y_keys),
            )
            .map_err(draw(plot))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_desc("workload: input / output tokens / QPS")
            .y_desc("mean TTFT, ms (log scale)")
            .x_label_formatter(&|x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 {
                    labels.get(i as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|y| format_number(10f64.powf(*y)))
            .draw()
            .map_err(draw(plot))?;
        let width = 0.18;
        for (k, (name, color, value)) in bars.iter().enumerate() {
            let offset = (k as f64 - 1.5) * width;
            let color = *color;
            chart
                .draw_series(pairs.iter().enumerate().map(|(i, p)| {
                    let x = i as f64 + offset;
                    let v = value(p).max(y0);
                    Rectangle::new(
                        [(x - width / 2.0, y0.log10()), (x + width / 2.0, v.log10())],
                        color.filled(),
                    )
                }))
                .map_err(draw(plot))?
                .label(*name)
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled())
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(draw(plot))?;
        root.present().map_err(draw(plot))?;
    }
    Ok(svg)
}

/// One bar of each workload: its legend, colour and value.
type Bar = (&'static str, RGBColor, fn(&FitPair) -> f64);

/// `512/128/4`: a seed row's workload.
fn workload(row: &SeedRow) -> String {
    format!("{}/{}/{}", row.input_len, row.output_len, row.qps)
}
