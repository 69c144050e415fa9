//! The line charts every plot but the model's is: a linear y axis from 0, an x axis linear or
//! logarithmic (drawn linear over the logarithm, ticks at round values), lines with or without
//! markers, and a legend; and the helpers the bar chart shares.

use std::fmt::Write as _;
use std::ops::Range;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::PlotError;

/// Width and height of every plot, pixels.
pub(super) const SIZE: (u32, u32) = (900, 540);

/// How an x axis maps its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scale {
    Linear,
    /// Ticks at powers of two.
    Log2,
    /// Ticks at 1-2-5 steps.
    Log10,
}

impl Scale {
    fn map(self, v: f64) -> f64 {
        match self {
            Scale::Linear => v,
            Scale::Log2 => v.log2(),
            Scale::Log10 => v.log10(),
        }
    }

    fn unmap(self, v: f64) -> f64 {
        match self {
            Scale::Linear => v,
            Scale::Log2 => v.exp2(),
            Scale::Log10 => 10f64.powf(v),
        }
    }

    /// Tick values (in the original unit) between `lo` and `hi`.
    fn ticks(self, lo: f64, hi: f64) -> Vec<f64> {
        match self {
            Scale::Linear => linear_ticks(lo, hi),
            Scale::Log2 => {
                let (a, b) = (lo.log2().ceil() as i32, hi.log2().floor() as i32);
                let step = ((b - a) / 8 + 1).max(1);
                (a..=b)
                    .step_by(step as usize)
                    .map(|e| f64::from(e).exp2())
                    .collect()
            }
            Scale::Log10 => {
                let all = one_two_five(lo, hi);
                if all.len() > 10 {
                    all.into_iter()
                        .filter(|v| {
                            let m = v / 10f64.powf(v.log10().floor());
                            (m - 1.0).abs() < 1e-9
                        })
                        .collect()
                } else {
                    all
                }
            }
        }
    }
}

pub(super) struct Series<'a> {
    pub(super) name: &'a str,
    pub(super) color: RGBColor,
    pub(super) points: Vec<(f64, f64)>,
    pub(super) markers: bool,
}

pub(super) struct LineChart<'a> {
    pub(super) plot: &'static str,
    pub(super) title: String,
    pub(super) x_label: &'a str,
    pub(super) y_label: &'a str,
    pub(super) x_scale: Scale,
    /// Formats an x tick, given in the original unit.
    pub(super) x_format: fn(f64) -> String,
    pub(super) legend: SeriesLabelPosition,
    /// The top of the y axis, when fixed (a CDF's 1); else a little above the highest point.
    pub(super) y_top: Option<f64>,
    pub(super) series: Vec<Series<'a>>,
}

pub(super) fn line_chart(spec: &LineChart<'_>) -> Result<String, PlotError> {
    let plot = spec.plot;
    let usable = |x: f64| spec.x_scale == Scale::Linear || x > 0.0;
    let points: Vec<(f64, f64)> = spec
        .series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite() && usable(*x))
        .collect();
    if points.is_empty() {
        return Err(PlotError::NoData { plot });
    }
    let (mut x_lo, mut x_hi) = bounds(points.iter().map(|p| p.0));
    let (_, y_max) = bounds(points.iter().map(|p| p.1));
    if x_hi <= x_lo {
        (x_lo, x_hi) = match spec.x_scale {
            Scale::Linear => (x_lo - 1.0, x_hi + 1.0),
            _ => (x_lo / 2.0, x_hi * 2.0),
        };
    }
    let y_hi = match spec.y_top {
        Some(top) => top,
        None if y_max > 0.0 => y_max * 1.12,
        None => 1.0,
    };
    let (mx_lo, mx_hi) = (spec.x_scale.map(x_lo), spec.x_scale.map(x_hi));
    let pad = (mx_hi - mx_lo) * 0.04;
    let x_keys: Vec<f64> = spec
        .x_scale
        .ticks(x_lo, x_hi)
        .into_iter()
        .map(|v| spec.x_scale.map(v))
        .collect();
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(draw(plot))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&spec.title, ("sans-serif", 18))
            .margin(15)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(Ticked::new(mx_lo - pad..mx_hi + pad, x_keys), 0f64..y_hi)
            .map_err(draw(plot))?;
        let scale = spec.x_scale;
        let format = spec.x_format;
        chart
            .configure_mesh()
            .x_desc(spec.x_label)
            .y_desc(spec.y_label)
            .max_light_lines(0)
            .x_label_formatter(&|x| format(scale.unmap(*x)))
            .y_label_formatter(&|y| format_number(*y))
            .draw()
            .map_err(draw(plot))?;
        for s in &spec.series {
            draw_series(&mut chart, s, scale, usable, plot)?;
        }
        chart
            .configure_series_labels()
            .position(spec.legend.clone())
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(draw(plot))?;
        root.present().map_err(draw(plot))?;
    }
    Ok(svg)
}

type LineCoord = Cartesian2d<Ticked, RangedCoordf64>;

/// A linear `f64` axis whose tick marks are the given values (plotters' own key-point
/// combinator has no default label formatting, which its mesh needs).
pub(super) struct Ticked {
    inner: RangedCoordf64,
    keys: Vec<f64>,
}

impl Ticked {
    pub(super) fn new(range: Range<f64>, keys: Vec<f64>) -> Self {
        let keys = keys
            .into_iter()
            .filter(|k| range.start <= *k && *k <= range.end)
            .collect();
        Ticked {
            inner: range.into(),
            keys,
        }
    }
}

impl Ranged for Ticked {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        self.inner.map(value, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        // Bold points only: the labelled ticks and their grid lines.
        if hint.weight().allow_light_points() {
            Vec::new()
        } else {
            self.keys.clone()
        }
    }

    fn range(&self) -> Range<f64> {
        self.inner.range()
    }
}

fn draw_series(
    chart: &mut ChartContext<'_, SVGBackend<'_>, LineCoord>,
    s: &Series<'_>,
    scale: Scale,
    usable: impl Fn(f64) -> bool,
    plot: &'static str,
) -> Result<(), PlotError> {
    let points: Vec<(f64, f64)> = s
        .points
        .iter()
        .filter(|(x, y)| x.is_finite() && y.is_finite() && usable(*x))
        .map(|&(x, y)| (scale.map(x), y))
        .collect();
    let color = s.color;
    chart
        .draw_series(LineSeries::new(
            points.iter().copied(),
            color.stroke_width(2),
        ))
        .map_err(draw(plot))?
        .label(s.name)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    if s.markers {
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(draw(plot))?;
    }
    Ok(())
}

pub(super) fn draw<E: std::error::Error + Send + Sync>(
    plot: &'static str,
) -> impl Fn(DrawingAreaErrorKind<E>) -> PlotError {
    move |e| PlotError::Draw {
        plot,
        message: e.to_string(),
    }
}

fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    })
}

/// About six round ticks from `lo` to `hi`.
pub(in crate::report) fn linear_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(f64::MIN_POSITIVE);
    let raw = span / 6.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

/// 1, 2, 5, 10, 20, … from `lo` to `hi` (both positive).
pub(in crate::report) fn one_two_five(lo: f64, hi: f64) -> Vec<f64> {
    let mut out = Vec::new();
    if !(lo > 0.0 && hi >= lo && hi.is_finite()) {
        return out;
    }
    let mut decade = 10f64.powf(lo.log10().floor());
    while decade <= hi * (1.0 + 1e-9) {
        for m in [1.0, 2.0, 5.0] {
            let v = m * decade;
            if v >= lo * (1.0 - 1e-9) && v <= hi * (1.0 + 1e-9) {
                out.push(v);
            }
        }
        decade *= 10.0;
    }
    out
}

/// A tick label: no decimals from 100, fewer digits below.
pub(super) fn format_number(v: f64) -> String {
    let a = v.abs();
    let mut s = String::new();
    let _ = if a >= 100.0 || a == 0.0 {
        write!(s, "{v:.0}")
    } else if a >= 1.0 {
        write!(s, "{v:.1}")
    } else {
        write!(s, "{v:.2}")
    };
    s
}

/// A time in µs as people read it: µs below 1 ms, ms above.
pub(super) fn format_us(v: f64) -> String {
    if v >= 1000.0 {
        format!("{} ms", format_number(v / 1000.0))
    } else {
        format!("{} µs", format_number(v))
    }
}
