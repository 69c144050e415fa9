//! The flags that name a heterogeneous pair (`demo`, `node` and `cluster` share them).

use clap::Args;
use kvhandoff_protocol::hetero::SideSpec;

/// A heterogeneous pair on the command line: a catalog model and both engines' geometries.
#[derive(Debug, Clone, Args)]
pub(crate) struct PairArgs {
    /// A heterogeneous pair: a model of the catalog (gqa8, gqa2, mla, swa, mamba), with
    /// `--prefill` and `--decode` (push). `demo` runs every rank of both engines in this
    /// process, `node` one rank (`--role`, `--rank`) as this process, `cluster` every rank as a
    /// process of its own.
    #[arg(long, requires_all = ["prefill", "decode"])]
    pub(crate) model: Option<String>,
    /// P's geometry: `tp=N,block=N,layout=NHD|HND[,pp=N][,kbpl=N]` (with `--model`).
    #[arg(long, requires = "model")]
    pub(crate) prefill: Option<String>,
    /// D's geometry, the same way (with `--model`).
    #[arg(long, requires = "model")]
    pub(crate) decode: Option<String>,
    /// With `--model`: requests in flight at once on each rank, each in its own memory slot.
    #[arg(long, requires = "model", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=32))]
    pub(crate) window: u32,
    /// With `--model --mode bidir`: how each request's first turn reaches D before its next
    /// turn is read back: `push` (P writes), `pull` (D reads, as vLLM's NIXL connector does) or
    /// `mixed` (drawn per request).
    #[arg(long, value_enum, requires = "model", default_value_t = FirstTurn::Push)]
    pub(crate) first_turn: FirstTurn,
}

/// `--first-turn`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum FirstTurn {
    Push,
    Pull,
    Mixed,
}

impl FirstTurn {
    /// Its name on the command line.
    pub(crate) fn name(self) -> &'static str {
        match self {
            FirstTurn::Push => "push",
            FirstTurn::Pull => "pull",
            FirstTurn::Mixed => "mixed",
        }
    }
}

/// A pair the flags name, its specs parsed.
#[derive(Debug, Clone)]
pub(crate) struct PairSpecs {
    pub(crate) model: String,
    pub(crate) prefill: SideSpec,
    pub(crate) decode: SideSpec,
}

impl PairArgs {
    /// The pair, if `--model` was given; a spec that does not parse says which flag and why.
    pub(crate) fn specs(&self) -> Result<Option<PairSpecs>, String> {
        let Some(model) = &self.model else {
            return Ok(None);
        };
        let parse = |what: &str, text: Option<&String>| {
            text.ok_or_else(|| format!("--{what} is needed with --model"))?
                .parse::<SideSpec>()
                .map_err(|e| format!("--{what}: {e}"))
        };
        Ok(Some(PairSpecs {
            model: model.clone(),
            prefill: parse("prefill", self.prefill.as_ref())?,
            decode: parse("decode", self.decode.as_ref())?,
        }))
    }
}

/// Refuses a pair's options: exit 2 with the reason, as `{"error": …}` with `--json`.
pub(crate) fn refuse(json: bool, error: &str) -> std::process::ExitCode {
    if json {
        super::print_json(&serde_json::json!({ "error": error }));
    } else {
        eprintln!("error: {error}");
    }
    std::process::ExitCode::from(2)
}

/// How a pair's requests move, from `--mode`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct PairMode {
    /// Every request pulled.
    pub(crate) pull: bool,
    /// Each request pushed or pulled, drawn from the seed.
    pub(crate) mixed: bool,
    /// Each request's first turn pushed, its next turn read back from D.
    pub(crate) bidir: bool,
}

impl PairMode {
    /// The pair's mode for `--mode` and `--first-turn` (which only a bidirectional run takes).
    pub(crate) fn of(mode: super::ModeArg, first: FirstTurn) -> Result<PairMode, String> {
        use super::ModeArg;
        let (pull, mixed, bidir) = match (mode, first) {
            (ModeArg::Push, FirstTurn::Push) => (false, false, false),
            (ModeArg::Pull, FirstTurn::Push) => (true, false, false),
            (ModeArg::Mixed, FirstTurn::Push) => (false, true, false),
            (ModeArg::Bidir, FirstTurn::Push) => (false, false, true),
            (ModeArg::Bidir, FirstTurn::Pull) => (true, false, true),
            (ModeArg::Bidir, FirstTurn::Mixed) => (false, true, true),
            (
                ModeArg::Push | ModeArg::Pull | ModeArg::Mixed,
                FirstTurn::Pull | FirstTurn::Mixed,
            ) => {
                return Err(format!(
                    "--first-turn {} is for --mode bidir (the other modes say how every request \
                     moves)",
                    first.name()
                ))
            }
        };
        Ok(PairMode { pull, mixed, bidir })
    }

    /// Whether a rank across processes needs the pair's router (anything D reads).
    pub(crate) fn needs_router(self) -> bool {
        self.pull || self.mixed || self.bidir
    }
}
