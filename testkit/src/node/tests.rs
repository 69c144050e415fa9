//! Unit tests of a node: the timing flags and the part of the plan a restarted node runs.

use super::drive::part_of;
use super::*;
use crate::demo::schedule;

#[test]
fn timing_flags_give_a_valid_config() {
    let ms = Duration::from_millis;
    let c = NodeTiming {
        heartbeat: Some(ms(200)),
        lease: Some(ms(3000)),
        decode_deadline: Some(ms(1500)),
        ..NodeTiming::default()
    }
    .config()
    .unwrap();
    assert_eq!(
        (c.heartbeat_interval, c.peer_timeout, c.lease_duration),
        (ms(200), ms(300), ms(3000))
    );
    assert_eq!(c.decode_deadline, ms(1500));
    assert!(c.lease_extension <= c.lease_duration);
    // A heartbeat longer than the default quarantine allows moves the quarantine.
    let long = NodeTiming {
        heartbeat: Some(Duration::from_secs(20)),
        ..NodeTiming::default()
    };
    long.config().unwrap();
    assert_eq!(NodeTiming::default().config().unwrap(), Config::default());
    let bad = NodeTiming {
        heartbeat: Some(ms(500)),
        lease: Some(ms(400)),
        ..NodeTiming::default()
    };
    assert!(bad.config().is_err());
    let tiny = NodeTiming {
        heartbeat: Some(ms(5)),
        ..NodeTiming::default()
    };
    assert!(tiny.config().is_err());
    // The fence flags: P's write deadline and abandon wait fit inside the write's life, and the
    // quarantine moves above the fence floor they make.
    let fenced = NodeTiming {
        heartbeat: Some(ms(200)),
        registration_ttl: Some(ms(1000)),
        max_write_life: Some(ms(1500)),
        max_message_delay: Some(ms(500)),
        ..NodeTiming::default()
    }
    .config()
    .unwrap();
    assert_eq!(fenced.write_timeout + fenced.abandon_timeout, ms(1500));
    assert_eq!(fenced.fence_floor(), ms(1000 + 200 + 500 + 300 + 1500));
    assert!(fenced.quarantine > fenced.fence_floor());
    assert!(fenced.quarantine < ms(4000), "{:?}", fenced.quarantine);
}

#[test]
fn a_later_part_of_the_plan_keeps_ids_and_shifts_arrivals() {
    let options = DemoOptions {
        requests: 20,
        ..DemoOptions::default()
    };
    let whole = schedule(&options, 16).unwrap();
    let part = part_of(&whole, 12);
    assert_eq!(part.len(), 8);
    assert_eq!(part[0].arrival, Duration::ZERO);
    for (q, w) in part.iter().zip(&whole[12..]) {
        assert_eq!((&q.prefill_id, &q.decode_id), (&w.prefill_id, &w.decode_id));
        assert_eq!(q.arrival, w.arrival - whole[12].arrival);
    }
    assert!(part_of(&whole, 20).is_empty());
}

#[test]
fn a_later_part_of_a_conversation_plan_renumbers_its_turns() {
    let options = DemoOptions {
        requests: 12,
        mode: crate::demo::DemoMode::Bidir,
        turns: 4,
        max_prompt_tokens: 256,
        ..DemoOptions::default()
    };
    let whole = schedule(&options, 16).unwrap();
    // From the middle of the second conversation (turns 4..8).
    let part = part_of(&whole, 6);
    assert_eq!(part.len(), 6);
    // Its turn 3 (whole index 6) starts the part: no turn before here, nothing to read back.
    assert_eq!((part[0].prev, part[0].prefix_tokens), (None, 0));
    assert_eq!(part[0].next, Some(1));
    assert_eq!(part[1].prev, Some(0));
    assert_eq!(part[1].prefix_tokens, whole[7].prefix_tokens);
    assert_eq!(part[1].next, None, "the conversation's last turn");
    // The third conversation, whole.
    assert_eq!((part[2].prev, part[2].next), (None, Some(3)));
    assert_eq!(part[5].prev, Some(4));
}
