#!/usr/bin/env python3
"""Asking the Stagehand catalogue from Python, over NATS request/reply.

A query is one JSON document sent to ``stagehand.catalogue.query``; a catalogue recorder
answers with one JSON document of at most 512 KiB (services/catalogue-client/src/query.rs has
the format). Lists are pages: ``limit`` (default 100, at most 10,000) and ``after`` (the
``next`` of the previous page); ``next`` is null on the last page. Where a query names a
``version``, a unique prefix of at least 8 characters will do; leaving ``project`` out means
"the only project with a dataset of that name". Times are RFC 3339 in UTC.

    {"query": "datasets", "project": "P"}               -> {"answer": "datasets", "datasets": [...], "next": ...}
    {"query": "dataset", "project": "P", "dataset": "D"} -> {"answer": "dataset", "dataset": {..., "version_count",
                                                            "rejection_count"}, "versions": [...], "versions_next",
                                                            "replicas": [...], "rejections": [...], "rejections_next"}
    {"query": "version", "project": "P", "dataset": "D", "version": "<digest or prefix>"}
                                                         -> {"answer": "version", "version": {...}, "replicas": [...]}
    {"query": "files", "dataset": "D", "version": "...", "limit": 1000, "after": "<path>"}
                                                         -> {"answer": "files", "version": "<digest>", "files": [...], "next": ...}
    {"query": "file", "dataset": "D", "version": "...", "path": "a/b.jpg"}
                                                         -> {"answer": "file", "version": "<digest>", "file": {...}}
    {"query": "rejection", "dataset": "D", "request_id": "..."}
                                                         -> {"answer": "rejection", "rejection": {...}}
    {"query": "stage_requests", "project": "P", "job_id": "J"}
                                                         -> {"answer": "stage_requests", "stages": [...], "next": ...}

A failed query answers ``{"answer": "error", "code": "not_found" | "ambiguous" | "bad_query" |
"internal", "message": "..."}``; :func:`ask` returns it like any answer, the caller decides.

Usage as a command:  catalogue_client.py '{"query":"datasets"}' [--nats-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Awaitable, Callable

SUBJECT = "stagehand.catalogue.query"


class CatalogueUnavailable(Exception):
    """No recorder answered (none running yet, or it did not answer in time)."""


async def ask(nc, query: dict, timeout: float = 5.0) -> dict:
    """Sends one query and returns the decoded answer; raises CatalogueUnavailable when no
    recorder answers within ``timeout`` seconds."""
    import nats

    try:
        msg = await nc.request(SUBJECT, json.dumps(query).encode(), timeout=timeout)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as e:
        raise CatalogueUnavailable(f"no catalogue recorder answered {query}: {type(e).__name__}") from None
    answer = json.loads(msg.data)
    if not isinstance(answer, dict) or "answer" not in answer:
        raise ValueError(f"the catalogue answered something that is not an answer: {msg.data[:200]!r}")
    return answer


async def all_files(nc, query: dict, page: int = 10_000, timeout: float = 5.0) -> list[dict]:
    """Every file of a version, asking ``files`` page by page (``query`` names project,
    dataset and version); raises ValueError on an error answer."""
    files: list[dict] = []
    after = None
    while True:
        q = dict(query, query="files", limit=page)
        if after is not None:
            q["after"] = after
        answer = await ask(nc, q, timeout=timeout)
        if answer.get("answer") != "files":
            raise ValueError(f"files query {q} answered {answer}")
        files.extend(answer["files"])
        after = answer["next"]
        if after is None:
            return files


async def poll(
    nc,
    query: dict,
    accept: Callable[[dict], bool],
    *,
    timeout: float,
    what: str,
    alive: Callable[[], None] | None = None,
    interval: float = 0.1,
) -> dict:
    """Asks ``query`` until ``accept(answer)`` holds and returns that answer, or raises
    AssertionError naming ``what`` and the last answer once ``timeout`` seconds have passed.

    The recorder folds facts asynchronously, so a fact seen on the stream may not be in the
    catalogue yet: this waits on the catalogue itself, within a bound. ``alive`` is called
    before each attempt and may raise to stop early (a service process has died)."""
    deadline = time.monotonic() + timeout
    last: object = "no answer yet"
    while True:
        if alive is not None:
            alive()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"{what}: not in the catalogue within {timeout}s; last answer: {last}")
        try:
            answer = await ask(nc, query, timeout=min(remaining, 2.0))
            if accept(answer):
                return answer
            last = answer
        except CatalogueUnavailable as e:
            last = str(e)
        # "No responders" comes back at once while a recorder starts: pace the attempts.
        await asyncio.sleep(min(interval, max(deadline - time.monotonic(), 0)))


async def _main(argv=None) -> int:
    import nats

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("query", help='a JSON query, e.g. \'{"query":"datasets"}\'')
    p.add_argument("--nats-url", default=os.environ.get("STAGEHAND_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args(argv)
    nc = await nats.connect(args.nats_url, connect_timeout=10)
    try:
        answer = await ask(nc, json.loads(args.query), timeout=args.timeout)
    except CatalogueUnavailable as e:
        print(f"catalogue_client: {e}", file=sys.stderr)
        return 2
    finally:
        await nc.close()
    print(json.dumps(answer, indent=2))
    return 1 if answer.get("answer") == "error" else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(_main()))
