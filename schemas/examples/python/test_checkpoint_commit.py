#!/usr/bin/env python3
"""End-to-end test of ``checkpoint_dcp.py`` against the real ``stagehand`` binary, nats-server
and catalogue recorder.

Run by deploy/py-tests.sh, which sets:
  PY_TEST_NATS_URL   the server to use
  PY_TEST_STAGEHAND  the stagehand binary
  PY_TEST_POLICIES   the policy folder (its posix tier "hot" rooted at PY_TEST_HOT_ROOT)
  PY_TEST_HOT_ROOT   root folder of the hot tier
  PY_TEST_PIDS       optional space-separated pids of the services, to fail fast if one dies

The DCP directory is written with torch when it is installed, else with ``save_stand_in``
(DCP's layout and write order without torch; deploy/py-tests.sh does not install torch). The
committed fact is read back from the facts stream with nats-py and every file's SHA-256
compared with one computed here. It ends with the line "N passed, M failed".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import msgpack
import nats

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkpoint_dcp  # noqa: E402

PROJECT = "lab-py"
RUN = "py-run"
TIMEOUT = float(os.environ.get("PY_TEST_TIMEOUT", "60"))


def services_alive() -> None:
    for pid in os.environ.get("PY_TEST_PIDS", "").split():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            raise AssertionError(f"service process {pid} has exited; see its log") from None


def step_dir(step: int) -> Path:
    return Path(os.environ["PY_TEST_HOT_ROOT"]) / PROJECT / "runs" / RUN / f"step-{step}"


def save(path: Path) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        checkpoint_dcp.save_stand_in({0: b"rank zero weights", 1: b"rank one weights"}, path)
        return
    import torch

    checkpoint_dcp.save_dcp({"model": torch.nn.Linear(4, 2).state_dict()}, path)


def commit(step: int, tags=()) -> dict:
    return checkpoint_dcp.commit(
        step_dir(step), run=RUN, step=step, project=PROJECT, tags=tags,
        stagehand=os.environ["PY_TEST_STAGEHAND"], policies=os.environ["PY_TEST_POLICIES"],
        nats_url=os.environ["PY_TEST_NATS_URL"],
    )


async def test_dcp_save_then_commit(ctx) -> None:
    path = step_dir(100)
    save(path)
    answer = commit(100, tags=["best"])
    assert answer["format"] == "torch.distributed.checkpoint", answer
    assert answer["duplicate"] is False, answer
    assert answer["location"] == {"tier": "hot", "prefix": f"{PROJECT}/runs/{RUN}/step-100"}, answer
    msg = await ctx["js"].get_last_msg("STAGEHAND_FACTS", f"stagehand.fact.checkpoint.committed.{PROJECT}")
    fact = msgpack.unpackb(msg.data, raw=False)
    assert fact["id"] == answer["id"], (fact["id"], answer["id"])
    payload = fact["payload"]
    on_disk = sorted(p for p in path.rglob("*") if p.is_file())
    expected = [
        {"path": p.relative_to(path).as_posix(), "size": p.stat().st_size,
         "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in on_disk
    ]
    got = sorted(payload["files"], key=lambda f: f["path"])
    expected.sort(key=lambda f: f["path"])
    assert got == expected, (got, expected)
    assert payload["tags"] == ["best"], payload
    assert payload["total_bytes"] == sum(f["size"] for f in expected)
    ctx["committed"] = answer


async def test_recommit_is_the_same_fact(ctx) -> None:
    again = commit(100, tags=["best"])
    assert again["id"] == ctx["committed"]["id"], again
    assert again["duplicate"] is True, again


async def test_unfinished_save_is_refused(ctx) -> None:
    path = step_dir(110)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"half written")
    (path / ".metadata.tmp").write_bytes(b"{}")
    try:
        commit(110)
    except checkpoint_dcp.CommitRefused as e:
        assert e.exit_code == 1 and "no .metadata" in e.reason, (e.exit_code, e.reason)
    else:
        raise AssertionError("an unfinished DCP save was committed")


async def test_catalogue_lists_the_step(ctx) -> None:
    deadline = time.monotonic() + TIMEOUT
    while True:
        services_alive()
        done = subprocess.run(
            [os.environ["PY_TEST_STAGEHAND"], "checkpoint", "list", RUN, "--project", PROJECT,
             "--policies", os.environ["PY_TEST_POLICIES"], "--json"],
            capture_output=True, text=True,
            env={**os.environ, "STAGEHAND_NATS_URL": os.environ["PY_TEST_NATS_URL"]},
        )
        assert done.returncode == 0, done.stderr
        listed = json.loads(done.stdout)
        if listed:
            assert [c["step"] for c in listed] == [100], listed
            assert listed[0]["tiers"] == ["hot"] and listed[0]["state"] == "committed", listed
            assert listed[0]["retention"]["placement"] == "hot", listed
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"step 100 not in the catalogue within {TIMEOUT}s")
        await asyncio.sleep(0.1)


async def main() -> int:
    nc = await nats.connect(os.environ["PY_TEST_NATS_URL"], connect_timeout=10)
    ctx = {"nc": nc, "js": nc.jetstream()}
    passed = failed = 0
    try:
        for test in [test_dcp_save_then_commit, test_recommit_is_the_same_fact,
                     test_unfinished_save_is_refused, test_catalogue_lists_the_step]:
            name = test.__name__
            if test is not test_dcp_save_then_commit and test is not test_unfinished_save_is_refused \
                    and "committed" not in ctx:
                print(f"FAIL {name}: needs the commit of test_dcp_save_then_commit")
                failed += 1
                continue
            try:
                await test(ctx)
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
