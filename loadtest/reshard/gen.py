"""Writes the resharding benchmark's raw files: FILES files of MIN..MAX bytes (uniform), as
samples of two members each (`dNNNN/sNNNNNNN.jpg` and `.json`), 1,000 samples per folder.

    python gen.py ROOT FILES MIN MAX

Every file is distinct (a 16-byte header naming it, then bytes from a random pool), so every
hash differs; the pool makes generation cost little more than the writes.
"""

import os
import random
import sys
from pathlib import Path


def main() -> None:
    root, files, lo, hi = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(20261129)
    pool = os.urandom(4 << 20)
    total = 0
    for i in range(files):
        sample, member = divmod(i, 2)
        folder = root / f"d{sample // 1000:04d}"
        if sample % 1000 == 0 and member == 0:
            folder.mkdir(parents=True, exist_ok=True)
        size = rng.randint(lo, hi)
        start = rng.randrange(0, len(pool) - size)
        header = f"{i:016d}".encode()
        data = header + pool[start : start + size - len(header)]
        (folder / f"s{sample:07d}.{'jpg' if member == 0 else 'json'}").write_bytes(data)
        total += size
    print(f"{files} files, {total} bytes under {root}")


if __name__ == "__main__":
    main()
