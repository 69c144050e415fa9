//! The report's run: each step timed and told to the progress, the benches, the plots, the
//! markdown.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::kernels::KernelBenchReport;
use crate::model::{tp4_pairs, FitPair};
use crate::transfer::{descriptor_sweep, SweepReport, TransferReport};
use crate::turns::TurnsReport;
use crate::ControlReport;

use super::{
    bandwidth_svg, default_geometry, fragmentation_svg, fragmentation_sweep, latency_cdf_svg,
    layerwise_svg, model_svg, render_section, splice_section, write_svg, FragmentationError,
    FragmentationSweep, LayerwisePoint, MachineInfo, Outcome, Progress, ReportData, ReportError,
    ReportOptions, ReportPlan, ReportSummary, StepSummary, BANDWIDTH_PLOT, FRAGMENTATION_PLOT,
    LATENCY_CDF_PLOT, LAYERWISE_PLOT, MARKDOWN_FILE, MODEL_PLOT, PLOTS_DIR,
};

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> ReportError + '_ {
    move |source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The steps' bookkeeping: progress, timing, summaries.
struct Steps<'a> {
    progress: &'a mut dyn Progress,
    total: usize,
    done: Vec<StepSummary>,
}

impl Steps<'_> {
    fn run<T>(
        &mut self,
        name: &str,
        step: impl FnOnce() -> Result<Outcome<T>, ReportError>,
        note: impl FnOnce(&T) -> String,
    ) -> Result<Outcome<T>, ReportError> {
        self.progress.start(self.done.len() + 1, self.total, name);
        let start = Instant::now();
        let outcome = step();
        let seconds = start.elapsed().as_secs_f64();
        let (ran, text, shown) = match &outcome {
            Ok(Outcome::Ran(t)) => {
                let text = note(t);
                (true, text.clone(), text)
            }
            Ok(Outcome::Skipped(why)) => (false, why.clone(), format!("skipped: {why}")),
            Err(e) => (false, e.to_string(), format!("failed: {e}")),
        };
        self.progress.end(name, seconds, &shown);
        self.done.push(StepSummary {
            name: name.into(),
            ran,
            seconds,
            note: text,
        });
        outcome
    }
}

/// Why the NIXL benches cannot run in this build or on this machine; `None` when they can.
pub fn nixl_unavailable() -> Option<String> {
    #[cfg(feature = "nixl")]
    {
        kvhandoff_actors::transport::nixl::nixl_runtime_available()
            .err()
            .map(|e| format!("the NIXL runtime does not load ({e}); `source scripts/nixl-env.sh`"))
    }
    #[cfg(not(feature = "nixl"))]
    {
        Some("this build has no `nixl` cargo feature (build with `--features nixl`)".into())
    }
}

/// Runs every bench, then writes the plots and the markdown section.
///
/// # Errors
/// [`ReportError`]: the output folder or markdown file unusable (checked before any bench runs),
/// a bench that fails (other than for want of NIXL or CUDA in this build), a plot that cannot be
/// drawn.
pub fn run_report(
    options: &ReportOptions,
    progress: &mut dyn Progress,
) -> Result<ReportSummary, ReportError> {
    let start = Instant::now();
    let plan = if options.quick {
        ReportPlan::quick()
    } else {
        ReportPlan::full()
    };
    // Fail before minutes of benches if the output cannot be written.
    let plots_dir = options.out_dir.join(PLOTS_DIR);
    std::fs::create_dir_all(&plots_dir).map_err(io_error(&plots_dir))?;
    let markdown_path = options.out_dir.join(MARKDOWN_FILE);
    let existing = read_markdown(&markdown_path)?;
    splice_section(&existing, "").map_err(|source| ReportError::Markers {
        path: markdown_path.clone(),
        source,
    })?;
    let machine = MachineInfo::detect();

    let mut steps = Steps {
        progress,
        total: 10,
        done: Vec::new(),
    };
    let result = run_steps(&plan, &mut steps, &plots_dir);
    let (results, plots) = match result {
        Ok(parts) => parts,
        Err(e) => {
            steps.progress.finish();
            return Err(e);
        }
    };
    let data = ReportData {
        machine,
        command: options.command.clone(),
        quick: options.quick,
        plan,
        steps: steps.done.clone(),
        control: results.control,
        transfer: results.transfer,
        sweep: results.sweep,
        fragmentation: results.fragmentation,
        turns: results.turns,
        model: results.model,
        layerwise: results.layerwise,
        kernels: results.kernels,
        plots: plots
            .iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect(),
    };
    let written = steps.run(
        "markdown",
        || {
            let document = splice_section(&existing, &render_section(&data)).map_err(|source| {
                ReportError::Markers {
                    path: markdown_path.clone(),
                    source,
                }
            })?;
            std::fs::write(&markdown_path, document).map_err(io_error(&markdown_path))?;
            Ok(Outcome::Ran(()))
        },
        |_| format!("{} written", markdown_path.display()),
    );
    steps.progress.finish();
    written?;
    Ok(ReportSummary {
        markdown: markdown_path,
        plots,
        quick: options.quick,
        seconds: start.elapsed().as_secs_f64(),
        steps: steps.done,
    })
}

/// The markdown file's text, or nothing if it does not exist yet.
fn read_markdown(path: &Path) -> Result<String, ReportError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(String::new()),
        Err(source) => Err(ReportError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// What the benches returned.
struct Results {
    control: Outcome<ControlReport>,
    transfer: Outcome<TransferReport>,
    sweep: Outcome<SweepReport>,
    fragmentation: FragmentationSweep,
    turns: Outcome<TurnsReport>,
    model: Vec<FitPair>,
    layerwise: Outcome<Vec<LayerwisePoint>>,
    kernels: Outcome<KernelBenchReport>,
}

/// Runs the benches (steps 1–8) and draws the plots: the results and the files written.
fn run_steps(
    plan: &ReportPlan,
    steps: &mut Steps<'_>,
    plots_dir: &Path,
) -> Result<(Results, Vec<PathBuf>), ReportError> {
    let nixl_missing = nixl_unavailable();
    let control = steps.run(
        "control",
        || Ok(Outcome::Ran(crate::control(&plan.control)?)),
        |r| {
            format!(
                "machines {:.0} ns/request, actix {:.0} requests/s",
                r.machine_ns_per_request, r.actix_requests_per_sec
            )
        },
    )?;
    let transfer = steps.run(
        "transfer",
        || match &nixl_missing {
            Some(why) => Ok(Outcome::Skipped(why.clone())),
            None => Ok(Outcome::Ran(crate::transfer::transfer(&plan.transfer)?)),
        },
        |r| {
            format!(
                "kvhandoff/raw {:.3} ({}), one-block handoff {:.3} ms vs raw {:.3} ms",
                r.ratio,
                r.headline_table,
                r.latency.kvhandoff_us / 1e3,
                r.latency.raw_us / 1e3
            )
        },
    )?;
    let sweep = steps.run(
        "descriptor sweep",
        || match &nixl_missing {
            Some(why) => Ok(Outcome::Skipped(why.clone())),
            None => Ok(Outcome::Ran(descriptor_sweep(&plan.sweep)?)),
        },
        |r| format!("{} descriptor sizes", r.points.len()),
    )?;
    let fragmentation = steps.run(
        "fragmentation",
        || {
            Ok(Outcome::Ran(fragmentation_sweep(
                &default_geometry(),
                plan.fragmentation_blocks,
                plan.fragmentation_steps,
            )?))
        },
        |r| {
            format!(
                "{} levels, {}–{} descriptors",
                r.points.len(),
                r.minimum,
                r.maximum
            )
        },
    )?;
    let fragmentation = match fragmentation {
        Outcome::Ran(sweep) => sweep,
        Outcome::Skipped(why) => return Err(FragmentationError(why).into()),
    };
    let turns = steps.run(
        "turns",
        || Ok(Outcome::Ran(crate::turns::turns(&plan.turns)?)),
        |r| format!("{} prefixes over {}", r.rows.len(), r.transport),
    )?;
    let model = steps.run(
        "model",
        || Ok(Outcome::Ran(tp4_pairs(&plan.model)?)),
        |pairs| format!("{} TP 4 workloads, push and pull", pairs.len()),
    )?;
    let model = model.ran().cloned().unwrap_or_default();
    let layerwise: Outcome<Vec<LayerwisePoint>> = steps.run(
        "layer-wise",
        || match &nixl_missing {
            Some(why) => Ok(Outcome::Skipped(why.clone())),
            None => {
                let report = crate::layerwise::layerwise(&plan.layerwise)?;
                let points = report.rows.iter().map(|r| LayerwisePoint {
                    tokens: r.tokens,
                    exposed_ms_whole: r.exposed_ms_whole,
                    exposed_ms_layerwise: r.exposed_ms_layerwise,
                });
                Ok(Outcome::Ran(points.collect()))
            }
        },
        |rows: &Vec<LayerwisePoint>| format!("{} prompt lengths", rows.len()),
    )?;
    let kernels = steps.run(
        "kernels",
        || run_kernels(plan),
        |r| {
            format!(
                "{} kernels, CUDA {}",
                r.kernels.len(),
                if r.cuda.ran { "ran" } else { "did not run" }
            )
        },
    )?;

    let mut plots = Vec::new();
    let plotted = steps.run(
        "plots",
        || {
            plots = draw_plots(
                plots_dir,
                &transfer,
                &sweep,
                &fragmentation,
                &model,
                &layerwise,
            )?;
            Ok(Outcome::Ran(plots.len()))
        },
        |n| format!("{n} SVG files in {}", plots_dir.display()),
    );
    plotted?;
    let results = Results {
        control,
        transfer,
        sweep,
        fragmentation,
        turns,
        model,
        layerwise,
        kernels,
    };
    Ok((results, plots))
}

#[cfg(feature = "cuda")]
fn run_kernels(plan: &ReportPlan) -> Result<Outcome<KernelBenchReport>, ReportError> {
    Ok(Outcome::Ran(crate::kernels::run(plan.kernels)?))
}

#[cfg(not(feature = "cuda"))]
fn run_kernels(_plan: &ReportPlan) -> Result<Outcome<KernelBenchReport>, ReportError> {
    Ok(Outcome::Skipped(
        "this build has no `cuda` cargo feature (build with `--features cuda`; the CUDA kernels \
         also need NVRTC, and a GPU to run)"
            .into(),
    ))
}

/// Draws every plot the results allow into `dir`; returns the files written.
fn draw_plots(
    dir: &Path,
    transfer: &Outcome<TransferReport>,
    sweep: &Outcome<SweepReport>,
    fragmentation: &FragmentationSweep,
    model: &[FitPair],
    layerwise: &Outcome<Vec<LayerwisePoint>>,
) -> Result<Vec<PathBuf>, ReportError> {
    let mut written = Vec::new();
    if let Some(sweep) = sweep.ran() {
        let subtitle = format!(
            "{} per request, {} repetitions",
            kvhandoff_testkit::stats::human_bytes(sweep.request_bytes),
            sweep.repeats
        );
        written.push(write_svg(
            dir,
            BANDWIDTH_PLOT,
            &bandwidth_svg(&sweep.points, &subtitle)?,
        )?);
    }
    if let Some(transfer) = transfer.ran() {
        let l = &transfer.latency;
        let subtitle = format!(
            "{} descriptors, {}, {} handoffs",
            l.descriptors,
            kvhandoff_testkit::stats::human_bytes(l.bytes),
            l.samples.kvhandoff_us.len()
        );
        written.push(write_svg(
            dir,
            LATENCY_CDF_PLOT,
            &latency_cdf_svg(&l.samples, &subtitle)?,
        )?);
    }
    written.push(write_svg(
        dir,
        FRAGMENTATION_PLOT,
        &fragmentation_svg(fragmentation)?,
    )?);
    written.push(write_svg(dir, MODEL_PLOT, &model_svg(model)?)?);
    if let Some(rows) = layerwise.ran() {
        written.push(write_svg(
            dir,
            LAYERWISE_PLOT,
            &layerwise_svg(rows, "layer-wise bench")?,
        )?);
    }
    Ok(written)
}
