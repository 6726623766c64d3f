//! What a sample is in the WebDataset layout, and the seeded order samples are packed in.
//!
//! **Keys.** A file belongs to the sample named by its path without its extensions: the
//! directory plus the file name up to its first dot. `train/0001.jpg` and `train/0001.seg.png`
//! are members `jpg` and `seg.png` of sample `train/0001`. This is exactly the rule of the
//! `webdataset` package's readers (`base_plus_ext`, the regular expression
//! `^((?:.*/|)[^.]+)[.]([^/]*)$`, with the extension lowercased when samples are grouped), so
//! a reader groups the members of a shard into the samples the resharder wrote. A file that
//! rule gives no sample to — no extension (`README`), a name starting with a dot
//! (`a/.hidden.jpg`), an empty extension (`a.`), or a path whose first component the readers
//! skip as metadata (`__meta__/x.json`) — can never be read back as a member, so it is a problem of the
//! derivation ([`crate::plan`]), never silently dropped.
//!
//! **Order.** Samples are shuffled by a keyed hash rather than by a random permutation held in
//! memory: each sample sorts by the first 8 bytes (big-endian) of
//! `SHA-256("stagehand/shuffle/v1" ++ 0x00 ++ u64_be(seed) ++ key)`, ties broken by the key's
//! bytes. Any seed gives a uniformly shuffled order, the same seed always the same order, and
//! sorting millions of keys needs only an external sort ([`crate::sort`]), never all of them in
//! memory. Readers can recompute the order from the keys and the recorded seed (the Python
//! check in `deploy/py-checks/` does).

use sha2::{Digest, Sha256};

/// The domain string of the shuffle hash (versioned: a change of rule is a new string).
pub const SHUFFLE_DOMAIN: &[u8] = b"stagehand/shuffle/v1";

/// The name of the shuffle rule, recorded in each prepared version's `prepared.json`.
pub const SHUFFLE_RULE: &str = "sha256-keyed-order-v1";

/// A file's sample key and its extension, as the `webdataset` readers split its path;
/// `None` when they would not read it as a member of any sample.
pub fn split_key(path: &str) -> Option<(&str, &str)> {
    // The readers skip, as metadata, names matching `__[^/]*__($|/)` from the start: those
    // whose first component begins and ends with two underscores.
    let first = path.split('/').next().unwrap_or(path);
    if first.len() >= 4 && first.starts_with("__") && first.ends_with("__") {
        return None;
    }
    let name_start = path.rfind('/').map_or(0, |i| i + 1);
    let name = &path[name_start..];
    let dot = name.find('.')?;
    if dot == 0 || dot + 1 == name.len() {
        return None;
    }
    let split = name_start + dot;
    Some((&path[..split], &path[split + 1..]))
}

/// The position of a sample in the seeded order (compared first; the key breaks ties).
pub fn order_hash(seed: u64, key: &str) -> u64 {
    let mut h = Sha256::new();
    h.update(SHUFFLE_DOMAIN);
    h.update([0u8]);
    h.update(seed.to_be_bytes());
    h.update(key.as_bytes());
    let digest = h.finalize();
    u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The split must be the `webdataset` package's: a disagreement would make readers group
    /// members into other samples than the ones written (and the index lie).
    #[test]
    fn keys_split_as_webdataset_readers_split_them() {
        let cases: &[(&str, Option<(&str, &str)>)] = &[
            ("0001.jpg", Some(("0001", "jpg"))),
            ("train/0001.jpg", Some(("train/0001", "jpg"))),
            ("train/0001.seg.png", Some(("train/0001", "seg.png"))),
            ("a.b/c.d/0001.JSON", Some(("a.b/c.d/0001", "JSON"))),
            ("train/0001", None),
            ("README", None),
            ("a/.hidden.jpg", None),
            ("a.", None),
            ("dir/x.", None),
            ("__meta__.json", Some(("__meta__", "json"))),
            ("__meta__/x.json", None),
            ("__a.b__", None),
            ("___/x.json", Some(("___/x", "json"))),
            ("__init.py", Some(("__init", "py"))),
            ("x/__meta__.json", Some(("x/__meta__", "json"))),
        ];
        for (path, want) in cases {
            assert_eq!(split_key(path), *want, "{path}");
        }
    }

    /// Pinned: the order is part of what a prepared version promises (the same seed gives the
    /// same shards forever), and readers recompute it.
    #[test]
    fn the_order_hash_is_pinned() {
        // Computed independently in Python:
        // int.from_bytes(sha256(b"stagehand/shuffle/v1\0" + seed.to_bytes(8, "big") + key)[:8], "big")
        assert_eq!(order_hash(0, "train/0001"), 0xdd64_c2f0_6376_292d);
        assert_eq!(order_hash(7, "train/0001"), 0xa9f5_f14d_20d1_0648);
        assert_ne!(order_hash(0, "a"), order_hash(0, "b"));
    }
}
