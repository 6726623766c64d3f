"""The Python producer's validated request is catalogued: the catalogue recorder lists the
dataset's version under the digest Python computed, with Python's file count, bytes and files,
and the request that made it.

Run by schemas/examples/python/test_ingest_roundtrip.py (through deploy/py-tests.sh, which
starts the real stagehand-catalogue-recorder) after the dataset.validated fact has been seen.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "schemas/examples/python"))
import catalogue_client  # noqa: E402
import produce_ingest  # noqa: E402

TIMEOUT = float(os.environ.get("PY_TEST_TIMEOUT", "60"))


def services_alive() -> None:
    for pid in os.environ.get("PY_TEST_PIDS", "").split():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            raise AssertionError(f"service process {pid} has exited; see its log") from None


async def check(nc, js, request: dict, fact: dict) -> None:
    project = request["project"]
    dataset = request["payload"]["dataset"]
    files = request["payload"]["files"]
    # Computed here, from the manifest Python sent, not taken from the validator's fact.
    digest = produce_ingest.version_digest(files)
    assert fact["payload"]["version"] == digest, "the validator agrees with Python's digest"

    def is_version(answer: dict) -> bool:
        return answer.get("answer") == "version"

    # A prefix of the digest names the version.
    answer = await catalogue_client.poll(
        nc,
        {"query": "version", "project": project, "dataset": dataset, "version": digest[:12]},
        is_version,
        timeout=TIMEOUT,
        what=f"version {digest[:12]} of {project}/{dataset}",
        alive=services_alive,
    )
    version = answer["version"]
    assert version["version"] == digest, version
    assert version["file_count"] == len(files), (version["file_count"], len(files))
    assert version["total_bytes"] == sum(f["size"] for f in files), version["total_bytes"]
    assert version["request_count"] == 1, version
    assert version["provenance"]["request_id"] == request["id"], version["provenance"]
    assert version["provenance"]["by"] == request["payload"]["requested_by"], version["provenance"]
    assert version["provenance"]["at"].endswith("Z"), "times are RFC 3339 in UTC"
    assert any(r["tier"] == "source" and r["state"] == "present" for r in answer["replicas"]), answer["replicas"]

    # The version's files are the manifest Python hashed, path for path, in manifest order,
    # read page by page.
    got = await catalogue_client.all_files(
        nc, {"project": project, "dataset": dataset, "version": digest}, page=2
    )
    want = sorted(files, key=lambda f: f["path"].encode())
    assert [(f["path"], f["size"], f["sha256"]) for f in got] == [
        (f["path"], f["size"], f["sha256"]) for f in want
    ], (got, want)
    one = await catalogue_client.ask(
        nc, {"query": "file", "project": project, "dataset": dataset, "version": digest, "path": want[0]["path"]}
    )
    assert one.get("answer") == "file" and one["file"]["sha256"] == want[0]["sha256"], one

    # The dataset counts it, and the dataset list shows it.
    detail = await catalogue_client.ask(nc, {"query": "dataset", "project": project, "dataset": dataset})
    assert detail["dataset"]["version_count"] == 1, detail["dataset"]
    assert [v["version"] for v in detail["versions"]] == [digest], detail["versions"]
    listing = await catalogue_client.ask(nc, {"query": "datasets", "project": project})
    assert listing.get("answer") == "datasets", listing
    assert [d for d in listing["datasets"] if d["dataset"] == dataset and d["version_count"] == 1], listing
