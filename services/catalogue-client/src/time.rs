//! Times in answers: RFC 3339 in UTC, whatever offset the fact that set them was written with.
//!
//! Answers carry full precision (`2026-12-01T06:44:25.765729Z`); what a person reads is cut to
//! the second ([`human`]: `2026-12-01T06:44:25Z`).

use time::format_description::BorrowedFormatItem;
use time::macros::format_description;
use time::{OffsetDateTime, UtcOffset};

const HUMAN: &[BorrowedFormatItem<'static>] =
    format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]Z");

/// `t` as a person reads it: RFC 3339 in UTC, to the second (`2026-12-01T06:44:25Z`).
pub fn human(t: OffsetDateTime) -> String {
    t.to_offset(UtcOffset::UTC)
        .format(HUMAN)
        .unwrap_or_else(|_| t.to_string())
}

/// Serde for an [`OffsetDateTime`] as RFC 3339 in UTC.
pub mod utc {
    use serde::{Deserializer, Serializer};
    use time::{OffsetDateTime, UtcOffset};

    pub fn serialize<S: Serializer>(t: &OffsetDateTime, s: S) -> Result<S::Ok, S::Error> {
        time::serde::rfc3339::serialize(&t.to_offset(UtcOffset::UTC), s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<OffsetDateTime, D::Error> {
        time::serde::rfc3339::deserialize(d).map(|t| t.to_offset(UtcOffset::UTC))
    }

    /// The same for an optional time (`null` when absent).
    pub mod option {
        use serde::{Deserializer, Serializer};
        use time::{OffsetDateTime, UtcOffset};

        pub fn serialize<S: Serializer>(
            t: &Option<OffsetDateTime>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            time::serde::rfc3339::option::serialize(&t.map(|t| t.to_offset(UtcOffset::UTC)), s)
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<OffsetDateTime>, D::Error> {
            time::serde::rfc3339::option::deserialize(d)
                .map(|t| t.map(|t| t.to_offset(UtcOffset::UTC)))
        }
    }
}

#[cfg(test)]
mod tests {
    use time::macros::datetime;

    use super::*;

    #[test]
    fn people_read_utc_to_the_second() {
        let t = datetime!(2026-12-01 08:44:25.765729 +02:00);
        assert_eq!(human(t), "2026-12-01T06:44:25Z");
    }

    #[test]
    fn answers_carry_utc_with_its_fraction() {
        #[derive(serde::Serialize, serde::Deserialize)]
        struct T(#[serde(with = "utc")] OffsetDateTime);
        let json = serde_json::to_string(&T(datetime!(2026-12-01 08:44:25.765729 +02:00))).unwrap();
        assert_eq!(json, "\"2026-12-01T06:44:25.765729Z\"");
        let back: T = serde_json::from_str(&json).unwrap();
        assert_eq!(back.0, datetime!(2026-12-01 06:44:25.765729 UTC));
    }
}
