//! What every configuration file, policy file and command-line flag shares: the one grammar
//! of sizes and durations ([`parse_size`], [`parse_duration`], [`ByteSize`], the
//! [`duration`](mod@duration) serde helpers; see the [`units`] module for the grammar), and
//! where a key is written in a TOML file.
//!
//! [`key_at`] and [`line_of`] are the one place that turns a parser's byte offset into the
//! dotted key and the line an error should name, and a key into the line it is written on.
//! The policies (`stagehand-policy`) and the service runner's configuration files
//! (`stagehand_bus::runner`) both report `file:line: \`key\`: what is wrong` through them.
//! They read the text line by line (table headers and `key = value` lines), which is all the
//! precision an error message needs; values spanning several lines count as their first.
//!
//! ```
//! let text = "[bus]\nservers = [\"nats://a:4222\"]\ncolour = \"red\"\n";
//! assert_eq!(stagehand_config::line_of(text, "bus.colour"), Some(3));
//! let at = text.find("colour").unwrap();
//! assert_eq!(stagehand_config::key_at(text, at), ("bus.colour".to_owned(), Some(3)));
//! ```

pub mod units;

pub use units::{
    ByteSize, UnitError, duration, format_duration, parse_duration, parse_duration_arg, parse_size,
};

/// Each line's byte offset, 1-based number and dotted key path: the table header it is under
/// plus its own key.
fn line_keys(text: &str) -> impl Iterator<Item = (usize, usize, String)> + '_ {
    let mut table = String::new();
    let mut offset = 0;
    text.split_inclusive('\n')
        .enumerate()
        .map(move |(index, raw)| {
            let start = offset;
            offset += raw.len();
            let line = raw.trim();
            let key = if let Some(header) = line.strip_prefix('[') {
                let header = header.trim_start_matches('[');
                let end = header.find(']').unwrap_or(header.len());
                table = normalise_key(&header[..end]);
                table.clone()
            } else if !line.starts_with('#')
                && let Some((key, _)) = line.split_once('=')
            {
                let key = normalise_key(key);
                if table.is_empty() {
                    key
                } else {
                    format!("{table}.{key}")
                }
            } else {
                table.clone()
            };
            (start, index + 1, key)
        })
}

/// `a . "b-c"` → `a.b-c`.
fn normalise_key(key: &str) -> String {
    key.split('.')
        .map(|part| part.trim().trim_matches('"').trim_matches('\''))
        .collect::<Vec<_>>()
        .join(".")
}

/// The dotted key path and the line at byte `pos` (a parser error's span start).
pub fn key_at(text: &str, pos: usize) -> (String, Option<usize>) {
    let mut found = (String::new(), None);
    for (start, line, key) in line_keys(text) {
        if start > pos {
            break;
        }
        found = (key, Some(line));
    }
    found
}

/// The line where `key` is written, else where the first table containing it opens.
pub fn line_of(text: &str, key: &str) -> Option<usize> {
    let mut table_line = None;
    for (_, line, found) in line_keys(text) {
        if found == key {
            return Some(line);
        }
        if table_line.is_none() && !found.is_empty() && key.starts_with(&format!("{found}.")) {
            table_line = Some(line);
        }
    }
    table_line
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# comment\ntop = 1\n\n[tiers.hot]\nkind = \"posix\"\n\"high_watermark\" = 2\n[tiers.hot.quotas]\nlab-a = 3\n";

    #[test]
    fn keys_follow_table_headers() {
        assert_eq!(line_of(TEXT, "top"), Some(2));
        assert_eq!(line_of(TEXT, "tiers.hot"), Some(4));
        assert_eq!(line_of(TEXT, "tiers.hot.high_watermark"), Some(6));
        assert_eq!(line_of(TEXT, "tiers.hot.quotas.lab-a"), Some(8));
        // A key not written falls back to the first table that contains it.
        assert_eq!(line_of(TEXT, "tiers.hot.root"), Some(4));
        assert_eq!(line_of(TEXT, "nowhere"), None);
        let pos = TEXT.find("lab-a").unwrap();
        assert_eq!(
            key_at(TEXT, pos),
            ("tiers.hot.quotas.lab-a".into(), Some(8))
        );
    }
}
