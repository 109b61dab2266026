"""Weights & Biases, opt-in: a training run's rows and config in a W&B run (`config.wandb`).

Off unless `config.wandb.project` is set, and `wandb` is then the only thing it needs
(the tracking extra: `pip install -r requirements/tracking.txt`; the project never imports
it otherwise, and without it refuses a run that sets the project, before any work). The run
sends what metrics.jsonl and TensorBoard get, row by row (`MetricsWriter`'s mirror), and its
resolved config, so that a sweep's trials form W&B's table of hyperparameters.

The rows are sent, not read back from the event files (W&B's `sync_tensorboard`):
that option hooks the TensorBoard writer classes of TensorFlow, PyTorch and
tensorboardX, and this project writes its event files itself (`metrics.EventFile`,
for buckets and for `purge_step`), so W&B would see none of them.

One W&B run per workdir: its id is kept in WORKDIR/wandb.json, so a resumed run
goes on in the same W&B run (`resume='allow'`). W&B's history only grows: the
steps a resume trains again after its checkpoint keep the values of the start that
was cut short there (metrics.jsonl and TensorBoard drop those), and W&B warns about
each such row. With `config.wandb.mode='offline'` nothing leaves the machine; the
run is kept under WORKDIR/wandb/ (`wandb sync` uploads it later).
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import ml_collections
from absl import logging

from transformer import config as config_lib
from transformer import extras, storage
from transformer.errors import InvalidInput

FILENAME = 'wandb.json'  # WORKDIR/wandb.json: {"id": ...}, the W&B run of this workdir.
FOLDER = 'wandb'  # WORKDIR/wandb/: W&B's own files of a local workdir.


_OFFLINE_MODES = ('offline', 'disabled', 'dryrun')  # WANDB_MODE values that need no login.


def login_errors(config: ml_collections.ConfigDict) -> list[str]:
  """Why a run of `config` could not start W&B here ([] when it needs none or has one).

  The wandb package (the tracking extra), then what `wandb.init` looks for online, without
  starting a run or asking: WANDB_API_KEY (or an identity token file), ~/.netrc's entry for the
  W&B host, W&B's settings. `sweep.py` checks it before its first trial (and with --dry_run),
  since every trial would fail at its start without it.
  """
  if not config.wandb.project:
    return []
  use = config_lib.wandb_use(config.wandb.project)
  if problem := extras.missing('wandb', 'tracking', use):
    return [f"{problem} Or set config.wandb.project='' to train without W&B."]
  if config.wandb.mode != 'online':
    return []
  if os.environ.get('WANDB_MODE', '').lower() in _OFFLINE_MODES:
    return []
  host = 'the W&B host'
  try:
    from wandb.sdk import wandb_setup  # pylint: disable=g-import-not-at-top
    from wandb.sdk.lib.wbauth import HostUrl, authenticate  # pylint: disable=g-import-not-at-top

    host = wandb_setup.singleton().settings.base_url
    found = authenticate._use_system_auth(  # noqa: SLF001  (how wandb.init finds it)
      host=HostUrl(host), source='check', update_session=False
    )
  except (ImportError, AttributeError, TypeError):
    return []  # Another wandb than 0.31's layout: the run's own start tells.
  except Exception as e:  # W&B's AuthenticationError: a key of the wrong form.
    found, host = None, f'{host} ({e})'
  if found is not None:
    return []
  return [
    f'config.wandb.project={config.wandb.project!r} logs to Weights & Biases online, but no W&B '
    f'login is found here for {host} (no WANDB_API_KEY, no ~/.netrc entry): every run would '
    'stop at its start. Log in (wandb login, or set WANDB_API_KEY), set config.wandb.mode='
    "'offline' (wandb sync uploads it later), or set config.wandb.project='' to train without "
    'W&B.'
  ]


class WandbRun:
  """The W&B run of one workdir, on process 0; `log` and `finish` never stop training."""

  def __init__(self, run: Any):
    self._run = run
    self._failed = False

  @classmethod
  def start(cls, config: ml_collections.ConfigDict, workdir: str) -> WandbRun | None:
    """Opens (or resumes) the workdir's W&B run; None when `config.wandb.project` is ''.

    Raises:
      InvalidInput: W&B did not start (no login, no network, a refused name), before
        anything of the run is written; what this start left in WORKDIR/wandb/ is removed.
    """
    if not config.wandb.project:
      return None
    wandb = extras.require('wandb', 'tracking', config_lib.wandb_use(config.wandb.project))

    id_path = storage.join(workdir, FILENAME)
    saved = None
    if storage.exists(id_path):
      saved = storage.read_json(id_path, 'Delete it to send this run to a new W&B run.')
      if not isinstance(saved, dict) or not isinstance(saved.get('id'), str) or not saved['id']:
        raise InvalidInput(
          f'{id_path} does not name a W&B run (expected {{"id": "..."}}). Nothing was changed. '
          'Delete it to send this run to a new W&B run.'
        )
    run_id = saved['id'] if saved else secrets.token_hex(4)
    local = not storage.is_url(workdir)
    folder = os.path.join(workdir, FOLDER)
    created = local and not os.path.exists(folder)
    if created:
      os.makedirs(folder)
    try:
      run = wandb.init(
        project=config.wandb.project,
        entity=config.wandb.entity or None,
        group=config.wandb.group or None,
        name=storage.basename(workdir.rstrip('/')),
        id=run_id,
        resume='allow',
        mode=config.wandb.mode,
        dir=workdir if local else None,  # A bucket workdir: W&B's default folder here.
        config=config.to_dict(),
        settings=wandb.Settings(console='off'),  # Console output stays the process's own.
      )
    except Exception as e:  # W&B raises its own kinds (UsageError, CommError, ...).
      if created:
        storage.rmtree(folder)
      raise InvalidInput(
        f'Weights & Biases did not start for config.wandb.project={config.wandb.project!r} '
        f'(mode {config.wandb.mode!r}): {type(e).__name__}: {e}\nNothing of the run was '
        "written. Log in (wandb login), set config.wandb.mode='offline', or set "
        "config.wandb.project='' to train without W&B."
      ) from None
    if not saved:
      storage.write_json(id_path, {'id': run_id})
    logging.info('Weights & Biases: run %s of project %s (%s).', run_id, run.project, run.url)
    return cls(run)

  def log(self, step: int, metrics: dict[str, float]) -> None:
    """Sends one row; a failure is warned about once, and training goes on."""
    if self._failed:
      return
    try:
      self._run.log(dict(metrics), step=int(step))
    except Exception as e:  # W&B must never stop a run: metrics.jsonl is the record.
      self._failed = True
      logging.warning('Weights & Biases: rows from step %d on are not sent: %s', step, e)

  def finish(self, failed: bool = False) -> None:
    try:
      self._run.finish(exit_code=1 if failed else 0)
    except Exception as e:  # Finishing must not hide the run's own outcome.
      logging.warning('Weights & Biases: the run did not finish cleanly: %s', e)
