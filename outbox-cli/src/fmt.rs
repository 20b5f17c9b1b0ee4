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

/// The key of the RFC 3339 twin of a millisecond timestamp key, if `key`
/// names one (`createdAtMs` -> `createdAt`, `lease_until_ms` -> `lease_until`).
fn timestamp_twin(key: &str) -> Option<String> {
    const CAMEL: [&str; 3] = ["AtMs", "SinceMs", "UntilMs"];
    const SNAKE: [&str; 3] = ["_at_ms", "_since_ms", "_until_ms"];
    if matches!(key, "nowMs" | "atMs" | "at_ms" | "now_ms") {
        return Some(key.trim_end_matches("Ms").trim_end_matches("_ms").to_owned());
    }
    if CAMEL.iter().any(|s| key.ends_with(s)) {
        return key.strip_suffix("Ms").map(str::to_owned);
    }
    if SNAKE.iter().any(|s| key.ends_with(s)) {
        return key.strip_suffix("_ms").map(str::to_owned);
    }
    None
}

/// Adds, next to every millisecond timestamp of a JSON document (keys
/// ending in `AtMs`, `SinceMs`, `UntilMs` or their snake_case forms), its
/// RFC 3339 twin without the `Ms` suffix; the millisecond field stays.
pub fn with_rfc3339(mut v: serde_json::Value) -> serde_json::Value {
    fn walk(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(m) => {
                let add: Vec<(String, String)> = m
                    .iter()
                    .filter_map(|(k, v)| Some((timestamp_twin(k)?, ts(v.as_i64()?))))
                    .filter(|(twin, _)| !m.contains_key(twin))
                    .collect();
                for v in m.values_mut() {
                    walk(v);
                }
                for (k, t) in add {
                    m.insert(k, serde_json::Value::String(t));
                }
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(walk),
            _ => {}
        }
    }
    walk(&mut v);
    v
}

/// `value` as pretty JSON with RFC 3339 twins of its timestamps; the
/// top level is always an object.
pub fn json<T: serde::Serialize>(value: &T) -> anyhow::Result<String> {
    let v = with_rfc3339(serde_json::to_value(value)?);
    anyhow::ensure!(v.is_object(), "internal: --json output must be an object");
    Ok(serde_json::to_string_pretty(&v)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_get_rfc3339_twins() {
        let v = with_rfc3339(serde_json::json!({"createdAtMs": 0, "x": [{"lease_until_ms": 1000, "age_ms": 5}], "nowMs": 0, "unknownSloMs": 9}));
        assert_eq!(v["createdAt"], "1970-01-01T00:00:00.000Z");
        assert_eq!(v["x"][0]["lease_until"], "1970-01-01T00:00:01.000Z");
        assert_eq!(v["now"], "1970-01-01T00:00:00.000Z");
        assert!(v["x"][0].get("age").is_none() && v.get("unknownSlo").is_none(), "durations are not timestamps");
        assert_eq!(v["createdAtMs"], 0, "the ms field stays");
    }

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
