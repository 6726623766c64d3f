//! Sizes and durations as people write them in policy files: `"500 GiB"`, `"90d"`.
//!
//! Sizes accept a bare integer (bytes) or a string with a unit; binary units (KiB, MiB, GiB,
//! TiB, PiB) are powers of 1024, decimal ones (KB, MB, GB, TB, PB) powers of 1000, so a file
//! says exactly what it means. Durations are a whole number followed by one unit: `ms`, `s`,
//! `m`, `h`, `d` or `w`.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};

/// A number of bytes, written in a policy as an integer or a string with a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 5] = [
            ("PiB", 1 << 50),
            ("TiB", 1 << 40),
            ("GiB", 1 << 30),
            ("MiB", 1 << 20),
            ("KiB", 1 << 10),
        ];
        for (unit, scale) in UNITS {
            if self.0 >= scale && self.0.is_multiple_of(scale) {
                return write!(f, "{} {unit}", self.0 / scale);
            }
        }
        write!(f, "{} B", self.0)
    }
}

/// Parses `"10 GiB"`, `"1.5TB"`, `"4096"`, `"512 B"`.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" => 1000,
        "MB" => 1000u64.pow(2),
        "GB" => 1000u64.pow(3),
        "TB" => 1000u64.pow(4),
        "PB" => 1000u64.pow(5),
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "PiB" => 1 << 50,
        other => {
            return Err(format!(
                "size {text:?} has unknown unit {other:?} (use B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB or PiB)"
            ));
        }
    };
    if number.is_empty() {
        return Err(format!("size {text:?} has no number"));
    }
    if let Ok(whole) = number.parse::<u64>() {
        return whole
            .checked_mul(scale)
            .ok_or_else(|| format!("size {text:?} is too large"));
    }
    let fractional: f64 = number
        .parse()
        .map_err(|_| format!("size {text:?} is not a number followed by a unit"))?;
    let bytes = fractional * scale as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("size {text:?} is too large"));
    }
    if bytes.fract() != 0.0 {
        return Err(format!("size {text:?} is not a whole number of bytes"));
    }
    Ok(bytes as u64)
}

/// Parses `"250ms"`, `"30s"`, `"5m"`, `"2h"`, `"90d"`, `"2w"`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let count: u64 = number
        .parse()
        .map_err(|_| format!("duration {text:?} must be a whole number followed by a unit"))?;
    let seconds_per: u64 = match unit.trim() {
        "ms" => return Ok(Duration::from_millis(count)),
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        other => {
            return Err(format!(
                "duration {text:?} has unknown unit {other:?} (use ms, s, m, h, d or w)"
            ));
        }
    };
    count
        .checked_mul(seconds_per)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("duration {text:?} is too long"))
}

impl<'de> serde::Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SizeVisitor;
        impl Visitor<'_> for SizeVisitor {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size: a number of bytes, or a string such as \"10 GiB\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("size {v} is negative")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                parse_bytes(v).map(ByteSize).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(SizeVisitor)
    }
}

/// `#[serde(with = "duration")]` for a [`Duration`] written as `"30s"`, `"2h"`, `"90d"`.
pub mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(deserializer)?;
        super::parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("512 B"), Ok(512));
        assert_eq!(parse_bytes("10 GiB"), Ok(10 << 30));
        assert_eq!(parse_bytes("1.5TB"), Ok(1_500_000_000_000));
        assert_eq!(parse_bytes("2 KB"), Ok(2000));
        assert!(parse_bytes("10 gigs").unwrap_err().contains("unknown unit"));
        assert!(parse_bytes("GiB").unwrap_err().contains("no number"));
        assert!(parse_bytes("0.3 B").unwrap_err().contains("whole number"));
        assert!(
            parse_bytes("99999999 PiB")
                .unwrap_err()
                .contains("too large")
        );
    }

    #[test]
    fn sizes_display_in_the_largest_exact_unit() {
        assert_eq!(ByteSize(10 << 30).to_string(), "10 GiB");
        assert_eq!(ByteSize(1000).to_string(), "1000 B");
    }

    #[test]
    fn durations_parse_one_unit() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("90d"), Ok(Duration::from_secs(90 * 86_400)));
        assert_eq!(parse_duration("2w"), Ok(Duration::from_secs(14 * 86_400)));
        assert!(parse_duration("1.5h").is_err());
        assert!(
            parse_duration("10 years")
                .unwrap_err()
                .contains("unknown unit")
        );
        assert!(parse_duration("h").is_err());
    }
}
