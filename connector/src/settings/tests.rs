use std::time::Duration;

use super::*;

/// What every field of the settings holds, whatever its part.
fn snapshot(settings: &RankSettings) -> String {
    format!(
        "{:?} {:?} {:?} {:?} {:?} {:?} {:?}",
        settings.config,
        settings.shell,
        settings.load_failure_policy,
        settings.next_turn_ttl,
        settings.recompute_threshold,
        settings.layerwise_parts,
        settings.layerwise_min_tokens
    )
}

/// A value every key takes and that is not its default.
fn sample(key: &str) -> SettingValue {
    match key {
        "block_pairing" => SettingValue::Text("as_given".into()),
        "load_failure_policy" => SettingValue::Text("recompute".into()),
        "integrity_digest" => SettingValue::Bool(true),
        k if k.ends_with("_ms") || k.ends_with("_us") || k.ends_with("_s") => {
            SettingValue::Int(7_777)
        }
        _ => SettingValue::Int(77),
    }
}

#[test]
fn every_key_sets_a_field_of_its_own() {
    let default = snapshot(&RankSettings::default());
    let mut seen = std::collections::HashSet::new();
    for key in RankSettings::keys() {
        let mut settings = RankSettings::default();
        settings.set(key, sample(key), "test").expect(key);
        let changed = snapshot(&settings);
        assert_ne!(changed, default, "{key} changed nothing");
        assert!(
            seen.insert(changed),
            "{key} sets the same field as another key"
        );
        assert!(settings.is_set(key));
    }
    assert_eq!(seen.len(), KEYS.len());
}

#[test]
fn the_file_the_environment_and_code_agree_on_every_key() {
    for key in RankSettings::keys() {
        let value = sample(key);
        let toml_value = match &value {
            SettingValue::Text(t) => format!("{t:?}"),
            other => other.to_string(),
        };
        let from_file =
            RankSettings::from_toml(&format!("[rank]\n{key} = {toml_value}\n"), "f.toml")
                .expect(key);
        let env_value = match &value {
            SettingValue::Text(t) => t.clone(),
            other => other.to_string(),
        };
        let mut from_env = RankSettings::default();
        from_env
            .apply_env([(format!("KVHANDOFF_RANK_{}", key.to_uppercase()), env_value)])
            .expect(key);
        let mut from_code = RankSettings::default();
        from_code.set(key, value, "code").expect(key);
        assert_eq!(snapshot(&from_file), snapshot(&from_code), "{key}");
        assert_eq!(snapshot(&from_env), snapshot(&from_code), "{key}");
    }
}

#[test]
fn code_overrides_the_environment_which_overrides_the_file() {
    let text = "[rank]\nconnect_timeout_ms = 1000\nmax_peers = 5\nlease_ms = 4000\n";
    let mut settings = RankSettings::from_toml(text, "f.toml").unwrap();
    settings
        .apply_env([
            ("KVHANDOFF_RANK_MAX_PEERS".to_string(), "6".to_string()),
            ("KVHANDOFF_RANK_LEASE_MS".to_string(), "5000".to_string()),
            // Another layer's variable (the command line's): not the rank's.
            ("KVHANDOFF_NODE_REQUESTS".to_string(), "x".to_string()),
        ])
        .unwrap();
    settings
        .set("lease_ms", SettingValue::Float(6000.5), "code")
        .unwrap();
    let config = settings.config().unwrap();
    assert_eq!(config.connect_timeout, Duration::from_secs(1));
    assert_eq!(config.max_peers, 6);
    assert_eq!(config.lease_duration, Duration::from_micros(6_000_500));
}

#[test]
fn other_tables_belong_to_the_command_line() {
    let text = "[node]\nrequests = 5\n[bench.transfer]\njson = true\n";
    let settings = RankSettings::from_toml(text, "f.toml").unwrap();
    assert_eq!(snapshot(&settings), snapshot(&RankSettings::default()));
}

#[test]
fn a_short_lease_pulls_the_unset_extension_and_heartbeat_along() {
    let mut settings = RankSettings::default();
    settings
        .set("lease_ms", SettingValue::Int(400), "code")
        .unwrap();
    let config = settings.config().unwrap();
    assert_eq!(config.lease_extension, Duration::from_millis(400));
    assert_eq!(config.heartbeat_interval, Duration::from_millis(100));
    // Set explicitly, a contradicting extension is an error, not a correction.
    settings
        .set("lease_extension_ms", SettingValue::Int(500), "code")
        .unwrap();
    assert!(matches!(settings.config(), Err(SettingsError::Invalid(_))));
}

#[test]
fn one_key_sets_how_long_a_handshake_may_take() {
    let defaults = RankSettings::default();
    let default_connect = defaults.config().unwrap().connect_timeout;
    assert_eq!(defaults.shell().handshake_timeout, default_connect);
    let thirty = Duration::from_secs(30);

    // The shell's budget alone: the endpoint's connect deadline follows, or it would give up
    // on a slow handshake first.
    let mut settings = RankSettings::default();
    settings
        .set("handshake_timeout_ms", SettingValue::Int(30_000), "test")
        .unwrap();
    assert_eq!(settings.shell().handshake_timeout, thirty);
    assert_eq!(settings.config().unwrap().connect_timeout, thirty);

    // The endpoint's deadline alone: the handshake's budget follows.
    let mut settings = RankSettings::default();
    settings
        .set("connect_timeout_ms", SettingValue::Int(30_000), "test")
        .unwrap();
    assert_eq!(settings.shell().handshake_timeout, thirty);
    assert_eq!(settings.config().unwrap().connect_timeout, thirty);

    // Both set: each as given.
    settings
        .set("handshake_timeout_ms", SettingValue::Int(2_000), "test")
        .unwrap();
    assert_eq!(settings.shell().handshake_timeout, Duration::from_secs(2));
    assert_eq!(settings.config().unwrap().connect_timeout, thirty);
}

#[test]
fn bad_values_name_their_key_and_origin() {
    let cases: &[(&str, SettingValue, &str)] = &[
        ("lease_ms", SettingValue::Int(0), "positive"),
        ("lease_ms", SettingValue::Int(-5), "positive"),
        ("lease_ms", SettingValue::Float(f64::NAN), "positive"),
        ("lease_ms", SettingValue::Float(1e12), "30 days"),
        (
            "lease_ms",
            SettingValue::Text("soon".into()),
            "milliseconds",
        ),
        ("lease_ms", SettingValue::Bool(true), "milliseconds"),
        ("max_requests", SettingValue::Int(0), "from 1"),
        ("max_requests", SettingValue::Int(1 << 40), "from 1"),
        ("max_requests", SettingValue::Float(2.5), "whole number"),
        ("max_register_retries", SettingValue::Int(1_001), "to 1000"),
        ("integrity_digest", SettingValue::Int(1), "true or false"),
        (
            "integrity_digest",
            SettingValue::Text("maybe".into()),
            "true or false",
        ),
        (
            "load_failure_policy",
            SettingValue::Text("retry".into()),
            "fail, recompute",
        ),
        (
            "block_pairing",
            SettingValue::Int(1),
            "tail_aligned, as_given",
        ),
    ];
    for (key, value, why) in cases {
        let mut settings = RankSettings::default();
        let before = snapshot(&settings);
        let err = settings.set(key, value.clone(), "origin-x").unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, SettingsError::BadValue { .. }),
            "{key} = {value}: {err:?}"
        );
        assert!(text.contains("origin-x") && text.contains(key), "{text}");
        assert!(text.contains(why), "{key} = {value}: {text}");
        // Nothing half-set.
        assert_eq!(snapshot(&settings), before);
        assert!(!settings.is_set(key));
    }
}

#[test]
fn unknown_keys_are_refused_in_the_file_and_under_the_rank_prefix() {
    let err = RankSettings::from_toml("[rank]\nleese_ms = 5\n", "f.toml").unwrap_err();
    assert!(matches!(&err, SettingsError::UnknownKey { key, .. } if key == "leese_ms"));
    assert!(err.to_string().contains("f.toml [rank]"), "{err}");
    assert!(
        err.to_string().contains("lease_ms"),
        "lists the keys: {err}"
    );

    let mut settings = RankSettings::default();
    let err = settings
        .apply_env([("KVHANDOFF_RANK_LEESE_MS".to_string(), "5".to_string())])
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("environment variable KVHANDOFF_RANK_LEESE_MS"),
        "{err}"
    );
}

#[test]
fn files_that_are_not_settings_are_refused() {
    let err = RankSettings::from_toml("[rank\nlease_ms = 5", "f.toml").unwrap_err();
    assert!(matches!(err, SettingsError::Syntax { .. }), "{err:?}");
    let err = RankSettings::from_toml("rank = 5", "f.toml").unwrap_err();
    assert!(err.to_string().contains("must be a table"), "{err}");
    let err = RankSettings::from_toml("[rank]\nlease_ms = [1, 2]", "f.toml").unwrap_err();
    assert!(
        err.to_string().contains("a number, a boolean or a string"),
        "{err}"
    );
    let err = RankSettings::from_toml("[rank.sub]\nx = 1", "f.toml").unwrap_err();
    assert!(
        matches!(&err, SettingsError::BadValue { key, .. } if key == "sub"),
        "{err:?}"
    );

    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    assert!(matches!(
        RankSettings::from_file(&missing),
        Err(SettingsError::Read { .. })
    ));
    let big = dir.path().join("big.toml");
    std::fs::write(&big, vec![b'#'; (MAX_FILE_BYTES + 1) as usize]).unwrap();
    assert!(matches!(
        RankSettings::from_file(&big),
        Err(SettingsError::TooLarge { .. })
    ));
    let good = dir.path().join("kvhandoff.toml");
    std::fs::write(&good, "[node]\nrequests = 3\n\n[rank]\nmax_peers = 9\n").unwrap();
    assert_eq!(
        RankSettings::from_file(&good)
            .unwrap()
            .config()
            .unwrap()
            .max_peers,
        9
    );
}

#[test]
fn connector_settings_follow_the_geometry_and_the_keys() {
    use kvhandoff_protocol::KvLayout;
    let geometry = KvGeometry::dense(4, 8, 128, 2, 16, KvLayout::Hnd);
    let mut settings = RankSettings::default();
    settings
        .set("layerwise_parts", SettingValue::Int(3), "code")
        .unwrap()
        .set("recompute_threshold", SettingValue::Int(0), "code")
        .unwrap()
        .set("next_turn_ttl_s", SettingValue::Int(60), "code")
        .unwrap()
        .set(
            "load_failure_policy",
            SettingValue::Text("recompute".into()),
            "code",
        )
        .unwrap();
    let config = settings.config().unwrap();
    let connector = settings.connector_settings(&config, &geometry);
    assert_eq!(connector.block_tokens, Some(16));
    assert_eq!(connector.layerwise_parts, 3);
    assert_eq!(connector.recompute_threshold, 0);
    assert_eq!(connector.next_turn_ttl, Duration::from_secs(60));
    assert_eq!(connector.load_failure_policy, LoadFailurePolicy::Recompute);
    assert_eq!(connector.lease_duration, config.lease_duration);
}

#[test]
fn a_layer_with_one_bad_key_applies_none_of_its_keys() {
    let mut settings = RankSettings::default();
    let before = snapshot(&settings);
    let text = "[rank]\nmax_peers = 9\nquarantine_ms = -1\n";
    assert!(settings.apply_toml(text, "f.toml").is_err());
    assert_eq!(snapshot(&settings), before);
    assert!(!settings.is_set("max_peers"));
    let vars = [
        ("KVHANDOFF_RANK_MAX_PEERS".to_string(), "9".to_string()),
        (
            "KVHANDOFF_RANK_QUARANTINE_MS".to_string(),
            "never".to_string(),
        ),
    ];
    assert!(settings.apply_env(vars).is_err());
    assert_eq!(snapshot(&settings), before);
}
