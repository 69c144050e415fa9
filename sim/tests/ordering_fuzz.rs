//! Ordering fuzz (tier T2): proptest-state-machine drives a small world one scheduler choice at
//! a time. Choices that are not possible in the current state do nothing, so a failure shrinks
//! to a minimal trace. `PROPTEST_CASES` overrides the 256 cases.

use proptest::prelude::*;
use proptest::sample::Index;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

use kvhandoff_sim::{Action, Kind, Mutation, World, WorldConfig};

/// One scheduler choice: a kind and which of the enabled choices of that kind.
#[derive(Debug, Clone)]
pub enum Choice {
    Deliver(Index),
    Drop(Index),
    Dup(Index),
    Complete(Index),
    Fail(Index),
    Engine(Index),
    Timer(Index),
    Crash(Index),
}

fn kind_of(choice: &Choice) -> (Kind, &Index) {
    match choice {
        Choice::Deliver(i) => (Kind::Deliver, i),
        Choice::Drop(i) => (Kind::Drop, i),
        Choice::Dup(i) => (Kind::Dup, i),
        Choice::Complete(i) => (Kind::Complete, i),
        Choice::Fail(i) => (Kind::Fail, i),
        Choice::Engine(i) => (Kind::Other, i),
        Choice::Timer(i) => (Kind::Timer, i),
        Choice::Crash(i) => (Kind::Crash, i),
    }
}

/// The reference is trivial: every choice is always allowed.
pub struct Scheduler;

impl ReferenceStateMachine for Scheduler {
    type State = bool;
    type Transition = Choice;

    fn init_state() -> BoxedStrategy<bool> {
        Just(false).boxed()
    }

    fn transitions(_: &bool) -> BoxedStrategy<Choice> {
        prop_oneof![
            6 => any::<Index>().prop_map(Choice::Deliver),
            1 => any::<Index>().prop_map(Choice::Drop),
            1 => any::<Index>().prop_map(Choice::Dup),
            4 => any::<Index>().prop_map(Choice::Complete),
            1 => any::<Index>().prop_map(Choice::Fail),
            4 => any::<Index>().prop_map(Choice::Engine),
            3 => any::<Index>().prop_map(Choice::Timer),
            1 => any::<Index>().prop_map(Choice::Crash),
        ]
        .boxed()
    }

    fn apply(state: bool, _: &Choice) -> bool {
        state
    }
}

/// Applies `choice` to `world`: no-op when nothing of its kind is enabled.
pub fn apply_choice(world: &mut World, choice: &Choice) {
    let (kind, index) = kind_of(choice);
    let enabled: Vec<Action> = world.actions_of(kind);
    if !enabled.is_empty() {
        world.apply(enabled[index.index(enabled.len())]);
    }
}

/// `KVHANDOFF_SIM_MUTATION=NAME` runs the fuzz with that deliberate bug (it must then fail).
fn mutation() -> Option<Mutation> {
    let name = std::env::var("KVHANDOFF_SIM_MUTATION").ok()?;
    Some(
        name.parse()
            .expect("a mutation name (kvhandoff sim --list-mutations)"),
    )
}

struct Fuzz;

impl StateMachineTest for Fuzz {
    type SystemUnderTest = World;
    type Reference = Scheduler;

    fn init_test(_: &bool) -> World {
        World::new(WorldConfig::small(2, 1, mutation()), 0)
    }

    fn apply(mut world: World, _: &bool, choice: Choice) -> World {
        apply_choice(&mut world, &choice);
        world
    }

    fn check_invariants(world: &World, _: &bool) {
        if let Some(v) = world.violations().first() {
            panic!(
                "violation at step {}: {}\n{}",
                v.step,
                v.message,
                v.trace.join("\n")
            );
        }
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn ordering_fuzz(sequential 1..60 => Fuzz);
}

/// The fuzz must catch the deliberate bug: search choice sequences directly (proptest's runner
/// reports a failure by panicking, so the search runs it and expects the panic).
#[test]
fn fuzz_catches_free_on_deadline() {
    use proptest::test_runner::{Config, TestRunner};
    let mut runner = TestRunner::new(Config {
        cases: 512,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = proptest::collection::vec(Scheduler::transitions(&false), 1..40);
    let result = runner.run(&strategy, |choices| {
        let mut world = World::new(WorldConfig::small(1, 0, Some(Mutation::FreeOnDeadline)), 0);
        for c in &choices {
            apply_choice(&mut world, c);
            prop_assert!(
                world.violations().is_empty(),
                "{}",
                world.violations()[0].message
            );
        }
        Ok(())
    });
    let err = result.expect_err("the fuzz must find the free-on-deadline bug");
    let text = format!("{err}");
    assert!(
        text.contains("S1") || text.contains("S2") || text.contains("proof:"),
        "{text}"
    );
}

/// Found by the fuzz (about 1 case in 25,000): D's liveness deadline for P falls at the very
/// instant a second handshake of the same incarnations completes (P's heartbeat in between was
/// lost), and the scheduler runs the handshake before D's timer of that instant. Handling the
/// handshake at its deadline, D declares P dead — what the timer due at that same instant does.
/// S9 allowed a death only for a timer due strictly before the handshake.
#[test]
fn repeated_handshake_at_the_peers_deadline_may_declare_it_dead() {
    const HALF: u64 = 1 << 63;
    const THIRD: u64 = 6_148_914_691_236_517_206;
    const THREE_QUARTERS: u64 = 13_835_058_055_282_163_712;
    let choices = [
        (Kind::Other, THREE_QUARTERS),
        (Kind::Other, 0),
        (Kind::Timer, 0),
        (Kind::Timer, 0),
        (Kind::Timer, 0),
        (Kind::Other, THIRD),
        (Kind::Timer, 0),
        (Kind::Timer, 0),
        (Kind::Other, THIRD),
        (Kind::Timer, 0),
        (Kind::Timer, HALF),
        (Kind::Deliver, HALF),
        (Kind::Timer, 0),
        (Kind::Other, 0),
        (Kind::Other, 0),
    ];
    let mut world = World::new(WorldConfig::small(2, 1, None), 0);
    for (kind, fraction) in choices {
        let enabled = world.actions_of(kind);
        if !enabled.is_empty() {
            // proptest's `Index::index`: a fixed-point fraction of the choices.
            let at = ((enabled.len() as u128 * u128::from(fraction)) >> 64) as usize;
            world.apply(enabled[at]);
        }
    }
    let hit = |mark: &str| world.coverage().get(mark).copied().unwrap_or(0);
    assert!(
        hit("duplicate_handshake_same_incarnation") > 0 && hit("false_death_peer_alive") > 0,
        "the replay no longer reaches a repeated handshake that ends in P's death: {:?}",
        world.coverage()
    );
    assert!(
        world.violations().is_empty(),
        "{}",
        world.violations()[0].message
    );
    assert!(
        hit("repeated_handshake_while_overdue") > 0,
        "the handshake came at D's deadline, which S9 must count as due"
    );
}
