#!/usr/bin/env python3
"""Save a PyTorch distributed checkpoint (torch.distributed.checkpoint, DCP), then commit it.

A training loop calls ``save_and_commit`` after each checkpoint; retention (the demoter) then
keeps, demotes or expires it by the rules of ``policies/retention.toml``::

    from checkpoint_dcp import save_and_commit
    save_and_commit(
        {"model": model.state_dict(), "optim": optim.state_dict()},
        hot_root / "vision-lab" / "runs" / run / f"step-{step}",
        run=run, step=step, project="vision-lab", tags=["best"] if is_best else [],
    )

The commit runs ``stagehand checkpoint commit --json``, which refuses a DCP directory without
``.metadata`` (DCP writes it last) and publishes ``checkpoint.committed`` with every file
hashed; committing the same (project, run, step) again is the same fact. Only rank 0 should
commit, after the save has returned on every rank (``dist.barrier()``).

Run as a script it saves a tiny model and commits it::

    python3 checkpoint_dcp.py "$STAGEHAND_HOME/tiers/hot/lab-a/runs/r1/step-100" \\
        --run r1 --step 100 --project lab-a [--tag best] [--stand-in]

``--stand-in`` (and ``save_stand_in``) writes a directory the way DCP lays one out —
``__<rank>_<n>.distcp`` shards, then ``.metadata.tmp`` renamed to ``.metadata`` — for machines
without torch; the tests use it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Mapping


class CommitRefused(Exception):
    """``stagehand checkpoint commit`` refused the checkpoint (exit 1) or its arguments (64)."""

    def __init__(self, exit_code: int, reason: str):
        super().__init__(reason)
        self.exit_code = exit_code
        self.reason = reason


def save_dcp(state_dict: Mapping, path: Path) -> None:
    """Saves ``state_dict`` with torch.distributed.checkpoint into the directory ``path``."""
    import torch.distributed.checkpoint as dcp  # only when torch is wanted

    dcp.save(dict(state_dict), checkpoint_id=str(path))


def save_stand_in(shards: Mapping[int, bytes], path: Path) -> None:
    """Writes rank shards and then the metadata, in DCP's order: a reader that finds
    ``.metadata`` finds every shard."""
    path.mkdir(parents=True, exist_ok=True)
    for rank, data in sorted(shards.items()):
        (path / f"__{rank}_0.distcp").write_bytes(data)
    tmp = path / ".metadata.tmp"
    tmp.write_bytes(json.dumps({"ranks": sorted(shards)}).encode())
    os.replace(tmp, path / ".metadata")


def commit(
    path: Path,
    *,
    run: str,
    step: int,
    project: str,
    tags: Iterable[str] = (),
    stagehand: str = "stagehand",
    policies: str | None = None,
    tier: str | None = None,
    nats_url: str | None = None,
) -> dict:
    """Runs ``stagehand checkpoint commit --json`` and returns its answer (``id``, ``format``,
    ``files``, ``total_bytes``, ``manifest``, ``duplicate``, ...). Raises ``CommitRefused`` for
    a refused checkpoint or argument, ``RuntimeError`` for anything else (NATS unreachable: 69).
    """
    args = [stagehand, "checkpoint", "commit", "--run", run, "--step", str(step),
            "--project", project, "--json"]
    for tag in tags:
        args += ["--tag", tag]
    if policies:
        args += ["--policies", policies]
    if tier:
        args += ["--tier", tier]
    args.append(str(path))
    env = dict(os.environ)
    if nats_url:
        env["STAGEHAND_NATS_URL"] = nats_url
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    if done.returncode in (1, 64):
        raise CommitRefused(done.returncode, done.stderr.strip())
    if done.returncode != 0:
        raise RuntimeError(f"stagehand checkpoint commit exited {done.returncode}: {done.stderr.strip()}")
    return json.loads(done.stdout)


def save_and_commit(state_dict: Mapping, path: Path, **commit_args) -> dict:
    """DCP save, then the commit (see ``commit`` for the arguments)."""
    save_dcp(state_dict, path)
    return commit(path, **commit_args)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", type=Path)
    p.add_argument("--run", required=True)
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--project", default=os.environ.get("STAGEHAND_PROJECT"))
    p.add_argument("--tag", action="append", default=[])
    p.add_argument("--stand-in", action="store_true", help="write a DCP-shaped directory without torch")
    p.add_argument("--stagehand", default="stagehand", help="the stagehand binary")
    a = p.parse_args()
    if not a.project:
        p.error("--project (or STAGEHAND_PROJECT) is required")
    if a.stand_in:
        save_stand_in({0: b"weights of rank 0"}, a.path)
    else:
        import torch

        model = torch.nn.Linear(4, 2)
        save_dcp({"model": model.state_dict()}, a.path)
    try:
        answer = commit(a.path, run=a.run, step=a.step, project=a.project, tags=a.tag,
                        stagehand=a.stagehand)
    except CommitRefused as e:
        print(e.reason, file=sys.stderr)
        return e.exit_code
    print(answer["id"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
