#!/usr/bin/env bash
# Scrub benchmark (issue 16): the demoter's scrub reading a replica on a posix tier folder —
# its own read-and-hash (`stagehand_demoter::scrub::read_replica`, `PARALLEL` files at once,
# the budget unlimited) — against `sha256sum -c` of a manifest and `rclone check --download`
# against the same manifest, over the same files, in interleaved rounds (scrub, sha256sum,
# rclone, and the scrub one file at a time as before `parallel_files`), the page cache dropped
# before every run. Beside them, in the same run: the all-core SHA-256 rate (the scrub's hasher
# on in-memory data, and `openssl speed -multi`; the higher counts) and, in every round right
# before the scrub, the disk's direct-read rate (`dd iflag=direct` of a large file, and the
# tier's own files read whole with O_DIRECT, PARALLEL at once, nothing hashed; and the same
# reads hashed by plain threads, the scrub's work without its machinery). Then a stage (`stagehand cp --manifest --atomic`,
# the promoter's verified set copy) timed alone and under a scrub of the tier at the shipped
# budget in another process, interleaved (target: within 1.2x of alone).
#
#   loadtest/scrub/bench.sh                                   # 20,000 files / 2 GiB, 3 rounds
#   FILES=100000 BYTES=$((10 << 30)) loadtest/scrub/bench.sh  # the issue's tier
#   FILES=200000 BYTES=$((20 << 30)) loadtest/scrub/bench.sh  # its 20 GiB, as the disk allows
#
# Settings (environment): FILES, BYTES (the tier: FILES files of BYTES/FILES bytes), PAIRS
# (rounds, default 3), PARALLEL (the scrub's `parallel_files`, default 4 as policies/scrub.toml),
# SKIP_SERIAL=1 (no one-file-at-a-time runs), CEILINGS_ONLY=1 (the scrub against the disk's
# rates alone, no sha256sum or rclone: more rounds in the time), BIG_MIB (the file `dd` reads, default 1024),
# STAGE_FILES, STAGE_BYTES (the staged version, default 256 files / 2 GiB), STAGE_UNDER_SCRUB=0
# (no stage runs),
# BENCH_DIR (default <cargo target dir>/scrub-bench; the tier is made once there and kept),
# PROFILE (release).
#
# Targets: the scrub at least 2x `sha256sum -c` (the median of the rounds' time ratios), and at
# least 0.85 of min(all-core SHA-256 rate, direct-read rate). Dropping the page cache needs
# root (`echo 3 > /proc/sys/vm/drop_caches`); without it every run reads a warm cache and the
# table says so.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
FILES=${FILES:-20000}
BYTES=${BYTES:-$((2 << 30))}
PAIRS=${PAIRS:-3}
PARALLEL=${PARALLEL:-4}
BIG_MIB=${BIG_MIB:-1024}
PROFILE=${PROFILE:-release}
log() { printf 'scrub-bench: %s\n' "$*" >&2; }

for tool in sha256sum rclone dd python3; do
    command -v "$tool" >/dev/null || { log "needs $tool (rclone: deploy/servers.sh install --bench)"; exit 1; }
done
case "$PROFILE" in
release) FLAG=--release ;;
*) FLAG="--profile $PROFILE" ;;
esac
(cd "$REPO" && cargo build -q $FLAG -p stagehand-loadtest --bin scrub-bench)
TARGET=${CARGO_TARGET_DIR:-$(cd "$REPO" && cargo metadata -q --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')}
BIN=$TARGET/$PROFILE/scrub-bench
BENCH_DIR=${BENCH_DIR:-$TARGET/scrub-bench}

TREE=$BENCH_DIR/tier/r-$FILES-$BYTES
BIG=$BENCH_DIR/big-$BIG_MIB.bin
mkdir -p "$BENCH_DIR/tier"
if [ ! -f "$TREE.list" ]; then
    rm -rf "$TREE"
    log "making $FILES files, $BYTES bytes in all, under $TREE"
    "$BIN" make --dir "$TREE" --files "$FILES" --bytes "$BYTES"
fi
"$BIN" big --file "$BIG" --mib "$BIG_MIB"
sync

DROP=yes
drop() {
    [ "$DROP" = yes ] || return 0
    sync
    if ! { echo 3 >/proc/sys/vm/drop_caches; } 2>/dev/null; then
        DROP="no (not root: every run reads a warm cache)"
        log "cannot drop the page cache: $DROP"
    fi
}
drop

OUT=$BENCH_DIR/results.jsonl
: >"$OUT"
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.6f", b - a }'; }
record() { printf '%s\n' "$1" | tee -a "$OUT" >&2; }

log "load before: $(uptime)"
# The ceilings, measured in the same run.
record "{\"sha_rate\":$("$BIN" sha-rate --seconds 3)}"
CORES=$(nproc)
if command -v openssl >/dev/null; then
    ossl=$(openssl speed -multi "$CORES" -seconds 3 -bytes 1048576 -evp sha256 2>/dev/null |
        awk '/^sha256/ { v = $2 } END { sub(/k$/, "", v); print v * 1000 }')
    record "{\"openssl_rate\":${ossl:-0}}"
fi
run() { # tool, command...
    local tool=$1
    shift
    drop
    local t0 t1
    t0=$(now)
    "$@" >"$BENCH_DIR/$tool.out" 2>&1 || { log "$tool failed:"; tail -20 "$BENCH_DIR/$tool.out" >&2; exit 1; }
    t1=$(now)
    record "{\"pair\":$pair,\"tool\":\"$tool\",\"wall\":$(secs "$t0" "$t1")}"
}
for pair in $(seq "$PAIRS"); do
    # The disk's direct-read rate in the same round, right before the scrub (this disk's rate
    # drifts between rounds): one large file (`dd`), and the tier's own files read whole with
    # O_DIRECT, as many at once as the scrub reads, nothing hashed.
    drop
    t0=$(now)
    dd if="$BIG" of=/dev/null bs=4M iflag=direct status=none
    t1=$(now)
    record "{\"pair\":$pair,\"dd_seconds\":$(secs "$t0" "$t1"),\"dd_bytes\":$((BIG_MIB << 20))}"
    run read-direct "$BIN" read --dir "$TREE" --parallel "$PARALLEL"
    # The scrub's work with none of its machinery: the same reads, each file hashed and checked
    # by plain threads (no runtime, budget, slots or confinement).
    run read-hash "$BIN" read --hash --dir "$TREE" --parallel "$PARALLEL"
    run stagehand "$BIN" scrub --dir "$TREE" --parallel "$PARALLEL"
    if [ -z "${CEILINGS_ONLY:-}" ]; then
        run sha256sum sh -c 'cd "$1" && sha256sum --quiet -c "$2"' - "$TREE" "$TREE.sha256"
        run rclone rclone check --checkfile sha256 --download "$TREE.sha256" "$TREE"
    fi
    [ -n "${SKIP_SERIAL:-}" ] || run stagehand-serial "$BIN" scrub --dir "$TREE" --parallel 1
done

# A stage timed alone and under a scrub at the shipped budget (policies/scrub.toml), interleaved:
# `stagehand cp --manifest --atomic --priority stage`, the promoter's verified set copy, of
# STAGE_FILES files / STAGE_BYTES bytes from a source tree into a fresh destination, with the
# scrub reading the bench tier in another process as a demoter beside a promoter would. The
# scrub's own read rate while the stage ran is taken from its /proc/PID/io (target: the stage
# within 1.2x of alone). STAGE_UNDER_SCRUB=0 leaves it out.
if [ "${STAGE_UNDER_SCRUB:-1}" != 0 ]; then
    STAGE_FILES=${STAGE_FILES:-256}
    STAGE_BYTES=${STAGE_BYTES:-$((2 << 30))}
    (cd "$REPO" && cargo build -q $FLAG -p stagehand --bin stagehand)
    SRC=$BENCH_DIR/stage-src/v-$STAGE_FILES-$STAGE_BYTES
    mkdir -p "$BENCH_DIR/stage-src"
    [ -f "$SRC.list" ] || "$BIN" make --dir "$SRC" --files "$STAGE_FILES" --bytes "$STAGE_BYTES"
    awk '{ print $3 "\t" $2 "\t" $1 }' "$SRC.list" >"$SRC.manifest"
    DST=$BENCH_DIR/stage-dst
    stage() { # tool
        rm -rf "$DST"
        drop
        local t0 t1
        t0=$(now)
        "$TARGET/$PROFILE/stagehand" cp -r --atomic --quiet --priority stage \
            --manifest "$SRC.manifest" "$SRC" "$DST" >"$BENCH_DIR/$1.out" 2>&1 ||
            { log "$1 failed:"; tail -20 "$BENCH_DIR/$1.out" >&2; exit 1; }
        t1=$(now)
        printf '%s %s' "$t0" "$t1"
    }
    for pair in $(seq "$PAIRS"); do
        read -r t0 t1 <<<"$(stage stage-alone)"
        record "{\"pair\":$pair,\"tool\":\"stage-alone\",\"wall\":$(secs "$t0" "$t1")}"
        SCRUB_OUT=$BENCH_DIR/scrub-beside.out
        "$BIN" scrub --dir "$TREE" --policies "$REPO/policies" --forever >"$SCRUB_OUT" 2>&1 &
        scrubber=$!
        # The scrub under way (its first file read) before the stage starts.
        until [ "$(awk '/^read_bytes/ { print $2 }' "/proc/$scrubber/io" 2>/dev/null || echo 0)" -gt 0 ]; do
            kill -0 "$scrubber" 2>/dev/null || { log "the scrub beside the stage stopped:"; tail "$SCRUB_OUT" >&2; exit 1; }
            sleep 0.05
        done
        r0=$(awk '/^read_bytes/ { print $2 }' "/proc/$scrubber/io")
        read -r t0 t1 <<<"$(stage stage-under-scrub)"
        r1=$(awk '/^read_bytes/ { print $2 }' "/proc/$scrubber/io")
        kill "$scrubber"
        wait "$scrubber" 2>/dev/null || true
        record "{\"pair\":$pair,\"tool\":\"stage-under-scrub\",\"wall\":$(secs "$t0" "$t1"),\"scrub_bytes\":$((r1 - r0))}"
    done
fi
log "load after: $(uptime)"

python3 - "$OUT" "$TREE.list" "$PARALLEL" "$DROP" "$CORES" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
files, data = 0, 0
for line in open(sys.argv[2]):
    files += 1
    data += int(line.split(" ", 2)[1])
parallel, dropped, cores = sys.argv[3], sys.argv[4], sys.argv[5]
mb = data / 1e6
sha = max([r["sha_rate"]["bytes_per_second"] for r in rows if "sha_rate" in r] +
          [r["openssl_rate"] for r in rows if "openssl_rate" in r]) / 1e6
sha_own = next(r["sha_rate"]["bytes_per_second"] for r in rows if "sha_rate" in r) / 1e6
ossl = [r["openssl_rate"] / 1e6 for r in rows if "openssl_rate" in r]
dd = {r["pair"]: r["dd_bytes"] / r["dd_seconds"] / 1e6 for r in rows if "dd_seconds" in r}
disk = statistics.median(dd.values())
walls = {}
for r in rows:
    if "tool" in r:
        walls.setdefault(r["tool"], {})[r["pair"]] = r["wall"]
s = walls["stagehand"]
def ratio(tool):
    return statistics.median(walls[tool][p] / s[p] for p in s)
names = {
    "read-direct": f"the tier's files read with O_DIRECT, {parallel} at once, no hash (a ceiling)",
    "read-hash": f"the same reads hashed and checked by {parallel} plain threads (the scrub's work, none of its machinery)",
    "stagehand": f"Stagehand scrub ({parallel} files at once)",
    "sha256sum": "sha256sum -c manifest",
    "rclone": "rclone check --checkfile sha256 --download",
    "stagehand-serial": "Stagehand scrub, 1 file at a time (before)",
}
print(f"{files:,} files, {mb / 1000:.2f} GB; {len(s)} rounds; page cache dropped before each run: {dropped}")
print(f"all-core SHA-256 ({cores} cores): {sha:.0f} MB/s (the scrub's hasher {sha_own:.0f}"
      + (f", openssl {ossl[0]:.0f}" if ossl else "") + f"); direct read (dd iflag=direct): {disk:.0f} MB/s")
print()
print("| tool | median time | MB/s | its time / the scrub's (median of rounds) |")
print("| --- | ---: | ---: | ---: |")
for tool in ["read-direct", "read-hash", "stagehand", "sha256sum", "rclone", "stagehand-serial"]:
    if tool not in walls:
        continue
    t = statistics.median(walls[tool].values())
    rel = "1.00" if tool == "stagehand" else f"{ratio(tool):.2f}"
    print(f"| {names[tool]} | {t:.2f} s | {mb / t:.0f} | {rel} |")
print()
rate = mb / statistics.median(s.values())
ceiling = min(sha, disk)
vs = ratio("sha256sum") if "sha256sum" in walls else None
# Each round's scrub against that round's ceilings (the disk's rate drifts between rounds).
of_dd = statistics.median(mb / s[p] / min(sha, dd[p]) for p in s)
of_files = statistics.median(mb / s[p] / min(sha, mb / walls["read-direct"][p]) for p in s)
print("| target | measured | met |")
print("| --- | ---: | --- |")
if vs is not None:
    print(f"| >= 2x sha256sum -c | {vs:.2f}x | {'yes' if vs >= 2 else 'no'} |")
print(f"| >= 0.85 x min(SHA-256 {sha:.0f}, disk {disk:.0f} MB/s (dd, one large file)) = {0.85 * ceiling:.0f} MB/s | {rate:.0f} MB/s; of each round's ceiling: {of_dd:.2f} | {'yes' if of_dd >= 0.85 else 'no'} |")
print(f"| >= 0.85 x min(SHA-256, the tier's files read directly) | of each round's ceiling: {of_files:.2f} | {'yes' if of_files >= 0.85 else 'no'} |")
if "read-hash" in walls:
    of_plain = statistics.median(walls["read-hash"][p] / s[p] for p in s)
    plain_of_files = statistics.median(walls["read-direct"][p] / walls["read-hash"][p] for p in s)
    print(f"| (for reference) plain threads reading and hashing, of the files read directly | {plain_of_files:.2f} | |")
    print(f"| (for reference) the scrub, of plain threads reading and hashing | {of_plain:.2f} | |")
if "stage-alone" in walls:
    alone, under = walls["stage-alone"], walls["stage-under-scrub"]
    pairs = sorted(set(alone) & set(under))
    ratios = [under[p] / alone[p] for p in pairs]
    scrub_rates = [r["scrub_bytes"] / r["wall"] / 1e6 for r in rows if r.get("tool") == "stage-under-scrub"]
    slow = statistics.median(ratios)
    print()
    print(f"| stage (stagehand cp --manifest, verified) | alone | under the scrub at the shipped budget | under / alone (median of {len(pairs)} pairs) | the scrub's read rate meanwhile |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print(f"| median time | {statistics.median(alone.values()):.2f} s | {statistics.median(under.values()):.2f} s | {slow:.2f} ({', '.join(f'{x:.2f}' for x in ratios)}) | {statistics.median(scrub_rates):.0f} MB/s |")
    print(f"| target: within 1.2x of the stage alone | | | {'met' if slow <= 1.2 else 'not met'} | |")
PY
