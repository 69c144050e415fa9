//! Bounded bookkeeping shared by the endpoint's tables: a timer index and tombstones.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::types::Time;

/// Which entry of which table a timer belongs to; one timer per entry.
#[derive(Debug)]
pub(crate) struct TimerIndex<K: Ord + Clone> {
    by_key: BTreeMap<K, Time>,
    by_time: BTreeSet<(Time, K)>,
}

impl<K: Ord + Clone> Default for TimerIndex<K> {
    fn default() -> Self {
        Self {
            by_key: BTreeMap::new(),
            by_time: BTreeSet::new(),
        }
    }
}

impl<K: Ord + Clone> TimerIndex<K> {
    /// Sets (or moves) the timer of `key`.
    pub(crate) fn set(&mut self, key: K, at: Time) {
        match self.by_key.get_mut(&key) {
            // Already set for that time: nothing moves.
            Some(old) if *old == at => {}
            Some(old) => {
                let old = std::mem::replace(old, at);
                self.by_time.remove(&(old, key.clone()));
                self.by_time.insert((at, key));
            }
            None => {
                self.by_key.insert(key.clone(), at);
                self.by_time.insert((at, key));
            }
        }
    }

    /// Removes the timer of `key`, if any.
    pub(crate) fn clear(&mut self, key: &K) {
        if let Some(old) = self.by_key.remove(key) {
            self.by_time.remove(&(old, key.clone()));
        }
    }

    /// The earliest timer.
    pub(crate) fn next(&self) -> Option<Time> {
        self.by_time.first().map(|(at, _)| *at)
    }

    /// Removes and returns every key whose timer is at or before `now`, earliest first.
    pub(crate) fn take_due(&mut self, now: Time) -> Vec<K> {
        let mut due = Vec::new();
        while let Some((at, _)) = self.by_time.first() {
            if *at > now {
                break;
            }
            if let Some((_, key)) = self.by_time.pop_first() {
                self.by_key.remove(&key);
                due.push(key);
            }
        }
        due
    }

    pub(crate) fn len(&self) -> usize {
        debug_assert_eq!(self.by_key.len(), self.by_time.len());
        self.by_key.len()
    }
}

/// Recently ended keys, kept for a while so that late messages about them are recognised.
/// Bounded: when full, the oldest is forgotten early.
#[derive(Debug)]
pub(crate) struct Tombstones<K: Ord + Clone, V> {
    entries: BTreeMap<K, (V, Time)>,
    order: VecDeque<(Time, K)>,
    limit: usize,
}

impl<K: Ord + Clone, V> Tombstones<K, V> {
    pub(crate) fn new(limit: usize) -> Self {
        assert!(limit > 0, "tombstone table needs room");
        Self {
            entries: BTreeMap::new(),
            order: VecDeque::new(),
            limit,
        }
    }

    /// Remembers `key` until `expires` (replacing an older record of it).
    pub(crate) fn insert(&mut self, key: K, value: V, expires: Time) {
        if self.entries.len() >= self.limit && !self.entries.contains_key(&key) {
            self.evict_oldest();
        }
        self.entries.insert(key.clone(), (value, expires));
        self.push_order(expires, key);
    }

    fn push_order(&mut self, expires: Time, key: K) {
        self.order.push_back((expires, key));
        if self.order.len() > 2 * self.limit {
            // Refreshed keys leave stale entries behind; drop them so `order` stays bounded.
            let entries = &self.entries;
            self.order
                .retain(|(at, k)| entries.get(k).is_some_and(|(_, exp)| exp == at));
        }
    }

    /// Remembers `key` until `expires` with the value `value` makes of its current record (if
    /// any): [`Self::get`] then [`Self::insert`], with one search of the table.
    pub(crate) fn upsert(&mut self, key: K, expires: Time, value: impl FnOnce(Option<&V>) -> V) {
        if self.entries.len() >= self.limit {
            let value = value(self.get(&key));
            self.insert(key, value, expires);
            return;
        }
        match self.entries.entry(key.clone()) {
            Entry::Occupied(mut entry) => {
                let value = value(Some(&entry.get().0));
                entry.insert((value, expires));
            }
            Entry::Vacant(entry) => {
                entry.insert((value(None), expires));
            }
        }
        self.push_order(expires, key);
    }

    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.entries.get(key).map(|(v, _)| v)
    }

    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        // The stale entry in `order` is skipped when it reaches the front.
        self.entries.remove(key).map(|(v, _)| v)
    }

    fn evict_oldest(&mut self) {
        while let Some((at, key)) = self.order.pop_front() {
            if self.entries.get(&key).is_some_and(|(_, exp)| *exp == at) {
                self.entries.remove(&key);
                return;
            }
        }
    }

    /// Forgets every record that expired at or before `now`.
    pub(crate) fn expire(&mut self, now: Time) {
        while let Some((at, key)) = self.order.front() {
            if *at > now {
                break;
            }
            if self.entries.get(key).is_some_and(|(_, exp)| exp == at) {
                self.entries.remove(key);
            }
            self.order.pop_front();
        }
    }

    /// When the oldest record expires.
    pub(crate) fn next_expiry(&self) -> Option<Time> {
        self.order.front().map(|(at, _)| *at)
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
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
}
