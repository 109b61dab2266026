"""Optional packages: each set beyond the core is an extra, and a missing one is refused by name.

The core (`requirements/core.txt`, pyproject.toml's `dependencies`) trains and evaluates on
local disk. The rest is opt-in, one pinned file and one extra of pyproject.toml each:

  buckets   gcsfs, s3fs: gs:// and s3:// paths (`storage.path_errors`)
  sweeps    optuna, submitit: sweep.py --search=optuna, --launcher=slurm
  tracking  wandb: config.wandb (`wandb_run`)
  interop   torch, transformers, ctranslate2: convert.py --to_ctranslate2, pytorch_model.bin
  tpu       libtpu (jax[tpu]): train.py --dry_run --topology, compiled for a TPU slice
  gpu       JAX's CUDA plugin, CUDA's ptxas: train.py --dry_run --topology=h100:8, for GPUs
  test      pytest, the local storage servers of the tests, ruff

Code that needs one of these packages asks here before it does any work: `require` imports it or
raises `InvalidInput`, whose one message names the extra and its requirements file; `missing`
gives that message without importing the package, for a list of errors.
"""

from __future__ import annotations

import importlib
import importlib.util
import types

from transformer.errors import InvalidInput

EXTRAS = ('buckets', 'sweeps', 'tracking', 'interop', 'tpu', 'gpu', 'test')


def requirements_file(extra: str) -> str:
  """The pinned file of `extra`, relative to the repository root."""
  return f'requirements/{extra}.txt'


def message(module: str, extra: str, what: str, problem: str = 'is not installed') -> str:
  """`what` (a flag, a path, a setting) needs `module` of `extra`: how to install it."""
  return (
    f'{what} needs {module}, which {problem}: pip install -r {requirements_file(extra)} '
    f"(or pip install '.[{extra}]')."
  )


def missing(module: str, extra: str, what: str) -> str | None:
  """`message` if `module` is not installed (looked up, not imported); None if it is."""
  try:
    found = importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):  # A parent package missing; a module without a spec.
    found = False
  return None if found else message(module, extra, what)


def require(module: str, extra: str, what: str) -> types.ModuleType:
  """`module`, imported; `InvalidInput` naming `extra` if it is not installed or fails to import.

  Args:
    module: The import name (`gcsfs`, `ctranslate2`).
    extra: The extra of pyproject.toml that installs it (one of `EXTRAS`).
    what: What needs it, as the message's subject: '--launcher=slurm', 'a gs:// path'.
  """
  try:
    return importlib.import_module(module)
  except ImportError as e:
    top = module.split('.')[0]
    absent = e.name is not None and (e.name == top or e.name.startswith(f'{top}.'))
    # Installed, but what it imports is not (or is broken): the import's own words.
    problem = 'is not installed' if absent else f'cannot be imported ({e})'
    raise InvalidInput(message(module, extra, what, problem)) from None
