"""Sweep: the modern variants against the paper's model on Multi30k, one switch at a time.

Every run is `configs/default.py` (Multi30k En->De, the same steps, batch and
schedule) with one override dict from `sweep()`; compare validation loss and BLEU
at equal steps. An override dict becomes command-line flags, e.g. for
`{'model.position': 'rope'}`:

  python train.py --config=configs/default.py --workdir=workdirs/m30k_position_rope \
      --config.data.manual_dir=../shared/data/multi30k --config.model.position=rope

`python -m configs.variants` prints the command of every run. Each takes as long
as the default run (see its docstring); `{}` is the baseline.
"""

from typing import Any


def sweep() -> list[dict[str, Any]]:
  """Override dicts (dotted config keys): the baseline, then each switch value alone."""
  return [
    {},  # The paper: post_ln, sinusoidal, relu, biases.
    {'model.norm': 'pre_ln'},
    {'model.norm': 'rmsnorm'},
    {'model.position': 'learned'},
    {'model.position': 'rope'},
    {'model.position': 'alibi'},
    {'model.ffn_activation': 'gelu'},
    {'model.ffn_activation': 'swiglu'},  # 1.5x the FFN parameters at the same d_ff.
    # SwiGLU at the FFN size of the baseline (Shazeer 2020 shrinks d_ff by 2/3; 680 ~ 1024 * 2/3).
    {'model.ffn_activation': 'swiglu', 'model.d_ff': 680},
    {'model.use_bias': False},
  ]


def command(overrides: dict[str, Any]) -> str:
  """The train.py command line of one run of the sweep."""
  name = '_'.join(f'{key.split(".")[-1]}_{value}' for key, value in overrides.items())
  flags = ''.join(f' --config.{key}={value}' for key, value in overrides.items())
  return (f'python train.py --config=configs/default.py --workdir=workdirs/m30k_{name or "paper"}'
          f' --config.data.manual_dir=../shared/data/multi30k{flags}')


if __name__ == '__main__':
  for overrides in sweep():
    print(command(overrides))
