"""Models in and out: Hugging Face Marian and CTranslate2 (see docs/interop.md).

Export a run's checkpoint (`--checkpoint`: latest, a step, avg:N, best, ... as eval.py reads
them; default the run's config.decode.checkpoint):

  python convert.py --workdir=RUN --to_hf=DIR            # transformers.MarianMTModel
  python convert.py --workdir=RUN --to_ctranslate2=DIR --quantization=int8

Import a Hugging Face Marian directory as a workdir (the data and training settings come
from --config; the model, vocabulary and decoding from the directory):

  python convert.py --from_hf=DIR --workdir=NEW --config=configs/multi30k_paper.py

then `eval.py --workdir=NEW` scores it and `train.py --config.init_from=NEW` fine-tunes it.
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends this at once while it imports.

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from transformer import checkpoint_spec, errors  # noqa: E402
from transformer import config as config_lib  # noqa: E402
from transformer.errors import InvalidInput  # noqa: E402
from transformer.interop import ctranslate2_model, workdirs  # noqa: E402

_WORKDIR = flags.DEFINE_string(
  'workdir', None, 'The run to export; with --from_hf, the new workdir to write.'
)
_TO_HF = flags.DEFINE_string('to_hf', None, 'Write a Hugging Face Marian directory here (new).')
_TO_CT2 = flags.DEFINE_string(
  'to_ctranslate2', None, 'Write a CTranslate2 model directory here (new).'
)
_FROM_HF = flags.DEFINE_string('from_hf', None, 'Import this Hugging Face Marian directory.')
_CHECKPOINT = flags.DEFINE_string(
  'checkpoint', None, "Which parameters to export (default: the run's config.decode.checkpoint)."
)
_QUANTIZATION = flags.DEFINE_enum(
  'quantization',
  'float32',
  ctranslate2_model.QUANTIZATIONS,
  "CTranslate2's weight type (--to_ctranslate2).",
)
_ALLOW_NORM_EPSILON = flags.DEFINE_bool(
  'allow_norm_epsilon',
  False,
  "--to_hf: export a model whose config.model.norm_epsilon is not Marian's 1e-5 (an "
  'approximation: transformers then computes slightly different numbers).',
)
_CONFIG = config_flags.DEFINE_config_file(
  'config', 'configs/default.py', '--from_hf: the data and training settings.', lock_config=True
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  jobs = [
    name
    for name, flag in (('--to_hf', _TO_HF), ('--to_ctranslate2', _TO_CT2), ('--from_hf', _FROM_HF))
    if flag.value is not None
  ]
  if len(jobs) != 1:
    raise app.UsageError(
      f'Give exactly one of --to_hf, --to_ctranslate2 and --from_hf (got {jobs or "none"}).'
    )
  if not _WORKDIR.value:
    raise app.UsageError('--workdir is required: the run to export, or the new one to import to.')
  if _CHECKPOINT.value is not None:
    if _FROM_HF.value is not None:
      raise app.UsageError('--checkpoint chooses what to export; --from_hf has none.')
    if error := checkpoint_spec.error(_CHECKPOINT.value):
      raise InvalidInput(f'--{error}')
  if _QUANTIZATION.present and _TO_CT2.value is None:
    raise app.UsageError('--quantization is for --to_ctranslate2.')
  if _ALLOW_NORM_EPSILON.present and _TO_HF.value is None:
    raise app.UsageError('--allow_norm_epsilon is for --to_hf.')
  if _FROM_HF.value is not None:
    overridden = config_flags.get_override_values(flags.FLAGS['config'])
    config_lib.raise_if(config_lib.ignored_override_errors(_CONFIG.value, overridden))
    workdirs.import_hf(_FROM_HF.value, _WORKDIR.value, _CONFIG.value, overridden)
  elif _TO_HF.value is not None:
    workdirs.export_hf(
      _WORKDIR.value,
      _TO_HF.value,
      _CHECKPOINT.value,
      allow_norm_epsilon=_ALLOW_NORM_EPSILON.value,
    )
  else:
    workdirs.export_ctranslate2(
      _WORKDIR.value, _TO_CT2.value, _CHECKPOINT.value, quantization=_QUANTIZATION.value
    )


if __name__ == '__main__':
  errors.run(main, flags_parser=config_lib.parse_flags)
