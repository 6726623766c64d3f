//! Sizes and durations as people write them: one grammar for every configuration file
//! (`[bus]`, `[worker]`, `[service]`), every policy file and every command-line flag.
//!
//! **Durations** are a whole number and one unit, with or without a space between: `ms`, `s`,
//! `m`, `h`, `d` or `w` (`250ms`, `30s`, `5m`, `2h`, `1d`, `2w`). A file must name the unit; a
//! bare number is refused with the spelling to use instead (`"90"` → `"90s"`). On the command
//! line a bare number is seconds ([`parse_duration_arg`]), as scripts and scheduler hooks have
//! always written it (`stage wait --timeout 600`).
//!
//! **Sizes** are a number of bytes, alone or followed by a unit: decimal `KB`, `MB`, `GB`, `TB`,
//! `PB` (powers of 1000), binary `KiB`, `MiB`, `GiB`, `TiB`, `PiB` (powers of 1024), or the
//! one-letter `K`, `M`, `G`, `T`, `P` (either case), which are binary as in rsync and rclone
//! (`--bwlimit 64K` is 64 KiB). `B` names bytes. A fraction is allowed when the result is a whole
//! number of bytes (`1.5 GiB`); in a file a size may also be a bare integer.
//!
//! ```
//! use std::time::Duration;
//! use stagehand_config::{parse_duration, parse_duration_arg, parse_size};
//!
//! assert_eq!(parse_duration("1d").unwrap(), Duration::from_secs(86_400));
//! assert!(parse_duration("90").unwrap_err().to_string().contains("\"90s\""));
//! assert_eq!(parse_duration_arg("90").unwrap(), Duration::from_secs(90));
//! assert_eq!(parse_size("64K").unwrap(), 64 << 10);
//! assert_eq!(parse_size("2 KB").unwrap(), 2000);
//! ```

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::{Serialize, Serializer};

/// The duration units, as error messages list them.
const DURATION_UNITS: &str = "ms, s, m, h, d or w";
/// The size units, as error messages list them.
const SIZE_UNITS: &str =
    "B, KB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB, or K, M, G, T, P (binary)";

/// A size or duration that does not follow the grammar. The message quotes the text and says
/// what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UnitError {
    /// A duration without a unit, in a file.
    #[error(
        "duration {text:?} has no unit: write \"{text}s\" for seconds (units: {DURATION_UNITS})"
    )]
    NoUnit { text: String },
    /// A unit the grammar does not know.
    #[error("{what} {text:?} has unknown unit {unit:?} (use {units})")]
    UnknownUnit {
        what: &'static str,
        text: String,
        unit: String,
        units: &'static str,
    },
    /// No number before the unit, or not a number the grammar reads.
    #[error("{what} {text:?} is not {expected}")]
    NotANumber {
        what: &'static str,
        text: String,
        expected: &'static str,
    },
    /// A size that is not a whole number of bytes.
    #[error("size {text:?} is not a whole number of bytes")]
    Fraction { text: String },
    /// More than 64 bits hold.
    #[error("{what} {text:?} is too large")]
    TooLarge { what: &'static str, text: String },
}

/// Splits `"30 s"` into `("30", "s")`: the leading number (digits, and a `.` when `fraction`)
/// and the rest, trimmed.
fn split_number(text: &str, fraction: bool) -> (&str, &str) {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || (fraction && c == '.')))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    (number, unit.trim())
}

/// Parses a duration as files write it: a whole number and a unit (`"250ms"`, `"30s"`,
/// `"5m"`, `"2h"`, `"90d"`, `"2w"`).
pub fn parse_duration(text: &str) -> Result<Duration, UnitError> {
    let (number, unit) = split_number(text, false);
    if number.is_empty() || unit.starts_with('.') {
        return Err(UnitError::NotANumber {
            what: "duration",
            text: text.to_owned(),
            expected: "a whole number followed by a unit",
        });
    }
    let too_large = || UnitError::TooLarge {
        what: "duration",
        text: text.to_owned(),
    };
    // Only digits are left, so the one way to fail is overflow.
    let count: u64 = number.parse().map_err(|_| too_large())?;
    let millis_per: u64 = match unit {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "w" => 7 * 86_400_000,
        "" => {
            return Err(UnitError::NoUnit {
                text: text.trim().to_owned(),
            });
        }
        other => {
            return Err(UnitError::UnknownUnit {
                what: "duration",
                text: text.to_owned(),
                unit: other.to_owned(),
                units: DURATION_UNITS,
            });
        }
    };
    count
        .checked_mul(millis_per)
        .map(Duration::from_millis)
        .ok_or_else(too_large)
}

/// Parses a duration as a command-line flag takes it: the grammar of [`parse_duration`], and a
/// bare whole number as seconds.
pub fn parse_duration_arg(text: &str) -> Result<Duration, UnitError> {
    match parse_duration(text) {
        Err(UnitError::NoUnit { text }) => parse_duration(&format!("{text}s")),
        other => other,
    }
}

/// A duration in the grammar's largest exact unit (`"1d"`, `"90s"`, `"250ms"`): what
/// [`parse_duration`] reads back as the same duration (to the millisecond).
pub fn format_duration(d: Duration) -> String {
    const UNITS: [(&str, u128); 5] = [
        ("w", 7 * 86_400_000),
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1000),
    ];
    let millis = d.as_millis();
    for (unit, per) in UNITS {
        if millis >= per && millis.is_multiple_of(per) {
            return format!("{}{unit}", millis / per);
        }
    }
    if millis == 0 {
        return "0s".to_owned();
    }
    format!("{millis}ms")
}

/// Parses a size: `"4096"`, `"512 B"`, `"10 GiB"`, `"1.5TB"`, `"64K"`.
pub fn parse_size(text: &str) -> Result<u64, UnitError> {
    let (number, unit) = split_number(text, true);
    let not_a_number = || UnitError::NotANumber {
        what: "size",
        text: text.to_owned(),
        expected: "a number of bytes, or a number followed by a unit",
    };
    if number.is_empty() {
        return Err(not_a_number());
    }
    let scale: u64 = match unit {
        "" | "B" => 1,
        "KB" => 1000,
        "MB" => 1000u64.pow(2),
        "GB" => 1000u64.pow(3),
        "TB" => 1000u64.pow(4),
        "PB" => 1000u64.pow(5),
        "KiB" | "K" | "k" => 1 << 10,
        "MiB" | "M" | "m" => 1 << 20,
        "GiB" | "G" | "g" => 1 << 30,
        "TiB" | "T" | "t" => 1 << 40,
        "PiB" | "P" | "p" => 1 << 50,
        other => {
            return Err(UnitError::UnknownUnit {
                what: "size",
                text: text.to_owned(),
                unit: other.to_owned(),
                units: SIZE_UNITS,
            });
        }
    };
    let too_large = || UnitError::TooLarge {
        what: "size",
        text: text.to_owned(),
    };
    if let Ok(whole) = number.parse::<u64>() {
        return whole.checked_mul(scale).ok_or_else(too_large);
    }
    let fractional: f64 = number.parse().map_err(|_| not_a_number())?;
    let bytes = fractional * scale as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(too_large());
    }
    if bytes.fract() != 0.0 {
        return Err(UnitError::Fraction {
            text: text.to_owned(),
        });
    }
    Ok(bytes as u64)
}

/// A number of bytes, written in a file as an integer or a string with a unit ([`parse_size`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub fn bytes(self) -> u64 {
        self.0
    }
}

/// The largest binary unit that divides the size exactly: `10 GiB`, `1000 B`.
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

impl std::str::FromStr for ByteSize {
    type Err = UnitError;
    fn from_str(text: &str) -> Result<Self, UnitError> {
        parse_size(text).map(ByteSize)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
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
                parse_size(v).map(ByteSize).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(SizeVisitor)
    }
}

/// `#[serde(with = "stagehand_config::duration")]` for a [`Duration`] written as `"30s"`,
/// `"2h"`, `"90d"` ([`parse_duration`]); written back by [`format_duration`].
pub mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_duration(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        super::parse_duration(&text).map_err(serde::de::Error::custom)
    }

    /// `Option<Duration>` in the same notation; absent (with `#[serde(default)]`) or `None`
    /// means `None`.
    pub mod option {
        use std::time::Duration;

        use serde::{Deserialize, Deserializer, Serializer};

        pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
            match d {
                Some(d) => super::serialize(d, s),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
            match Option::<String>::deserialize(d)? {
                Some(text) => super::super::parse_duration(&text)
                    .map(Some)
                    .map_err(serde::de::Error::custom),
                None => Ok(None),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_decimal_and_one_letter_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512 B"), Ok(512));
        assert_eq!(parse_size("10 GiB"), Ok(10 << 30));
        assert_eq!(parse_size("1.5TB"), Ok(1_500_000_000_000));
        assert_eq!(parse_size("2 KB"), Ok(2000));
        // One letter is binary, in either case: what `stagehand cp --bwlimit` always read.
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("100M"), Ok(100 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        let unknown = parse_size("10 gigs").unwrap_err().to_string();
        assert!(
            unknown.contains("unknown unit \"gigs\"") && unknown.contains("KiB"),
            "{unknown}"
        );
        assert!(matches!(
            parse_size("GiB"),
            Err(UnitError::NotANumber { .. })
        ));
        assert!(matches!(
            parse_size("fast"),
            Err(UnitError::NotANumber { .. })
        ));
        assert!(
            parse_size("0.3 B")
                .unwrap_err()
                .to_string()
                .contains("whole number")
        );
        assert!(
            parse_size("99999999 PiB")
                .unwrap_err()
                .to_string()
                .contains("too large")
        );
        assert_eq!("3 MiB".parse::<ByteSize>(), Ok(ByteSize(3 << 20)));
    }

    #[test]
    fn sizes_display_in_the_largest_exact_unit_and_read_back() {
        assert_eq!(ByteSize(10 << 30).to_string(), "10 GiB");
        assert_eq!(ByteSize(1000).to_string(), "1000 B");
        for size in [0, 1, 1000, 1 << 20, 3 << 40, 12345] {
            assert_eq!(parse_size(&ByteSize(size).to_string()), Ok(size));
        }
    }

    #[test]
    fn durations_take_one_unit_from_ms_to_weeks() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5 m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        // The bus refused days once while policies took them: one grammar now.
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("2w"), Ok(Duration::from_secs(14 * 86_400)));
        for bad in ["1.5h", "h", "-1s", ""] {
            assert!(
                matches!(parse_duration(bad), Err(UnitError::NotANumber { .. })),
                "{bad:?}"
            );
        }
        assert!(
            parse_duration("10 years")
                .unwrap_err()
                .to_string()
                .contains("unknown unit \"years\"")
        );
        assert!(matches!(
            parse_duration("99999999999999999999d"),
            Err(UnitError::TooLarge { .. })
        ));
        assert!(matches!(
            parse_duration("9999999999999999d"),
            Err(UnitError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_bare_number_is_seconds_on_the_command_line_and_refused_in_files() {
        let e = parse_duration("90").unwrap_err();
        assert_eq!(
            e.to_string(),
            "duration \"90\" has no unit: write \"90s\" for seconds (units: ms, s, m, h, d or w)"
        );
        assert_eq!(parse_duration_arg("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration_arg("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration_arg("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(
            parse_duration_arg("10w"),
            Ok(Duration::from_secs(70 * 86_400))
        );
        assert!(parse_duration_arg("1.5s").is_err());
    }

    #[test]
    fn durations_format_in_the_largest_exact_unit_and_read_back() {
        for (d, text) in [
            (Duration::from_secs(86_400), "1d"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(3600), "1h"),
            (Duration::from_secs(14 * 86_400), "2w"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::ZERO, "0s"),
        ] {
            assert_eq!(format_duration(d), text);
            assert_eq!(parse_duration(text), Ok(d));
        }
    }
}
