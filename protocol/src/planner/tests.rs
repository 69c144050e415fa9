//! Unit tests of the planner: run grouping, the ascending/repeat helpers, unordered pairs and
//! the shapes of the fragmented 70B fixture.

use super::engine::{first_repeat, strictly_ascending};
use super::*;

fn runs(local: &[u32], remote: &[u32]) -> Vec<(u32, u32, u32)> {
    block_runs(local, remote)
        .map(|r| (r.local, r.remote, r.len))
        .collect()
}

#[test]
fn runs_of_empty_lists() {
    assert!(runs(&[], &[]).is_empty());
}

#[test]
fn runs_need_contiguity_on_both_sides() {
    assert_eq!(runs(&[1, 2, 3], &[7, 8, 9]), [(1, 7, 3)]);
    assert_eq!(runs(&[1, 2, 3], &[7, 9, 10]), [(1, 7, 1), (2, 9, 2)]);
    assert_eq!(runs(&[1, 3, 4], &[7, 8, 9]), [(1, 7, 1), (3, 8, 2)]);
    // Descending ids are not contiguous in the same order.
    assert_eq!(runs(&[3, 2], &[8, 7]), [(3, 8, 1), (2, 7, 1)]);
}

#[test]
fn runs_stop_at_the_top_of_the_id_space() {
    let max = u32::MAX;
    assert_eq!(
        runs(&[max - 1, max, 0], &[max - 1, max, 0]),
        [(max - 1, max - 1, 2), (0, 0, 1)]
    );
}

#[test]
fn runs_use_the_shorter_list() {
    assert_eq!(runs(&[1, 2, 3], &[5, 6]), [(1, 5, 2)]);
}

#[test]
fn ascending_and_repeat_helpers() {
    assert!(strictly_ascending(&[]));
    assert!(strictly_ascending(&[1, 5]));
    assert!(!strictly_ascending(&[1, 1]));
    assert_eq!(first_repeat(&[1, 2, 2, 3, 3]), Some(2));
    assert_eq!(first_repeat(&[1, 2, 3]), None);
}

#[test]
fn planner_sorts_unordered_pairs_into_minimal_runs() {
    // Token order 5, 3, 4 pairs with 7, 5, 6: all three are one run once sorted by local id.
    let spec = RegionSpec {
        group: 0,
        layer: 0,
        kind: crate::RegionKind::Key,
        block_len: 8,
    };
    let region = RegionDesc {
        base: 1000,
        len: 80,
        num_blocks: 10,
        block_len: 8,
    };
    let local = BlockIds::single_group(vec![5, 3, 4]);
    let remote = BlockIds::single_group(vec![7, 5, 6]);
    let (regions, specs) = ([region], [spec]);
    let input = PlanInput::new(&regions, &regions, &specs, &local, &remote, 1);
    let plan = plan_transfer(&input).unwrap();
    assert_eq!(
        plan.descriptors,
        [Descriptor {
            local_addr: 1000 + 3 * 8,
            remote_addr: 1000 + 5 * 8,
            len: 24
        }]
    );
}

#[test]
fn fragmented_case_shapes() {
    let (geometry, local, remote, p, d) = fragmented_70b_case();
    geometry.validate().unwrap();
    assert_eq!(geometry.regions().unwrap().len(), 160);
    assert_eq!(geometry.attention_block_len().unwrap(), 4096);
    assert_eq!((local.len(), remote.len()), (160, 160));
    assert_eq!((p.total(), d.total()), (118, 118));
    for group in p.groups.iter().chain(&d.groups) {
        let mut sorted = group.clone();
        sorted.sort_unstable();
        assert!(
            sorted.windows(2).all(|w| w[1] > w[0] + 1),
            "no two adjacent"
        );
    }
    for n in [1, 10, 117, 118] {
        let (_, _, _, p, d) = fragmented_70b_case_with_runs(n);
        assert_eq!(block_runs(&p.groups[0], &d.groups[0]).count(), n as usize);
    }
}
