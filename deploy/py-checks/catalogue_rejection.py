"""The damaged upload from Python shows in the catalogue as a rejection of its dataset, with
the `checksum_mismatch` reason naming the file, and no version is recorded for it.

Run by schemas/examples/python/test_ingest_roundtrip.py (through deploy/py-tests.sh, which
starts the real stagehand-catalogue-recorder) after the dataset.rejected fact has been seen.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "schemas/examples/python"))
import catalogue_client  # noqa: E402
import produce_ingest  # noqa: E402

# Get the damaged request and its dataset.rejected fact.
AFTER = "rejected"
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
    declared = produce_ingest.version_digest(request["payload"]["files"])

    def is_rejection(answer: dict) -> bool:
        return answer.get("answer") == "rejection"

    answer = await catalogue_client.poll(
        nc,
        {"query": "rejection", "project": project, "dataset": dataset, "request_id": request["id"]},
        is_rejection,
        timeout=TIMEOUT,
        what=f"the rejection of request {request['id']} ({project}/{dataset})",
        alive=services_alive,
    )
    rejection = answer["rejection"]
    assert rejection["request_id"] == request["id"], rejection
    problems = [(p["code"], p.get("path")) for p in rejection["problems"]]
    assert problems == [("checksum_mismatch", "a.bin")], problems
    assert rejection["problems"][0]["detail"], "the reason says what is wrong"
    assert rejection["problem_counts"] == [["checksum_mismatch", 1]], rejection["problem_counts"]
    assert rejection["problems_total"] == 1, rejection["problems_total"]
    assert rejection["declared_version"] == declared, (rejection["declared_version"], declared)
    assert rejection["requested_by"] == request["payload"]["requested_by"], rejection
    assert rejection["quarantine"] == fact["payload"]["quarantine"], (rejection["quarantine"], fact["payload"])
    assert rejection["stamp"]["at"].endswith("Z"), "times are RFC 3339 in UTC"

    detail = await catalogue_client.ask(nc, {"query": "dataset", "project": project, "dataset": dataset})
    assert detail.get("answer") == "dataset", detail
    assert detail["dataset"]["rejection_count"] >= 1, detail["dataset"]
    assert any(r["request_id"] == request["id"] for r in detail["rejections"]), detail["rejections"]
    assert detail["versions"] == [] and detail["dataset"]["version_count"] == 0, "a rejected upload is no version"
