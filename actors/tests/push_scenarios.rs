//! Smoke for the harness.
mod harness;
use harness::*;

#[test]
fn smoke() {
    let mut h = Harness::new();
    h.decode(decode_start(1, &[500, 501, 502])).unwrap();
    h.prefill(prefill_start(1, &[10, 11, 12])).unwrap();
    println!("{:?}", h.posted);
    h.complete_writes();
    println!("{:?} {:?}", h.d_results(), h.p_results());
    h.assert_no_leak();
}
