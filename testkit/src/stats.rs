//! The statistics and formatting every report of the command line shares: medians, nearest-rank
//! percentiles, spreads, bandwidths and byte counts.
//!
//! A few lines each, over small sample vectors; a statistics crate would add a dependency and an
//! API to learn for less code than this module.
//!
//! ```
//! use kvhandoff_testkit::stats::{human_bytes, median, percentile};
//! assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
//! assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), 2.0);
//! assert_eq!(human_bytes(512 * 1024), "512 KiB");
//! assert_eq!(human_bytes(3 << 29), "1.50 GiB");
//! ```

fn sorted(values: &[f64]) -> Vec<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

/// The median of `values` (the mean of the middle two for an even count); 0 for none.
pub fn median(values: &[f64]) -> f64 {
    let v = sorted(values);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The nearest-rank `p`-th percentile of `values` (in any order); 0 for none.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let v = sorted(values);
    if v.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// The smallest and largest of `values` (`(inf, 0)` for none).
pub fn spread(values: &[f64]) -> (f64, f64) {
    values.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
        (lo.min(*v), hi.max(*v))
    })
}

/// The smallest of `values` (`inf` for none).
pub fn min(values: &[f64]) -> f64 {
    spread(values).0
}

/// Gigabytes (10⁹ bytes) per second of `bytes` moved in `us` microseconds; 0 for no time.
pub fn gbps(bytes: u64, us: f64) -> f64 {
    if us > 0.0 {
        bytes as f64 / (us * 1e3)
    } else {
        0.0
    }
}

/// `bytes` in binary units: whole values without decimals ("32 KiB"), others with two
/// ("1.50 GiB").
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_spreads() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(
            median(&[5.0, 100.0, 1.0, 4.0, 6.0]),
            5.0,
            "one outlier moves nothing"
        );
        assert_eq!(spread(&[5.0, 100.0, 1.0]), (1.0, 100.0));
        assert_eq!(min(&[5.0, 100.0, 1.0]), 1.0);
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn bytes_read_as_people_write_them() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1000), "1000 B");
        assert_eq!(human_bytes(32 * 1024), "32 KiB");
        assert_eq!(human_bytes(256 << 20), "256 MiB");
        assert_eq!(human_bytes((20 << 20) + (1 << 19)), "20.50 MiB");
        assert_eq!(gbps(1_000_000, 1000.0), 1.0);
        assert_eq!(gbps(1, 0.0), 0.0);
    }
}
