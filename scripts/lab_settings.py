"""JupyterLab defaults for the workbench's .venv: ``{sys.prefix}/share/jupyter/lab/settings/overrides.json``
gets ``"saveState": true`` for the widget manager (a saved notebook keeps its widgets' state, so an
interactive control reopens drawn, not as "model not found").  Keeps any other override there;
run by scripts/quickstart.sh, idempotent."""

from __future__ import annotations

import json
import sys
from pathlib import Path

PLUGIN = "@jupyter-widgets/jupyterlab-manager:plugin"


def main() -> int:
    path = Path(sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    try:
        current = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        print(f"{path}: not valid JSON; leaving it alone (add {PLUGIN!r}: {{'saveState': true}} by hand)",
              file=sys.stderr)
        return 0
    current.setdefault(PLUGIN, {})["saveState"] = True
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(current, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
