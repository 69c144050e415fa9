//! Running the `kvhandoff` binary with `--json` from an end-to-end test.

use std::process::Command;

/// Runs `kvhandoff <command> <args> --json`: its exit code and its stdout as JSON (the test
/// fails, with stdout and stderr, if it is not JSON).
pub fn run_json(command: &str, args: &[&str]) -> (Option<i32>, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvhandoff"))
        .arg(command)
        .args(args)
        .arg("--json")
        .output()
        .expect("the binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), json)
}
