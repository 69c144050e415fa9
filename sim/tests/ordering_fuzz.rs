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
