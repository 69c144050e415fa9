//! Runs a sweep and prints the report as JSON: `sweep [A..B] [requests] [none|network|chaos]
//! [mutation]`. Used to time sweeps in release builds.

use kvhandoff_sim::{parse_seed_range, run_seeds, Faults, SimOptions};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let seeds = parse_seed_range(args.first().map_or("0..500", String::as_str)).expect("seeds");
    let requests = args.get(1).map_or(50, |s| s.parse().expect("requests"));
    let faults: Faults = args.get(2).map_or("chaos", String::as_str).parse().expect("faults");
    let mutation = args.get(3).is_some_and(|s| s == "mutation");
    let start = std::time::Instant::now();
    let report = run_seeds(&SimOptions { seeds, requests, faults, long: false, mutation });
    let elapsed = start.elapsed();
    println!("{}", serde_json::to_string_pretty(&report).expect("serializable"));
    eprintln!("elapsed: {elapsed:?}");
}
