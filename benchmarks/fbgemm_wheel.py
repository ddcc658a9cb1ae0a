"""Carry FBGEMM's released TBE to a GPU machine without network, in one call of the device tool (issue 39).

The released ``fbgemm_gpu`` 1.6.0 wheel (CUDA 13, the build for torch 2.11, which the device image runs) is
465 MB: far over the device tool's 64 MiB a call. Almost all of it is GPU code for three architectures
(sm_80, sm_90, sm_100) in the libraries' fat binaries. ``prepare`` keeps the released files and changes
only what the H100/H200 (sm_90) never runs:

- the code for the other architectures is overwritten with zeros in each ``.nv_fatbin`` section (sizes and
  offsets unchanged, so the libraries load as released; the CUDA runtime reads only the sm_90 image);
- three libraries the training TBE does not use are left out (inference, variable batch size, global weight
  decay) and ``fbgemm_gpu/__init__.py``'s list of libraries to load loses them;

then packs the package as one ``.tar.xz`` (about 56 MiB) with its sha256. Standard library + ``readelf``.

    python benchmarks/fbgemm_wheel.py prepare               # here: .whl-fbgemm/fbgemm_gpu-<v>-sm90.tar.xz
    python3 benchmarks/fbgemm_wheel.py install --target /tmp/site  # device: verify, extract, import check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from gpu_wheels import sha256  # the same checksum as cuDF's carried wheels (standard library, this folder)

ROOT = Path(__file__).resolve().parents[1]
VERSION = "1.6.0"
DIR = ".whl-fbgemm"
KEEP_ARCH = 90  # H100 and H200
DROPPED = ("fbgemm_gpu_tbe_inference", "fbgemm_gpu_tbe_training_backward_vbe", "fbgemm_gpu_tbe_training_backward_gwd")
FATBIN_MAGIC = 0xBA55ED50


def fatbin_section(path: Path) -> tuple[int, int] | None:
    """(file offset, size) of the ``.nv_fatbin`` section, or None (``readelf -S -W``)."""
    out = subprocess.run(["readelf", "-S", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if " .nv_fatbin " in line:
            fields = line.split("]", 1)[1].split()  # name, type, address, offset, size, ...
            return int(fields[3], 16), int(fields[4], 16)
    return None


def blank_other_architectures(path: Path, keep: int = KEEP_ARCH) -> dict[int, int]:
    """Zero the payload of every fat-binary entry (SASS or PTX) whose architecture is not ``keep``; returns the
    bytes per architecture found. A fat binary is a run of containers (magic, version, header size, payload
    size), each a run of entries (kind, header size, payload size, ..., arch at byte 28)."""
    section = fatbin_section(path)
    if section is None:
        return {}
    data = bytearray(path.read_bytes())
    start, size = section
    found: dict[int, int] = {}
    at, end = start, start + size
    while at < end:
        magic, _, header, payload = struct.unpack_from("<IHHQ", data, at)
        if magic != FATBIN_MAGIC:
            at += 8  # containers are 8-byte aligned
            continue
        entry, stop = at + header, at + header + payload
        while entry < stop:
            _, _, entry_header, entry_size = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            found[arch] = found.get(arch, 0) + entry_size
            if arch != keep:
                data[entry + entry_header:entry + entry_header + entry_size] = bytes(entry_size)
            entry += entry_header + entry_size
        at = stop
    if keep not in found:
        raise SystemExit(f"{path.name}: no code for sm_{keep} (found {sorted(found)}); nothing to keep")
    path.write_bytes(data)
    return found


def prepare(directory: Path) -> Path:
    work = directory / "work"
    shutil.rmtree(work, ignore_errors=True)
    (work / "download").mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "-d", str(work / "download"), f"fbgemm-gpu=={VERSION}"], check=True)
    wheel = next((work / "download").glob("fbgemm_gpu-*.whl"))
    tree = work / "tree"
    zipfile.ZipFile(wheel).extractall(tree)
    package = tree / "fbgemm_gpu"
    for name in DROPPED:
        (package / f"{name}.so").unlink()
    init = package / "__init__.py"
    text = init.read_text()
    for name in DROPPED:
        line = f'    "{name}",\n'
        if line not in text:
            raise SystemExit(f"{init}: no {line.strip()} to drop (another fbgemm_gpu layout?)")
        text = text.replace(line, "")
    init.write_text(text)
    for library in sorted(package.rglob("*.so")):
        found = blank_other_architectures(library)
        if found:
            print(f"{library.name}: kept sm_{KEEP_ARCH} ({found[KEEP_ARCH] / 2**20:.1f} MiB), blanked "
                  + ", ".join(f"sm_{a} ({n / 2**20:.1f} MiB)" for a, n in sorted(found.items()) if a != KEEP_ARCH))
    out = directory / f"fbgemm_gpu-{VERSION}-sm{KEEP_ARCH}.tar.xz"
    with open(out, "wb") as f:  # xz with two threads: ~3 min here, ~56 MiB
        tar = subprocess.Popen(["tar", "-C", str(tree), "-cf", "-", "."], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-T2", "-6"], stdin=tar.stdout, stdout=f, check=True)
        tar.wait()
    (directory / "manifest.json").write_text(json.dumps({
        "file": out.name, "sha256": sha256(out), "size": out.stat().st_size, "from": wheel.name,
        "wheel_sha256": sha256(wheel), "kept_arch": KEEP_ARCH, "dropped": list(DROPPED)}, indent=1))
    shutil.rmtree(work)
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")
    return out


def install(directory: Path, target: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    archive = directory / manifest["file"]
    if sha256(archive) != manifest["sha256"]:
        raise SystemExit(f"{archive}: sha256 differs from the manifest (a partial copy?)")
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:  # the names, checked before anything is written
        unsafe = [m.name for m in tar if m.name.startswith("/") or ".." in Path(m.name).parts or m.issym()]
    if unsafe:
        raise SystemExit(f"{archive}: refusing entries outside the target: {unsafe[:5]}")
    # xz's own threads: ~1.3 GB unpacked (the blanked code is zeros)
    subprocess.run(["tar", "-C", str(target), "--use-compress-program=xz -d -T0", "-xf", str(archive)], check=True)
    env = dict(os.environ, PYTHONPATH=f"{target}:{os.environ.get('PYTHONPATH', '')}")
    check = ("import logging; logging.disable(logging.WARNING); import torch, fbgemm_gpu; "
             "from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen; "
             "print('fbgemm_gpu', fbgemm_gpu.__version__, 'on torch', torch.__version__)")
    result = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True)
    print(result.stdout.strip() or result.stderr.strip()[-3000:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="download, strip to sm_90, pack")
    p.add_argument("--dir", default=DIR)
    p = sub.add_parser("install", help="device: verify and extract into --target")
    p.add_argument("--dir", default=DIR)
    p.add_argument("--target", default="/tmp/site")
    args = parser.parse_args(argv)
    directory = (ROOT / args.dir).resolve()
    if args.cmd == "prepare":
        directory.mkdir(parents=True, exist_ok=True)
        prepare(directory)
    else:
        install(directory, Path(args.target))


if __name__ == "__main__":
    main()
