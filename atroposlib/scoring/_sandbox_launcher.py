"""Runs inside the sandbox child: isolate, limit, then run the program. Standard library only.

Invoked by :mod:`atroposlib.scoring.sandbox` as ``python -I -B _sandbox_launcher.py CONFIG_JSON``.
Order matters: namespaces (need privileges) -> drop to the sandbox uid -> rlimits -> audit hook
-> run the program with ``runpy``. The first line on stderr (prefixed with the parent's nonce)
lists the isolation layers that were actually applied.
"""

import ctypes
import json
import os
import resource
import runpy
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
    return libc


def _mount(libc, src, target, flags):
    def enc(s):
        return s.encode() if s is not None else None

    return libc.mount(enc(src), enc(target), None, flags, None) == 0


def _mount_points():
    points = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            point = line.split()[4].encode().decode("unicode_escape")
            points.append(point)
    return points


def _isolate_as_root(libc, workdir, applied):
    if libc.unshare(CLONE_NEWNET) == 0:
        applied.append("net-namespace")
    # Only ever touch mounts after a successful unshare: the host's mounts must stay as they are.
    if libc.unshare(CLONE_NEWNS) != 0:
        return
    if not _mount(libc, None, "/", MS_REC | MS_PRIVATE):
        return
    if not _mount(libc, workdir, workdir, MS_BIND | MS_REC):
        return
    ok = True
    for point in _mount_points():
        if point == workdir or point.startswith("/proc"):
            continue
        if not _mount(libc, None, point, MS_REMOUNT | MS_BIND | MS_RDONLY):
            ok = ok and point not in ("/", "/tmp")
    if ok:
        applied.append("read-only-filesystem")


def _isolate_unprivileged(libc, applied):
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return
    try:
        with open("/proc/self/setgroups", "w") as fh:
            fh.write("deny")
        with open("/proc/self/uid_map", "w") as fh:
            fh.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as fh:
            fh.write(f"{gid} {gid} 1")
    except OSError:
        pass
    applied.append("net-namespace")


def _user_process_count(uid):
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


def _audit_hook(workdir, block_network):
    allowed = (workdir + os.sep, "/dev/null")

    def hook(event, args):
        if block_network and event in (
            "socket.connect",
            "socket.bind",
            "socket.sendto",
            "socket.sendmsg",
        ):
            raise PermissionError(f"sandbox: network access is disabled ({event})")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return
            writing = (mode and any(c in str(mode) for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            )
            if writing:
                real = os.path.realpath(os.fsdecode(path))
                if not (real.startswith(allowed[0]) or real == workdir or real == allowed[1]):
                    raise PermissionError(f"sandbox: writing outside the work directory: {real}")
        elif event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.truncate"):
            target = args[0]
            if isinstance(target, (str, bytes, os.PathLike)):
                real = os.path.realpath(os.fsdecode(target))
                if not real.startswith(allowed[0]):
                    raise PermissionError(
                        f"sandbox: changing files outside the work directory: {real}"
                    )

    sys.addaudithook(hook)


def main():
    config = json.loads(sys.argv[1])
    workdir = config["workdir"]
    applied = []
    libc = _libc()
    if os.geteuid() == 0:
        _isolate_as_root(libc, workdir, applied)
        uid = config["uid"]
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        applied.append("uid-drop")
        existing = 0
    else:
        if not config["network"]:
            _isolate_unprivileged(libc, applied)
        existing = _user_process_count(os.getuid())
    if not config["network"] and "net-namespace" not in applied:
        applied.append("net-audit-hook-only")

    nproc = existing + config["max_processes"]
    limits = [
        (resource.RLIMIT_CPU, config["cpu_time_s"], config["cpu_time_s"] + 1),
        (resource.RLIMIT_AS, config["memory_bytes"], config["memory_bytes"]),
        (resource.RLIMIT_FSIZE, config["max_file_bytes"], config["max_file_bytes"]),
        (resource.RLIMIT_NOFILE, config["max_open_files"], config["max_open_files"]),
        (resource.RLIMIT_NPROC, nproc, nproc),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))
    applied.append("rlimits")
    os.chdir(workdir)
    sys.stderr.write(config["nonce"] + " " + ",".join(applied) + "\n")
    sys.stderr.flush()
    _audit_hook(workdir, block_network=not config["network"])
    sys.argv = [config["program"], *config["args"]]
    sys.path.insert(0, workdir)
    runpy.run_path(config["program"], run_name="__main__")


if __name__ == "__main__":
    main()
