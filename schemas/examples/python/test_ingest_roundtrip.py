#!/usr/bin/env python3
"""End-to-end test of the Python producer against the real Stagehand services.

Run by deploy/py-tests.sh, which starts nats-server and the services and sets:
  PY_TEST_NATS_URL   the server to use
  PY_TEST_TIER_ROOT  root folder of the posix source tier named "source" in the policies
  PY_TEST_WORK       a scratch folder
  PY_TEST_CHECKS_DIR optional folder of extra checks (see below)
  PY_TEST_PIDS       optional space-separated pids of the services, to fail fast if one dies

Each test publishes with produce_ingest.py and asserts, by consuming the facts stream with
nats-py, what the services published: a small upload (manifest inline) validated, a damaged
one rejected, a large one (manifest by reference in the project's upload bucket) validated and
catalogued with every file, an inline manifest over the bound refused before anything is
published. It ends with the line "N passed, M failed".

Extra checks: every ``*.py`` file in PY_TEST_CHECKS_DIR defining
``async def check(nc, js, request: dict, fact: dict) -> None`` is run after the tests above,
as one more test each; it raises AssertionError to fail. ``request`` and ``fact`` are the
validated request of the first test and its ``dataset.validated`` fact; a check module that
sets ``AFTER = "rejected"`` gets the damaged request of the second test and its
``dataset.rejected`` fact instead. A check whose test did not produce its fact fails without
running. This is where checks of later services (the catalogue) plug in, alongside the
services deploy/py-tests.sh starts for them.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

import msgpack
import nats
from nats.js.api import DeliverPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import catalogue_client  # noqa: E402
import produce_ingest as producer  # noqa: E402

FACTS_STREAM = "STAGEHAND_FACTS"
REQUESTS_STREAM = "STAGEHAND_REQUESTS"
VALIDATOR = "ingest-validator"
TIMEOUT = float(os.environ.get("PY_TEST_TIMEOUT", "60"))


def services_alive() -> None:
    for pid in os.environ.get("PY_TEST_PIDS", "").split():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            raise AssertionError(f"service process {pid} has exited; see its log") from None


async def wait_ready(js) -> None:
    """Waits until the validator has provisioned the streams and its consumer."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        services_alive()
        try:
            await js.consumer_info(REQUESTS_STREAM, VALIDATOR)
            return
        except Exception as e:  # not there yet: stream or consumer missing
            if time.monotonic() > deadline:
                raise AssertionError(f"the validator's consumer did not appear within {TIMEOUT}s: {e}")
        await asyncio.sleep(0.1)


async def wait_fact(js, request_id: str) -> dict:
    """Reads the facts stream from its start until a fact caused by ``request_id`` appears."""
    sub = await js.subscribe("stagehand.fact.>", ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    deadline = time.monotonic() + TIMEOUT
    try:
        while True:
            services_alive()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no fact caused by request {request_id} within {TIMEOUT}s")
            try:
                msg = await sub.next_msg(timeout=min(remaining, 1.0))
            except nats.errors.TimeoutError:
                continue
            fact = msgpack.unpackb(msg.data, raw=False)
            if fact.get("causation_id") == request_id:
                fact["_subject"] = msg.subject
                fact["_msg_id"] = (msg.headers or {}).get("Nats-Msg-Id")
                return fact
    finally:
        await sub.unsubscribe()


def make_folder(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


async def produce(folder: Path, dataset: str, prefix: str) -> dict:
    args = producer.parse_args(
        [
            str(folder),
            "--tier-root", os.environ["PY_TEST_TIER_ROOT"],
            "--project", "lab-py",
            "--dataset", dataset,
            "--prefix", prefix,
            "--requested-by", "py-producer",
            "--label", "source=python",
            "--nats-url", os.environ["PY_TEST_NATS_URL"],
        ]
    )
    return await producer.produce(args)


async def test_python_request_is_validated(ctx) -> None:
    work = Path(os.environ["PY_TEST_WORK"])
    folder = make_folder(
        work / "upload-good",
        {"train/0001.bin": os.urandom(4096), "train/0002.bin": b"", "labels.csv": b"id,label\n1,cat\n"},
    )
    request = await produce(folder, "py-cats", f"lab-py/py/good-{os.getpid()}")
    files = list(producer.hash_folder(folder))
    assert request["schema"] == 2 and "files" in request["payload"], "a small manifest travels inline"
    expected_version = hashlib.sha256(
        "".join(f"{f['path']}\t{f['size']}\t{f['sha256']}\n" for f in sorted(files, key=lambda f: f["path"].encode())).encode()
    ).hexdigest()

    fact = await wait_fact(ctx["js"], request["id"])
    assert fact["kind"] == "dataset.validated", f"expected dataset.validated, got {fact['kind']}: {fact['payload']}"
    assert fact["_subject"] == "stagehand.fact.dataset.validated.lab-py", fact["_subject"]
    assert fact["id"] == producer.fact_id(request["project"], request["id"], "validated"), "fact id follows the id rules"
    assert fact["_msg_id"] == producer.msg_id_for(fact["_subject"], fact["id"]), "Nats-Msg-Id is the fact id scoped by its subject"
    payload = fact["payload"]
    assert payload["version"] == expected_version, (payload["version"], expected_version)
    assert payload["request_id"] == request["id"]
    assert payload["total_bytes"] == sum(f["size"] for f in files)
    assert payload["labels"] == [["source", "python"]]
    assert sorted(f["path"] for f in payload["files"]) == sorted(f["path"] for f in files)
    ctx["validated"] = (request, fact)


async def test_python_request_with_corrupt_file_is_rejected(ctx) -> None:
    work = Path(os.environ["PY_TEST_WORK"])
    folder = make_folder(work / "upload-bad", {"a.bin": b"original bytes", "b.bin": b"fine"})
    prefix = f"lab-py/py/bad-{os.getpid()}"
    files = list(producer.hash_folder(folder))
    manifest = producer.Manifest.build(files)
    request = producer.build_event(
        project="lab-py", dataset="py-dogs", tier="source", prefix=prefix, manifest=manifest, requested_by="py-producer"
    )
    manifest.remove()
    tier_root = Path(os.environ["PY_TEST_TIER_ROOT"])
    producer.place_files(folder, files, tier_root, prefix)
    # The bytes on the tier differ from the manifest (damaged after hashing): the validator
    # must notice.
    (tier_root / prefix / "a.bin").write_bytes(b"tampered bytes")
    await producer.publish(ctx["js"], request)

    fact = await wait_fact(ctx["js"], request["id"])
    assert fact["kind"] == "dataset.rejected", f"expected dataset.rejected, got {fact['kind']}"
    problems = [(p["code"], p.get("path")) for p in fact["payload"]["problems"]]
    assert problems == [("checksum_mismatch", "a.bin")], problems
    assert fact["payload"]["quarantine"], "a rejected upload is marked"
    assert (Path(os.environ["PY_TEST_TIER_ROOT"]) / prefix / "a.bin").exists(), "never deleted"
    ctx["rejected"] = (request, fact)


def test_an_inline_manifest_over_the_bound_is_refused(ctx) -> None:
    """Issue 7: the producer refuses to inline a manifest over INLINE_MANIFEST_MAX_BYTES."""
    entries = [
        {"path": f"frames/{i:08}.jpg", "size": 1000, "sha256": hashlib.sha256(str(i).encode()).hexdigest()}
        for i in range(3000)
    ]
    manifest = producer.Manifest.build(entries)
    try:
        assert not manifest.fits_inline(), manifest.length
        try:
            producer.build_event(
                project="lab-py", dataset="py-big", tier="source", prefix="lab-py/x",
                manifest=manifest, requested_by="py-producer", inline="always",
            )
        except producer.ProducerError as e:
            assert str(e).startswith("refused: an inline manifest of 3000 files"), str(e)
            assert str(producer.INLINE_MANIFEST_MAX_BYTES) in str(e), str(e)
        else:
            raise AssertionError("an inline manifest over the bound was built")
        # The same manifest by reference is a small event.
        event = producer.build_event(
            project="lab-py", dataset="py-big", tier="source", prefix="lab-py/x",
            manifest=manifest, requested_by="py-producer",
        )
        assert "files" not in event["payload"] and event["payload"]["manifest"]["files"] == 3000
        assert len(producer.encode(event)) < 1024
        assert manifest.digest == producer.version_digest(entries)
    finally:
        manifest.remove()


async def test_python_request_by_reference_is_validated_and_catalogued(ctx) -> None:
    """Issue 7: a manifest too large to travel inline is put into the project's upload bucket
    with nats-py's Object Store, and the request that references it is validated and
    catalogued with every file."""
    work = Path(os.environ["PY_TEST_WORK"])
    folder = make_folder(work / "upload-big", {f"frames/{i:05}.jpg": f"frame {i}\n".encode() for i in range(4000)})
    request = await produce(folder, "py-frames", f"lab-py/py/big-{os.getpid()}")
    files = list(producer.hash_folder(folder))
    version = producer.version_digest(files)
    assert "files" not in request["payload"], "4,000 entries do not travel inline"
    assert request["payload"]["manifest"] == {
        "digest": version, "files": 4000, "bytes": sum(f["size"] for f in files),
    }, request["payload"]["manifest"]
    store = await ctx["js"].object_store(producer.upload_bucket("lab-py"))
    info = await store.get_info(version)
    assert info.size > producer.INLINE_MANIFEST_MAX_BYTES, info.size

    fact = await wait_fact(ctx["js"], request["id"])
    assert fact["kind"] == "dataset.validated", f"expected dataset.validated, got {fact['kind']}: {fact['payload']}"
    assert fact["payload"]["version"] == version
    assert fact["payload"]["manifest"]["files"] == 4000, fact["payload"]

    answer = await catalogue_client.poll(
        ctx["nc"],
        {"query": "version", "project": "lab-py", "dataset": "py-frames", "version": version},
        lambda a: a.get("answer") == "version",
        timeout=TIMEOUT,
        what=f"version {version[:12]} of lab-py/py-frames",
        alive=services_alive,
    )
    assert answer["version"]["file_count"] == 4000, answer["version"]
    listed = await catalogue_client.all_files(
        ctx["nc"], {"query": "files", "project": "lab-py", "dataset": "py-frames", "version": version}
    )
    assert [f["path"] for f in listed] == sorted(f["path"] for f in files), "every file, in path order"


async def test_republishing_is_a_duplicate(ctx) -> None:
    request, _ = ctx["validated"]
    # Other requests of the project came since: an uploader, which may read only the last
    # request on its subject, cannot prove the stored one its own and stores it once more
    # (the validator answers that copy from its record). Published again now, the last
    # request on the subject is this one: a proven duplicate, dropped by the window.
    first = await producer.publish(ctx["js"], request)
    again = await producer.publish(ctx["js"], request)
    assert again.duplicate, "the same request id is dropped by JetStream's duplicate window"
    assert again.seq == first.seq, (first, again)


def load_checks() -> list:
    folder = os.environ.get("PY_TEST_CHECKS_DIR")
    if not folder or not Path(folder).is_dir():
        return []
    checks = []
    for path in sorted(Path(folder).glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"stagehand_check_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, "check"):
            raise SystemExit(f"{path}: defines no `async def check(nc, js, request, fact)`")
        after = getattr(module, "AFTER", "validated")
        if after not in ("validated", "rejected"):
            raise SystemExit(f"{path}: AFTER must be \"validated\" or \"rejected\", not {after!r}")

        async def run(ctx, module=module, after=after):
            request, fact = ctx[after]
            await module.check(ctx["nc"], ctx["js"], request, fact)

        run.__name__ = f"check {path.name}"
        run.needs = after
        checks.append(run)
    return checks


async def main() -> int:
    nc = await nats.connect(os.environ["PY_TEST_NATS_URL"], connect_timeout=10)
    ctx = {"nc": nc, "js": nc.jetstream()}
    passed = failed = 0
    try:
        await wait_ready(ctx["js"])
        tests = [
            test_python_request_is_validated,
            test_python_request_with_corrupt_file_is_rejected,
            test_an_inline_manifest_over_the_bound_is_refused,
            test_python_request_by_reference_is_validated_and_catalogued,
            test_republishing_is_a_duplicate,
        ] + load_checks()
        for test in tests:
            name = test.__name__
            needs = getattr(test, "needs", "validated" if test is test_republishing_is_a_duplicate else None)
            if needs is not None and needs not in ctx:
                print(f"FAIL {name}: needs the {needs} request of an earlier test")
                failed += 1
                continue
            try:
                result = test(ctx)
                if asyncio.iscoroutine(result):
                    await result
                print(f"ok   {name}")
                passed += 1
            except Exception:
                print(f"FAIL {name}")
                traceback.print_exc()
                failed += 1
    finally:
        await nc.close()
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
