#!/usr/bin/env bash
# Stagehand's test command, the same locally and in CI (.ci/run calls it):
# installs the servers the tests start (deploy/servers.sh install, deploy/slurm/slurm.sh install),
# then
#   cargo fmt --check, clippy with warnings as errors, the docs with warnings as errors, every
#   test of the workspace against real servers (cargo-nextest when installed, else cargo test),
#   the doctests, and the Python producer test (deploy/py-tests.sh) when present.
#
# Builds go to $CARGO_TARGET_DIR (default ~/.cache/stagehand/target) so that clones share them.
# Tests start their own nats-server and S3 server on free ports through stagehand-testkit; no
# server needs to be running beforehand.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

step() { printf '\n==> %s\n' "$*"; }

# Every check runs even when an earlier one failed, so one run shows every problem; the script
# fails at the end, naming the checks that failed.
failed=()
check() {
    step "$*"
    if ! "$@"; then
        failed+=("$*")
    fi
}

# rustup's cargo reads rust-toolchain.toml; make sure its proxies come first.
if [ -d "$HOME/.cargo/bin" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v rustup >/dev/null || { echo "test.sh: rustup not found; install it, then rerun" >&2; exit 1; }
toolchain="$(sed -n 's/^channel *= *"\(.*\)"/\1/p' rust-toolchain.toml)"
if ! rustup run "$toolchain" rustc --version >/dev/null 2>&1; then
    step "installing Rust $toolchain (rust-toolchain.toml)"
    rustup toolchain install "$toolchain" --profile minimal --component rustfmt,clippy
fi
step "toolchain: $(cargo --version) ($(rustup show active-toolchain | cut -d' ' -f1))"

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/stagehand/target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

step "servers: deploy/servers.sh install"
deploy/servers.sh install
eval "$(deploy/servers.sh env)"

# The Slurm tests (services/cli/tests/slurm.rs) start one-node clusters of the distribution's
# Slurm; install it once here rather than in the first test. Needs root, as CI runs; where it
# cannot be installed, the Slurm tests fail with the reason (they are never skipped).
check deploy/slurm/slurm.sh install
check deploy/package.sh install-deps   # debootstrap for the package's install test (root)

check cargo fmt --all --check
check cargo clippy --workspace --all-targets -- -D warnings
check env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
if cargo nextest --version >/dev/null 2>&1; then
    check cargo nextest run --workspace --no-fail-fast
    check cargo test --doc --workspace
else
    check cargo test --workspace --no-fail-fast
fi
if [ -f deploy/py-tests.sh ]; then
    check bash deploy/py-tests.sh
fi

if [ "${#failed[@]}" -gt 0 ]; then
    step "FAILED: ${#failed[@]} check(s)"
    printf '    %s\n' "${failed[@]}"
    exit 1
fi
step "all checks passed"
