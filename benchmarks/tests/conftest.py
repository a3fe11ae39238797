"""The lab scripts' tests import the scripts by their module names (``import peer_bench``), as the scripts
import each other when run as ``python benchmarks/<script>.py``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
