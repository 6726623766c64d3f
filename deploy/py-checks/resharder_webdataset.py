"""The resharder's shards read back with the real `webdataset` package (PyPI) yield exactly the
raw samples, byte for byte, in the seeded order the resharder documents, and each shard's index
points at every member's bytes with the upload's SHA-256.

Run by schemas/examples/python/test_ingest_roundtrip.py (through deploy/py-tests.sh, which starts
the real stagehand-resharder with a packing policy that packs lab-py/py-shards into 1 MiB shards
with seed 20261129, requiring .jpg and .cls). It uploads its own dataset with the Python producer,
waits for dataset.validated and then dataset.prepared, and reads the shards from the capacity
tier (PY_TEST_PREPARED_ROOT).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import msgpack
import nats
from nats.js.api import DeliverPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "schemas/examples/python"))
import produce_ingest  # noqa: E402

TIMEOUT = float(os.environ.get("PY_TEST_TIMEOUT", "60"))
PROJECT = "lab-py"
DATASET = "py-shards"
SEED = 20261129
SAMPLES = 240


def order_key(seed: int, key: str) -> tuple[bytes, bytes]:
    """The resharder's seeded order: the first 8 bytes of
    SHA-256("stagehand/shuffle/v1\\0" ++ u64_be(seed) ++ key), then the key's bytes."""
    digest = hashlib.sha256(b"stagehand/shuffle/v1\0" + seed.to_bytes(8, "big") + key.encode()).digest()
    return digest[:8], key.encode()


def dataset_files() -> dict[str, bytes]:
    files = {}
    for i in range(SAMPLES):
        key = f"images/{i:05d}"
        # Deterministic bytes of 1-9 KiB: the test can be rerun on the same tier.
        seed = hashlib.sha256(key.encode()).digest()
        files[f"{key}.jpg"] = (seed * (1 + (i * 37) % 288))[: 1024 + (i * 997) % 8192]
        files[f"{key}.cls"] = str(i % 10).encode()
        files[f"{key}.json"] = json.dumps({"id": i, "caption": f"sample {i}"}).encode()
    return files


async def wait_fact(js, cause: str, kind: str) -> dict:
    sub = await js.subscribe("stagehand.fact.>", ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    deadline = time.monotonic() + TIMEOUT
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {kind} caused by {cause} within {TIMEOUT}s")
            try:
                msg = await sub.next_msg(timeout=min(remaining, 1.0))
            except nats.errors.TimeoutError:
                continue
            fact = msgpack.unpackb(msg.data, raw=False)
            if fact.get("causation_id") == cause:
                assert fact["kind"] == kind, f"expected {kind}, got {fact['kind']}: {fact['payload']}"
                return fact
    finally:
        await sub.unsubscribe()


async def check(nc, js, request: dict, fact: dict) -> None:
    import webdataset as wds

    files = dataset_files()
    folder = Path(os.environ["PY_TEST_WORK"]) / "upload-shards"
    for rel, data in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    args = produce_ingest.parse_args(
        [
            str(folder),
            "--tier-root", os.environ["PY_TEST_TIER_ROOT"],
            "--project", PROJECT,
            "--dataset", DATASET,
            "--prefix", f"{PROJECT}/shards-{os.getpid()}",
            "--requested-by", "py-producer",
            "--nats-url", os.environ["PY_TEST_NATS_URL"],
        ]
    )
    ingest = await produce_ingest.produce(args)
    validated = await wait_fact(js, ingest["id"], "dataset.validated")
    prepared = await wait_fact(js, validated["id"], "dataset.prepared")
    payload = prepared["payload"]
    assert payload["derived_from"] == validated["payload"]["version"]
    assert payload["layout"] == "webdataset"
    assert payload["seed"] == SEED
    assert payload["samples"] == SAMPLES, payload["samples"]

    root = Path(os.environ["PY_TEST_PREPARED_ROOT"]) / payload["location"]["prefix"]
    shards = sorted(str(p) for p in root.glob("shard-*.tar"))
    assert len(shards) >= 2, f"~1.5 MiB in 1 MiB shards: {shards}"
    meta = json.loads((root / "prepared.json").read_text())
    assert meta["shard_pattern"] == f"shard-{{000000..{len(shards) - 1:06d}}}.tar", meta

    # The real reader, in shard order, no shuffling of its own.
    samples = list(wds.WebDataset(shards, shardshuffle=False, empty_check=False))
    keys = [s["__key__"] for s in samples]
    expected = sorted({rel.split(".", 1)[0] for rel in files}, key=lambda k: order_key(SEED, k))
    assert keys == expected, "the samples come in the seeded order"
    seen = set()
    for sample in samples:
        exts = sorted(k for k in sample if not k.startswith("__"))
        assert exts == ["cls", "jpg", "json"], (sample["__key__"], exts)
        for ext in exts:
            rel = f"{sample['__key__']}.{ext}"
            assert sample[ext] == files[rel], f"{rel}: bytes differ"
            seen.add(rel)
    assert seen == set(files), "every raw file, once"

    # The index: per sample its members' offsets, sizes and the upload's SHA-256.
    uploaded = {f["path"]: f["sha256"] for f in produce_ingest.hash_folder(folder)}
    listed = 0
    for shard in shards:
        data = Path(shard).read_bytes()
        index = Path(shard[: -len(".tar")] + ".index.jsonl").read_text().splitlines()
        for line in index:
            entry = json.loads(line)
            for m in entry["members"]:
                member = data[m["offset"] : m["offset"] + m["size"]]
                assert hashlib.sha256(member).hexdigest() == m["sha256"] == uploaded[m["path"]], m["path"]
                listed += 1
    assert listed == len(files), listed

