"""``python -m placement.formats``: regenerate the published JSON Schemas in ``placement/schemas/``."""

import json
from pathlib import Path

from placement.formats import atomic_write_text, json_schemas

if __name__ == "__main__":
    out_dir = Path(__file__).resolve().parent.parent / "schemas"
    for name, schema in json_schemas().items():
        atomic_write_text(out_dir / name, json.dumps(schema, indent=2) + "\n")
        print(f"wrote {out_dir / name}")
