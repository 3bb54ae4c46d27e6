"""The offline kit: built and size-checked here (``prepare``), verified here and on the GPU machine."""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import (
    CACHE,
    GEVENTHTTPCLIENT,
    IMAGE_PACKAGES,
    IMAGE_REQUIREMENTS,
    KIT,
    KIT_FORMAT,
    KIT_REQUIREMENTS,
    LIBB64,
    LIMIT_BYTES,
    PLATFORMS,
    PYTHON_VERSION,
    PYTRITON,
    log,
    sha256,
    tail,
)

# --------------------------------------------------------------------------------------------- sizes


def tree_files(root: Path) -> list[str]:
    """The working tree as sent: tracked and untracked-not-ignored files, relative to ``root``."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True, check=True
    ).stdout
    return [name for name in listed.decode().split("\0") if name and (root / name).is_file()]


def tree_bytes(root: Path) -> int:
    """Bytes of the working tree as sent (links not counted)."""
    return sum((root / name).stat().st_size for name in tree_files(root) if not (root / name).is_symlink())


def tree_copy(root: Path, target: Path) -> Path:
    """A copy of the working tree as sent (so that builds leave nothing in the tree itself)."""
    shutil.rmtree(target, ignore_errors=True)
    for name in tree_files(root):
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target / name)
    return target


def mib(n: int) -> str:
    """``n`` bytes in MiB."""
    return f"{n / 2**20:.2f} MiB"


def size_table(root: Path, kit: Path) -> tuple[str, bool, dict[str, int]]:
    """Markdown size table of one call (tree + kit) against the limit, whether it fits, the figures."""
    figures = {"working tree": tree_bytes(root)}
    for path in sorted(kit.iterdir()):
        if path.is_file():
            figures[f"{KIT}/{path.name}"] = path.stat().st_size
    total = sum(figures.values())
    rows = ["| what | bytes | MiB |", "| --- | ---: | ---: |"]
    rows += [f"| {name} | {n} | {n / 2**20:.2f} |" for name, n in figures.items()]
    rows.append(f"| **one call** | {total} | {total / 2**20:.2f} |")
    rows.append(f"| limit | {LIMIT_BYTES} | {LIMIT_BYTES / 2**20:.2f} |")
    return "\n".join(rows), total <= LIMIT_BYTES, {**figures, "total": total, "limit": LIMIT_BYTES}


# --------------------------------------------------------------------------------------------- prepare


def pip_platform_args() -> list[str]:
    """The pip options that pick cp312 manylinux x86_64 wheels."""
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    args += ["--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def run_checked(command: Sequence[str], cwd: Path | None = None, timeout: float = 900) -> str:
    """Run ``command``; raise with its output tail when it fails."""
    done = subprocess.run(list(command), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... failed:\n{tail(done.stdout + done.stderr, 25)}")
    return done.stdout


def elf_needed(path: Path) -> list[str]:
    """The DT_NEEDED names of an ELF64 little-endian file ([] for anything else)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for at in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab + value)
                needed.append(data[strtab + value : end].decode())
    return needed


def repack_pytriton(wheel: Path, target: Path) -> Path:
    """A copy of the pytriton wheel with what tritonserver needs under Python 3.12 only.

    Kept: the ``pytriton`` package (its Python files and ``tritonserver/`` without the stubs of other
    Python versions) and the libraries of ``nvidia_pytriton.libs`` that the kept ELF files link
    against, transitively. ``RECORD`` lists what is kept. Stored uncompressed (the kit's xz compresses).
    """
    stub_dir = "pytriton/tritonserver/python_backend_stubs/"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()

        def wanted(name: str) -> bool:
            if name.startswith(stub_dir):
                return name.startswith(f"{stub_dir}{PYTHON_VERSION}/")
            return not name.startswith("nvidia_pytriton.libs/") and not name.endswith(".dist-info/RECORD")

        kept = {n for n in names if wanted(n)}
        libs = {Path(n).name: n for n in names if n.startswith("nvidia_pytriton.libs/")}
        with tempfile.TemporaryDirectory() as scratch:
            queue = [n for n in kept if n.startswith("pytriton/tritonserver/")]
            seen: set[str] = set()
            while queue:
                name = queue.pop()
                if name in seen:
                    continue
                seen.add(name)
                local = Path(scratch) / "f"
                local.write_bytes(zf.read(name))
                for lib in elf_needed(local):
                    if lib in libs and libs[lib] not in seen:
                        kept.add(libs[lib])
                        queue.append(libs[lib])
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        record = zf.read(record_name).decode().splitlines()
        out = target / wheel.name
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as new:
            for name in names:
                if name in kept:
                    new.writestr(zf.getinfo(name), zf.read(name), compress_type=zipfile.ZIP_STORED)
            lines = [line for line in record if line.split(",", 1)[0] in kept]
            new.writestr(record_name, "\n".join([*lines, f"{record_name},,"]) + "\n")
    return out


def store_wheel(wheel: Path, target: Path) -> Path:
    """Copy of ``wheel`` with its members stored uncompressed (same files, same RECORD)."""
    out = target / wheel.name
    with zipfile.ZipFile(wheel) as zf, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as new:
        for info in zf.infolist():
            new.writestr(info, zf.read(info), compress_type=zipfile.ZIP_STORED)
    return out


def fetch_libb64(cache: Path) -> Path:
    """Debian's libb64 shared object, from ``apt-get download libb64-0d`` (or this machine's copy)."""
    extracted = cache / "libb64" / LIBB64
    if extracted.is_file():
        return extracted
    folder = cache / "libb64"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        run_checked(["apt-get", "download", "libb64-0d"], cwd=folder, timeout=300)
        deb = next(folder.glob("libb64-0d_*.deb"))
        run_checked(["dpkg-deb", "-x", str(deb), str(folder / "root")])
        found = next((folder / "root").rglob(LIBB64))
    except (RuntimeError, StopIteration, FileNotFoundError) as exc:
        local = Path("/usr/lib/x86_64-linux-gnu") / LIBB64
        if not local.is_file():
            raise RuntimeError(f"libb64: apt-get download failed and no local copy ({exc})") from exc
        found = local
    shutil.copyfile(found.resolve(), extracted)  # a plain file, never a link
    return extracted


def kit_key() -> str:
    """What the kit is built from: a rebuild is needed when this changes."""
    text = json.dumps([KIT_FORMAT, PLATFORMS, PYTRITON, GEVENTHTTPCLIENT, KIT_REQUIREMENTS, PYTHON_VERSION])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prepare(root: Path, force: bool = False) -> Path:
    """Build (or reuse) the kit in ``root/.gpu-kit``; return its folder."""
    kit, cache = root / KIT, root / CACHE
    manifest = kit / "kit.json"
    if not force and manifest.is_file() and json.loads(manifest.read_text()).get("key") == kit_key():
        log(f"reusing {KIT} (key {kit_key()})")
        return kit
    downloads = cache / f"downloads-{kit_key()}"
    downloads.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "-d", str(downloads), *pip_platform_args()]
    log("downloading cp312 wheels")
    run_checked([*pip, *KIT_REQUIREMENTS])
    run_checked([*pip, "--no-deps", PYTRITON])
    run_checked(
        [sys.executable, "-m", "pip", "download", "-q", "-d", str(downloads), "--no-deps"]
        + ["--no-binary=:all:", GEVENTHTTPCLIENT]
    )
    libb64 = fetch_libb64(cache)
    stage = cache / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "wheels").mkdir(parents=True)
    files: dict[str, dict[str, Any]] = {}
    for source in sorted(downloads.iterdir()):
        if source.name.startswith("nvidia_pytriton-"):
            log(f"repacking {source.name}")
            out = repack_pytriton(source, stage / "wheels")
        elif source.suffix == ".whl":
            out = store_wheel(source, stage / "wheels")
        else:
            out = stage / "wheels" / source.name
            shutil.copyfile(source, out)
        files[out.name] = {
            "sha256": sha256(out),
            "bytes": out.stat().st_size,
            "download": source.stat().st_size,
        }
    shutil.rmtree(kit, ignore_errors=True)
    kit.mkdir()
    log("compressing the wheels (xz)")
    with lzma.open(kit / "wheels.tar.xz", "wb", preset=9 | lzma.PRESET_EXTREME) as xz:
        with tarfile.open(fileobj=xz, mode="w") as tar:
            for name in sorted(files):
                tar.add(stage / "wheels" / name, arcname=f"wheels/{name}")
    shutil.copyfile(libb64, kit / LIBB64)
    document = {
        "key": kit_key(),
        "python": PYTHON_VERSION,
        "platforms": PLATFORMS,
        "kit_requirements": KIT_REQUIREMENTS,
        "image_requirements": IMAGE_REQUIREMENTS,
        "no_deps": [PYTRITON, GEVENTHTTPCLIENT],
        "files": files,
        "libb64_sha256": sha256(kit / LIBB64),
    }
    manifest.write_text(json.dumps(document, indent=2) + "\n")
    shutil.rmtree(stage, ignore_errors=True)
    return kit


# --------------------------------------------------------------------------------------------- kit checks


def unpack_kit(kit: Path, target: Path) -> Path:
    """Unpack ``wheels.tar.xz`` into ``target/wheels`` (replaced); return that folder."""
    wheels = target / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(kit / "wheels.tar.xz", "r:xz") as tar:
        for member in tar.getmembers():
            if not (member.isfile() and member.name.startswith("wheels/") and "/" not in member.name[7:]):
                raise RuntimeError(f"unexpected kit member {member.name!r}")
        tar.extractall(target)
    return wheels


def check_files(kit: Path, wheels: Path) -> list[str]:
    """Problems of the unpacked kit against its manifest (missing, extra or changed files)."""
    manifest = json.loads((kit / "kit.json").read_text())
    problems = []
    present = {p.name for p in wheels.iterdir()}
    for name, entry in manifest["files"].items():
        if name not in present:
            problems.append(f"missing from the kit: {name}")
        elif sha256(wheels / name) != entry["sha256"]:
            problems.append(f"changed in the kit: {name}")
    problems += [f"not in the manifest: {name}" for name in sorted(present - set(manifest["files"]))]
    if not (kit / LIBB64).is_file():
        problems.append(f"missing from the kit: {LIBB64}")
    return problems


def stand_in_wheel(folder: Path, name: str, version: str) -> Path:
    """An empty wheel named like an image package: the check resolves against it as installed there."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        zf.writestr(
            f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def check_resolution(wheels: Path, scratch: Path) -> tuple[list[str], list[str]]:
    """Resolve the install for cp312 from ``wheels`` alone (no index); return (problems, resolved names).

    The image's packages are empty stand-in wheels in a second folder; everything else must come from
    the kit. The no-deps packages (repacked pytriton) must be present with cp312-compatible tags.
    """
    stand_ins = scratch / "image-stand-ins"
    shutil.rmtree(stand_ins, ignore_errors=True)
    stand_ins.mkdir(parents=True)
    for name, version in IMAGE_PACKAGES.items():
        stand_in_wheel(stand_ins, name, version)
    base = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index"]
    base += ["--disable-pip-version-check", "--no-cache-dir", "--isolated"]
    base += ["--find-links", str(wheels), *pip_platform_args(), "--target", str(scratch / "target")]
    problems: list[str] = []
    resolved: list[str] = []
    report = scratch / "report.json"
    for label, extra in (
        ("kit requirements", ["--find-links", str(stand_ins), *KIT_REQUIREMENTS, *IMAGE_REQUIREMENTS]),
        ("pytriton (no deps)", ["--no-deps", PYTRITON]),
    ):
        done = subprocess.run(
            [*base, "--report", str(report), *extra], capture_output=True, text=True, timeout=600
        )
        if done.returncode != 0:
            problems.append(f"{label} do not resolve from the kit:\n{tail(done.stderr, 12)}")
            continue
        for item in json.loads(report.read_text())["install"]:
            url = item["download_info"]["url"]
            resolved.append(f"{item['metadata']['name']}=={item['metadata']['version']}")
            if not (url.startswith(wheels.as_uri()) or url.startswith(stand_ins.as_uri())):
                problems.append(f"{item['metadata']['name']} came from outside the kit: {url}")
    if not any(p.name.startswith("geventhttpclient-2.0.2") for p in wheels.iterdir()):
        problems.append("missing from the kit: the geventhttpclient 2.0.2 sdist")
    return problems, sorted(set(resolved))


def verify_kit(kit: Path, scratch: Path) -> tuple[list[str], list[str]]:
    """Unpack and check ``kit``: files against the manifest, then the cp312 resolution."""
    wheels = unpack_kit(kit, scratch)
    problems = check_files(kit, wheels)
    more, resolved = check_resolution(wheels, scratch)
    return problems + more, resolved
