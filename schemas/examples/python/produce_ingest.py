#!/usr/bin/env python3
"""Stagehand ingest producer in Python: a lab uploader that does not use Rust.

It follows the contract in schemas/ exactly, as any producer outside this repository would:

1. walks FOLDER and hashes every regular file (SHA-256, streamed), writing the manifest's
   canonical lines (``path\\tsize\\tsha256\\n``, sorted by the UTF-8 bytes of the path) through
   an external merge sort into a spool file: memory stays bounded whatever the file count;
2. places the files beneath ``<tier root>/<prefix>`` on a posix source tier (a temp file in
   the destination folder, fsynced, then renamed into place: never a partial file under its
   real name);
3. carries the manifest inline only when its canonical bytes fit the contract's bound
   (``INLINE_MANIFEST_MAX_BYTES``, 256 KiB); otherwise puts it into the project's upload
   bucket ``stagehand_uploads_<project>`` with nats-py's Object Store, named by its SHA-256
   (which is the version digest), and sends the reference ``{digest, files, bytes}``. An inline
   manifest over the bound is refused here, before anything is published;
4. publishes one ``ingest.requested`` event (schema 2) to JetStream: a MessagePack map with
   field names, the envelope fields (id, schema, occurred_at, project, correlation_id,
   causation_id, kind, payload), on subject ``stagehand.req.ingest.requested.<project>``,
   with the ``Nats-Msg-Id`` header set to ``<subject>:<event id>`` (the id scoped by the
   subject, as the contract asks), and waits for the PubAck. A PubAck that says
   ``duplicate`` is believed only when the last request on the project's subject is this one;
   otherwise another message holds the id, and the request is published again under a
   message id nobody can predict.

The request id is derived from (project, dataset, version digest) as
``EventId::for_ingest`` does, so running the same upload twice is the same request and
JetStream drops the copy.

Usage:
    produce_ingest.py FOLDER --tier-root DIR --project P --dataset D
                      [--tier source] [--prefix PREFIX] [--requested-by NAME]
                      [--inline auto|always|never] [--label key=value]... [--nats-url URL]

Needs nats-py and msgpack (deploy/requirements.txt pins both).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import getpass
import hashlib
import heapq
import os
import re
import shutil
import struct
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Iterable, Iterator

SCHEMA_VERSION = 2
KIND = "ingest.requested"
MAX_EVENT_BYTES = 512 * 1024
INLINE_MANIFEST_MAX_BYTES = 256 * 1024
# Lines sorted in memory before a run is spilled to the spool (about 300,000 entries).
RUN_BYTES = 32 * 1024 * 1024
# How long an upload bucket keeps a manifest: the requests stream's retention (30 days).
UPLOAD_MAX_AGE_SECONDS = 30 * 24 * 3600
_PROJECT_RE = re.compile(r"^[a-z0-9_-]{1,64}$")
_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class ProducerError(Exception):
    """Bad input, said with what and where."""


def subject_for(project: str) -> str:
    """The request subject (schemas/src/subject.rs): stagehand.req.<kind>.<project>."""
    return f"stagehand.req.{KIND}.{project}"


def upload_bucket(project: str) -> str:
    """The project's upload bucket (schemas/src/subject.rs, upload_manifest_bucket)."""
    return f"stagehand_uploads_{project}"


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


def walk_folder(folder: Path) -> Iterator[tuple[str, Path]]:
    """Every regular file beneath ``folder`` as (relative path, full path), one at a time.

    Symlinks and special files are refused: the validator would refuse them too, and a link
    could point anywhere.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ProducerError(f"{folder} is not a folder")
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
            yield rel, full


def hash_folder(folder: Path) -> Iterator[dict]:
    """Every regular file beneath ``folder`` as a file reference {path, size, sha256}."""
    for rel, full in walk_folder(folder):
        yield {"path": rel, "size": full.stat().st_size, "sha256": sha256_file(full)}


def manifest_line(f: dict) -> bytes:
    return f"{f['path']}\t{f['size']}\t{f['sha256']}\n".encode()


def _path_of(line: bytes) -> bytes:
    return line.split(b"\t", 1)[0]


class Manifest:
    """A canonical manifest spooled to a file: its lines sorted by path bytes (ties keep the
    order they came in, as the Rust builder does), their SHA-256 (the version digest), entry
    count, byte total and length. Built from entries in any order in bounded memory."""

    def __init__(self, spool: Path, digest: str, files: int, total: int, length: int):
        self.spool = spool
        self.digest = digest
        self.files = files
        self.bytes = total
        self.length = length

    @classmethod
    def build(cls, entries: Iterable[dict], spool_dir: Path | None = None) -> "Manifest":
        spool_dir = Path(spool_dir or tempfile.gettempdir())
        runs: list[Path] = []
        lines: list[bytes] = []
        held = 0

        def spill() -> None:
            nonlocal lines, held
            if not lines:
                return
            lines.sort(key=_path_of)  # stable: ties keep their order
            fd, name = tempfile.mkstemp(prefix="stagehand-manifest-run-", dir=spool_dir)
            with os.fdopen(fd, "wb") as out:
                out.writelines(lines)
            runs.append(Path(name))
            lines, held = [], 0

        for f in entries:
            line = manifest_line(f)
            if b"\n" in line[:-1] or line.count(b"\t") != 2:
                raise ProducerError(f"manifest entry {f['path']!r} cannot be a manifest line")
            lines.append(line)
            held += len(line)
            if held >= RUN_BYTES:
                spill()
        spill()
        fd, name = tempfile.mkstemp(prefix="stagehand-manifest-", dir=spool_dir)
        digest = hashlib.sha256()
        files = total = length = 0
        readers = [open(run, "rb") for run in runs]
        try:
            with os.fdopen(fd, "wb") as out:
                # heapq.merge is stable across its inputs, which are in push order.
                for line in heapq.merge(*readers, key=_path_of):
                    out.write(line)
                    digest.update(line)
                    files += 1
                    total += int(line.split(b"\t")[1])
                    length += len(line)
                out.flush()
                os.fsync(out.fileno())
        finally:
            for reader in readers:
                reader.close()
            for run in runs:
                run.unlink()
        return cls(Path(name), digest.hexdigest(), files, total, length)

    def entries(self) -> Iterator[dict]:
        with open(self.spool, "rb") as f:
            for line in f:
                path, size, sha = line.rstrip(b"\n").decode().split("\t")
                yield {"path": path, "size": int(size), "sha256": sha}

    def fits_inline(self) -> bool:
        return self.length <= INLINE_MANIFEST_MAX_BYTES

    def reference(self) -> dict:
        return {"digest": self.digest, "files": self.files, "bytes": self.bytes}

    def remove(self) -> None:
        self.spool.unlink(missing_ok=True)


def version_digest(files: Iterable[dict]) -> str:
    """The version digest of schemas/src/manifest.rs: SHA-256 over the manifest lines
    ``path\\tsize\\tsha256\\n`` sorted by the UTF-8 bytes of the path."""
    digest = hashlib.sha256()
    for f in sorted(files, key=lambda f: f["path"].encode()):
        digest.update(manifest_line(f))
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


def ingest_id(project: str, dataset: str, version: str) -> str:
    """``EventId::for_ingest``: the same upload of the same bytes is the same request."""
    return content_id(project.encode(), dataset.encode(), version.encode())


def now_rfc3339() -> str:
    """UTC now in RFC 3339 with microseconds, as the Rust side writes it."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def place_files(folder: Path, files: Iterable[dict], tier_root: Path, prefix: str) -> None:
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


def inline_files(manifest: Manifest) -> list[dict]:
    """The manifest's entries for an inline request; refused over the contract's bound."""
    if not manifest.fits_inline():
        raise ProducerError(
            f"refused: an inline manifest of {manifest.files} files is {manifest.length} bytes of "
            f"manifest lines, over the contract's inline bound of {INLINE_MANIFEST_MAX_BYTES} bytes "
            "(INLINE_MANIFEST_MAX_BYTES); put it into the project's upload bucket and send a reference"
        )
    return list(manifest.entries())


def build_event(
    *,
    project: str,
    dataset: str,
    tier: str,
    prefix: str,
    manifest: Manifest,
    requested_by: str,
    labels: Iterable[tuple[str, str]] = (),
    inline: str = "auto",
    request_id: str | None = None,
) -> dict:
    """The ``ingest.requested`` event as a dict of the wire's field names. ``inline`` is
    ``auto`` (inline when the manifest fits the bound), ``always`` (refused over it) or
    ``never`` (a reference; the manifest must be put into the upload bucket)."""
    if not _PROJECT_RE.match(project):
        raise ProducerError(f"project {project!r} must be 1-64 characters of [a-z0-9_-]")
    if prefix:
        check_relative_path(prefix)
    if inline not in ("auto", "always", "never"):
        raise ProducerError(f"inline must be auto, always or never, not {inline!r}")
    if request_id is None:
        request_id = ingest_id(project, dataset, manifest.digest)
    if not _ID_RE.match(request_id):
        raise ProducerError(f"request id {request_id!r} must be 1-128 characters of [A-Za-z0-9._:-]")
    payload = {
        "dataset": dataset,
        "source": {"tier": tier, "prefix": prefix},
        "requested_by": requested_by,
        "labels": [[k, v] for k, v in labels],
    }
    if inline == "always" or (inline == "auto" and manifest.fits_inline()):
        payload["files"] = inline_files(manifest)
    else:
        payload["manifest"] = manifest.reference()
    return {
        "id": request_id,
        "schema": SCHEMA_VERSION,
        "occurred_at": now_rfc3339(),
        "project": project,
        "correlation_id": request_id,
        "causation_id": None,
        "kind": KIND,
        "payload": payload,
    }


def encode(event: dict) -> bytes:
    import msgpack

    data = msgpack.packb(event, use_bin_type=True)
    if len(data) > MAX_EVENT_BYTES:
        raise ProducerError(
            f"the request is {len(data)} bytes, over the event bound of {MAX_EVENT_BYTES}; "
            "send the manifest by reference"
        )
    return data


async def upload_manifest(js, project: str, manifest: Manifest) -> None:
    """Puts the manifest into the project's upload bucket under its digest, creating the
    bucket when it is missing (and this user may). An object of that name whose recorded
    SHA-256 is the digest holds the same bytes already and is left as it is."""
    import base64

    from nats.js.api import ObjectStoreConfig
    from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError

    bucket = upload_bucket(project)
    try:
        store = await js.object_store(bucket)
    except BucketNotFoundError:
        store = await js.create_object_store(
            bucket,
            config=ObjectStoreConfig(
                description="Stagehand: manifests uploaders put for their ingest requests, by declared digest",
                ttl=UPLOAD_MAX_AGE_SECONDS,
            ),
        )
    want = "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(manifest.digest)).decode()
    try:
        info = await store.get_info(manifest.digest)
        if not info.deleted and info.digest and info.digest.rstrip("=") == want.rstrip("="):
            return
    except (NotFoundError, ObjectNotFoundError):
        pass
    with open(manifest.spool, "rb") as f:
        info = await store.put(manifest.digest, f)
    if info.digest.rstrip("=") != want.rstrip("="):
        raise ProducerError(f"the object store recorded {info.digest} for manifest {manifest.digest}")


def msg_id_for(subject: str, event_id: str) -> str:
    """The Nats-Msg-Id of an event on a subject: the id scoped by the subject (schemas/README.md)."""
    return f"{subject}:{event_id}"


async def publish(js, event: dict):
    """Publishes on the request subject under the scoped message id; returns the PubAck.

    A duplicate PubAck names the stored message's sequence: it is this request only when the
    last message on the project's request subject is at that sequence (or later, a copy stored
    before) and carries this event id. Anything else is another message holding the id, so the
    request is published again under an unpredictable message id: consumers handle each
    (subject, id) once, so a second copy costs nothing, a lost request would."""
    import msgpack

    subject = subject_for(event["project"])
    msg_id = msg_id_for(subject, event["id"])
    data = encode(event)
    ack = await js.publish(subject, data, headers={"Nats-Msg-Id": msg_id}, timeout=10)
    if not ack.duplicate:
        return ack
    try:
        last = await js.get_last_msg(ack.stream, subject, direct=True)
        if msgpack.unpackb(last.data, raw=False).get("id") == event["id"]:
            ack.seq = last.seq  # where this request is stored
            return ack
    except Exception:  # noqa: BLE001 - unreadable is unproven
        pass
    fresh = f"{msg_id}.{uuid.uuid4().hex}"
    return await js.publish(subject, data, headers={"Nats-Msg-Id": fresh}, timeout=10)


async def produce(args) -> dict:
    import nats

    labels = []
    for label in args.label:
        if "=" not in label:
            raise ProducerError(f"label {label!r} must be key=value")
        labels.append(tuple(label.split("=", 1)))
    manifest = Manifest.build(hash_folder(Path(args.folder)))
    try:
        if manifest.files == 0:
            raise ProducerError(f"{args.folder} holds no files to ingest")
        prefix = args.prefix if args.prefix is not None else f"{args.project}/{args.dataset}/{manifest.digest[:16]}"
        event = build_event(
            project=args.project,
            dataset=args.dataset,
            tier=args.tier,
            prefix=prefix,
            manifest=manifest,
            requested_by=args.requested_by,
            labels=labels,
            inline=args.inline,
            request_id=args.request_id,
        )
        encode(event)
        place_files(Path(args.folder), manifest.entries(), Path(args.tier_root), prefix)
        nc = await nats.connect(args.nats_url, connect_timeout=10, max_reconnect_attempts=3)
        try:
            js = nc.jetstream()
            if "manifest" in event["payload"]:
                await upload_manifest(js, args.project, manifest)
            ack = await publish(js, event)
        finally:
            await nc.close()
    finally:
        manifest.remove()
    carried = "inline" if "files" in event["payload"] else f"by reference in {upload_bucket(args.project)}"
    print(
        f"request {event['id']}: {manifest.files} files, {manifest.bytes} bytes, "
        f"version {manifest.digest}, manifest {carried}"
    )
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
    p.add_argument("--inline", choices=["auto", "always", "never"], default="auto",
                   help="carry the manifest inline: when it fits the bound (auto), or refuse when it does not (always)")
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
