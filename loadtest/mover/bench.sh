#!/usr/bin/env bash
# posix → posix benchmark of `stagehand cp` against rclone, rsync and cp, on the same data in
# one run, with the machine's limits measured in the same run. Warm page cache throughout:
# dropping caches is not assumed possible, so every tool reads a source that is in memory.
#
#   loadtest/mover/bench.sh            # 4 GiB file + 20,000 × 4 KiB files
#   LARGE_MIB=1024 SMALL_FILES=5000 loadtest/mover/bench.sh   # a quicker run
#
# Data lives under $BENCH_DIR (default: $CARGO_TARGET_DIR/mover-bench) on the same
# filesystem for every tool. Every small-file run writes into a directory of its own and the
# destinations are removed only at the end: ext4 without a journal skips inodes deleted in the
# last ~30 s when it allocates new ones, so a run right after `rm -rf` of 20,000 files pays for
# the previous tool's deletion (seen in profiles as find_inode_bit / recently_deleted).
# The SHA-256 limit is measured right before and right after stagehand's large-file run, and
# the load average is printed with the tables: other work on the machine moves every figure.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
BENCH_DIR=${BENCH_DIR:-$CARGO_TARGET_DIR/mover-bench}
LARGE_MIB=${LARGE_MIB:-4096}
SMALL_FILES=${SMALL_FILES:-20000}

need() {
    command -v "$1" >/dev/null 2>&1 && return
    echo "installing $2 ..." >&2
    apt-get update -qq >/dev/null && apt-get install -y -qq "$2" >/dev/null
}
need rclone rclone
need rsync rsync
need openssl openssl

# The optimised binary of `stagehand cp` (the workspace's bench-release profile).
cargo build --profile bench-release -p stagehand-mover --bin stagehand-mover-cp >&2
CP="$CARGO_TARGET_DIR/bench-release/stagehand-mover-cp"

mkdir -p "$BENCH_DIR"
SRC_L="$BENCH_DIR/large-src"; SRC_S="$BENCH_DIR/small-src"; DST="$BENCH_DIR/dst"
mkdir -p "$SRC_L" "$SRC_S"

# Data: made once, reused across runs.
if [ "$(stat -c %s "$SRC_L/large.bin" 2>/dev/null || echo 0)" != "$((LARGE_MIB * 1048576))" ]; then
    echo "creating a ${LARGE_MIB} MiB file ..." >&2
    # Incompressible bytes; openssl stops on SIGPIPE when head has enough.
    { openssl enc -aes-128-ctr -pass pass:stagehand -nosalt -pbkdf2 </dev/zero 2>/dev/null || true; } |
        head -c "$((LARGE_MIB * 1048576))" >"$SRC_L/large.bin"
fi
if [ "$(find "$SRC_S" -type f | wc -l)" != "$SMALL_FILES" ]; then
    echo "creating $SMALL_FILES × 4 KiB files ..." >&2
    rm -rf "$SRC_S"; mkdir -p "$SRC_S"
    python3 - "$SRC_S" "$SMALL_FILES" <<'PY'
import os, sys
root, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    d = os.path.join(root, f"d{i % 20:02}", f"e{(i // 20) % 50:02}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"f{i:06}.bin"), "wb") as f:
        f.write(os.urandom(4096))
PY
fi
# Warm the cache: every tool then reads from memory.
cat "$SRC_L/large.bin" >/dev/null
find "$SRC_S" -type f -exec cat {} + >/dev/null

TIMEFORMAT=%R
secs() { # run a command, print its wall seconds
    local t
    sync
    { t=$( { time "$@" >/dev/null 2>&1; } 2>&1 ); } || { echo "FAILED: $*" >&2; echo "nan"; return; }
    echo "$t"
}
fresh() { rm -rf "$DST"; mkdir -p "$DST"; sync; }
RUN=0
fresh_small() { RUN=$((RUN + 1)); DST="$BENCH_DIR/dst-small-$RUN"; rm -rf "$DST"; mkdir -p "$DST"; sync; }
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
LARGE_BYTES=$((LARGE_MIB * 1048576))
declare -A L S

echo "limits ..." >&2
L[sha256_openssl_before]=$(secs openssl dgst -sha256 "$SRC_L/large.bin")
L[sha256sum]=$(secs sha256sum "$SRC_L/large.bin")
fresh; L[pagecache_copy]=$(secs dd if="$SRC_L/large.bin" of="$DST/large.bin" bs=1M)
fresh; L[odirect_write]=$(secs dd if="$SRC_L/large.bin" of="$DST/large.bin" bs=4M oflag=direct)

echo "large file ..." >&2
fresh; L[stagehand]=$(secs "$CP" "$SRC_L/large.bin" "$DST/" --quiet)
L[sha256_openssl_after]=$(secs openssl dgst -sha256 "$SRC_L/large.bin")
fresh; L[stagehand_pread]=$(secs "$CP" "$SRC_L/large.bin" "$DST/" --quiet --engine pread)
fresh; L[rclone_checksum]=$(secs rclone copy --checksum "$SRC_L" "$DST")
fresh; L[rsync]=$(secs rsync -a "$SRC_L/" "$DST/")
fresh; L[cp]=$(secs cp "$SRC_L/large.bin" "$DST/large.bin")
fresh; L[cp_sha256sum]=$(secs sh -c "cp '$SRC_L/large.bin' '$DST/large.bin' && sync '$DST/large.bin' && sha256sum '$DST/large.bin'")

rm -rf "$DST"
echo "small files ..." >&2
rm -rf "$BENCH_DIR"/dst-small-*; sync
fresh_small; S[stagehand]=$(secs "$CP" "$SRC_S" "$DST" -r --quiet)
fresh_small; S[stagehand_pread]=$(secs "$CP" "$SRC_S" "$DST" -r --quiet --engine pread)
fresh_small; S[rclone_checksum]=$(secs rclone copy --checksum --transfers 64 --checkers 64 "$SRC_S" "$DST")
fresh_small; S[rclone]=$(secs rclone copy --transfers 64 --checkers 64 "$SRC_S" "$DST")
fresh_small; S[rsync]=$(secs rsync -a "$SRC_S/" "$DST/")
fresh_small; S[cp_r]=$(secs cp -r "$SRC_S/." "$DST/")
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)
rm -rf "$BENCH_DIR"/dst-small-*

python3 - "$LARGE_BYTES" "$SMALL_FILES" "$LOAD_START" "$LOAD_END" "$(nproc)" <<PY
import math, sys
large_bytes, n = int(sys.argv[1]), int(sys.argv[2])
print(f"\nload average at start {sys.argv[3]}, at end {sys.argv[4]} ({sys.argv[5]} cores)")
L = {$(for k in "${!L[@]}"; do printf '"%s": %s, ' "$k" "${L[$k]}"; done)}
L["sha256_openssl"] = (L["sha256_openssl_before"] + L["sha256_openssl_after"]) / 2
S = {$(for k in "${!S[@]}"; do printf '"%s": %s, ' "$k" "${S[$k]}"; done)}
gib = large_bytes / 2**30
def rate(s): return gib / s if s and s > 0 else float("nan")
print(f"\n## one {gib:g} GiB file, posix -> posix (warm page cache)\n")
print(f"{'tool':<40}{'seconds':>9}{'GiB/s':>9}{'vs rclone --checksum':>22}")
notes = {
  "sha256_openssl_before": "limit: openssl dgst -sha256, before",
  "sha256_openssl_after": "limit: openssl dgst -sha256, after",
  "sha256_openssl": "limit: openssl dgst -sha256 (mean)",
  "sha256sum": "limit: sha256sum (1 core)",
  "pagecache_copy": "limit: dd page-cache copy (unverified)",
  "odirect_write": "limit: dd oflag=direct write",
  "stagehand": "stagehand cp (io_uring, verified, durable)",
  "stagehand_pread": "stagehand cp --engine pread",
  "rclone_checksum": "rclone copy --checksum",
  "rsync": "rsync -a",
  "cp": "cp (unverified, not synced)",
  "cp_sha256sum": "cp && sync && sha256sum",
}
rc = rate(L["rclone_checksum"])
for k in ["sha256_openssl_before","sha256_openssl_after","sha256_openssl","sha256sum","pagecache_copy","odirect_write","stagehand","stagehand_pread","rclone_checksum","rsync","cp","cp_sha256sum"]:
    print(f"{notes[k]:<40}{L[k]:>9.2f}{rate(L[k]):>9.2f}{rate(L[k])/rc:>21.2f}x")
st, sha = rate(L["stagehand"]), rate(L["sha256_openssl"])
print(f"\ntarget large: >= 3x rclone --checksum -> {st/rc:.2f}x; >= 0.85 of single-core SHA-256 -> {st/sha:.2f}")
print(f"\n## {n} x 4 KiB files in nested folders, posix -> posix (warm page cache)\n")
print(f"{'tool':<40}{'seconds':>9}{'files/s':>10}{'vs rclone --checksum':>22}")
sn = {"stagehand": "stagehand cp -r (verified, durable)", "stagehand_pread": "stagehand cp -r --engine pread",
      "rclone_checksum": "rclone copy --checksum (64 transfers)", "rclone": "rclone copy (64 transfers)",
      "rsync": "rsync -a", "cp_r": "cp -r (unverified, not synced)"}
def fps(s): return n / s if s and s > 0 else float("nan")
rs = fps(S["rclone_checksum"])
for k in ["stagehand","stagehand_pread","rclone_checksum","rclone","rsync","cp_r"]:
    print(f"{sn[k]:<40}{S[k]:>9.2f}{fps(S[k]):>10.0f}{fps(S[k])/rs:>21.2f}x")
print(f"\ntarget small: >= 5x rclone files/s -> {fps(S['stagehand'])/rs:.2f}x (vs rclone --checksum), {fps(S['stagehand'])/fps(S['rclone']):.2f}x (vs plain rclone)")
PY
