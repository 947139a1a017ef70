"""Compile the simulator's hot modules (``computron._fast.MODULES``) with mypyc into build/fast.

Run by ``scripts/build_fast.sh`` with an interpreter that has mypy (mypyc ships with it) and is the
same Python version as the one that will load the build. The sources are copied to a temporary
directory and compiled there, so the source tree never holds a compiled module that would shadow
its ``.py``; the manifest records each source's SHA-256, and ``computron._fast`` loads the build
only while they match. Prints the build directory; exits non-zero if the compile fails.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
from computron import _fast  # noqa: E402  (plain Python: nothing compiled is loaded here)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(_fast.default_dir()))
    a = ap.parse_args()
    out = Path(a.out)
    hashes = _fast.source_hashes()
    with tempfile.TemporaryDirectory(prefix="computron-mypyc-") as tmp:
        work = Path(tmp)
        shutil.copytree(ROOT / "src" / "computron", work / "computron",
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
        files = [str(Path(*m.split(".")).with_suffix(".py")) for m in _fast.MODULES]
        cmd = [sys.executable, "-m", "mypyc", "--follow-imports=silent", "--ignore-missing-imports", *files]
        r = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        if r.returncode:
            sys.stderr.write(r.stdout[-6000:] + r.stderr[-6000:])
            raise SystemExit(f"build_fast: mypyc failed (exit {r.returncode}); the Python modules stay what runs")
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        found: dict[str, str] = {}
        for m in _fast.MODULES:
            so = work / Path(*m.split(".")).with_suffix(suffix)
            dest = out / (m + suffix)
            shutil.copy2(so, dest)
            found[m] = dest.name
        for so in work.glob("*__mypyc" + suffix):  # mypyc's shared library of the group (a top-level module)
            shutil.copy2(so, out / so.name)
            found[so.name[: -len(suffix)]] = so.name
        # last: a build without its manifest is never loaded
        (out / "manifest.json").write_text(json.dumps({
            "suffix": suffix, "python": sys.version.split()[0], "sources": hashes, "files": found,
            "mypy": subprocess.run([sys.executable, "-m", "mypy", "--version"], capture_output=True,
                                   text=True).stdout.strip()}, indent=1) + "\n")
    if _fast.source_hashes() != hashes:  # edited meanwhile: the build would be refused anyway
        (out / "manifest.json").unlink()
        raise SystemExit("build_fast: the sources changed during the build; run it again")
    print(out)


if __name__ == "__main__":
    main()
