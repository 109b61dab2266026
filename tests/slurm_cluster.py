"""A single-node Slurm on 127.0.0.1 for the tests: munged, slurmctld and slurmd in a folder.

Debian's `slurm-wlm` and `munge` (`.ci/run` installs them). `start(folder)` writes a minimal
slurm.conf (no cgroups: proctrack/linuxproc, task/none; one node, `localhost`, of 2 CPUs; no
accounting database), starts the three daemons as the current user on free ports, and waits
until the node is idle. Clients find the cluster through `SLURM_CONF` (`Cluster.env`).
`stop()` cancels what still runs and stops the daemons it started, by their pids.

Where that cannot be done (no binaries, a daemon that exits or a node that never comes up),
`start` raises `Unavailable` with the reason: the daemon's own log lines.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ('munged', 'slurmctld', 'slurmd')
CLIENTS = ('sbatch', 'srun', 'squeue', 'scontrol', 'scancel', 'sinfo')
_START_SECONDS = 30.0


class Unavailable(RuntimeError):
  """Slurm cannot run here; the message says why."""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


_CONF = """\
ClusterName=pytest
SlurmctldHost=localhost(127.0.0.1)
SlurmUser={user}
SlurmdUser={user}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge/munge.socket
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
PlugStackConfig={folder}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@dataclasses.dataclass
class Cluster:
  folder: Path
  env: dict[str, str]  # os.environ with SLURM_CONF: what clients and sbatch's jobs see.

  def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
      command, env=self.env, capture_output=True, text=True, timeout=60, check=check
    )

  def logs(self, lines: int = 20) -> str:
    """The last lines of each daemon's log."""
    parts = []
    for name in ('munge/munged.log', 'slurmctld.log', 'slurmd.log'):
      path = self.folder / name
      if path.exists():
        tail = path.read_text(errors='replace').splitlines()[-lines:]
        parts.append(f'--- {path}\n' + '\n'.join(tail))
    return '\n'.join(parts)

  def stop(self) -> None:
    """Cancels every job, then stops the daemons this cluster started."""
    self.run('scancel', f'--user={getpass.getuser()}', check=False)
    deadline = time.time() + 30
    while time.time() < deadline and self.run('squeue', '-h', check=False).stdout.strip():
      time.sleep(0.5)
    for pid_file in ('slurmd.pid', 'slurmctld.pid', 'munge/munged.pid'):
      path = self.folder / pid_file
      if not path.exists():
        continue
      pid = int(path.read_text().split()[0])
      try:
        os.kill(pid, signal.SIGTERM)
      except ProcessLookupError:
        continue
      for _ in range(100):
        try:
          os.kill(pid, 0)
        except ProcessLookupError:
          break
        time.sleep(0.1)


def start(folder: Path) -> Cluster:
  """Starts the cluster in `folder` (fresh state); raises `Unavailable` saying why it cannot."""
  missing = [name for name in DAEMONS + CLIENTS if not shutil.which(name)]
  if missing:
    raise Unavailable(
      f'{", ".join(missing)} not found: Slurm and munge are not installed '
      '(apt-get install slurm-wlm munge).'
    )
  folder.mkdir(parents=True, exist_ok=True)
  for sub in ('munge', 'state', 'spool'):
    (folder / sub).mkdir(exist_ok=True)
  (folder / 'munge').chmod(0o700)
  key = folder / 'munge' / 'munge.key'
  key.write_bytes(os.urandom(128))
  key.chmod(0o400)
  (folder / 'plugstack.conf').write_text('')
  conf = folder / 'slurm.conf'
  conf.write_text(
    _CONF.format(user=getpass.getuser(), folder=folder, ctld_port=_free_port(), d_port=_free_port())
  )
  cluster = Cluster(folder, {**os.environ, 'SLURM_CONF': str(conf)})
  munge = folder / 'munge'
  commands = [
    [
      'munged',
      '--force',
      f'--socket={munge}/munge.socket',
      f'--key-file={key}',
      f'--pid-file={munge}/munged.pid',
      f'--log-file={munge}/munged.log',
      f'--seed-file={munge}/munged.seed',
    ],
    ['slurmctld', '-f', str(conf)],
    ['slurmd', '-f', str(conf), '-N', 'localhost'],
  ]
  for command in commands:
    result = cluster.run(*command, check=False)
    if result.returncode != 0:
      cluster.stop()
      raise Unavailable(
        f'{command[0]} exited with status {result.returncode}: {result.stderr.strip()}\n'
        + cluster.logs()
      )
  deadline = time.time() + _START_SECONDS
  state = ''
  while time.time() < deadline:
    state = cluster.run('sinfo', '-h', '-N', '-o', '%T', check=False).stdout.strip()
    if state == 'idle':
      return cluster
    time.sleep(0.5)
  cluster.stop()
  raise Unavailable(
    f'the node is {state or "unknown"!r}, not idle, {_START_SECONDS:.0f} s after the daemons '
    f'started:\n{cluster.logs()}'
  )
