use super::*;

#[test]
fn timers_fire_in_order_and_move() {
    let mut t = TimerIndex::default();
    t.set("a", Time::from_nanos(30));
    t.set("b", Time::from_nanos(10));
    t.set("c", Time::from_nanos(20));
    t.set("a", Time::from_nanos(5));
    t.clear(&"c");
    assert_eq!(t.next(), Some(Time::from_nanos(5)));
    assert_eq!(t.take_due(Time::from_nanos(10)), vec!["a", "b"]);
    assert_eq!(t.len(), 0);
    assert_eq!(t.next(), None);
}

/// The index against a plain map under a long pseudo-random mix of sets, moves, clears and
/// expiries: same next timer, same due keys in the same order, and a bounded queue.
#[test]
fn timers_match_a_plain_model() {
    let mut index = TimerIndex::default();
    let mut model: BTreeMap<u32, Time> = BTreeMap::new();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut random = |below: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % below
    };
    let mut now = 0u64;
    for _ in 0..20_000 {
        let key = random(40) as u32;
        match random(10) {
            0..=5 => {
                let at = Time::from_nanos(now + random(500));
                index.set(key, at);
                model.insert(key, at);
            }
            6..=7 => {
                index.clear(&key);
                model.remove(&key);
            }
            _ => {
                now += random(100);
                let now = Time::from_nanos(now);
                let mut expected: Vec<(Time, u32)> = model
                    .iter()
                    .filter(|(_, at)| **at <= now)
                    .map(|(key, at)| (*at, *key))
                    .collect();
                expected.sort();
                for (_, key) in &expected {
                    model.remove(key);
                }
                let expected: Vec<u32> = expected.into_iter().map(|(_, key)| key).collect();
                assert_eq!(index.take_due(now), expected);
            }
        }
        assert_eq!(index.next(), model.values().min().copied());
        assert_eq!(index.len(), model.len());
        assert!(index.queue.len() <= 2 * model.len() + STALE_TIMER_SLACK + 1);
    }
}

/// Machines and their timers against a plain map of (machine, timer) under a long
/// pseudo-random mix of inserts, transitions that move or keep the timer, endings and
/// expiries: the same machines, the same next timer, the same due keys in the same order,
/// and a bounded queue.
/// A machine whose timer is whatever its last transition set.
#[derive(Debug)]
struct Timed {
    value: u64,
    at: Time,
}

impl Machine for Timed {
    type Ctx<'a> = ();
    type Input = ();
    type Next = ();

    fn handle(self, _: &(), _: (), _: &mut crate::machine::effects::Outbox) {}

    fn next_timer(&self, _: &Config) -> Time {
        self.at
    }
}

#[test]
fn machine_timers_match_a_plain_model() {
    let config = Config::default();
    let mut machines: Machines<u32, Timed> = Machines::default();
    let mut model: BTreeMap<u32, (u64, Time)> = BTreeMap::new();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = |below: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % below
    };
    let mut now = 0u64;
    for _ in 0..20_000 {
        let key = random(40) as u32;
        let value = random(1_000);
        let at = Time::from_nanos(now + random(500));
        match random(12) {
            0..=2 => {
                if let std::collections::btree_map::Entry::Vacant(entry) = model.entry(key) {
                    machines.insert(key, Timed { value, at }, &config);
                    entry.insert((value, at));
                }
            }
            3..=6 => {
                let said = machines.step(&key, &config, |old| {
                    (
                        Some(Timed {
                            value: old.value + value,
                            at,
                        }),
                        old.value,
                    )
                });
                assert_eq!(said, model.get(&key).map(|(old, _)| *old));
                if let Some(entry) = model.get_mut(&key) {
                    *entry = (entry.0 + value, at);
                }
            }
            7 => {
                let said = machines.step(&key, &config, |old| (None, old.value));
                assert_eq!(said, model.remove(&key).map(|(old, _)| old));
            }
            8 => {
                // Keeps the armed timer: the model's timer does not move.
                let said = machines.step_keeping_timer(&key, &config, |old| {
                    (
                        Timed {
                            value: old.value + 1,
                            at,
                        },
                        (),
                    )
                });
                assert_eq!(said.is_some(), model.contains_key(&key));
                if let Some(entry) = model.get_mut(&key) {
                    entry.0 += 1;
                }
            }
            _ => {
                now += random(100);
                let now = Time::from_nanos(now);
                let mut expected: Vec<(Time, u32)> = model
                    .iter()
                    .filter(|(_, (_, at))| *at <= now)
                    .map(|(key, (_, at))| (*at, *key))
                    .collect();
                expected.sort();
                let expected: Vec<u32> = expected.into_iter().map(|(_, key)| key).collect();
                assert_eq!(machines.take_due(now), expected);
                // Every due machine steps again, as `handle_timeout` does: a later timer.
                for key in expected {
                    let later = Time::from_nanos(now.as_nanos() + 1 + random(500));
                    machines.step(&key, &config, |old| {
                        (
                            Some(Timed {
                                value: old.value,
                                at: later,
                            }),
                            (),
                        )
                    });
                    if let Some(entry) = model.get_mut(&key) {
                        entry.1 = later;
                    }
                }
            }
        }
        assert!(machines.all_armed());
        assert_eq!(machines.len(), model.len());
        assert_eq!(
            machines.next_timer(),
            model.values().map(|(_, at)| *at).min()
        );
        for (key, (value, _)) in &model {
            assert_eq!(machines.get(key).map(|m| m.value), Some(*value));
        }
        assert!(machines.timers.len() <= 2 * model.len() + STALE_TIMER_SLACK + 1);
    }
}

#[test]
fn tombstones_expire_and_stay_bounded() {
    let mut t = Tombstones::new(2);
    t.insert(1, "x", Time::from_nanos(10));
    t.insert(2, "y", Time::from_nanos(20));
    t.insert(3, "z", Time::from_nanos(30));
    assert_eq!(t.len(), 2);
    assert!(t.get(&1).is_none(), "the oldest is evicted when full");
    t.insert(2, "y2", Time::from_nanos(40));
    t.expire(Time::from_nanos(30));
    assert_eq!(
        t.get(&2),
        Some(&"y2"),
        "a refreshed record outlives its old expiry"
    );
    assert!(t.get(&3).is_none());
    assert_eq!(t.remove(&2), Some("y2"));
    assert_eq!(t.len(), 0);
}

#[test]
fn timer_edges() {
    let mut t = TimerIndex::default();
    t.clear(&"absent");
    assert_eq!(t.take_due(Time::from_nanos(100)), Vec::<&str>::new());
    t.set("b", Time::from_nanos(10));
    t.set("a", Time::from_nanos(10));
    t.set("a", Time::from_nanos(10));
    assert_eq!(t.len(), 2, "setting the same timer twice keeps one");
    assert_eq!(t.take_due(Time::from_nanos(9)), Vec::<&str>::new());
    assert_eq!(
        t.take_due(Time::from_nanos(10)),
        vec!["a", "b"],
        "due at exactly its time; ties by key"
    );
    t.set("c", Time::from_nanos(50));
    t.set("c", Time::from_nanos(5));
    assert_eq!(
        t.next(),
        Some(Time::from_nanos(5)),
        "a timer can move earlier"
    );
    assert_eq!(t.take_due(Time::from_nanos(49)), vec!["c"]);
    assert_eq!(t.len(), 0);
}

#[test]
fn tombstone_edges() {
    let mut t = Tombstones::new(2);
    assert_eq!(t.remove(&9), None);
    t.insert(1, "a", Time::from_nanos(10));
    t.insert(2, "b", Time::from_nanos(20));
    t.remove(&1);
    t.insert(3, "c", Time::from_nanos(30));
    t.insert(4, "d", Time::from_nanos(40));
    assert_eq!(t.len(), 2);
    assert!(
        t.get(&2).is_none(),
        "eviction skips the removed key's stale entry and takes the oldest live one"
    );
    assert!(t.get(&3).is_some() && t.get(&4).is_some());

    // Refreshing one key many times leaves `order` bounded.
    for i in 0..100u64 {
        t.insert(3, "c", Time::from_nanos(100 + i));
        assert!(t.order.len() <= 2 * t.limit + 1, "order grows unbounded");
    }
    assert_eq!(t.len(), 2);
    t.expire(Time::from_nanos(40));
    assert_eq!(t.get(&4), None, "expires at exactly its time");
    assert_eq!(t.get(&3), Some(&"c"), "the refreshed record lives on");
    t.expire(Time::from_nanos(199));
    assert_eq!(t.len(), 0);
    assert_eq!(t.next_expiry(), None);
}

#[test]
fn upsert_sees_the_current_record_and_stays_bounded() {
    let mut t = Tombstones::new(2);
    t.upsert(1, Time::from_nanos(10), |old| {
        assert_eq!(old, None);
        "a"
    });
    t.upsert(1, Time::from_nanos(20), |old| {
        assert_eq!(old, Some(&"a"));
        "b"
    });
    t.upsert(2, Time::from_nanos(30), |_| "c");
    t.upsert(3, Time::from_nanos(40), |old| {
        assert_eq!(old, None);
        "d"
    });
    assert_eq!(t.len(), 2);
    assert_eq!(t.get(&1), None, "the oldest is evicted when full");
    t.expire(Time::from_nanos(30));
    assert_eq!(t.get(&3), Some(&"d"));
    assert_eq!(t.len(), 1);
}

#[test]
#[should_panic(expected = "needs room")]
fn tombstones_need_room() {
    let _ = Tombstones::<u32, ()>::new(0);
}
