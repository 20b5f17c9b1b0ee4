//! Durations on the command line: a plain number is milliseconds (as
//! before), or a number with a unit, several of them in a row (`250ms`,
//! `30s`, `5m`, `1h30m`, `7d`; `ms`, `s`, `m`/`min`, `h`, `d`, `w`),
//! in the style of the `humantime` crate.

/// Parses a duration into milliseconds (at most 100 years).
pub fn parse_ms(text: &str) -> Result<u64, String> {
    const MAX_MS: u128 = 100 * 365 * 86_400_000;
    let t = text.trim();
    if t.is_empty() {
        return Err("empty duration (e.g. 30s, 5m, 7d, or a number of milliseconds)".into());
    }
    if t.bytes().all(|b| b.is_ascii_digit()) {
        let v: u128 = t.parse().map_err(|_| format!("{text:?}: too large"))?;
        return if v <= MAX_MS { Ok(v as u64) } else { Err(format!("{text:?}: longer than 100 years")) };
    }
    let mut total: u128 = 0;
    let mut rest = t;
    while !rest.is_empty() {
        rest = rest.trim_start();
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(format!("{text:?}: expected a number at {rest:?} (e.g. 30s, 5m, 1h30m, 7d)"));
        }
        let n: u128 = rest[..digits].parse().map_err(|_| format!("{text:?}: number too large"))?;
        rest = rest[digits..].trim_start();
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let unit = &rest[..unit_len];
        let per: u128 = match unit {
            "ms" | "msec" => 1,
            "s" | "sec" | "secs" => 1_000,
            "m" | "min" | "mins" => 60_000,
            "h" | "hr" | "hrs" => 3_600_000,
            "d" | "day" | "days" => 86_400_000,
            "w" | "week" | "weeks" => 7 * 86_400_000,
            "" => return Err(format!("{text:?}: a number needs a unit after another unit (ms, s, m, h, d, w)")),
            other => return Err(format!("{text:?}: unknown unit {other:?} (ms, s, m, h, d, w)")),
        };
        total = total.saturating_add(n.saturating_mul(per));
        if total > MAX_MS {
            return Err(format!("{text:?}: longer than 100 years"));
        }
        rest = &rest[unit_len..];
    }
    Ok(total as u64)
}

/// [`parse_ms`] as an `i64` (for the settings stored as signed milliseconds).
pub fn parse_ms_i64(text: &str) -> Result<i64, String> {
    parse_ms(text).map(|v| v as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_plain_ms() {
        assert_eq!(parse_ms("604800000"), Ok(604_800_000));
        assert_eq!(parse_ms("7d"), Ok(604_800_000));
        assert_eq!(parse_ms("30s"), Ok(30_000));
        assert_eq!(parse_ms("250ms"), Ok(250));
        assert_eq!(parse_ms("1h30m"), Ok(5_400_000));
        assert_eq!(parse_ms("1h 30m"), Ok(5_400_000));
        assert_eq!(parse_ms("2w"), Ok(14 * 86_400_000));
        assert_eq!(parse_ms("0"), Ok(0));
        for bad in ["", "s", "30x", "1.5s", "-1s", "30s5", "999999999999999d"] {
            assert!(parse_ms(bad).is_err(), "{bad:?}");
        }
    }
}
