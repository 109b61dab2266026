"""train.py with a crash point, for the fault-injection tests (tests/test_reliability.py).

  python tests/fault_driver.py --fault=after_step:3 --config=configs/tiny.py --workdir=DIR ...

Takes train.py's flags plus `--fault=<point>:<step>` and trains through
`training.train_and_evaluate` with a hook (`training.Hooks`) that SIGKILLs
this process at that point. SIGKILL cannot be intercepted, so the crash is as
abrupt as an out-of-memory kill or a lost machine, and it happens at an exact
point rather than after a guessed delay. Points:

  after_step:N   at the end of loop iteration N: the step done, its metrics
                 written, and every save started so far committed (the hook
                 waits for them, so that the point is exact).
  during_save:N  inside the save of checkpoint N, in Orbax's background
                 thread: every file is written into the temporary
                 `<N>.orbax-checkpoint-tmp*` folder, not yet renamed into
                 place (committed).

`--signal=<SIGTERM|SIGINT>:<point>:<N>` instead sends this process that signal
(as `kill` or Ctrl-C would) in the middle of data preparation:

  tfds:N         as TFDS writes the prepared dataset, after N examples.
  vocabulary:N   as SentencePiece reads its training sentences, after N.
  encoding:N     as a split's token ids are encoded, after N blocks.
"""

import functools
import os
import signal
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

import train  # noqa: E402, F401  (defines train.py's flags)
from transformer import distributed, preemption, prepared_ids, tokenizer, training  # noqa: E402
from transformer.datasets import parallel_text  # noqa: E402

POINTS = ('after_step', 'during_save')
_FAULT = flags.DEFINE_string(
  'fault', None, '<point>:<step>, point one of after_step, during_save: SIGKILL this process there.'
)
_SIGNAL = flags.DEFINE_string(
  'signal',
  None,
  '<SIGTERM|SIGINT>:<point>:<N>, point one of tfds, vocabulary, encoding: send that signal '
  'to this process there, during data preparation.',
)


def _send(signum: int) -> None:
  logging.warning('--signal: sending %s to this process.', signal.Signals(signum).name)
  logging.flush()
  os.kill(os.getpid(), signum)


def _signal_after(items, count: int, signum: int):
  """Yields `items`, sending `signum` to this process after `count` of them."""
  for index, item in enumerate(items):
    if index == count:
      _send(signum)
    yield item


def install_signal(value: str) -> None:
  """Wraps the data preparation step of `--signal=<SIGNAL>:<point>:<N>` to send the signal."""
  name, point, count = (value.split(':') + ['', ''])[:3]
  if name not in ('SIGTERM', 'SIGINT') or not count.isdigit():
    raise app.UsageError(f'--signal={value!r}: expected <SIGTERM|SIGINT>:<point>:<N>.')
  signum, count = signal.Signals[name], int(count)
  if point == 'tfds':
    generate = parallel_text.ParallelText._generate_examples
    parallel_text.ParallelText._generate_examples = lambda self, paths: _signal_after(
      generate(self, paths), count, signum
    )
  elif point == 'vocabulary':
    sentences = tokenizer._training_sentences
    tokenizer._training_sentences = lambda *args: _signal_after(sentences(*args), count, signum)
  elif point == 'encoding':
    encode = prepared_ids._encode_block
    blocks = iter(range(1 << 30))

    def encode_block(block):
      if next(blocks) == count:
        _send(signum)
      return encode(block)

    prepared_ids._encode_block = encode_block
  else:
    raise app.UsageError(f'--signal={value!r}: {point!r} is not tfds, vocabulary or encoding.')


def _kill_at(
  point: str, fault_step: int, step: int, settle: Callable[[], None] | None = None
) -> None:
  """SIGKILLs this process at `fault_step` (after `settle`, e.g. waiting for saves in flight)."""
  if step != fault_step:
    return
  if settle is not None:
    settle()
  logging.warning('--fault=%s:%d: killing this process with SIGKILL.', point, step)
  logging.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def parse_fault(value: str) -> training.Hooks:
  """The hooks of `--fault=<point>:<step>`."""
  point, _, step = value.partition(':')
  if point not in POINTS or not step.isdigit():
    raise app.UsageError(f'--fault={value!r}: expected <point>:<step> with point one of {POINTS}.')
  return training.Hooks(**{point: functools.partial(_kill_at, point, int(step))})


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  hooks = parse_fault(_FAULT.value) if _FAULT.value else training.Hooks()
  if _SIGNAL.value:
    install_signal(_SIGNAL.value)
  distributed.initialize()
  try:
    training.train_and_evaluate(
      flags.FLAGS.config,
      flags.FLAGS.workdir,
      restore_fallback=flags.FLAGS.restore_fallback,
      profile_steps=flags.FLAGS.profile_steps,
      hooks=hooks,
    )
  except preemption.Interrupted as e:  # As train.py.
    logging.warning('%s', e)
    sys.exit(128 + e.signum)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config', 'workdir'])
  app.run(main)
