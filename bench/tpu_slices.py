"""The paper's configs compiled for the TPU slices people rent: docs/devices.md's table.

  python bench/tpu_slices.py                       # every config x slice x attention
  python bench/tpu_slices.py --configs=wmt14_ende_base --slices=v5e-8 --attention=xla

Each row is `train.py --config=configs/CONFIG.py --dry_run --topology=SLICE
--config.model.attention_impl=IMPL`'s train step (`tpu_compile.compile_run`): the TPU
compiler's memory per device beside `transformer/memory.py`'s estimate, whether it fits the
chip's HBM, the FLOPs per step, and the bound step time and MFU that follow from the chip's
published peak and bandwidth. A row that does not fit also gets the first change of
`tpu_compile.find_fit` that does, found by compiling. Needs the `tpu` extra (libtpu); nothing
runs on a TPU. Prints a Markdown table (and each row's command) to stdout.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

from absl import app, flags

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer import config_fields, tpu_compile, tpu_topology  # noqa: E402
from transformer.tpu_topology import GIB  # noqa: E402

CONFIGS = ('wmt14_ende_base', 'wmt14_ende_big', 'wmt14_enfr_big', 'lm1b')
SLICES = ('v4-8', 'v5e-8', 'v5e-16', 'v5p-8', 'v6e-8')

_CONFIGS = flags.DEFINE_list('configs', list(CONFIGS), 'Config modules under configs/.')
_SLICES = flags.DEFINE_list('slices', list(SLICES), 'Topologies, as --topology takes them.')
_ATTENTION = flags.DEFINE_list(
  'attention', ['xla', 'pallas'], 'Values of config.model.attention_impl, one row each.'
)
_FIND_FIT = flags.DEFINE_bool('find_fit', True, 'For a row that does not fit, compile changes.')

HEADER = (
  '| config | slice | attention | mesh | rows/device | compiler GiB | estimate GiB | fits '
  '| TFLOP/step | step ≥ ms | MFU ≤ | changed |\n'
  '|---|---|---|---|---|---|---|---|---|---|---|---|'
)


def row(name: str, report: tpu_compile.Report, impl: str, change: str = '') -> str:
  """One Markdown row of `report`'s train step; `change`: what `find_fit` changed."""
  train = report.train
  mesh = '×'.join(f'{axis} {size}' for axis, size in report.mesh.items() if size > 1) or '1'
  rows = report.train_rows // (report.mesh['data'] * report.mesh['fsdp'])
  estimate = f'{report.estimate / GIB:.2f}'
  if train.error is not None:
    figures = f'over HBM | {estimate} | no | | |'
  else:
    figures = (
      f'{train.total / GIB:.2f} | {estimate} ({report.estimate / train.total:.2f}x) | '
      f'{"yes" if report.fits() else "no"} | '
      f'{report.step_flops() * report.topology.chips / 1e12:,.1f} | '
      f'{report.step_seconds() * 1e3:,.0f} | {report.mfu_ceiling():.0%}'
    )
  return f'| {name} | {report.topology.name} | {impl} | {mesh} | {rows} | {figures} | {change} |'


def main(argv):
  del argv
  tpu_topology.require_extra()
  lines, commands = [HEADER], []
  for name in _CONFIGS.value:
    base = importlib.import_module(f'configs.{name}').get_config()
    for value in _SLICES.value:
      topology = tpu_topology.parse(value)
      devices = tpu_topology.devices(topology)
      for impl in _ATTENTION.value:
        config = config_fields.with_values(base, {'model.attention_impl': impl})
        start = time.perf_counter()
        report = tpu_compile.compile_run(config, topology, ('train step',), devices)
        lines.append(row(name, report, impl))
        command = (
          f'python train.py --config=configs/{name}.py --dry_run --topology={value} '
          f'--config.model.attention_impl={impl}'
        )
        if not report.fits() and _FIND_FIT.value:
          found = tpu_compile.find_fit(config, topology, devices, lambda _: None)
          if found is None:
            lines[-1] = lines[-1][:-2] + 'nothing find_fit tries fits |'
          else:
            description, overrides, fitted = found
            lines.append(row(name, fitted, impl, description))
        commands.append(f'{command}  # {time.perf_counter() - start:.0f} s')
        print(lines[-1], file=sys.stderr, flush=True)
  print('\n'.join(lines))
  print('\nCommands (compile time on this host):\n')
  print('\n'.join(commands))


if __name__ == '__main__':
  app.run(main)
