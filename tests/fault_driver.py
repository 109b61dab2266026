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

Two more points act without killing:

  term_during_save:N   sends this process SIGTERM from inside the save of checkpoint N (as
                       during_save:N), then lets the save go on: a preemption notice that
                       arrives while a checkpoint commits.
  pause_during_save:N  inside the save of checkpoint N (as during_save:N), creates the file
                       named by --pause_file with '.ready' appended, then waits until that
                       file itself exists, then lets the save go on: the test does something
                       in between (stops the object store from answering).

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
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

import train  # noqa: E402, F401  (defines train.py's flags)
from transformer import distributed, preemption, prepared_ids, tokenizer, training  # noqa: E402
from transformer.datasets import parallel_text  # noqa: E402

POINTS = ('after_step', 'during_save', 'term_during_save', 'pause_during_save')
_FAULT = flags.DEFINE_string(
  'fault', None, f'<point>:<step>, point one of {POINTS}: act there (the module docstring).'
)
_PAUSE_FILE = flags.DEFINE_string(
  'pause_file', None, 'With --fault=pause_during_save:N: the file to wait for.'
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


def _term_at(fault_step: int, step: int) -> None:
  if step == fault_step:
    logging.warning('--fault=term_during_save:%d: sending SIGTERM to this process.', step)
    os.kill(os.getpid(), signal.SIGTERM)


def _pause_at(fault_step: int, pause_file: str, step: int) -> None:
  if step != fault_step:
    return
  logging.warning('--fault=pause_during_save:%d: waiting for %s.', step, pause_file)
  logging.flush()
  with open(pause_file + '.ready', 'w'):
    pass
  while not os.path.exists(pause_file):
    time.sleep(0.05)


def parse_fault(value: str, pause_file: str | None = None) -> training.Hooks:
  """The hooks of `--fault=<point>:<step>`."""
  point, _, step = value.partition(':')
  if point not in POINTS or not step.isdigit():
    raise app.UsageError(f'--fault={value!r}: expected <point>:<step> with point one of {POINTS}.')
  if point == 'term_during_save':
    return training.Hooks(during_save=functools.partial(_term_at, int(step)))
  if point == 'pause_during_save':
    if not pause_file:
      raise app.UsageError('--fault=pause_during_save:N needs --pause_file.')
    return training.Hooks(during_save=functools.partial(_pause_at, int(step), pause_file))
  return training.Hooks(**{point: functools.partial(_kill_at, point, int(step))})


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  hooks = parse_fault(_FAULT.value, _PAUSE_FILE.value) if _FAULT.value else training.Hooks()
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
