"""The optional compiled build of the simulator's hot path: typed, torch-free modules compiled with
mypyc (``scripts/build_fast.sh``), about 3.5x the simulated requests per second of the same modules
as Python (``bench/sim_speed.py --compare-compiled``), with the same outcomes.

The Python modules are always there and are what runs, unless ``COMPUTRON_COMPILED=1`` is set when
``computron`` is first imported. Then ``enable`` looks for a build in ``build/fast`` (or
``COMPUTRON_COMPILED_DIR``) and uses it only if it was made for this Python from exactly the sources
here (each module's SHA-256 is in its manifest): a stale or foreign build is never loaded; a
warning says why and the Python modules run. ``compiled_modules()`` says which ones run compiled.

Compiled classes cannot be patched on an instance (``core.step = ...``) or given attributes they do
not declare; code that does (some tests spy on plans that way) needs the Python modules. mypyc also
checks annotations at run time: a value of another type than declared raises ``TypeError``.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

ENV = "COMPUTRON_COMPILED"
DIR_ENV = "COMPUTRON_COMPILED_DIR"
# What is compiled: the scheduler, the engine core and the simulator's executor, clock and loop (with
# the few helpers they call per step), and the messages of a step (messages.py: its other classes stay
# plain Python classes). Not sim/costs.py (its fields take other types than they declare, converted in
# __post_init__); its step-time functions are, in sim/timing.py.
MODULES = (
    "computron.messages",
    "computron.scheduler.state",
    "computron.scheduler.memory",
    "computron.scheduler.slo",
    "computron.scheduler.scheduler",
    "computron.engine.core",
    "computron.engine.buckets",
    "computron.memory.units",
    "computron.sim.clock",
    "computron.sim.timing",
    "computron.sim.executor",
    "computron.sim.run",
)
SRC = Path(__file__).resolve().parent.parent  # the directory that holds the computron package
_finder: _Finder | None = None


def default_dir() -> Path:
    d = os.environ.get(DIR_ENV)
    return Path(d) if d else SRC.parent / "build" / "fast"


def source_file(module: str) -> Path:
    return SRC.joinpath(*module.split(".")).with_suffix(".py")


def source_hashes() -> dict[str, str]:
    return {m: hashlib.sha256(source_file(m).read_bytes()).hexdigest() for m in MODULES}


def suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def check(root: Path | None = None) -> tuple[dict[str, Path] | None, str]:
    """The build's files by module name (the modules and mypyc's shared library), or None and why
    it may not be used."""
    root = default_dir() if root is None else Path(root)
    try:
        man = json.loads((root / "manifest.json").read_text())
    except FileNotFoundError:
        return None, f"no compiled build in {root} (scripts/build_fast.sh makes one)"
    except (OSError, ValueError) as e:
        return None, f"unreadable manifest in {root}: {e}"
    if man.get("suffix") != suffix():
        return None, f"the build in {root} is for {man.get('suffix')!r}, this Python loads {suffix()!r}"
    want, got = source_hashes(), man.get("sources", {})
    stale = sorted(m for m in MODULES if got.get(m) != want[m])
    if stale:
        return None, f"the build in {root} was made from other sources of {', '.join(stale)} (build it again)"
    files = {name: root / f for name, f in man.get("files", {}).items()}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing or not set(MODULES) <= set(files):
        return None, f"the build in {root} lacks files: {', '.join(missing) or 'modules'}"
    return files, ""


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the compiled modules (and mypyc's shared library) in the build, before the sources."""

    def __init__(self, files: dict[str, Path]):
        self.files = files

    def find_spec(self, name, path=None, target=None):
        f = self.files.get(name)
        if f is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(name, str(f))
        return importlib.util.spec_from_file_location(name, str(f), loader=loader)


def enable(root: Path | None = None) -> str:
    """Load the compiled modules from now on; '' if so, else why not (the Python modules run).
    Must come before any of ``MODULES`` is imported (``computron/__init__.py`` calls it)."""
    global _finder
    if _finder is not None:
        return ""
    early = [m for m in MODULES if m in sys.modules]
    if early:
        return f"already imported as Python: {', '.join(early)}"
    files, why = check(root)
    if files is None:
        return why
    _finder = _Finder(files)
    sys.meta_path.insert(0, _finder)
    return ""


def compiled_modules() -> list[str]:
    """Those of ``MODULES`` imported so far that run compiled."""
    return [m for m in MODULES if m in sys.modules and
            str(getattr(sys.modules[m], "__file__", "") or "").endswith(suffix())]


def requested() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def enable_if_requested() -> None:
    if requested():
        why = enable()
        if why:
            warnings.warn(f"{ENV}=1 but the Python modules run: {why}", RuntimeWarning, stacklevel=3)
