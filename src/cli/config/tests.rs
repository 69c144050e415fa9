use std::io::Write;

use clap::{ArgMatches, CommandFactory};

use super::*;
use crate::Cli;

const NODE: [&str; 6] = [
    "--listen",
    "127.0.0.1:5601",
    "--peer",
    "127.0.0.1:5600",
    "--role",
    "decode",
];

fn file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new()
        .suffix(".toml")
        .tempfile()
        .expect("temp file");
    f.write_all(text.as_bytes()).expect("write");
    f
}

/// Parses `argv` (without the program name) under `env`, as `main` does.
fn parse(argv: &[&str], env: &[(&str, &str)]) -> Result<ArgMatches, String> {
    let argv: Vec<OsString> = std::iter::once("kvhandoff")
        .chain(argv.iter().copied())
        .map(OsString::from)
        .collect();
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let command = configure(Cli::command(), &argv, &env).map_err(|e| e.to_string())?;
    command
        .try_get_matches_from(argv)
        .map_err(|e| e.to_string())
}

/// `--config PATH node` with the node's required options.
fn node_with_config(path: &str) -> Vec<&str> {
    ["--config", path, "node"]
        .iter()
        .chain(NODE.iter())
        .copied()
        .collect()
}

fn node(m: &ArgMatches) -> &ArgMatches {
    m.subcommand_matches("node").expect("node")
}

fn requests(m: &ArgMatches) -> u32 {
    *node(m).get_one::<u32>("requests").expect("requests")
}

#[test]
fn layers_rank_default_file_json_env_then_command_line() {
    let f = file("[node]\nrequests = 200\nseed = 7\n");
    let path = f.path().to_str().unwrap();
    let base = ["--config", path, "node"];
    let argv: Vec<&str> = base.iter().chain(NODE.iter()).copied().collect();
    let m = parse(&argv, &[]).unwrap();
    assert_eq!(requests(&m), 200);
    assert_eq!(*node(&m).get_one::<u64>("seed").unwrap(), 7);
    // Untouched options keep their built-in defaults.
    assert_eq!(*node(&m).get_one::<u32>("pool_blocks").unwrap(), 1024);

    let json = r#"{"kv_connector":"KvHandoffConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"requests":300}}"#;
    let mut with_json = argv.clone();
    with_json.extend(["--kv-transfer-config", json]);
    assert_eq!(requests(&parse(&with_json, &[]).unwrap()), 300);

    let env = [("KVHANDOFF_NODE_REQUESTS", "400")];
    assert_eq!(requests(&parse(&with_json, &env).unwrap()), 400);

    let mut with_flag = with_json.clone();
    with_flag.extend(["--requests", "500"]);
    assert_eq!(requests(&parse(&with_flag, &env).unwrap()), 500);
}

#[test]
fn the_file_can_supply_required_options_and_flags() {
    let f = file(
        "[node]\nrole = \"prefill\"\nlisten = \"127.0.0.1:5600\"\npeer = \"127.0.0.1:5601\"\njson = true\n",
    );
    let path = f.path().to_str().unwrap();
    let m = parse(&["node", "--config", path], &[]).unwrap();
    assert!(node(&m).get_flag("json"));
    assert_eq!(
        node(&m)
            .get_one::<std::net::SocketAddr>("listen")
            .unwrap()
            .port(),
        5600
    );
    // Without the file the same command line is refused by clap.
    assert!(parse(&["node"], &[]).is_err());
    // The file's name from the environment.
    let m = parse(&["node"], &[(CONFIG_VAR, path)]).unwrap();
    assert!(node(&m).get_flag("json"));
}

#[test]
fn nested_subcommands_have_their_own_tables() {
    let f = file("[bench.transfer]\njson = true\n");
    let path = f.path().to_str().unwrap();
    let m = parse(&["--config", path, "bench", "transfer"], &[]).unwrap();
    let transfer = m
        .subcommand_matches("bench")
        .and_then(|b| b.subcommand_matches("transfer"))
        .expect("bench transfer");
    assert!(transfer.get_flag("json"));
    // The same file configures nothing of another subcommand.
    let argv: Vec<&str> = ["--config", path, "node"]
        .iter()
        .chain(NODE.iter())
        .copied()
        .collect();
    assert!(!node(&parse(&argv, &[]).unwrap()).get_flag("json"));
}

#[test]
fn a_bad_file_is_refused_naming_the_file_table_and_key() {
    let cases = [
        (
            "[node]\nrequets = 5\n",
            "`requets` is not an option of `kvhandoff node`",
        ),
        ("[nod]\nrequests = 5\n", "[nod] names no subcommand"),
        ("requests = 5\n", "[requests] names no subcommand"),
        ("[node]\nrequests = 0\n", "`requests` = \"0\""),
        ("[node]\nrequests = \"many\"\n", "`requests` = \"many\""),
        ("[node]\nrole = \"both\"\n", "`role` = \"both\""),
        ("[node]\nrequests = [1, 2]\n", "takes one value"),
        ("[node]\nrequests = 1979-05-27\n", "must be a string"),
        ("[node]\nhelp = true\n", "`help` is not an option"),
        (
            "[sim]\nrequets = 5\n",
            "`requets` is not an option of `kvhandoff sim`",
        ),
        ("[node\n", "not valid TOML"),
        ("[rank]\nleese_ms = 5\n", "`leese_ms` is not a rank setting"),
        ("[rank]\nlease_ms = 0\n", "[rank]: `lease_ms` = 0"),
    ];
    for (text, expected) in cases {
        let f = file(text);
        let path = f.path().to_str().unwrap();
        let err = parse(&node_with_config(path), &[]).expect_err(text);
        assert!(err.contains(expected), "{text:?}: {err}");
        if !expected.contains("TOML") {
            assert!(err.contains(path), "{text:?}: {err}");
        }
    }
    let err = parse(&["--config", "/nonexistent/kvhandoff.toml", "node"], &[]).unwrap_err();
    assert!(err.contains("cannot read the configuration file /nonexistent/kvhandoff.toml"));
}

#[test]
fn the_environment_is_strict_on_values_and_lenient_on_names() {
    let argv: Vec<&str> = ["node"].iter().chain(NODE.iter()).copied().collect();
    // A variable of the prefix that names no option (the test script's own) is ignored.
    let m = parse(&argv, &[("KVHANDOFF_NODE_NOT_AN_OPTION", "1")]).unwrap();
    assert_eq!(requests(&m), 64);
    let err = parse(&argv, &[("KVHANDOFF_NODE_REQUESTS", "lots")]).unwrap_err();
    assert!(
        err.contains("environment variable KVHANDOFF_NODE_REQUESTS"),
        "{err}"
    );
    for (value, on) in [("1", true), ("yes", true), ("0", false), ("off", false)] {
        let m = parse(&argv, &[("KVHANDOFF_NODE_JSON", value)]).unwrap();
        assert_eq!(node(&m).get_flag("json"), on, "{value}");
    }
    let err = parse(&argv, &[("KVHANDOFF_NODE_JSON", "maybe")]).unwrap_err();
    assert!(err.contains("a flag takes true or false"), "{err}");
    // Variables of another subcommand do not apply.
    let m = parse(&argv, &[("KVHANDOFF_DEMO_REQUESTS", "9")]).unwrap();
    assert_eq!(requests(&m), 64);
}

#[test]
fn vllm_kv_transfer_config_maps_the_role_and_the_extra_config() {
    let run = |json: &str| {
        parse(
            &[
                "node",
                "--listen",
                "127.0.0.1:1",
                "--peer",
                "127.0.0.1:2",
                "--kv-transfer-config",
                json,
            ],
            &[],
        )
    };
    let m = run(r#"{"kv_connector":"KvHandoffConnector","kv_role":"kv_producer","engine_id":"e1","kv_buffer_device":"cpu","kv_connector_extra_config":{"seed":3,"json":true}}"#).unwrap();
    assert_eq!(*node(&m).get_one::<u64>("seed").unwrap(), 3);
    assert!(node(&m).get_flag("json"));
    let refused = [
        (r#"{"kv_role":"kv_both"}"#, "a node runs one role"),
        (
            r#"{"kv_role":"kv_consumer","kv_connector":"NixlConnector"}"#,
            "kv_connector is \"NixlConnector\"",
        ),
        (
            r#"{"kv_role":"kv_consumer","kv_whatever":1}"#,
            "`kv_whatever` is not a field",
        ),
        (
            r#"{"kv_role":"kv_consumer","kv_connector_extra_config":{"sed":1}}"#,
            "`sed` is not an option",
        ),
        (
            r#"{"kv_role":"kv_consumer","kv_connector_extra_config":{"requests":-1}}"#,
            "`requests` = \"-1\"",
        ),
        (r#"["kv_role"]"#, "not a JSON object"),
        ("{", "not JSON"),
    ];
    for (json, expected) in refused {
        let err = run(json).expect_err(json);
        assert!(err.contains("--kv-transfer-config"), "{json}: {err}");
        assert!(err.contains(expected), "{json}: {err}");
    }
}

#[test]
fn commands_without_configuration_parse_as_before() {
    assert!(parse(&["version"], &[]).is_ok());
    let m = parse(&["sim", "--seeds", "1..3"], &[("KVHANDOFF_SIM_TRACE", "1")]);
    assert!(m.is_ok(), "{m:?}");
}

/// One deployment file serves the command line and the engines: `[rank]` is the embedding
/// API's (`kvhandoff::RankSettings`), and a command reading the file leaves it to them.
#[test]
fn the_rank_table_is_the_embedding_apis() {
    let text =
        "[rank]\nlease_ms = 5000\nload_failure_policy = \"recompute\"\n\n[node]\nrequests = 7\n";
    let f = file(text);
    let path = f.path().to_str().unwrap();
    let m = parse(&node_with_config(path), &[]).expect("a [rank] table is not a subcommand's");
    assert_eq!(requests(&m), 7);
    let rank = kvhandoff::RankSettings::from_file(f.path()).expect("the same file");
    assert_eq!(
        rank.config().expect("valid").lease_duration,
        std::time::Duration::from_secs(5)
    );
}
