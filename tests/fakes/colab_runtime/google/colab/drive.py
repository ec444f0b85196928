"""``google.colab.drive`` in the Colab simulator's runtimes: Colab's two calls with Colab's
lines and errors (googlecolab/colabtools, google/colab/drive.py): ``mount`` prints ``Mounted at
...`` or that Drive is already mounted, and raises ``ValueError`` for a bad mount point;
``flush_and_unmount`` prints that nothing is mounted, or pushes every pending change (blocking)
and unmounts, raising ``ValueError('flush_and_unmount failed')`` if that fails or times out.
The simulator does the work (``colab_sim.py _drive``); here only the mount of this process's
namespace is changed (each ``colab exec`` has its own; later ones follow the simulator).
"""
import os as _os
import subprocess as _subprocess
import sys as _sys

__all__ = ['flush_and_unmount', 'mount']

_SIMULATED = '/content/drive'


def _sim(*args):
    return _subprocess.run(
        [_sys.executable, _os.environ['COLAB_SIM_SCRIPT'], '_drive', args[0],
         _os.environ['COLAB_SIM_SESSION'], *args[1:]],
        stdout=_subprocess.PIPE, text=True)


def _is_mount_point(mountpoint):
    target = _os.path.realpath(mountpoint)
    with open('/proc/self/mountinfo') as f:
        return any(line.split()[4] == target for line in f)


def flush_and_unmount(timeout_ms=24 * 60 * 60 * 1000):
    """Unmount Google Drive and flush any outstanding writes to it."""
    if not _is_mount_point(_SIMULATED):
        print('Drive not mounted, so nothing to flush and unmount.')
        return
    if _sim('flush', str(timeout_ms / 1000)).returncode:
        raise ValueError('flush_and_unmount failed')
    _subprocess.run(['umount', _SIMULATED], check=True)


def mount(mountpoint, force_remount=False, timeout_ms=120000, readonly=False):
    """Mount your Google Drive at the specified mountpoint path."""
    if ' ' in mountpoint:
        raise ValueError('Mountpoint must not contain a space.')
    mountpoint = _os.path.expanduser(mountpoint)
    already_mounted = _os.path.isdir(_os.path.join(mountpoint, 'MyDrive'))
    if not force_remount and already_mounted:
        print('Drive already mounted at {mnt}; to attempt to forcibly remount, '
              'call drive.mount("{mnt}", force_remount=True).'.format(mnt=mountpoint))
        return
    if _os.path.normpath(mountpoint) != _SIMULATED:
        raise ValueError('colab_sim simulates Drive at {} only, not {}'.format(
            _SIMULATED, mountpoint))
    if _is_mount_point(mountpoint):
        _subprocess.run(['umount', mountpoint], check=True)
    if _os.path.islink(mountpoint):
        raise ValueError('Mountpoint must not be a symlink')
    if _os.path.isdir(mountpoint) and _os.listdir(mountpoint):
        raise ValueError('Mountpoint must not already contain files')
    if not _os.path.isdir(mountpoint) and _os.path.exists(mountpoint):
        raise ValueError('Mountpoint must either be a directory or not exist')
    done = _sim('mount')
    if done.returncode:
        raise ValueError('mount failed')
    _os.makedirs(mountpoint, exist_ok=True)
    _subprocess.run(['mount', '--bind', done.stdout.strip().splitlines()[-1], mountpoint],
                        check=True)
    print('Mounted at {}'.format(mountpoint))
