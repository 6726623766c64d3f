#!/usr/bin/env bash
# Stagehand's release artefacts: a Debian package and a tarball of the same tree, holding every
# binary Stagehand ships, the systemd units, the default service configurations, NATS configs and
# policies, the runbooks, and the man pages and shell completions generated from the CLI's own
# definition. Installing either needs no Rust toolchain and no network.
#
#   deploy/package.sh [build]        build the artefacts into $STAGEHAND_PACKAGE_OUT
#   deploy/package.sh binaries       print the binaries that ship, one a line
#   deploy/package.sh install-deps   install what the package test needs (debootstrap), as root
#   deploy/package.sh clean-root DIR a clean Debian root in DIR for the install test (debootstrap,
#                                    made once: a second call finds it and downloads nothing)
#
# Environment:
#   STAGEHAND_PACKAGE_PROFILE  release (default): `cargo build --release` of the binaries; or
#                              debug: the debug binaries the test suite already built, as they
#                              are, nothing built (the install test's: a `cargo build` after
#                              `cargo test` would compile every dependency again, as the two
#                              profiles' flags differ). `cargo test --workspace --no-run` makes
#                              them.
#   STAGEHAND_PACKAGE_OUT      where the artefacts go (default $CARGO_TARGET_DIR/package)
#   STAGEHAND_DEBIAN_SUITE     the suite of the clean root (default bookworm, what the project
#                              builds and tests on); STAGEHAND_DEBIAN_MIRROR its mirror
#   CARGO_TARGET_DIR           as for every build (default ~/.cache/stagehand/target)
#
# The build runs cargo with --locked --offline: it never touches the network. On a machine that
# has never built Stagehand, `cargo fetch --locked` once first.
#
# What ships: every binary a `[[bin]]` of services/*/Cargo.toml declares (the CLI and the six
# services). Binaries a crate keeps under src/bin/ (stagehand-mover-cp, stagehand-bus-testworker)
# and loadtest/'s are for tests and benchmarks and do not ship. services/cli/tests/package.rs
# installs the package on a clean root and runs it there (deploy/README.md, "Packages").
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

log() { printf 'package.sh: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# The binaries that ship: each `[[bin]]` name of services/*/Cargo.toml, or the package's name
# for a crate with a src/main.rs and no `[[bin]]`.
binaries() {
    local manifest
    for manifest in services/*/Cargo.toml; do
        awk -v main="$([ -f "$(dirname "$manifest")/src/main.rs" ] && echo 1)" '
             /^\[\[bin\]\]/ { section = "bin"; bins++; next }
             /^\[package\]/ { section = "package"; next }
             /^\[/         { section = ""; next }
             /^name *=/ && (section == "bin" || section == "package") {
                 name = $0; sub(/^name *= *"/, "", name); sub(/".*$/, "", name)
                 if (section == "bin") print name; else package = name
             }
             END { if (!bins && main && package != "") print package }' "$manifest"
    done | sort
}

workspace_version() {
    sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml
}

install_deps() {
    [ "$(id -u)" -eq 0 ] || die "install-deps needs root (apt-get)"
    if command -v debootstrap >/dev/null && command -v dpkg-shlibdeps >/dev/null; then
        return
    fi
    log "installing debootstrap and dpkg-dev (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        debootstrap dpkg-dev >/dev/null
}

# A minimal Debian root made by debootstrap, kept: the install test copies it and installs the
# package into the copy, so the kept root stays clean and a second run downloads nothing.
clean_root() {
    local dir="${1:?clean-root needs a folder}"
    local suite="${STAGEHAND_DEBIAN_SUITE:-bookworm}"
    local mirror="${STAGEHAND_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
    [ "$(id -u)" -eq 0 ] || die "clean-root needs root (debootstrap)"
    command -v debootstrap >/dev/null || die "no debootstrap: run \`deploy/package.sh install-deps\`"
    mkdir -p "$(dirname "$dir")"
    # One maker at a time; the others wait and find it made.
    exec 9>"$dir.lock"
    flock 9
    if [ -f "$dir/.stagehand-clean-root" ] && [ "$(cat "$dir/.stagehand-clean-root")" = "$suite" ]; then
        return
    fi
    rm -rf "$dir" "$dir.partial"
    log "making a clean $suite root in $dir (debootstrap, a few minutes, once)"
    if ! debootstrap --variant=minbase "$suite" "$dir.partial" "$mirror" >"$dir.log" 2>&1; then
        tail -n 20 "$dir.log" >&2
        die "debootstrap $suite failed (the whole log: $dir.log)"
    fi
    # Nothing downloaded stays in the root.
    rm -rf "$dir.partial"/var/cache/apt/archives/*.deb
    echo "$suite" >"$dir.partial/.stagehand-clean-root"
    mv "$dir.partial" "$dir"
}

# The runtime libraries the binaries link, as Debian package dependencies.
shlib_depends() {
    local work
    work="$(mktemp -d)"
    mkdir -p "$work/debian"
    printf 'Source: stagehand\n\nPackage: stagehand\nArchitecture: any\n' >"$work/debian/control"
    (cd "$work" && dpkg-shlibdeps -O "$@" 2>/dev/null) | sed -n 's/^shlibs:Depends=//p'
    rm -rf "$work"
}

build() {
    local profile="${STAGEHAND_PACKAGE_PROFILE:-release}"
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/stagehand/target}"
    local out="${STAGEHAND_PACKAGE_OUT:-$CARGO_TARGET_DIR/package}"
    local version arch bin_dir
    version="$(workspace_version)"
    [ -n "$version" ] || die "no [workspace.package] version in Cargo.toml"
    command -v dpkg-deb >/dev/null || die "no dpkg-deb: run on Debian or Ubuntu"
    command -v dpkg-shlibdeps >/dev/null || die "no dpkg-shlibdeps: run \`deploy/package.sh install-deps\`"
    arch="$(dpkg --print-architecture)"
    local bins=()
    mapfile -t bins < <(binaries)
    [ "${#bins[@]}" -gt 0 ] || die "no [[bin]] in services/*/Cargo.toml"
    case "$profile" in
        release)
            bin_dir="$CARGO_TARGET_DIR/release"
            local args=()
            for bin in "${bins[@]}"; do args+=(--bin "$bin"); done
            log "building ${bins[*]} (release)"
            if ! cargo build --locked --offline --release --workspace "${args[@]}"; then
                die "cargo build failed (offline: on a machine that never built Stagehand, run \`cargo fetch --locked\` first)"
            fi
            ;;
        debug)
            bin_dir="$CARGO_TARGET_DIR/debug"
            for bin in "${bins[@]}"; do
                [ -x "$bin_dir/$bin" ] ||
                    die "$bin_dir/$bin is missing: the debug package takes the test suite's build (\`cargo test --workspace --no-run\`)"
            done
            ;;
        *) die "STAGEHAND_PACKAGE_PROFILE=$profile: release or debug" ;;
    esac

    local root="$out/root"
    rm -rf "$root"
    mkdir -p "$root/DEBIAN" "$root/usr/bin" "$root/lib/systemd/system" \
        "$root/etc/stagehand/policies" "$root/etc/stagehand/nats" \
        "$root/usr/share/doc/stagehand/runbooks" "$root/usr/share/doc/stagehand/examples" \
        "$root/usr/share/man/man1" "$root/usr/share/bash-completion/completions" \
        "$root/usr/share/zsh/vendor-completions" "$root/usr/share/fish/vendor_completions.d"

    for bin in "${bins[@]}"; do
        [ -x "$bin_dir/$bin" ] || die "$bin_dir/$bin was not built"
        # Symbols stay (a backtrace names its functions); the debug sections do not ship.
        objcopy --strip-debug "$bin_dir/$bin" "$root/usr/bin/$bin"
        chmod 0755 "$root/usr/bin/$bin"
    done

    # Man pages and completions from the CLI's own clap definition.
    local docs="$out/docs"
    rm -rf "$docs"
    "$root/usr/bin/stagehand" generate-docs --out "$docs" >/dev/null
    for page in "$docs"/man/man1/*.1; do
        gzip -9n <"$page" >"$root/usr/share/man/man1/$(basename "$page").gz"
    done
    install -m 0644 "$docs/completions/stagehand" "$root/usr/share/bash-completion/completions/stagehand"
    install -m 0644 "$docs/completions/_stagehand" "$root/usr/share/zsh/vendor-completions/_stagehand"
    install -m 0644 "$docs/completions/stagehand.fish" "$root/usr/share/fish/vendor_completions.d/stagehand.fish"

    install -m 0644 deploy/systemd/*.service deploy/systemd/*.timer "$root/lib/systemd/system/"
    install -m 0644 deploy/config/*.toml "$root/etc/stagehand/"
    install -m 0644 policies/*.toml "$root/etc/stagehand/policies/"
    # The production server configs (dev.conf is for `stagehand up` and the tests).
    install -m 0644 deploy/nats/accounts.conf deploy/nats/single.conf deploy/nats/cluster-*.conf \
        "$root/etc/stagehand/nats/"
    install -m 0644 runbooks/*.md "$root/usr/share/doc/stagehand/runbooks/"
    install -m 0644 README.md "$root/usr/share/doc/stagehand/README.md"
    install -m 0644 deploy/README.md "$root/usr/share/doc/stagehand/deploy.md"
    install -m 0644 policies/README.md "$root/usr/share/doc/stagehand/policies.md"
    install -m 0644 deploy/systemd/nats.env.example "$root/usr/share/doc/stagehand/examples/nats.env.example"
    printf 'Stagehand %s\nLicense: %s\n' "$version" \
        "$(sed -n '/^\[workspace.package\]/,/^\[/s/^license *= *"\(.*\)"/\1/p' Cargo.toml)" \
        >"$root/usr/share/doc/stagehand/copyright"

    local depends
    depends="$(shlib_depends "${bins[@]/#/$root/usr/bin/}")"
    [ -n "$depends" ] || die "dpkg-shlibdeps found no dependencies of the binaries"
    cat >"$root/DEBIAN/control" <<EOF
Package: stagehand
Version: $version
Architecture: $arch
Maintainer: Stagehand <stagehand@example.invalid>
Depends: $depends, passwd
Section: admin
Priority: optional
Homepage: $(sed -n '/^\[workspace.package\]/,/^\[/s/^repository *= *"\(.*\)"/\1/p' Cargo.toml)
Description: datasets between the storage tiers of a GPU cluster, with one catalogue
 Stagehand moves datasets, checkpoints and models between the storage tiers of a GPU
 cluster on NATS JetStream events and keeps the catalogue of where every version is.
 This package holds the stagehand CLI, the six services (ingest validator, catalogue
 recorder, resharder, promoter, demoter, backup copier), their systemd units, default
 configurations and policies under /etc/stagehand, and the runbooks.
EOF
    (cd "$root" && find etc -type f | sort | sed 's|^|/|') >"$root/DEBIAN/conffiles"
    # The units run as the system user stagehand; nothing is enabled or started: each service
    # needs its NATS user and TLS files first (deploy/README.md).
    cat >"$root/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
    if ! getent passwd stagehand >/dev/null; then
        useradd --system --user-group --home-dir /var/lib/stagehand --no-create-home \
            --shell /usr/sbin/nologin stagehand
    fi
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload >/dev/null || true
    fi
fi
EOF
    cat >"$root/DEBIAN/postrm" <<'EOF'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null || true
fi
EOF
    chmod 0755 "$root/DEBIAN/postinst" "$root/DEBIAN/postrm"

    # The same bytes from the same commit: file times are the commit's.
    local epoch
    epoch="$(git log -1 --format=%ct 2>/dev/null || date +%s)"
    find "$root" -exec touch -h -d "@$epoch" {} +

    local deb="$out/stagehand_${version}_${arch}.deb"
    local tarball="$out/stagehand-${version}-$(uname -m)-linux.tar.gz"
    local level=9
    # A debug package is for the install test: fast over small.
    [ "$profile" = release ] || level=1
    SOURCE_DATE_EPOCH="$epoch" dpkg-deb --root-owner-group -Zgzip -z"$level" --build "$root" "$deb" >/dev/null
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$epoch" \
        -C "$root" --exclude=./DEBIAN -cf - . | gzip -"$level"n >"$tarball"
    echo "$deb"
    echo "$tarball"
}

case "${1:-build}" in
    build) build ;;
    binaries) binaries ;;
    install-deps) install_deps ;;
    clean-root) clean_root "${2:-}" ;;
    *) die "usage: deploy/package.sh [build|binaries|install-deps|clean-root DIR]" ;;
esac
