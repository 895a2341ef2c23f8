"""What the bench scripts share at the end of a run: the median table and the JSON file.

Run from ``bench/`` (``python bench/<script>.py`` puts this folder first on ``sys.path``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence


def print_medians(medians: Mapping[str, float], names: Sequence[str], *, width: int = 12,
                  base: str = "off") -> None:
    """One line per setting: its median step in ms and its ratio to ``base``."""
    print(f"{'setting':<{width}}{'median ms':>10}{'vs ' + base:>8}")
    for name in names:
        print(f"{name:<{width}}{medians[name]:>10.2f}{medians[name] / medians[base]:>8.3f}")


def write_json(path: str, result: Any, *, indent: int = 2) -> None:
    """``result`` as strict JSON (a non-finite number becomes null, with a warning) at ``path``."""
    from hpfunc.train.output import to_json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(to_json(result, where=str(path), indent=indent))
    print(f"wrote {path}")
