"""``computron bench hybrid`` (``src/computron/colocate/hybrid.py``), at the path the scripts and the
results' commands name: ``python bench/hybrid.py ARGS`` runs ``computron bench hybrid ARGS``, and its names
import from here (``bench/colocate_release.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from computron.colocate.hybrid import *  # noqa: E402,F401,F403
from computron.colocate.hybrid import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
