"""Sweep: each modern switch alone against the paper's model, at `configs/variants_study.py` size.

  python sweep.py --config=configs/variants_study.py \
      --sweep=configs/sweeps/variants_study.py --workdir=workdirs/variants_study \
      --config.data.manual_dir=../shared/data/multi30k

9 trials (a run's time is in configs/variants_study.py), in order of the comparisons the
issue asks for first (post-LN vs pre-norm; sinusoidal vs RoPE vs ALiBi; ReLU vs
SwiGLU at a matched parameter count), so a stopped sweep has the main ones.

With 3 seeds per variant and two tests of each against the paper's model (27 runs
of 2.5-3 minutes each, training and eval.py, about 75 minutes alone on 2 CPU cores;
summary.md says which switches differ significantly from `base`, over sentences and
across seeds; results/variants.md has the measured table):

  python sweep.py --config=configs/variants_study.py \
      --sweep=configs/sweeps/variants_study.py --workdir=workdirs/variants_study_3seeds \
      --seeds=3 --compare_to=base --eval --eval_flags='--split=validation --decoder=greedy' \
      --config.data.manual_dir=../shared/data/multi30k
"""


def sweep() -> list[dict]:
  """The baseline (post_ln, sinusoidal, relu, biases), then one switch value at a time."""
  return [
    {},
    {'model.norm': 'pre_ln'},
    {'model.position': 'rope'},
    {'model.position': 'alibi'},
    # SwiGLU with d_ff shrunk by 2/3 (Shazeer 2020): 3 x 128 x 344 ~ 2 x 128 x 512 parameters.
    {'model.ffn_activation': 'swiglu', 'model.d_ff': 344},
    {'model.norm': 'rmsnorm'},
    {'model.ffn_activation': 'gelu'},
    {'model.position': 'learned'},
    {'model.use_bias': False},
  ]
