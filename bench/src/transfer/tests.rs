use super::*;
use kvhandoff_protocol::planner::descriptor_count;
use kvhandoff_protocol::RegionDesc;

#[test]
fn tables_do_not_merge_when_fragmented() {
    for n in [1u32, 2, 3, 4, 5, 128] {
        let (pool, [c, f]) = block_tables(n);
        let mut remote = f.remote.groups[0].clone();
        remote.sort_unstable();
        remote.dedup();
        assert_eq!(remote.len(), n as usize, "a permutation for n = {n}");
        assert!(remote.iter().all(|&b| b < pool));
        assert!(f.local.groups[0].iter().all(|&b| b < pool));
        let options = TransferOptions {
            tokens: n * BLOCK_TOKENS,
            ..TransferOptions::tiny()
        };
        let geometry = bench_geometry(&options);
        let specs = geometry.regions().unwrap();
        let table = |base: u64| -> Vec<RegionDesc> {
            specs
                .iter()
                .enumerate()
                .map(|(i, s)| RegionDesc {
                    base: base + (i as u64) * (1 << 32),
                    len: s.block_len * u64::from(pool),
                    num_blocks: pool,
                    block_len: s.block_len,
                })
                .collect()
        };
        let (local, remote) = (table(1 << 40), table(1 << 41));
        let count = |t: &BlockTable| {
            descriptor_count(&PlanInput::new(
                &local, &remote, &specs, &t.local, &t.remote, 1,
            ))
            .unwrap()
        };
        assert_eq!(count(&c), specs.len());
        assert_eq!(count(&f), specs.len() * n as usize);
    }
}

#[test]
fn default_request_is_the_8b_case() {
    let options = TransferOptions::default();
    assert_eq!(options.blocks(), 128);
    let geometry = bench_geometry(&options);
    let specs = geometry.regions().unwrap();
    assert_eq!(specs.len(), 64);
    assert_eq!(specs[0].block_len, 32 * 1024);
}
