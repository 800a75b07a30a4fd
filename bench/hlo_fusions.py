"""Print what named fusions of a dumped program do (`bench/decode.py --hlo-dir DIR` writes gzipped
optimized HLO): `python3 bench/hlo_fusions.py FILE.hlo.txt.gz input_reduce_fusion_33 loop_multiply_fusion_1`.
A kernel name from a profile table (underscores) is matched to its instruction (dots), and the fused
computation it calls is printed (first 40 lines each), so a table row can be named by the ops in it."""

from __future__ import annotations

import gzip
import re
import sys


def main() -> None:
    path, names = sys.argv[1], sys.argv[2:]
    text = (gzip.open if path.endswith(".gz") else open)(path, "rt").read()
    for name in names:
        inst = re.sub(r"_(\d+)$", r".\1", name)
        m = re.search(rf"^\s*(ROOT )?%?{re.escape(inst)} = .*$", text, re.M)
        if not m:
            print(f"## {name}: not found")
            continue
        line = m.group(0).strip()
        print(f"## {name}\n{line[:600]}")
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called:
            body = re.search(rf"^%?{re.escape(called.group(1))} .*?^}}", text, re.M | re.S)
            print("\n".join((body.group(0) if body else "(body not found)").splitlines()[:40]))


if __name__ == "__main__":
    main()
