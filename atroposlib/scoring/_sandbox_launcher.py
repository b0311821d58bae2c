"""Runs inside the sandbox child: isolate, limit, then run the program. Standard library only.

Invoked by :mod:`atroposlib.scoring.sandbox` as ``python -I -B _sandbox_launcher.py CONFIG_JSON``
with a status pipe on the file descriptor ``config["status_fd"]``: each line written there is a
JSON object for the parent (the isolation layers applied, then the program's fate), never visible
to the program, which closes it before it starts.

Two modes (see the module docstring of :mod:`atroposlib.scoring.sandbox` for the guarantees):

``strong`` (the default): this process (the *launcher*) unshares a user namespace (unless it runs
as root), a mount, PID, IPC and UTS namespace and, unless network is allowed, a network
namespace, then forks the *init* (PID 1 of the new PID namespace). The init builds a new root
filesystem (a small tmpfs with the host's ``/usr``, ``/etc``, the library directories and the
interpreter's prefixes bound read-only, a few device nodes, a fresh ``/proc`` and one size-capped
tmpfs behind ``/tmp``, ``/var/tmp`` and ``/dev/shm``), pivots into it, drops to the sandbox uid
(root only), forbids new user namespaces, and forks the *program* process, which sets rlimits,
drops every capability, sets ``no_new_privs`` and runs the code. The init reaps, counts the
sandbox's processes and (without a memory cgroup) their memory, and exits when the program
exits, which makes the kernel SIGKILL every process left in the namespace. It also dies with the
launcher (``PR_SET_PDEATHSIG`` plus a lifeline pipe), and the launcher dies with the parent's
process-group kill. If any step of that setup fails, nothing of the program runs: the init
reports ``{"unavailable": reason}`` and exits 97.

``weak`` (only when the parent allows it): rlimits, a uid drop under root, a private read-only
mount namespace and an empty network namespace where the kernel allows them, and a Python audit
hook; the program runs in this process.
"""

import ctypes
import json
import os
import platform
import resource
import runpy
import select
import signal
import stat
import sys
import traceback

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
SYS_MOUNT_SETATTR = 442
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
UNAVAILABLE_EXIT = 97

# Host paths bound read-only into the new root (when they exist; symlinks are copied as links).
SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
DEVICES = ("null", "zero", "full", "random", "urandom")


class SetupError(Exception):
    """A step of the strong isolation failed; the message names it."""


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.syscall.restype = ctypes.c_long
    return libc


def _mount(libc, src, target, flags, fstype=None, data=None):
    def enc(s):
        return s.encode() if s is not None else None

    return libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)) == 0


def _check(ok, what, libc=None):
    if not ok:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)} (errno {errno})")


def _write(path, text):
    try:
        with open(path, "w") as fh:
            fh.write(text)
    except OSError as exc:
        raise SetupError(f"writing {text!r} to {path}: {exc.strerror}") from None


# --------------------------------------------------------------------------- strong mode


def _read_tree(root):
    """Every file and directory under ``root`` as (relative path, mode, bytes or None)."""
    entries = []
    for base, dirs, names in os.walk(root):
        rel_base = os.path.relpath(base, root)
        for name in sorted(dirs):
            path = os.path.join(base, name)
            entries.append((os.path.normpath(os.path.join(rel_base, name)), 0o755, None))
        for name in sorted(names):
            path = os.path.join(base, name)
            with open(path, "rb") as fh:
                data = fh.read()
            mode = stat.S_IMODE(os.stat(path).st_mode)
            entries.append((os.path.normpath(os.path.join(rel_base, name)), mode, data))
    return entries


def _makedirs_in(root, path):
    target = root + path
    os.makedirs(target, mode=0o755, exist_ok=True)
    return target


def _python_paths():
    """The interpreter's installation directories: they must stay importable after the pivot."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths = set()
    for prefix in prefixes:
        if prefix and os.path.isdir(prefix):
            paths.add(os.path.realpath(prefix))
            paths.add(os.path.abspath(prefix))
    for entry in sys.path:
        if entry and os.path.isdir(entry):
            real = os.path.realpath(entry)
            if any(real.startswith(p + os.sep) for p in list(paths)):
                paths.add(real)
    return sorted(paths)


def _bind_readonly(libc, src, target):
    _check(_mount(libc, src, target, MS_BIND | MS_REC), f"bind {src}")
    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
    rc = libc.syscall(
        SYS_MOUNT_SETATTR, AT_FDCWD, target.encode(), AT_RECURSIVE, ctypes.byref(attr), 32
    )
    if rc != 0:  # kernels before 5.12: the top mount only, keeping its locked flags
        flags = os.statvfs(target).f_flag
        keep = flags & (MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048)  # noatime, nodiratime
        _check(
            _mount(libc, None, target, MS_REMOUNT | MS_BIND | MS_RDONLY | keep),
            f"read-only {src}",
        )


def _build_root(libc, config, entries):
    """Build the new root on a tmpfs mounted over the host work directory (hidden only in this
    mount namespace) and pivot into it. Returns the work directory's path inside."""
    host_workdir = config["workdir"]
    inside_workdir = "/tmp/" + os.path.basename(host_workdir)
    root = host_workdir
    _check(_mount(libc, None, "/", MS_REC | MS_PRIVATE), "make mounts private")
    _check(
        _mount(libc, "sandbox-root", root, MS_NOSUID | MS_NODEV, "tmpfs", "size=1m,mode=755"),
        "mount root tmpfs",
    )
    bound = []
    for path in [*SYSTEM_PATHS, *_python_paths()]:
        if not os.path.lexists(path) or any(path.startswith(b + os.sep) for b in bound):
            continue
        if os.path.islink(path) and os.path.dirname(path) == "/":
            os.symlink(os.readlink(path), root + path)
            continue
        if not os.path.isdir(path):
            continue
        _bind_readonly(libc, path, _makedirs_in(root, path))
        bound.append(path)

    dev = _makedirs_in(root, "/dev")
    _check(
        _mount(libc, "sandbox-dev", dev, MS_NOSUID | MS_NOEXEC, "tmpfs", "size=64k,mode=755"),
        "mount /dev tmpfs",
    )
    for name in DEVICES:
        open(f"{dev}/{name}", "w").close()
        _check(_mount(libc, f"/dev/{name}", f"{dev}/{name}", MS_BIND), f"bind /dev/{name}")
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm")

    # One size-capped tmpfs holds everything writable: /tmp (with the work directory),
    # /var/tmp and /dev/shm, so that a single quota covers them all.
    quota = _makedirs_in(root, "/.quota")
    inodes = max(1024, min(1 << 16, config["max_disk_bytes"] // 4096))
    _check(
        _mount(
            libc,
            "sandbox-tmp",
            quota,
            MS_NOSUID | MS_NODEV,
            "tmpfs",
            f"size={config['max_disk_bytes']},nr_inodes={inodes},mode=1777",
        ),
        "mount the writable tmpfs",
    )
    for sub, target in (("tmp", "/tmp"), ("vartmp", "/var/tmp"), ("shm", "/dev/shm")):
        os.mkdir(f"{quota}/{sub}")
        os.chmod(f"{quota}/{sub}", 0o1777)
        _check(
            _mount(libc, f"{quota}/{sub}", _makedirs_in(root, target), MS_BIND),
            f"bind {target}",
        )
    _check(libc.umount2(quota.encode(), MNT_DETACH) == 0, "detach the quota tmpfs")
    os.rmdir(quota)

    work = root + inside_workdir
    os.mkdir(work, 0o700)
    uid = config["uid"]
    for rel, mode, data in entries:
        path = os.path.join(work, rel)
        if data is None:
            os.mkdir(path, 0o755)
        else:
            with open(path, "wb") as fh:
                fh.write(data)
            os.chmod(path, mode)
        if uid is not None:
            os.chown(path, uid, uid)
    if uid is not None:
        os.chown(work, uid, uid)

    # A new procfs may only be mounted while a fully visible one is in the namespace: before
    # the old root goes.
    _check(
        _mount(libc, "proc", _makedirs_in(root, "/proc"), MS_NOSUID | MS_NODEV | MS_NOEXEC, "proc"),
        "mount /proc",
    )
    _check(
        _mount(libc, None, dev, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC),
        "read-only /dev",
    )
    nr = SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise SetupError(f"pivot_root: unknown syscall number on {platform.machine()}")
    os.chdir(root)
    _check(libc.syscall(nr, b".", b".") == 0, "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH) == 0, "detach the old root")
    os.chdir("/")
    _check(
        _mount(libc, None, "/", MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV),
        "read-only root",
    )
    return inside_workdir


def _map_ids(uid, gid):
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def _drop_capabilities(libc):
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(libc.capset(header, data) == 0, "drop capabilities")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0, "no_new_privs")


def _set_rlimits(config, nproc):
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


def _proc_status(pid):
    """(threads, anonymous + shared memory in bytes) of one process; (0, 0) if it is gone."""
    threads = memory = 0
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    memory += int(line.split()[1]) * 1024
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
    except (OSError, ValueError):
        return 0, 0
    return threads, memory


def _sysv_shm_bytes():
    try:
        with open("/proc/sysvipc/shm") as fh:
            header = fh.readline().split()
            column = header.index("rss")
            return sum(int(line.split()[column]) for line in fh if line.strip())
    except (OSError, ValueError):
        return 0


class _Watch:
    """What the init sees of the sandbox: process count and memory, polled."""

    def __init__(self, config, report):
        self.report = report
        self.max_processes = config["max_processes"]
        self.memory_bytes = config["memory_bytes"]
        self.watch_memory = not config.get("memory_cgroup")
        self.peak_processes = 0
        self.peak_memory = 0
        self.process_limit_hit = False
        self.memory_exceeded = False

    def poll(self):
        tasks = total = 0
        for entry in os.listdir("/proc"):
            if entry.isdigit() and entry != "1":
                threads, memory = _proc_status(entry)
                tasks += threads
                total += memory
        self.peak_processes = max(self.peak_processes, tasks)
        if tasks >= self.max_processes and not self.process_limit_hit:
            self.process_limit_hit = True
            self.report(process_limit_hit=True)  # now: a timeout may come before the end
        if not self.watch_memory:
            return
        total += _sysv_shm_bytes()
        fs = os.statvfs("/tmp")
        total += (fs.f_blocks - fs.f_bfree) * fs.f_frsize
        self.peak_memory = max(self.peak_memory, total)
        if total > self.memory_bytes:
            self.memory_exceeded = True
            self.report(memory_exceeded=True, peak_memory_bytes=total)
            os.kill(-1, signal.SIGKILL)  # from PID 1: every other process of the namespace


def _init(libc, config, lifeline, status_fd, entries, launcher_in_userns):
    """PID 1 of the sandbox: set up, fork the program, reap and watch until it exits."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    status = os.fdopen(status_fd, "w", buffering=1)

    def report(**fields):
        status.write(json.dumps(fields) + "\n")

    applied = ["user-namespace" if launcher_in_userns else "root", "pid-namespace"]
    applied += ["mount-namespace", "private-root", "ipc-namespace"]
    if not config["network"]:
        applied.append("net-namespace")
    try:
        for path in config.get("cgroup_procs") or []:
            _write(path, "0")
        if config.get("cgroup_procs"):
            applied.append("cgroup")
            try:  # spare the init from the OOM killer where allowed (CAP_SYS_RESOURCE)
                _write("/proc/self/oom_score_adj", "-1000")
            except SetupError:
                pass
        workdir = _build_root(libc, config, entries)
        uid = config["uid"]
        in_userns = launcher_in_userns
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # a uid change cleared it: /proc/self/*
            applied.append("uid-drop")
            # A user namespace of its own, only to forbid nested ones below (where the kernel
            # refuses it to this uid, the program cannot create one either).
            if libc.unshare(CLONE_NEWUSER) == 0:
                _map_ids(uid, uid)
                in_userns = True
        if in_userns:
            _write("/proc/sys/user/max_user_namespaces", "0")
            applied.append("no-nested-userns")
        applied.append("tmpfs-quota")
    except (SetupError, OSError) as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        report(unavailable=f"{type(exc).__name__}: {exc} (at {where.name}:{where.lineno})")
        status.close()
        os._exit(UNAVAILABLE_EXIT)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    os.environ["HOME"] = os.environ["TMPDIR"] = workdir
    os.chdir(workdir)
    applied += ["no-capabilities", "rlimits"]
    report(isolation=applied)

    program = os.fork()
    if program == 0:
        os.close(lifeline)
        status.close()
        if config.get("cgroup_procs"):
            try:
                _write("/proc/self/oom_score_adj", "0")
            except SetupError:
                pass
        # Processes counted by RLIMIT_NPROC in this user namespace: the init, the launcher when
        # it created the namespace, and the program's own.
        nproc = config["max_processes"] + 1 + (1 if launcher_in_userns else 0)
        _set_rlimits(config, nproc)
        _drop_capabilities(libc)
        return workdir

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    watch = _Watch(config, report)
    returncode = None
    while returncode is None:
        ready, _, _ = select.select([lifeline, wake_r], [], [], 0.05)
        if lifeline in ready:  # the launcher is gone: take everything down with us
            os._exit(1)
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:
            try:
                pid, wstatus = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
            if pid == program:
                returncode = os.waitstatus_to_exitcode(wstatus)
        if returncode is None:
            watch.poll()
    times = os.times()
    report(
        returncode=returncode,
        cpu_s=times.children_user + times.children_system,
        peak_processes=watch.peak_processes,
        process_limit_hit=watch.process_limit_hit,
        memory_exceeded=watch.memory_exceeded,
        peak_memory_bytes=watch.peak_memory,
    )
    status.close()
    os._exit(returncode if returncode >= 0 else 128 - returncode)


def _strong(config):
    """Returns (in the program process) the work directory to run in; the launcher and the
    init never return."""
    libc = _libc()
    entries = _read_tree(config["workdir"])
    as_root = os.geteuid() == 0
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if not config["network"]:
        flags |= CLONE_NEWNET
    if not as_root:
        flags |= CLONE_NEWUSER
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(flags) != 0:
        errno = ctypes.get_errno()
        msg = f"unshare(user, mount, pid, ipc, net namespaces): {os.strerror(errno)}"
        os.write(config["status_fd"], (json.dumps({"unavailable": msg}) + "\n").encode())
        os._exit(UNAVAILABLE_EXIT)
    if not as_root:
        try:
            _map_ids(uid, gid)
        except OSError as exc:
            msg = f"user namespace id maps: {exc}"
            os.write(config["status_fd"], (json.dumps({"unavailable": msg}) + "\n").encode())
            os._exit(UNAVAILABLE_EXIT)
    lifeline, keep_alive = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(keep_alive)
        return _init(libc, config, lifeline, config["status_fd"], entries, not as_root)
    os.close(lifeline)
    os.close(config["status_fd"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _, wstatus = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(wstatus)
    os._exit(code if code >= 0 else 128 - code)


# --------------------------------------------------------------------------- weak mode


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
        _map_ids(uid, gid)
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


def _weak(config):
    workdir = config["workdir"]
    applied = ["weak"]
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
    _set_rlimits(config, existing + config["max_processes"])
    applied.append("rlimits")
    os.write(config["status_fd"], (json.dumps({"isolation": applied}) + "\n").encode())
    os.close(config["status_fd"])
    os.chdir(workdir)
    _audit_hook(workdir, block_network=not config["network"])
    return workdir


def main():
    config = json.loads(sys.argv[1])
    workdir = _strong(config) if config["mode"] == "strong" else _weak(config)
    program = os.path.join(workdir, config["program"])
    sys.argv = [program, *config["args"]]
    sys.path.insert(0, workdir)
    runpy.run_path(program, run_name="__main__")


if __name__ == "__main__":
    main()
