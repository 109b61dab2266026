"""A sweep's table in TensorBoard: `tensorboard --logdir ROOT`, the HPARAMS tab.

Each trial that has started gets the run ROOT/<name>/tensorboard/hparams (a fixed name beside
train.py's own events in ROOT/<name>/tensorboard): one event file holding the hparams plugin's
session (the trial's value of every swept key; with --seeds its configuration is the session
group, so the table can show one row per configuration), the trial's results as scalars (those
of summary.csv: the target metric among them) and its status. TensorBoard builds the table
from the sessions: a column per swept key and per result; the trials' learning curves are the
runs ROOT/<name>/tensorboard.

The file is written again only when what it holds changes (its name carries a digest of its
content, the old one is removed), so rewriting the summary while TensorBoard watches the root
adds no duplicates. Like the summary, it is rebuilt from each trial's workdir at any time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

from transformer import metrics, storage
from transformer.tools import sweep_results, sweeps

RUN = 'hparams'  # The run of each trial's session: ROOT/<name>/tensorboard/hparams.
# summary.csv's columns written as the session's results; `config.target_metric` ranks by one.
RESULTS = (
  'eval_loss',
  'best_eval_bleu',
  'best_eval_bleu_lc',
  'decode_bleu',
  'decode_bleu_lc',
  'train_loss',
  'steps',
)
# A trial's status as the hparams plugin's session status (api.proto's Status); others unknown.
_STATUS = {'finished': 'STATUS_SUCCESS', 'failed': 'STATUS_FAILURE', 'running': 'STATUS_RUNNING'}
_SUFFIX = '.sweep-hparams-'  # Event files named ...<suffix><digest of the content>.


def _value(config: Any, key: str) -> str | float | bool:
  node = config
  for part in key.split('.'):
    node = node[part]
  return node if isinstance(node, str | bool) else float(node)


def session(
  sweep: sweeps.Sweep, trial: sweeps.Trial, result: sweep_results.TrialResult
) -> dict[str, Any]:
  """What the trial's session holds: hparams, results, status and group (JSON-able)."""
  return {
    # Every swept key, also where this trial keeps the base value: the columns are the same
    # for every trial, and `base` shows what it ran with.
    # With seeds a session group is a configuration; its seeds are the sessions in it.
    'hparams': {
      key: _value(trial.config, key)
      for key in sweep.swept_keys()
      if not (key == 'seed' and sweep.seeds > 1)
    },
    'results': {
      name: float(getattr(result, name)) for name in RESULTS if getattr(result, name) is not None
    },
    'step': result.steps or 0,
    'status': _STATUS.get(result.status, 'STATUS_UNKNOWN'),
    'group': trial.group or '',
  }


def _plugin_summary(tag: str, **content: Any):
  """A Summary of the hparams plugin's data (`HParamsPluginData` with one of its fields)."""
  metrics.import_tensorboardx()
  from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData
  from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata

  data = HParamsPluginData(version=0, **content)
  plugin = SummaryMetadata.PluginData(plugin_name='hparams', content=data.SerializeToString())
  return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])


def _events(held: dict[str, Any]) -> list:
  """The session's events: its start (hparams, group), results as scalars, its end (status)."""
  metrics.import_tensorboardx()
  from tensorboardX.proto.api_pb2 import Status
  from tensorboardX.proto.event_pb2 import Event
  from tensorboardX.proto.plugin_hparams_pb2 import SessionEndInfo, SessionStartInfo
  from tensorboardX.proto.summary_pb2 import Summary

  start = SessionStartInfo(group_name=held['group'])
  for key, value in held['hparams'].items():
    if isinstance(value, str):
      start.hparams[key].string_value = value
    elif isinstance(value, bool):
      start.hparams[key].bool_value = value
    else:
      start.hparams[key].number_value = value
  now = time.time()
  events = [
    Event(wall_time=now, file_version='brain.Event:2'),
    Event(
      wall_time=now,
      summary=_plugin_summary('_hparams_/session_start_info', session_start_info=start),
    ),
  ]
  if held['results']:
    values = [Summary.Value(tag=k, simple_value=v) for k, v in held['results'].items()]
    events.append(Event(wall_time=now, step=held['step'], summary=Summary(value=values)))
  if held['status'] != 'STATUS_RUNNING':
    end = SessionEndInfo(status=Status.Value(held['status']))
    events.append(
      Event(
        wall_time=now,
        step=held['step'],
        summary=_plugin_summary('_hparams_/session_end_info', session_end_info=end),
      )
    )
  return events


def write_trial(
  sweep: sweeps.Sweep, trial: sweeps.Trial, result: sweep_results.TrialResult
) -> bool:
  """Writes the trial's session unless it holds that already; True if it wrote."""
  held = session(sweep, trial, result)
  digest = hashlib.sha256(json.dumps(held, sort_keys=True).encode()).hexdigest()[:16]
  directory = storage.join(sweep.workdir(trial), 'tensorboard', RUN)
  earlier = storage.glob(directory, 'events.out.tfevents.*') if storage.isdir(directory) else []
  if any(path.endswith(_SUFFIX + digest) for path in earlier):
    return False
  storage.makedirs(directory)
  # Named by the time, so that a TensorBoard watching the root reads it after the one it replaces.
  name = f'events.out.tfevents.{time.time():017.6f}{_SUFFIX}{digest}'
  storage.write_bytes(storage.join(directory, name), metrics.encode_events(_events(held)))
  for path in earlier:
    # Two workers of one study end together and both rewrite every trial's session: the other
    # may have replaced this file already (at least one session file stays: each lists before
    # it writes).
    with contextlib.suppress(FileNotFoundError):
      storage.remove(path)
  return True


def write(
  sweep: sweeps.Sweep,
  results: Sequence[sweep_results.TrialResult | sweep_results.GroupResult] = (),
) -> int:
  """Writes the session of every trial that has started; returns how many were (re)written.

  `results`: what `sweep_summary.write` returned, if at hand; each trial is read otherwise.
  """
  by_name = {
    trial.name: trial
    for result in results
    for trial in (result.trials if isinstance(result, sweep_results.GroupResult) else [result])
  }
  written = 0
  for trial in sweep.trials:
    result = by_name.get(trial.name) or sweep_results.collect(sweep, trial)
    if result.status != 'pending':
      written += write_trial(sweep, trial, result)
  return written
