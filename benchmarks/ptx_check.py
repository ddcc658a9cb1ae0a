"""What the embedding kernels compile to on a Hopper GPU, without one: access widths, registers, occupancy.

    python benchmarks/ptx_check.py [--json out.json]

Runs one forward and one fused backward of ``recloop_kernels`` on the CPU with every Triton launch
recorded instead of run (the torch work between launches runs on garbage, harmlessly), then compiles
each recorded launch for sm_90 with Triton's own compiler and ptxas (they ship in the triton wheel) and
counts the global loads and stores by width. Rows padded to 16 bytes and constexpr dims should make
every row access a 16-byte vector (``.v4.b32`` for fp32, ``.v4.b32`` or ``.v8.b16`` for halves): this is
the prediction the GPU run then checks against bandwidth. Needs triton, not a GPU; must run without
``TRITON_INTERPRET=1``.

It also assembles each PTX with the ptxas Triton itself uses (same flags) and reports the registers a
thread, spills, and the theoretical occupancy those registers allow on an H100/H200 (64K registers an SM in
four quarters, allocated per warp in units of 256; at most 64 warps and 32 blocks an SM). Nsight Compute
on the H200 (2026-11-26, triton 3.6) agreed with this arithmetic: forward 147 registers → 18.75 %, segment
61 → 50 %. Register counts move a little between Triton versions; the direction of a change does not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import torch
from common import use_source_tree

use_source_tree()
from recloop_kernels import EmbeddingBagCollection, TableConfig, embedding_bag  # noqa: E402

KERNELS = ["_forward_kernel", "_linearize_kernel", "_mark_kernel", "_scatter_kernel", "_segment_kernel",
           "_split_kernel"]
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
         torch.int32: "i32", torch.bool: "i1"}
OPTIONS = ("num_warps", "num_stages")


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` records the call and returns."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.calls.append((self.kernel, grid, args, kwargs))
        return record


def record_launches(dtype: torch.dtype, dim: int, hotness: int, optimizer: str) -> list:
    """The Triton launches of one forward + fused backward (26 tables, batch 512)."""
    calls: list = []
    originals = {name: getattr(embedding_bag, name) for name in KERNELS}
    for name, kernel in originals.items():
        setattr(embedding_bag, name, _Recorder(kernel, calls))
    try:
        tables = [TableConfig(f"t{i}", 1000, dim) for i in range(26)]
        ebc = EmbeddingBagCollection(tables, optimizer=optimizer, dtype=dtype, check_ids="off")
        batch = 512
        values = torch.randint(0, 1000, (26 * batch * hotness,))
        offsets = torch.arange(26 * batch + 1) * hotness
        out = embedding_bag.embedding_bags(ebc.weights, values, offsets, None, ebc.id_errors,
                                           *embedding_bag.layout_args(ebc.layout), batch, True)
        embedding_bag.embedding_bags_sparse_update(torch.randn_like(out), ebc.weights, ebc.state1, ebc.state2, values,
                                                   offsets, None, *embedding_bag.layout_args(ebc.layout), batch, True,
                                                   optimizer, 0.01, 1e-8, 0.0, 0.9, 0.999, ebc.step)
    finally:
        for name, kernel in originals.items():
            setattr(embedding_bag, name, kernel)
    return calls


def compile_ptx(kernel, args: tuple, kwargs: dict, arch: int = 90) -> str:
    """PTX of ``kernel`` specialized as a real launch with these arguments would be (16-byte pointers)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    bound = dict(zip(names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = bound[name]
        if i in kernel.constexprs or name in kernel.constexprs:
            signature[name], constexprs[name] = "constexpr", value
        elif torch.is_tensor(value):
            signature[name] = "*" + TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and value != 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]


def resources(ptx: str, arch: int = 90) -> dict[str, int]:
    """Registers a thread and spilled bytes, from Triton's own ptxas with the flags Triton passes it."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as work:
        source = Path(work) / "kernel.ptx"
        source.write_text(ptx)
        result = subprocess.run([get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                                 f"--gpu-name={sm_arch_from_capability(arch)}", str(source), "-o", str(source) + ".o"],
                                capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"ptxas failed: {result.stderr[-2000:]}")
    registers = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
    return {"registers": int(registers.group(1)) if registers else 0,
            "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else 0}


def occupancy(registers: int, num_warps: int) -> float:
    """Theoretical occupancy on Hopper (H100/H200) allowed by registers alone, in [0, 1]."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256  # allocated per warp in units of 256
    warps = (16384 // per_warp) * 4  # four quarters of 16K registers, a warp lives in one
    blocks = min(warps // num_warps, 32, 64 // num_warps)
    return blocks * num_warps / 64


def access_widths(ptx: str) -> dict[str, dict[str, int]]:
    """Global loads and stores counted by instruction form (``ld.global.v4.b32``...)."""
    out = {}
    for op in ("ld", "st"):
        forms = Counter(re.sub(r"\.(L1|L2|lu|cg|ca|cs|nc|evict_\w+|L1::\w+|L2::\w+)", "", m)
                        for m in re.findall(rf"\b{op}\.global[\.\w:]*", ptx))
        out[op] = dict(sorted(forms.items()))
    return out


CONFIGURATIONS = [(torch.float32, 128, 1, "rowwise_adagrad"), (torch.bfloat16, 128, 1, "rowwise_adagrad"),
                  (torch.float32, 32, 64, "adam"), (torch.float32, 20, 4, "sgd")]


def check(configurations=CONFIGURATIONS) -> list[dict]:
    """Per configuration (dtype, dim, hotness, optimizer) and kernel: the access widths of its PTX."""
    rows = []
    for dtype, dim, hotness, optimizer in configurations:
        seen = set()
        for kernel, _grid, args, kwargs in record_launches(dtype, dim, hotness, optimizer):
            if kernel.__name__ in seen:
                continue
            seen.add(kernel.__name__)
            ptx = compile_ptx(kernel, args, kwargs)
            widths, used = access_widths(ptx), resources(ptx)
            warps = kwargs.get("num_warps", 4)
            rows.append({"kernel": kernel.__name__.strip("_"), "dtype": str(dtype).replace("torch.", ""), "dim": dim,
                         "hotness": hotness, "optimizer": optimizer, "loads": widths["ld"], "stores": widths["st"],
                         **used, "num_warps": warps, "occupancy": occupancy(used["registers"], warps)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--first", action="store_true", help="the first configuration only (fp32, dim 128)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the kernels must be compiled, not interpreted")
    rows = check(CONFIGURATIONS[:1] if args.first else CONFIGURATIONS)
    for row in rows:
        print(f"{row['kernel']:<18} {row['dtype']:<9} dim {row['dim']:<4} {row['hotness']:>2}-hot {row['optimizer']:<16}"
              f" {row['registers']:>3} registers, {row['num_warps']} warps, occupancy {row['occupancy']:.1%}"
              f"{', SPILLS ' + str(row['spill_bytes']) + ' bytes' if row['spill_bytes'] else ''}"
              f"  loads {row['loads']}  stores {row['stores']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
