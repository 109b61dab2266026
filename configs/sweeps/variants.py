"""Sweep: the modern variants against the paper's model on Multi30k, one switch at a time.

Every trial is `configs/default.py` (Multi30k En->De, the same steps, batch and
schedule) with one switch changed; compare validation loss and BLEU at equal
steps. The first trial (`base`) is the paper's model.

  python sweep.py --config=configs/default.py --sweep=configs/sweeps/variants.py \
      --workdir=workdirs/variants --config.data.manual_dir=../shared/data/multi30k

runs the 10 trials one after another, each as long as the default run (see its
docstring); add `--dry_run` to print their train.py commands instead.
"""

from transformer.tools import sweeps


def sweep() -> list[dict]:
  """The baseline (post_ln, sinusoidal, relu, biases), then each other switch value alone."""
  return sweeps.one_at_a_time(
    {
      'model.norm': ['pre_ln', 'rmsnorm'],
      'model.position': ['learned', 'rope', 'alibi'],
      'model.ffn_activation': ['gelu', 'swiglu'],  # SwiGLU: 1.5x the FFN parameters at one d_ff.
      'model.use_bias': [False],
    }
  ) + [
    # SwiGLU at the FFN size of the baseline (Shazeer 2020 shrinks d_ff by 2/3; 680 ~ 1024 * 2/3).
    {'model.ffn_activation': 'swiglu', 'model.d_ff': 680},
  ]
