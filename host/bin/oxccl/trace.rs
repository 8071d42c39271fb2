//! `oxccl trace`: flight-recorder dumps read by `oxccl::comm::flight_recorder::analyze`.
use super::*;

#[derive(clap::Args)]
pub(super) struct TraceArgs {
    /// Dump files (JSON, one per rank; several communicators may be mixed).
    #[arg(required = true, value_name = "DUMP")]
    dumps: Vec<std::path::PathBuf>,
}

pub(super) fn trace(a: TraceArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let mut dumps = Vec::with_capacity(a.dumps.len());
    for p in &a.dumps {
        let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        dumps.push((p.display().to_string(), text));
    }
    print!("{}", oxccl::comm::flight_recorder::analyze(&dumps)?);
    Ok(ExitCode::SUCCESS)
}
