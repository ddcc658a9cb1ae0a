"""What a fresh process pays to score its first batch through the embedding kernels: the gate's serving check
and a new serving replica are such processes.

A ``torch.library`` custom op's first eager call imports ``torch._dynamo`` (torch wraps each op implementation
in a lazy dynamo-disable). Now ``recloop_kernels.embedding_bag.pool`` calls the function
itself when nothing compiles, exports or traces (the op stays in compiled and exported graphs). Side by side in
one run, alternating: the first forward through **the op** (the baseline: every eager call before) and through
**pool** (what ships), each in a process of its own that imports torch and the kernels first.

    python benchmarks/fresh_score.py [--repeats 5] [--json results/fresh-score-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

from common import ROOT, machine

CODE = """
import sys, time, torch
from recloop_kernels import EmbeddingBagCollection, TableConfig, embedding_bag
ebc = EmbeddingBagCollection([TableConfig("user", 1000, 16), TableConfig("item", 500, 16, pooling="mean")])
values, offsets = torch.randint(0, 500, (512,)), torch.arange(0, 513)
layout = embedding_bag.layout_args(ebc._layout)
errors = torch.zeros(2, dtype=torch.int64)
call = embedding_bag.{name}
began = time.perf_counter()
with torch.no_grad():
    call(ebc.weights, values, offsets, None, errors, *layout, 256, False)
print(time.perf_counter() - began, "torch._dynamo" in sys.modules)
"""


def run(name: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "kernels"), "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", CODE.format(name=name)], capture_output=True, text=True,
                          env=env, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    first, dynamo = done.stdout.split()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"first_call_s": float(first), "process_cpu_s": cpu, "imported_dynamo": dynamo == "True"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    cases = {"the op (baseline)": "embedding_bags", "pool (ships)": "pool"}
    rows: dict[str, list[dict]] = {case: [] for case in cases}
    for _ in range(args.repeats):
        for case, name in cases.items():
            rows[case].append(run(name))
    print("| first forward in a fresh process | median first call | median process CPU | imported torch._dynamo |")
    print("| --- | --- | --- | --- |")
    summary = {}
    for case, runs in rows.items():
        summary[case] = {"first_call_s": statistics.median(r["first_call_s"] for r in runs),
                         "process_cpu_s": statistics.median(r["process_cpu_s"] for r in runs),
                         "imported_dynamo": all(r["imported_dynamo"] for r in runs)}
        print(f"| {case} | {summary[case]['first_call_s']:.3f} s | {summary[case]['process_cpu_s']:.2f} s | "
              f"{summary[case]['imported_dynamo']} |")
    if args.json_path:
        with open(args.json_path, "w") as out:
            json.dump({"machine": machine(), "repeats": args.repeats, "summary": summary, "runs": rows}, out,
                      indent=1)


if __name__ == "__main__":
    main()
