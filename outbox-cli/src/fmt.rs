//! Formatting helpers shared by the text renderings.

/// ms since the epoch as RFC 3339 UTC with milliseconds.
pub fn ts(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms).map(|t| t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()).unwrap_or_else(|| format!("{ms} ms"))
}

/// A duration in ms, for humans: `850 ms`, `12.3 s`, `4m 05s`, `2h 10m`, `3d 4h`.
pub fn age(ms: i64) -> String {
    let ms = ms.max(0);
    let s = ms / 1000;
    match ms {
        0..=999 => format!("{ms} ms"),
        1_000..=59_999 => format!("{:.1} s", ms as f64 / 1000.0),
        60_000..=3_599_999 => format!("{}m {:02}s", s / 60, s % 60),
        3_600_000..=86_399_999 => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86_400, (s % 86_400) / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(ts(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(age(850), "850 ms");
        assert_eq!(age(12_300), "12.3 s");
        assert_eq!(age(245_000), "4m 05s");
        assert_eq!(age(7_800_000), "2h 10m");
        assert_eq!(age(3 * 86_400_000 + 4 * 3_600_000), "3d 4h");
    }
}
