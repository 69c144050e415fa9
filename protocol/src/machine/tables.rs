//! Bounded bookkeeping shared by the endpoint's tables: a timer index and tombstones.

use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::fmt;
use std::hash::Hash;

use super::shape::Machine;
use super::types::Time;
use super::Config;

/// A queue of timers, each entry `(time, key)`, earliest first (ties by key), where an entry
/// may have gone stale: its key's timer moved or went away. The owner knows which entries are
/// live (`is_live`), so moving a timer costs one push instead of a search of the heap; stale
/// entries are skipped when they reach the front, the front is kept live (so
/// [`Self::next`] is exact), and the queue is rebuilt from the live timers when stale entries
/// outnumber them. [`Machines`] and [`TimerIndex`] both keep their timers here.
#[derive(Debug)]
struct LazyTimers<K: Ord + Clone> {
    queue: BinaryHeap<Reverse<(Time, K)>>,
}

impl<K: Ord + Clone> Default for LazyTimers<K> {
    fn default() -> Self {
        Self {
            queue: BinaryHeap::new(),
        }
    }
}

impl<K: Ord + Clone> LazyTimers<K> {
    fn push(&mut self, at: Time, key: K) {
        self.queue.push(Reverse((at, key)));
    }

    fn next(&self) -> Option<Time> {
        self.queue.peek().map(|Reverse((at, _))| *at)
    }

    fn len(&self) -> usize {
        self.queue.len()
    }

    /// Pops every entry due at `now`, earliest first, and returns the live ones (`take` says
    /// whether an entry is live and disarms it).
    fn pop_due(&mut self, now: Time, mut take: impl FnMut(&K, Time) -> bool) -> Vec<K> {
        let mut due = Vec::new();
        while self.next().is_some_and(|at| at <= now) {
            let Some(Reverse((at, key))) = self.queue.pop() else {
                break;
            };
            if take(&key, at) {
                due.push(key);
            }
        }
        due
    }

    /// A timer that was at `old` is no longer live: if its entry may be the front, drop stale
    /// entries from the front so that [`Self::next`] stays exact.
    fn after_disarm(&mut self, old: Time, is_live: impl Fn(&K, Time) -> bool) {
        if self.next() == Some(old) {
            self.drop_stale_front(is_live);
        }
    }

    fn drop_stale_front(&mut self, is_live: impl Fn(&K, Time) -> bool) {
        while let Some(Reverse((at, key))) = self.queue.peek() {
            if is_live(key, *at) {
                return;
            }
            self.queue.pop();
        }
    }

    /// Rebuilds the queue from `live` when stale entries outnumber the `live_count` live ones.
    fn compact(&mut self, live_count: usize, live: impl Iterator<Item = (Time, K)>) {
        if self.queue.len() > 2 * live_count + STALE_TIMER_SLACK {
            self.queue = live.map(Reverse).collect();
        }
    }
}

/// Live machines by key, each with its one timer.
///
/// A transition ([`Self::step`]) takes a machine out of its slot and puts its successor back
/// into the same slot, re-arming the machine's timer on the way: one search per step, where a
/// separate timer index and a remove-and-reinsert cost four. Timers live in a [`LazyTimers`]
/// queue, each slot knowing which of its entries is live.
#[derive(Debug)]
pub(crate) struct Machines<K: Ord + Clone, M> {
    slots: BTreeMap<K, Slot<M>>,
    /// Every timer armed. An entry is live while its slot's `armed` holds its time.
    timers: LazyTimers<K>,
}

/// One machine's place. The machine is boxed so that the B-tree's nodes hold pointers, not
/// machines (inserting or removing a key shifts small values), and is out of its box only
/// inside a transition.
#[derive(Debug)]
struct Slot<M> {
    machine: Box<Option<M>>,
    /// The time of the machine's live timer entry; `None` while a due timer waits for its step.
    armed: Option<Time>,
}

impl<M> Slot<M> {
    fn get(&self) -> &M {
        (*self.machine)
            .as_ref()
            .unwrap_or_else(|| unreachable!("only a transition empties a slot"))
    }

    fn get_mut(&mut self) -> &mut M {
        (*self.machine)
            .as_mut()
            .unwrap_or_else(|| unreachable!("only a transition empties a slot"))
    }

    fn take(&mut self) -> M {
        (*self.machine)
            .take()
            .unwrap_or_else(|| unreachable!("a transition runs on a present machine"))
    }
}

impl<K: Ord + Clone, M> Default for Machines<K, M> {
    fn default() -> Self {
        Self {
            slots: BTreeMap::new(),
            timers: LazyTimers::default(),
        }
    }
}

impl<K: Ord + Clone, M: Machine> Machines<K, M> {
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub(crate) fn contains_key(&self, key: &K) -> bool {
        self.slots.contains_key(key)
    }

    pub(crate) fn get(&self, key: &K) -> Option<&M> {
        self.slots.get(key).map(Slot::get)
    }

    /// For changes a machine makes to itself that leave its timer alone (queueing a message).
    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut M> {
        self.slots.get_mut(key).map(Slot::get_mut)
    }

    /// Adds a machine, with its timer armed, for a key that has none.
    pub(crate) fn insert(&mut self, key: K, machine: M, config: &Config) {
        let at = machine.next_timer(config);
        let slot = Slot {
            machine: Box::new(Some(machine)),
            armed: Some(at),
        };
        let previous = self.slots.insert(key.clone(), slot);
        assert!(previous.is_none(), "one machine per key");
        self.timers.push(at, key);
        self.compact_timers();
    }

    /// Runs `transition` on `key`'s machine, if there is one, and returns what it says besides
    /// the successor. A successor takes the slot with its timer at its
    /// [`Machine::next_timer`]; no successor (the machine ended) frees the slot.
    pub(crate) fn step<R>(
        &mut self,
        key: &K,
        config: &Config,
        transition: impl FnOnce(M) -> (Option<M>, R),
    ) -> Option<R> {
        let slot = self.slots.get_mut(key)?;
        let (next, said) = transition(slot.take());
        let old = slot.armed;
        let disarmed = match next {
            Some(next) => {
                let at = next.next_timer(config);
                *slot.machine = Some(next);
                if old == Some(at) {
                    None
                } else {
                    slot.armed = Some(at);
                    self.timers.push(at, key.clone());
                    old
                }
            }
            None => {
                self.slots.remove(key);
                old
            }
        };
        self.after_disarm(disarmed);
        self.compact_timers();
        Some(said)
    }

    /// [`Self::step`] for a transition that never hastens the machine's timer: the armed timer
    /// stays (a timer that fires early finds the machine re-checking its deadlines), unless none
    /// is armed.
    pub(crate) fn step_keeping_timer<R>(
        &mut self,
        key: &K,
        config: &Config,
        transition: impl FnOnce(M) -> (M, R),
    ) -> Option<R> {
        let slot = self.slots.get_mut(key)?;
        let (next, said) = transition(slot.take());
        if slot.armed.is_none() {
            let at = next.next_timer(config);
            slot.armed = Some(at);
            self.timers.push(at, key.clone());
        }
        *slot.machine = Some(next);
        Some(said)
    }

    /// The earliest timer.
    pub(crate) fn next_timer(&self) -> Option<Time> {
        self.timers.next()
    }

    /// Every key whose timer is at or before `now`, earliest first; their timers are disarmed
    /// until their machines step again (the caller steps each one).
    pub(crate) fn take_due(&mut self, now: Time) -> Vec<K> {
        let slots = &mut self.slots;
        let due = self
            .timers
            .pop_due(now, |key, at| match slots.get_mut(key) {
                Some(slot) if slot.armed == Some(at) => {
                    slot.armed = None;
                    true
                }
                Some(_) | None => false,
            });
        let slots = &self.slots;
        self.timers
            .drop_stale_front(|key, at| slots.get(key).is_some_and(|s| s.armed == Some(at)));
        due
    }

    /// Whether every machine has a live timer (true outside `handle_timeout`).
    pub(crate) fn all_armed(&self) -> bool {
        self.slots.values().all(|slot| slot.armed.is_some())
            && self.timers.len() >= self.slots.len()
    }

    fn after_disarm(&mut self, old: Option<Time>) {
        if let Some(old) = old {
            let slots = &self.slots;
            self.timers.after_disarm(old, |key, at| {
                slots.get(key).is_some_and(|s| s.armed == Some(at))
            });
        }
    }

    fn compact_timers(&mut self) {
        let live = self
            .slots
            .iter()
            .filter_map(|(key, slot)| slot.armed.map(|at| (at, key.clone())));
        self.timers.compact(self.slots.len(), live);
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = &K> {
        self.slots.keys()
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &M> {
        self.slots.values().map(Slot::get)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &M)> {
        self.slots.iter().map(|(key, slot)| (key, slot.get()))
    }
}

/// Which entry of which table a timer belongs to; one timer per entry. For tables of plain
/// entries (P's pending registrations, whose timers move with every renewal); machines keep
/// their timers in [`Machines`].
///
/// Moving a timer costs one search: `by_key` holds each key's live time, and the
/// [`LazyTimers`] queue every time ever set.
#[derive(Debug)]
pub(crate) struct TimerIndex<K: Ord + Clone> {
    by_key: BTreeMap<K, Time>,
    queue: LazyTimers<K>,
}

impl<K: Ord + Clone> Default for TimerIndex<K> {
    fn default() -> Self {
        Self {
            by_key: BTreeMap::new(),
            queue: LazyTimers::default(),
        }
    }
}

/// Stale entries `queue` may hold beyond the live ones before it is rebuilt.
const STALE_TIMER_SLACK: usize = 64;

impl<K: Ord + Clone> TimerIndex<K> {
    /// Sets (or moves) the timer of `key`.
    pub(crate) fn set(&mut self, key: K, at: Time) {
        let old = match self.by_key.get_mut(&key) {
            // Already set for that time: nothing moves.
            Some(old) if *old == at => return,
            Some(old) => Some(std::mem::replace(old, at)),
            None => {
                self.by_key.insert(key.clone(), at);
                None
            }
        };
        self.queue.push(at, key);
        if let Some(old) = old {
            self.after_removal(old);
        }
        let live = self.by_key.iter().map(|(key, at)| (*at, key.clone()));
        self.queue.compact(self.by_key.len(), live);
    }

    /// Removes the timer of `key`, if any.
    pub(crate) fn clear(&mut self, key: &K) {
        if let Some(old) = self.by_key.remove(key) {
            self.after_removal(old);
        }
    }

    fn after_removal(&mut self, old: Time) {
        let by_key = &self.by_key;
        self.queue
            .after_disarm(old, |key, at| by_key.get(key) == Some(&at));
    }

    /// The earliest timer.
    pub(crate) fn next(&self) -> Option<Time> {
        self.queue.next()
    }

    /// Removes and returns every key whose timer is at or before `now`, earliest first.
    pub(crate) fn take_due(&mut self, now: Time) -> Vec<K> {
        let by_key = &mut self.by_key;
        let due = self.queue.pop_due(now, |key, at| {
            if by_key.get(key) == Some(&at) {
                by_key.remove(key);
                true
            } else {
                false
            }
        });
        let by_key = &self.by_key;
        self.queue
            .drop_stale_front(|key, at| by_key.get(key) == Some(&at));
        due
    }

    pub(crate) fn len(&self) -> usize {
        debug_assert!(self.queue.len() >= self.by_key.len());
        self.by_key.len()
    }
}

/// Recently ended keys, kept for a while so that late messages about them are recognised.
/// Bounded: when full, the oldest is forgotten early.
///
/// The one table that is hashed, not ordered: at full load it holds ~10⁵ keys and is searched
/// for nearly every message, where a B-tree walk costs several cache misses. It is only ever
/// searched by key, never iterated (its order lives in `order`), so the hash seed cannot reach
/// any output: the machines stay a function of their inputs. The hasher is foldhash, seeded at
/// random per process (a peer cannot aim the ids it chooses at one bucket without first
/// learning the seed) and several times cheaper than `std`'s SipHash on ids of ~50 bytes.
/// Its `Debug` text lists the records sorted, so that it too is a function of the inputs (the
/// exhaustive check hashes it to recognise states it has seen).
pub(crate) struct Tombstones<K: Hash + Eq + Clone, V> {
    entries: HashMap<K, (V, Time), foldhash::fast::RandomState>,
    order: VecDeque<(Time, K)>,
    limit: usize,
    /// Records forgotten at capacity before they expired.
    evicted: u64,
}

impl<K: Hash + Eq + Clone + fmt::Debug, V: fmt::Debug> fmt::Debug for Tombstones<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut records: Vec<String> = self
            .entries
            .iter()
            .map(|(k, (v, at))| format!("{k:?}: {v:?} until {at}"))
            .collect();
        records.sort_unstable();
        let live = |(at, k): &&(Time, K)| self.entries.get(k).is_some_and(|(_, exp)| exp == at);
        let order: Vec<String> = self
            .order
            .iter()
            .filter(live)
            .map(|(at, k)| format!("{k:?}@{at}"))
            .collect();
        f.debug_struct("Tombstones")
            .field("records", &records)
            .field("order", &order)
            .field("limit", &self.limit)
            .field("evicted", &self.evicted)
            .finish()
    }
}

impl<K: Hash + Eq + Clone, V> Tombstones<K, V> {
    pub(crate) fn new(limit: usize) -> Self {
        assert!(limit > 0, "tombstone table needs room");
        Self {
            entries: HashMap::default(),
            order: VecDeque::new(),
            limit,
            evicted: 0,
        }
    }

    /// Records forgotten at capacity before they expired.
    pub(crate) fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Remembers `key` until `expires` (replacing an older record of it); true if the key was
    /// not remembered before (a new record).
    pub(crate) fn insert(&mut self, key: K, value: V, expires: Time) -> bool {
        if self.entries.len() >= self.limit && !self.entries.contains_key(&key) {
            self.evict_oldest();
        }
        let new = self.entries.insert(key.clone(), (value, expires)).is_none();
        self.push_order(expires, key);
        new
    }

    /// Whether inserting a new key now would evict a record (the table is full).
    pub(crate) fn is_full(&self) -> bool {
        self.entries.len() >= self.limit
    }

    pub(crate) fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Records written (made or refreshed) with an expiry after `cutoff`, counting a refreshed
    /// key's older writes too: at least the live records expiring after `cutoff`. Records all
    /// live the same time, so `order` is sorted by expiry and the young ones are its tail.
    pub(crate) fn written_after(&self, cutoff: Time) -> usize {
        self.order.len() - self.order.partition_point(|(at, _)| *at <= cutoff)
    }

    /// When the record an insert at capacity would evict expires (the oldest live one).
    pub(crate) fn oldest_expiry(&mut self) -> Option<Time> {
        while let Some((at, key)) = self.order.front() {
            if self.entries.get(key).is_some_and(|(_, exp)| exp == at) {
                return Some(*at);
            }
            self.order.pop_front();
        }
        None
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
    /// any): [`Self::get`] then [`Self::insert`], with one search of the table. True if the key
    /// was not remembered before.
    pub(crate) fn upsert(
        &mut self,
        key: K,
        expires: Time,
        value: impl FnOnce(Option<&V>) -> V,
    ) -> bool {
        if self.entries.len() >= self.limit {
            let value = value(self.get(&key));
            return self.insert(key, value, expires);
        }
        let new = match self.entries.entry(key.clone()) {
            Entry::Occupied(mut entry) => {
                let value = value(Some(&entry.get().0));
                entry.insert((value, expires));
                false
            }
            Entry::Vacant(entry) => {
                entry.insert((value(None), expires));
                true
            }
        };
        self.push_order(expires, key);
        new
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
                self.evicted += 1;
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
mod tests;
