#!/usr/bin/env python3
"""Stagehand ingest producer in Python: a lab uploader that does not use Rust.

It follows the contract in schemas/ exactly, as any producer outside this repository would:

1. walks FOLDER and hashes every regular file (SHA-256, streamed);
2. places the files beneath ``<tier root>/<prefix>`` on a posix source tier (a temp file in
   the destination folder, fsynced, then renamed into place: never a partial file under its
   real name);
3. publishes one ``ingest.requested`` event to JetStream: a MessagePack map with field names,
   the envelope fields (id, schema, occurred_at, project, correlation_id, causation_id, kind,
   payload), on subject ``stagehand.req.ingest.requested.<project>``, with the ``Nats-Msg-Id``
   header set to the event id, and waits for the PubAck.

The request id is derived from (project, dataset, version digest) as ``EventId::for_content``
does, so running the same upload twice is the same request and JetStream drops the copy.

Usage:
    produce_ingest.py FOLDER --tier-root DIR --project P --dataset D
                      [--tier source] [--prefix PREFIX] [--requested-by NAME]
                      [--label key=value]... [--nats-url URL]

Needs nats-py and msgpack (deploy/requirements.txt pins both).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import getpass
import hashlib
import os
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path

SCHEMA_VERSION = 1
KIND = "ingest.requested"
MAX_EVENT_BYTES = 8 * 1024 * 1024
_PROJECT_RE = re.compile(r"^[a-z0-9_-]{1,64}$")
_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class ProducerError(Exception):
    """Bad input, said with what and where."""


def subject_for(project: str) -> str:
    """The request subject (schemas/src/subject.rs): stagehand.req.<kind>.<project>."""
    return f"stagehand.req.{KIND}.{project}"


def check_relative_path(path: str) -> None:
    """The path rules of schemas/src/path.rs: relative, normalised, plain components."""
    if not path:
        raise ProducerError("path is empty")
    if "\0" in path:
        raise ProducerError(f"path {path!r} contains a NUL byte")
    if path.startswith("/"):
        raise ProducerError(f"path {path!r} is absolute")
    if len(path.encode()) > 4096:
        raise ProducerError(f"path {path!r} is over 4096 bytes")
    if "\\" in path:
        raise ProducerError(f"path {path!r} contains a backslash")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in path):
        raise ProducerError(f"path {path!r} contains a control character")
    for component in path.split("/"):
        if component == "..":
            raise ProducerError(f"path {path!r} contains a `..` component")
        if component in ("", "."):
            raise ProducerError(f"path {path!r} is not normalised")
        if len(component.encode()) > 255:
            raise ProducerError(f"path {path!r} has a component over 255 bytes")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def hash_folder(folder: Path) -> list[dict]:
    """Every regular file beneath ``folder`` as a file reference {path, size, sha256}.

    Symlinks and special files are refused: the validator would refuse them too, and a link
    could point anywhere.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ProducerError(f"{folder} is not a folder")
    files = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]):
            full = Path(dirpath) / name
            rel = full.relative_to(folder).as_posix()
            if full.is_symlink():
                raise ProducerError(f"{full}: symlinks are not uploaded; copy the file itself")
            if not full.is_file():
                raise ProducerError(f"{full}: not a regular file")
            check_relative_path(rel)
            files.append({"path": rel, "size": full.stat().st_size, "sha256": sha256_file(full)})
    return files


def version_digest(files: list[dict]) -> str:
    """The version digest of schemas/src/manifest.rs: SHA-256 over the manifest lines
    ``path\\tsize\\tsha256\\n`` sorted by the UTF-8 bytes of the path."""
    digest = hashlib.sha256()
    for f in sorted(files, key=lambda f: f["path"].encode()):
        digest.update(f"{f['path']}\t{f['size']}\t{f['sha256']}\n".encode())
    return digest.hexdigest()


def content_id(*parts: bytes) -> str:
    """``EventId::for_content`` (schemas/src/id.rs): the first 16 bytes of
    SHA-256("stagehand/v1" || for each part: 0x00 || u64 big-endian length || part), as hex."""
    digest = hashlib.sha256(b"stagehand/v1")
    for part in parts:
        digest.update(b"\0")
        digest.update(struct.pack(">Q", len(part)))
        digest.update(part)
    return digest.hexdigest()[:32]


def fact_id(project: str, cause: str, step: str) -> str:
    """``EventId::for_fact``: the id of the fact that ``step`` of handling ``cause``, an event of
    ``project``, produces."""
    return content_id(b"fact", project.encode(), cause.encode(), step.encode())


def now_rfc3339() -> str:
    """UTC now in RFC 3339 with microseconds, as the Rust side writes it."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def place_files(folder: Path, files: list[dict], tier_root: Path, prefix: str) -> None:
    """Copies each file to ``<tier_root>/<prefix>/<path>``: temp file in the destination
    folder, fsync, rename. A destination already holding the same bytes is left as it is; one
    holding different bytes is an error (an upload never overwrites another)."""
    tier_root = Path(tier_root)
    if not tier_root.is_dir():
        raise ProducerError(f"tier root {tier_root} is not a folder")
    base = tier_root / prefix if prefix else tier_root
    for f in files:
        src = Path(folder) / f["path"]
        dst = base / f["path"]
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists():
            if dst.is_file() and not dst.is_symlink() and sha256_file(dst) == f["sha256"]:
                continue
            raise ProducerError(f"{dst} already exists with other content; choose another --prefix")
        fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
        try:
            with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
                shutil.copyfileobj(inp, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
            os.rename(tmp, dst)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        dir_fd = os.open(dst.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def build_event(
    *,
    project: str,
    dataset: str,
    tier: str,
    prefix: str,
    files: list[dict],
    requested_by: str,
    labels: list[tuple[str, str]] = (),
    request_id: str | None = None,
) -> dict:
    """The ``ingest.requested`` event as a dict of the wire's field names."""
    if not _PROJECT_RE.match(project):
        raise ProducerError(f"project {project!r} must be 1-64 characters of [a-z0-9_-]")
    if prefix:
        check_relative_path(prefix)
    if request_id is None:
        request_id = content_id(project.encode(), dataset.encode(), version_digest(files).encode())
    if not _ID_RE.match(request_id):
        raise ProducerError(f"request id {request_id!r} must be 1-128 characters of [A-Za-z0-9._:-]")
    return {
        "id": request_id,
        "schema": SCHEMA_VERSION,
        "occurred_at": now_rfc3339(),
        "project": project,
        "correlation_id": request_id,
        "causation_id": None,
        "kind": KIND,
        "payload": {
            "dataset": dataset,
            "source": {"tier": tier, "prefix": prefix},
            "files": [{"path": f["path"], "size": f["size"], "sha256": f["sha256"]} for f in files],
            "requested_by": requested_by,
            "labels": [[k, v] for k, v in labels],
        },
    }


def encode(event: dict) -> bytes:
    import msgpack

    data = msgpack.packb(event, use_bin_type=True)
    if len(data) > MAX_EVENT_BYTES:
        raise ProducerError(
            f"the request is {len(data)} bytes, over the limit of {MAX_EVENT_BYTES}; split the dataset"
        )
    return data


async def publish(js, event: dict):
    """Publishes on the request subject with Nats-Msg-Id = event id; returns the PubAck."""
    return await js.publish(
        subject_for(event["project"]),
        encode(event),
        headers={"Nats-Msg-Id": event["id"]},
        timeout=10,
    )


async def produce(args) -> dict:
    import nats

    files = hash_folder(Path(args.folder))
    version = version_digest(files)
    prefix = args.prefix if args.prefix is not None else f"{args.project}/{args.dataset}/{version[:16]}"
    labels = []
    for label in args.label:
        if "=" not in label:
            raise ProducerError(f"label {label!r} must be key=value")
        labels.append(tuple(label.split("=", 1)))
    event = build_event(
        project=args.project,
        dataset=args.dataset,
        tier=args.tier,
        prefix=prefix,
        files=files,
        requested_by=args.requested_by,
        labels=labels,
        request_id=args.request_id,
    )
    place_files(Path(args.folder), files, Path(args.tier_root), prefix)
    nc = await nats.connect(args.nats_url, connect_timeout=10, max_reconnect_attempts=3)
    try:
        ack = await publish(nc.jetstream(), event)
    finally:
        await nc.close()
    print(f"request {event['id']}: {len(files)} files, {sum(f['size'] for f in files)} bytes, version {version}")
    print(f"stored in {ack.stream} at sequence {ack.seq}{' (duplicate: already requested)' if ack.duplicate else ''}")
    return event


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="folder to upload")
    p.add_argument("--tier-root", required=True, help="root folder of the posix source tier")
    p.add_argument("--project", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--tier", default="source", help="source tier name in policies/tiers.toml")
    p.add_argument("--prefix", default=None, help="folder beneath the tier root, within <project>/ (default <project>/<dataset>/<version>)")
    p.add_argument("--requested-by", default=os.environ.get("USER") or getpass.getuser())
    p.add_argument("--request-id", default=None, help="default: derived from project, dataset and content")
    p.add_argument("--label", action="append", default=[], help="key=value, repeatable")
    p.add_argument("--nats-url", default=os.environ.get("STAGEHAND_NATS_URL", "nats://127.0.0.1:4222"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    try:
        asyncio.run(produce(parse_args(argv)))
    except ProducerError as e:
        print(f"produce_ingest: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
