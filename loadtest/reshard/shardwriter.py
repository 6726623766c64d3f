"""The webdataset package's ShardWriter on the benchmark's raw files: each sample (its .jpg and
.json, read from disk) written in key order into shards of at most MAXSIZE bytes. Prints one
JSON line: seconds, files, bytes, shards, peak RSS. No hashing, no fsync, no shuffle: what a
user writing shards with the package would run.

    python shardwriter.py ROOT OUT MAXSIZE
"""

import json
import os
import resource
import sys
import time
from pathlib import Path

import webdataset as wds


def main() -> None:
    root, out, maxsize = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    files = total = 0
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxsize=maxsize, maxcount=10**9, verbose=0) as sink:
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            names = sorted(os.listdir(folder))
            samples = {}
            for name in names:
                key, ext = name.split(".", 1)
                samples.setdefault(key, {})[ext] = (folder / name).read_bytes()
            for key in sorted(samples):
                sample = {"__key__": f"{folder.name}/{key}"}
                for ext, data in samples[key].items():
                    sample[ext] = data
                    files += 1
                    total += len(data)
                sink.write(sample)
        shards = sink.shard
    seconds = time.monotonic() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"tool": "webdataset-shardwriter", "seconds": seconds, "files": files,
                      "bytes": total, "shards": shards, "peak_rss_bytes": rss}))


if __name__ == "__main__":
    main()
