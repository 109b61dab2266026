"""Writes docs/config.md's table of every config field from its declaration (`config_fields`).

  python -m transformer.tools.config_reference [--output=docs/config.md]

tests/test_config_fields.py fails while the file differs from what this writes.
"""

import os
import sys

from transformer import CODE_DIR, config_fields

PATH = os.path.join(CODE_DIR, 'docs', 'config.md')
HEADER = """# Config reference

Every field of a training config, generated from its one declaration in
`transformer/config_fields.py` by `python -m transformer.tools.config_reference` (do not edit
by hand). Override any of them as `--config.KEY=VALUE` (e.g. `--config.model.num_layers=3`);
configs/*.py start from these defaults (`configs/default.py`) and change what they need.

*On resume* says what changing the value means when a workdir is resumed: **free** (logged),
**warned** (training goes on differently from the checkpoint), **refused (weights)** (the
checkpoints would be read as another model: train in a new workdir) or **refused (start)**
(where the parameters started, `init_from`). *Runs before it* is the value that runs written
before the field existed had: their `config.json` is read with it.

"""


def text() -> str:
  return HEADER + config_fields.reference_table()


def main(argv: list[str]) -> None:
  path = next((a.split('=', 1)[1] for a in argv[1:] if a.startswith('--output=')), PATH)
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text())
  print(f'Wrote {path} ({len(config_fields.FIELDS)} fields).')


if __name__ == '__main__':
  main(sys.argv)
