//! The generated section of `docs/benchmarks.md`: where it goes (between two marker lines,
//! [`splice_section`]) and what it says ([`render_section`], each bench's part in
//! `sections.rs`).

use std::fmt::Write as _;

use super::sections;
use super::ReportData;

/// The line that opens the generated section.
pub const REPORT_BEGIN: &str = "<!-- report:begin -->";
/// The line that closes it.
pub const REPORT_END: &str = "<!-- report:end -->";

/// Why the markers of a markdown file cannot take a generated section.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MarkerError {
    /// A marker line appears more than once.
    #[error("`{marker}` appears more than once (lines {first} and {second})")]
    Duplicate {
        /// The marker.
        marker: &'static str,
        /// Its first line (from 1).
        first: usize,
        /// Its second line.
        second: usize,
    },
    /// One marker without the other.
    #[error("line {line}: `{found}` without `{missing}`")]
    Unpaired {
        /// The marker present.
        found: &'static str,
        /// The marker missing.
        missing: &'static str,
        /// The present marker's line (from 1).
        line: usize,
    },
    /// The end marker comes first.
    #[error("`{REPORT_END}` (line {end}) comes before `{REPORT_BEGIN}` (line {begin})")]
    Misordered {
        /// The begin marker's line (from 1).
        begin: usize,
        /// The end marker's line.
        end: usize,
    },
    /// The section to insert has a marker line of its own.
    #[error("the generated section contains a marker line")]
    MarkerInSection,
}

/// Whether `line` is `marker` (surrounding white space allowed): only a marker alone on its line
/// counts, so prose or code that quotes one is left alone.
fn is_marker(line: &str, marker: &str) -> bool {
    line.trim() == marker
}

/// `document` with `section` between its marker lines, replacing what was there; the text
/// outside the markers is kept byte for byte. Without markers, the section and its markers are
/// appended (after a blank line).
///
/// ```
/// use kvhandoff_bench::report::splice_section;
/// let doc = "# Title\n\n<!-- report:begin -->\nold\n<!-- report:end -->\n\nafter\n";
/// let new = splice_section(doc, "new\n").unwrap();
/// assert_eq!(new, "# Title\n\n<!-- report:begin -->\nnew\n<!-- report:end -->\n\nafter\n");
/// ```
///
/// # Errors
/// [`MarkerError`] for a marker that appears twice, one without the other, the end before the
/// begin, or a `section` that holds a marker line itself.
pub fn splice_section(document: &str, section: &str) -> Result<String, MarkerError> {
    if section
        .lines()
        .any(|l| is_marker(l, REPORT_BEGIN) || is_marker(l, REPORT_END))
    {
        return Err(MarkerError::MarkerInSection);
    }
    let mut section = section.to_string();
    if !section.is_empty() && !section.ends_with('\n') {
        section.push('\n');
    }
    // (line number from 1, byte offset of the line's start, offset past its end).
    let mut begins = Vec::new();
    let mut ends = Vec::new();
    let mut offset = 0;
    for (i, line) in document.split_inclusive('\n').enumerate() {
        let next = offset + line.len();
        if is_marker(line, REPORT_BEGIN) {
            begins.push((i + 1, offset, next));
        } else if is_marker(line, REPORT_END) {
            ends.push((i + 1, offset, next));
        }
        offset = next;
    }
    for (marker, found) in [(REPORT_BEGIN, &begins), (REPORT_END, &ends)] {
        if let [first, second, ..] = found.as_slice() {
            return Err(MarkerError::Duplicate {
                marker,
                first: first.0,
                second: second.0,
            });
        }
    }
    match (begins.first(), ends.first()) {
        (None, None) => {
            let mut out = document.to_string();
            if !out.is_empty() {
                if !out.ends_with('\n') {
                    out.push('\n');
                }
                if !out.ends_with("\n\n") {
                    out.push('\n');
                }
            }
            let _ = write!(out, "{REPORT_BEGIN}\n{section}{REPORT_END}\n");
            Ok(out)
        }
        (Some(&(line, _, _)), None) => Err(MarkerError::Unpaired {
            found: REPORT_BEGIN,
            missing: REPORT_END,
            line,
        }),
        (None, Some(&(line, _, _))) => Err(MarkerError::Unpaired {
            found: REPORT_END,
            missing: REPORT_BEGIN,
            line,
        }),
        (Some(&(begin, _, after_begin)), Some(&(end, end_start, _))) => {
            if end < begin {
                return Err(MarkerError::Misordered { begin, end });
            }
            let mut out = String::with_capacity(document.len() + section.len());
            out.push_str(&document[..after_begin]);
            // A begin marker on the file's last line without a newline.
            if !out.ends_with('\n') {
                out.push('\n');
            }
            out.push_str(&section);
            out.push_str(&document[end_start..]);
            Ok(out)
        }
    }
}

/// The generated section: what ran where and when, then each bench's tables with the command
/// that produced them and links to the plots (relative to the markdown file: `plots/…`).
pub fn render_section(data: &ReportData) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "<!-- Generated by `kvhandoff bench report`: everything up to the end marker is replaced \
         on every run; edit around it. -->\n"
    );
    let _ = writeln!(out, "### The run\n");
    let _ = writeln!(
        out,
        "**Command:** `{}` ({}). Total {:.0} s.\n",
        data.command,
        if data.quick {
            "quick: small sizes and few repetitions, a smoke run; not figures to compare"
        } else {
            "full run"
        },
        data.steps.iter().map(|s| s.seconds).sum::<f64>()
    );
    let _ = writeln!(out, "{}\n", data.machine.describe());
    let _ = writeln!(out, "| step | | time | what it did |\n|---|---|---|---|");
    for s in &data.steps {
        let _ = writeln!(
            out,
            "| {} | {} | {:.1} s | {} |",
            s.name,
            if s.ran { "ran" } else { "skipped" },
            s.seconds,
            s.note.replace('|', "\\|")
        );
    }
    out.push('\n');
    sections::control(&mut out, data);
    sections::transfer(&mut out, data);
    sections::sweep(&mut out, data);
    sections::fragmentation(&mut out, data);
    sections::turns(&mut out, data);
    sections::model(&mut out, data);
    sections::layerwise(&mut out, data);
    sections::kernels(&mut out, data);
    out
}
