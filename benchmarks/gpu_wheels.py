"""Carry cuDF's wheels to a GPU machine without network, in parts under the device tool's transfer limit.

The device tool copies the working tree plus at most 8 ignored folders, 64 MiB in all, per call, and the
machine keeps /tmp only while warm (30 s after a call ends). So: download here, pack into parts, carry one
part per call (``stash`` into /tmp), and install on the last call. Standard library only.

    python benchmarks/gpu_wheels.py prepare            # here: download PINS, pack .whl-cudf/p1..pK
    python benchmarks/gpu_wheels.py commands           # here: the device calls to make, in order
    python3 benchmarks/gpu_wheels.py stash .whl-cudf/p1                # device, once per part
    python3 benchmarks/gpu_wheels.py install           # device, last call: reassemble, sha256, pip --target
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the device image lacks for cuDF (its numpy, pyarrow, cupy, numba, numba-cuda, cuda-* and nvidia-*
# CUDA 13 libraries are used as they are), exact versions that satisfy cudf-cu13 26.10.2's Requires-Dist.
# pandas 3.0 because cudf 26.10 requires pandas>=3.0,<3.1 (on PYTHONPATH it shadows the device's pandas).
PINS = (
    "cudf-cu13==26.10.2", "pylibcudf-cu13==26.10.2", "libcudf-cu13==26.10.2", "rmm-cu13==26.10.0",
    "librmm-cu13==26.10.0", "libkvikio-cu13==26.10.0", "nvidia-libnvcomp-cu13==5.3.0.16",
    "rapids-logger==0.3.0", "nvtx==0.2.17", "cachetools==8.0.1", "pandas==3.0.6",
)
# A Requires-Dist of cudf, but imported only by cudf.core.udf (rolling UDFs), never by ``import cudf`` nor the
# feature job: 71 MB, one more part, so only with ``prepare --with-mlir``.
OPTIONAL = ("numba-cuda-mlir==0.6.0",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# H200 machine, 2026-11-26: ``import cudf`` failed in the device image's numba-cuda ("module 'numpy' has no
# attribute 'row_stack'": numpy 2.4 removed the alias that numba-cuda still registers an overload for).
# gpu_suite.py's cudf step calls this before ``import cudf``, as does the install's check.
NUMPY_ALIAS = "import numpy; numpy.row_stack = getattr(numpy, 'row_stack', numpy.vstack)"


def restore_numpy_row_stack() -> None:
    """Give numpy back ``row_stack`` (= ``vstack``) where it lacks it (numpy >= 2.4), for numba-cuda."""
    import numpy

    if not hasattr(numpy, "row_stack"):
        numpy.row_stack = numpy.vstack


MANIFEST = "manifest.json"
DIR = ".whl-cudf"
STASH = "/tmp/recloop-wheels"
TARGET = "/tmp/site"
MIB = 1 << 20


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def pack(wheels: list[Path], out: Path, part_mib: float) -> list[Path]:
    """Split ``wheels`` into pieces ``NAME.000``, ``.001``... packed into ``out/p1..pK``, each at most
    ``part_mib`` MiB; ``manifest.json`` (name, size, sha256, pieces) goes into every part."""
    limit = int(part_mib * MIB)
    if limit <= 0:
        raise ValueError("part size must be positive")
    for old in out.glob("p[0-9]*"):
        shutil.rmtree(old)
    out.mkdir(parents=True, exist_ok=True)
    entries, parts, used = [], [], limit  # used = limit: the first piece opens a part
    for wheel in sorted(wheels, key=lambda p: p.name):
        size, pieces = wheel.stat().st_size, []
        with open(wheel, "rb") as f:
            offset = 0
            while offset < size or not pieces:
                if used >= limit:
                    parts.append(out / f"p{len(parts) + 1}")
                    parts[-1].mkdir()
                    used = 0
                chunk = f.read(min(limit - used, size - offset))
                name = f"{wheel.name}.{len(pieces):03d}"
                (parts[-1] / name).write_bytes(chunk)
                pieces.append(name)
                offset += len(chunk)
                used += len(chunk)
        entries.append({"name": wheel.name, "size": size, "sha256": sha256(wheel), "pieces": pieces})
    manifest = json.dumps({"wheels": entries, "parts": len(parts)}, indent=1)
    for part in parts:
        (part / MANIFEST).write_text(manifest)
    return parts


def stash(part: Path, to: Path) -> list[str]:
    """Copy one part's pieces and its manifest into ``to`` (on the device: /tmp, kept while warm)."""
    if not (part / MANIFEST).is_file():
        raise SystemExit(f"{part} holds no {MANIFEST}: not a part made by 'prepare' (was it carried?)")
    to.mkdir(parents=True, exist_ok=True)
    copied = []
    for piece in sorted(part.iterdir()):
        shutil.copyfile(piece, to / piece.name)
        copied.append(piece.name)
    return copied


def reassemble(stash_dir: Path, out: Path) -> list[Path]:
    """Join the pieces in ``stash_dir`` into whole wheels under ``out``, each checked against the manifest's
    sha256; a missing piece or a wrong checksum stops with an error naming it."""
    if not (stash_dir / MANIFEST).is_file():
        raise SystemExit(f"no {MANIFEST} in {stash_dir}: no part was stashed (the machine went cold?)")
    entries = json.loads((stash_dir / MANIFEST).read_text())["wheels"]
    missing = [p for e in entries for p in e["pieces"] if not (stash_dir / p).is_file()]
    if missing:
        raise SystemExit(f"missing {len(missing)} piece(s) in {stash_dir}: {', '.join(missing)} "
                         "(stash every part within 30 s of the previous call)")
    out.mkdir(parents=True, exist_ok=True)
    wheels = []
    for entry in entries:
        wheel = out / entry["name"]
        with open(wheel, "wb") as f:
            for piece in entry["pieces"]:
                with open(stash_dir / piece, "rb") as p:
                    shutil.copyfileobj(p, f)
        if wheel.stat().st_size != entry["size"] or sha256(wheel) != entry["sha256"]:
            raise SystemExit(f"sha256 mismatch for {entry['name']}: a piece is corrupt or from another prepare")
        wheels.append(wheel)
    return wheels


def download(dest: Path, pins: tuple[str, ...] = PINS) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + list(pins), check=True)
    wanted = {pin.split("==")[0].replace("-", "_").lower() for pin in pins}
    return [w for w in dest.glob("*.whl") if w.name.split("-")[0].lower() in wanted]


def parts_of(directory: Path) -> list[Path]:
    return sorted(directory.glob("p[0-9]*"), key=lambda p: int(p.name[1:]))


def commands(directory: str) -> list[tuple[str, list[str]]]:
    """(command, carry) for each device call: one stash per part, the last also installs and runs cudf."""
    parts = parts_of(ROOT / directory)
    if not parts:
        raise SystemExit(f"no parts under {directory}: run 'python benchmarks/gpu_wheels.py prepare' first")
    calls = []
    for i, part in enumerate(parts):
        rel = f"{directory}/{part.name}"
        cmd = f"python3 benchmarks/gpu_wheels.py stash {rel} --to {STASH}"
        if i == len(parts) - 1:  # the suite's JSON so far, carried in gpu-in/ (if any), gets the cudf step
            cmd += (f" && python3 benchmarks/gpu_wheels.py install --from {STASH} --target {TARGET}"
                    " && { [ ! -f gpu-in/gpu_suite.json ] || cp gpu-in/gpu_suite.json $OUT/; }"
                    f" && PYTHONPATH={TARGET}:$PYTHONPATH python3 benchmarks/gpu_suite.py --only cudf"
                    " --out $OUT/gpu_suite.json")
        assert len(cmd) <= 2000, cmd
        calls.append((cmd, [rel, "gpu-in"] if i == len(parts) - 1 else [rel]))
    return calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="download PINS here and pack them into parts")
    p.add_argument("--dir", default=DIR)
    p.add_argument("--part-mib", type=float, default=61.0, help="per part; the repo (~2.2 MB) travels too")
    p.add_argument("--with-mlir", action="store_true", help="also carry " + ", ".join(OPTIONAL))
    p = sub.add_parser("stash", help="device: copy one carried part into the stash folder")
    p.add_argument("part")
    p.add_argument("--to", default=STASH)
    p = sub.add_parser("install", help="device: reassemble, verify sha256, pip install --target")
    p.add_argument("--from", dest="src", default=STASH)
    p.add_argument("--target", default=TARGET)
    p.add_argument("--no-pip", action="store_true", help="only reassemble and verify")
    p = sub.add_parser("commands", help="print the device calls to make")
    p.add_argument("--dir", default=DIR)
    args = parser.parse_args(argv)

    if args.cmd == "prepare":
        directory = (ROOT / args.dir).resolve()
        wheels = download(directory / "download", PINS + (OPTIONAL if args.with_mlir else ()))
        parts = pack(wheels, directory, args.part_mib)
        shutil.rmtree(directory / "download")
        total = sum(f.stat().st_size for part in parts for f in part.iterdir())
        for part in parts:
            size = sum(f.stat().st_size for f in part.iterdir())
            print(f"{part.name}: {size / MIB:.1f} MiB, {len(list(part.iterdir())) - 1} piece(s)")
        print(f"{len(wheels)} wheels in {len(parts)} parts, {total / 1e6:.0f} MB in all")
    elif args.cmd == "stash":
        copied = stash(Path(args.part), Path(args.to))
        print(f"stashed {len(copied)} file(s) from {args.part} into {args.to}")
    elif args.cmd == "install":
        src = Path(args.src)
        wheels = reassemble(src, src / "whole")
        print(f"reassembled {len(wheels)} wheels, sha256 verified")
        if args.no_pip:
            return
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", args.target, *map(str, wheels)], check=True)
        check = NUMPY_ALIAS + "; import cudf, pandas; print('cudf', cudf.__version__, 'pandas', pandas.__version__)"
        env = dict(os.environ)
        env["PYTHONPATH"] = args.target + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        result = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True)
        print(result.stdout.strip() or result.stderr.strip()[-3000:])
    elif args.cmd == "commands":
        calls = commands(args.dir)
        print(f"{len(calls)} device run calls, in order; each must start within 30 s of the previous one's end "
              "(the machine keeps /tmp only while warm):")
        for i, (cmd, carry) in enumerate(calls, 1):
            print(f"\n# call {i}/{len(calls)}\ncarry: {json.dumps(carry)}\ncommand: {cmd}")


if __name__ == "__main__":
    main()
