//! The per-instruction profile every backend keeps under `RLX_PROFILE=1`: time and calls per
//! instruction kind, printed to stderr when the program is dropped.
use std::collections::BTreeMap;

/// Milliseconds and calls, keyed by instruction kind.
pub type Profile = BTreeMap<String, (f64, u64)>;

/// Whether `RLX_PROFILE=1` asks for a profile.
pub fn requested() -> bool {
    std::env::var("RLX_PROFILE").is_ok_and(|v| v == "1")
}

/// Whether `RLX_PROFILE=step` asks for whole-run timing (a GPU backend then keeps replaying
/// its captured graph and reports each run's device time beside the host time of the call).
pub fn step_requested() -> bool {
    std::env::var("RLX_PROFILE").is_ok_and(|v| v == "step")
}

/// Median, minimum and maximum of `xs` (which must not be empty), as text in microseconds.
pub fn spread_us(xs: &mut [f64]) -> String {
    xs.sort_by(f64::total_cmp);
    format!(
        "median {:.1} us (min {:.1}, max {:.1})",
        xs[xs.len() / 2] * 1e3,
        xs[0] * 1e3,
        xs[xs.len() - 1] * 1e3
    )
}

/// Adds one call of `ms` milliseconds to `key`'s row.
pub fn add(p: &mut Profile, key: String, ms: f64) {
    let e = p.entry(key).or_default();
    e.0 += ms;
    e.1 += 1;
}

/// The profile as text, slowest kind first, headed by `title`, the kinds in a column as wide as
/// the longest; empty for a program that never ran.
pub fn render(title: &str, p: &Profile) -> String {
    if p.is_empty() {
        return String::new();
    }
    let total: f64 = p.values().map(|v| v.0).sum();
    let mut rows: Vec<_> = p.iter().collect();
    rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut s = format!(
        "{title}: {total:.3} ms over {} instruction kinds\n",
        rows.len()
    );
    for (k, (t, n)) in rows {
        s.push_str(&format!(
            "  {k:<width$} {t:9.3} ms {:5.1}% {n:8} calls\n",
            100.0 * t / total.max(1e-12)
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_come_slowest_first_with_shares_and_calls() {
        let mut p = Profile::new();
        add(&mut p, "small".into(), 1.0);
        add(&mut p, "big".into(), 2.0);
        add(&mut p, "big".into(), 1.0);
        let s = render("t", &p);
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "t: 4.000 ms over 2 instruction kinds");
        assert!(lines[1].trim_start().starts_with("big") && lines[1].contains("75.0%"));
        assert!(lines[1].trim_end().ends_with("2 calls"));
        assert!(lines[2].trim_start().starts_with("small") && lines[2].contains("25.0%"));
        // The times line up under the longest kind; a program that never ran prints nothing.
        add(
            &mut p,
            "a kind much longer than the forty columns kept before".into(),
            0.5,
        );
        let s = render("t", &p);
        let at: Vec<usize> = s.lines().skip(1).map(|l| l.find(" ms ").unwrap()).collect();
        assert!(at.windows(2).all(|w| w[0] == w[1]), "{s}");
        assert_eq!(render("t", &Profile::new()), "");
    }
}
