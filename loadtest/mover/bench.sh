#!/usr/bin/env bash
# posix → posix benchmark of the mover's copy (what `stagehand cp` runs) against rclone, rsync
# and cp, on the same data in one run, with the machine's limits measured in the same run.
# Warm page cache throughout: dropping caches is not assumed possible, so every tool reads a
# source that is in memory.
#
#   loadtest/mover/bench.sh            # 4 GiB file, 4 × 512 MiB files, 20,000 × 4 KiB files
#   LARGE_MIB=1024 SMALL_FILES=5000 loadtest/mover/bench.sh   # a quicker run
#   MULTI_FILES=8 MULTI_MIB=1024 loadtest/mover/bench.sh      # the multi-file case's size
#   CASES="multi" loadtest/mover/bench.sh   # only some cases (large, multi, small)
#   STAGEHAND_CP=/path/to/stagehand-mover-cp loadtest/mover/bench.sh   # another build
#   REPS=5 loadtest/mover/bench.sh     # rounds per tool (default 3); medians are reported
#
# The multi-file case measures what spreading SHA-256 over the cores buys: its limit is the
# SHA-256 rate of *all* cores, measured in the same run as `openssl dgst -sha256` of the same
# files, one process per core at a time (xargs -P nproc).
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
MULTI_FILES=${MULTI_FILES:-4}
MULTI_MIB=${MULTI_MIB:-512}
CASES=${CASES:-large multi small}
REPS=${REPS:-3}
want() { case " $CASES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

need() {
    command -v "$1" >/dev/null 2>&1 && return
    echo "installing $2 ..." >&2
    apt-get update -qq >/dev/null && apt-get install -y -qq "$2" >/dev/null
}
need rclone rclone
need rsync rsync
need openssl openssl

# The optimised binary of the mover's copy (the workspace's bench-release profile; it takes its
# options as one JSON argument, see services/mover/src/bin), or the one STAGEHAND_CP names (to
# compare two builds on the same data).
if [ -n "${STAGEHAND_CP:-}" ]; then
    CP=$STAGEHAND_CP
else
    cargo build --profile bench-release -p stagehand-mover --bin stagehand-mover-cp >&2
    CP="$CARGO_TARGET_DIR/bench-release/stagehand-mover-cp"
fi

# `shcp SRC DST [JSON fields]`: one copy, e.g. shcp a b '"recursive":true'.
shcp() {
    local extra=${3:+,$3}
    "$CP" "{\"src\":\"$1\",\"dst\":\"$2\"$extra}"
}

mkdir -p "$BENCH_DIR"
SRC_L="$BENCH_DIR/large-src"; SRC_S="$BENCH_DIR/small-src"; SRC_M="$BENCH_DIR/multi-src"; DST="$BENCH_DIR/dst"
mkdir -p "$SRC_L" "$SRC_S" "$SRC_M"

# Data: made once, reused across runs.
make_file() { # make_file PATH MIB SEED
    if [ "$(stat -c %s "$1" 2>/dev/null || echo 0)" != "$(($2 * 1048576))" ]; then
        echo "creating $1 ($2 MiB) ..." >&2
        # Incompressible bytes; openssl stops on SIGPIPE when head has enough.
        { openssl enc -aes-128-ctr -pass "pass:stagehand$3" -nosalt -pbkdf2 </dev/zero 2>/dev/null || true; } |
            head -c "$(($2 * 1048576))" >"$1"
    fi
}
want large && make_file "$SRC_L/large.bin" "$LARGE_MIB" 0
if want multi; then
    find "$SRC_M" -type f ! -name 'part-*' -delete
    for i in $(seq "$MULTI_FILES"); do make_file "$SRC_M/part-$i.bin" "$MULTI_MIB" "$i"; done
    for f in "$SRC_M"/part-*.bin; do n=${f##*/part-}; n=${n%.bin}; [ "$n" -le "$MULTI_FILES" ] || rm -f "$f"; done
fi
if want small && [ "$(find "$SRC_S" -type f | wc -l)" != "$SMALL_FILES" ]; then
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
if want large; then cat "$SRC_L/large.bin" >/dev/null; fi
if want multi; then cat "$SRC_M"/part-*.bin >/dev/null; fi
if want small; then find "$SRC_S" -type f -exec cat {} + >/dev/null; fi

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
rm -rf "$BENCH_DIR"/dst-small-*
LARGE_BYTES=$((LARGE_MIB * 1048576))
MULTI_BYTES=$((MULTI_FILES * MULTI_MIB * 1048576))
NPROC=$(nproc)
declare -A L S M

add() { # add a measurement: add TABLE KEY SECONDS
    case $1 in
        L) L[$2]="${L[$2]:-} $3" ;;
        M) M[$2]="${M[$2]:-} $3" ;;
        *) S[$2]="${S[$2]:-} $3" ;;
    esac
}
sha_all_cores() { # the same files, one openssl process per core at a time
    find "$SRC_M" -name 'part-*.bin' -print0 | xargs -0 -P "$NPROC" -n 1 openssl dgst -sha256
}
for round in $(seq "$REPS"); do
    want multi || break
    echo "round $round of $REPS: $MULTI_FILES × $MULTI_MIB MiB files ..." >&2
    add M sha256_all_before "$(secs sha_all_cores)"
    fresh; add M stagehand "$(secs shcp "$SRC_M" "$DST/m" '"recursive":true')"
    add M sha256_all_after "$(secs sha_all_cores)"
    fresh; add M stagehand_pread "$(secs shcp "$SRC_M" "$DST/m" '"recursive":true,"engine":"pread"')"
    add M sha256_one_core "$(secs openssl dgst -sha256 "$SRC_M"/part-*.bin)"
    fresh; add M rclone_checksum "$(secs rclone copy --checksum "$SRC_M" "$DST/m")"
    fresh; add M odirect_write "$(secs dd if=/dev/zero of="$DST/zeros" bs=4M count=$((MULTI_BYTES / 4194304)) oflag=direct)"
    fresh; add M cp_r "$(secs cp -r "$SRC_M" "$DST/m")"
    fresh; add M cp_sha256sum "$(secs sh -c "cp -r '$SRC_M' '$DST/m' && sync && find '$DST/m' -type f -print0 | xargs -0 -P $NPROC -n 1 sha256sum")"
    rm -rf "$DST"
done
for round in $(seq "$REPS"); do
    want large || break
    echo "round $round of $REPS: large file ..." >&2
    add L sha256_openssl_before "$(secs openssl dgst -sha256 "$SRC_L/large.bin")"
    fresh; add L stagehand "$(secs shcp "$SRC_L/large.bin" "$DST/")"
    add L sha256_openssl_after "$(secs openssl dgst -sha256 "$SRC_L/large.bin")"
    fresh; add L stagehand_pread "$(secs shcp "$SRC_L/large.bin" "$DST/" '"engine":"pread"')"
    fresh; add L rclone_checksum "$(secs rclone copy --checksum "$SRC_L" "$DST")"
    add L sha256sum "$(secs sha256sum "$SRC_L/large.bin")"
    fresh; add L pagecache_copy "$(secs dd if="$SRC_L/large.bin" of="$DST/large.bin" bs=1M)"
    fresh; add L odirect_write "$(secs dd if="$SRC_L/large.bin" of="$DST/large.bin" bs=4M oflag=direct)"
    fresh; add L rsync "$(secs rsync -a "$SRC_L/" "$DST/")"
    fresh; add L cp "$(secs cp "$SRC_L/large.bin" "$DST/large.bin")"
    fresh; add L cp_sha256sum "$(secs sh -c "cp '$SRC_L/large.bin' '$DST/large.bin' && sync '$DST/large.bin' && sha256sum '$DST/large.bin'")"
    rm -rf "$DST"
done
for round in $(seq "$REPS"); do
    want small || break
    echo "round $round of $REPS: small files ..." >&2
    fresh_small; add S stagehand "$(secs shcp "$SRC_S" "$DST" '"recursive":true')"
    fresh_small; add S rclone_checksum "$(secs rclone copy --checksum --transfers 64 --checkers 64 "$SRC_S" "$DST")"
    fresh_small; add S stagehand_pread "$(secs shcp "$SRC_S" "$DST" '"recursive":true,"engine":"pread"')"
    fresh_small; add S rclone "$(secs rclone copy --transfers 64 --checkers 64 "$SRC_S" "$DST")"
    fresh_small; add S rsync "$(secs rsync -a "$SRC_S/" "$DST/")"
    fresh_small; add S cp_r "$(secs cp -r "$SRC_S/." "$DST/")"
done
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)
rm -rf "$BENCH_DIR"/dst-small-*

python3 - "$LARGE_BYTES" "$SMALL_FILES" "$LOAD_START" "$LOAD_END" "$(nproc)" "$REPS" "$MULTI_BYTES" "$MULTI_FILES" <<PY
import math, statistics, sys
large_bytes, n, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[6])
multi_bytes, multi_files, cores = int(sys.argv[7]), int(sys.argv[8]), int(sys.argv[5])
print(f"\nload average at start {sys.argv[3]}, at end {sys.argv[4]} ({sys.argv[5]} cores); median of {reps} interleaved rounds, [min-max] seconds")
RL = {$(for k in "${!L[@]}"; do printf '"%s": [%s], ' "$k" "$(echo ${L[$k]} | tr ' ' ',')"; done)}
RS = {$(for k in "${!S[@]}"; do printf '"%s": [%s], ' "$k" "$(echo ${S[$k]} | tr ' ' ',')"; done)}
RM = {$(for k in "${!M[@]}"; do printf '"%s": [%s], ' "$k" "$(echo ${M[$k]} | tr ' ' ',')"; done)}
def spread(v): return f"[{min(v):.2f}-{max(v):.2f}]"
if RM:
    RM["sha256_all"] = [(a + b) / 2 for a, b in zip(RM["sha256_all_before"], RM["sha256_all_after"])]
    M = {k: statistics.median(v) for k, v in RM.items()}
    mg = multi_bytes / 2**30
    def mrate(s): return mg / s if s and s > 0 else float("nan")
    print(f"\n## {multi_files} files, {mg:g} GiB in all, posix -> posix (warm page cache)\n")
    print(f"{'tool':<48}{'seconds':>9}{'GiB/s':>9}{'vs all-core SHA-256':>21}  spread")
    mn = {
      "sha256_all_before": f"limit: openssl dgst -sha256 x {cores} procs, before",
      "sha256_all_after": f"limit: openssl dgst -sha256 x {cores} procs, after",
      "sha256_all": f"limit: SHA-256 on all {cores} cores (mean)",
      "sha256_one_core": "limit: openssl dgst -sha256 (1 core)",
      "odirect_write": "limit: dd oflag=direct write of as many bytes",
      "stagehand": "stagehand cp -r (io_uring, verified, durable)",
      "stagehand_pread": "stagehand cp -r --engine pread",
      "rclone_checksum": "rclone copy --checksum",
      "cp_r": "cp -r (unverified, not synced)",
      "cp_sha256sum": f"cp -r && sync && sha256sum x {cores} procs",
    }
    lim = mrate(M["sha256_all"])
    for k in ["sha256_all_before","sha256_all_after","sha256_all","sha256_one_core","odirect_write","stagehand","stagehand_pread","rclone_checksum","cp_r","cp_sha256sum"]:
        print(f"{mn[k]:<48}{M[k]:>9.2f}{mrate(M[k]):>9.2f}{mrate(M[k])/lim:>20.2f}x  {spread(RM[k])}")
    per_round = [b / a for a, b in zip(RM["stagehand"], RM["sha256_all"])]
    print(f"\ntarget multi: >= 0.85 of all-core SHA-256 -> {mrate(M['stagehand'])/lim:.2f}"
          f" (per round, against the runs around it: {', '.join(f'{r:.2f}' for r in per_round)});"
          f" vs rclone --checksum {mrate(M['stagehand'])/mrate(M['rclone_checksum']):.2f}x;"
          f" of the direct-write limit {mrate(M['stagehand'])/mrate(M['odirect_write']):.2f}")
if RL:
    RL["sha256_openssl"] = [(a + b) / 2 for a, b in zip(RL["sha256_openssl_before"], RL["sha256_openssl_after"])]
    L = {k: statistics.median(v) for k, v in RL.items()}
    gib = large_bytes / 2**30
    def rate(s): return gib / s if s and s > 0 else float("nan")
    print(f"\n## one {gib:g} GiB file, posix -> posix (warm page cache)\n")
    print(f"{'tool':<44}{'seconds':>9}{'GiB/s':>9}{'vs rclone --checksum':>22}  spread")
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
        print(f"{notes[k]:<44}{L[k]:>9.2f}{rate(L[k]):>9.2f}{rate(L[k])/rc:>21.2f}x  {spread(RL[k])}")
    st, sha = rate(L["stagehand"]), rate(L["sha256_openssl"])
    per_round = [b / a for a, b in zip(RL["stagehand"], RL["sha256_openssl"])]
    print(f"\ntarget large: >= 3x rclone --checksum -> {st/rc:.2f}x; >= 0.85 of single-core SHA-256 -> {st/sha:.2f}"
          f" (per round, against the openssl runs around it: {', '.join(f'{r:.2f}' for r in per_round)})")
if RS:
    S = {k: statistics.median(v) for k, v in RS.items()}
    print(f"\n## {n} x 4 KiB files in nested folders, posix -> posix (warm page cache)\n")
    print(f"{'tool':<44}{'seconds':>9}{'files/s':>10}{'vs rclone --checksum':>22}  spread")
    sn = {"stagehand": "stagehand cp -r (verified, durable)", "stagehand_pread": "stagehand cp -r --engine pread",
          "rclone_checksum": "rclone copy --checksum (64 transfers)", "rclone": "rclone copy (64 transfers)",
          "rsync": "rsync -a", "cp_r": "cp -r (unverified, not synced)"}
    def fps(s): return n / s if s and s > 0 else float("nan")
    rs = fps(S["rclone_checksum"])
    for k in ["stagehand","stagehand_pread","rclone_checksum","rclone","rsync","cp_r"]:
        print(f"{sn[k]:<44}{S[k]:>9.2f}{fps(S[k]):>10.0f}{fps(S[k])/rs:>21.2f}x  {spread(RS[k])}")
    print(f"\ntarget small: >= 5x rclone files/s -> {fps(S['stagehand'])/rs:.2f}x (vs rclone --checksum), {fps(S['stagehand'])/fps(S['rclone']):.2f}x (vs plain rclone)")
PY
