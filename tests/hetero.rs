//! `kvhandoff plan` end to end: the binary plans a good heterogeneous pair as JSON, and answers
//! an impossible pair and a bad spec with `{"error": ...}` and exit code 2.

mod cli_json;

fn plan(args: &[&str]) -> (Option<i32>, serde_json::Value) {
    cli_json::run_json("plan", args)
}

#[test]
fn a_good_pair_is_planned_and_verified() {
    let (code, json) = plan(&[
        "--model",
        "gqa2",
        "--prefill",
        "tp=4,block=16,layout=NHD",
        "--decode",
        "tp=1,block=32,layout=HND",
        "--tokens",
        "150",
        "--verify",
    ]);
    assert_eq!(code, Some(0), "{json}");
    assert_eq!(json["verified"], true);
    // Heads replicated on P: ranks 0 and 2 write, 1 and 3 are idle; D waits for 2 writes.
    let targets: Vec<usize> = json["prefill_ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["targets"].as_array().unwrap().len())
        .collect();
    assert_eq!(targets, [1, 0, 1, 0]);
    assert_eq!(json["decode_ranks"][0]["writers"], 2);
    let t = &json["prefill_ranks"][2]["targets"][0];
    assert_eq!(t["heads"]["global"]["start"], 1);
    assert!(t["descriptors"].as_u64().unwrap() > 0);
    assert!(t["head_bytes"]["decode"]["offset"].as_u64().unwrap() > 0);
    assert!(json["transforms"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["kind"] == "Regroup"));
    assert_eq!(json["vllm"]["verdict"], "rejected");
}

#[test]
fn an_impossible_pair_and_bad_input_exit_2_with_a_reason() {
    let cases: [(&[&str], &str); 4] = [
        (
            &[
                "--model",
                "gqa8",
                "--prefill",
                "tp=3,block=16,layout=HND",
                "--decode",
                "tp=1,block=16,layout=HND",
            ],
            "8 KV heads cannot be split over or replicated across 3 TP ranks",
        ),
        (
            &[
                "--model",
                "mamba",
                "--prefill",
                "tp=1,block=16,layout=HND",
                "--decode",
                "tp=16,block=16,layout=HND",
            ],
            "mamba state heads cannot be split evenly over tp=16",
        ),
        (
            &[
                "--model",
                "gqa8",
                "--prefill",
                "tp=1,block=16,layout=XYZ",
                "--decode",
                "tp=1,block=16,layout=HND",
            ],
            "P spec: layout=\"XYZ\" is neither NHD nor HND",
        ),
        (
            &[
                "--model",
                "llama",
                "--prefill",
                "tp=1,block=16,layout=HND",
                "--decode",
                "tp=1,block=16,layout=HND",
            ],
            "unknown model \"llama\"",
        ),
    ];
    for (args, why) in cases {
        let (code, json) = plan(args);
        assert_eq!(code, Some(2), "{args:?}: {json}");
        let error = json["error"].as_str().unwrap_or_default();
        assert!(error.contains(why), "{args:?}: {error}");
    }
}
