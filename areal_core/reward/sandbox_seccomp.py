"""The system call filter of sandboxed processes (seccomp, stdlib only; a small BPF program installed with prctl).

A sandboxed process (the program, the checker, each program of a batch, each tool call) installs it when it drops
into the sandbox (``sandbox_proc.enter``), after ``PR_SET_NO_NEW_PRIVS`` and before anything untrusted runs; it
holds for the process, everything it starts and everything they exec. It refuses (``EPERM``) the calls that reach
the kernel's namespace, mount, tracing, BPF, key ring, module, io_uring and clock interfaces: what a program never
needs and what kernel escapes start from (``unshare(CLONE_NEWUSER)`` would give it every capability in a user
namespace of its own). ``clone`` with a ``CLONE_NEW*`` flag is refused too; ``clone3``, whose flags the filter cannot
read (they are behind a pointer), answers ``ENOSYS``, so the C library falls back to ``clone``. A call of another
architecture's numbering (x86's 32-bit ``int 0x80``) kills the process, and on x86_64 the x32 numbering is refused.

The numbers are the kernel's (``asm/unistd_64.h`` for x86_64, the generic ``asm-generic/unistd.h`` for aarch64).
Elsewhere there is no filter (:func:`supported`), and ``sandbox.guarantees`` says so (``syscall_filter``).
"""

from __future__ import annotations

import ctypes
import functools
import os

PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38
# CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
X32_BIT = 0x40000000
# classic BPF opcodes
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
# offsets in struct seccomp_data: nr, arch, then the arguments (64 bits each; the low half first, little endian)
OFF_NR, OFF_ARCH, OFF_ARG0_LOW = 0, 4, 16

DENIED = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "open_by_handle_at", "name_to_handle_at", "fanotify_init", "swapon", "swapoff", "reboot", "syslog", "acct",
    "quotactl", "quotactl_fd", "lookup_dcookie", "vhangup", "sethostname", "setdomainname", "settimeofday",
    "clock_settime", "adjtimex", "clock_adjtime",
)  # fmt: skip
_X86_64 = {
    "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438, "kcmp": 312, "bpf": 321,
    "perf_event_open": 298, "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "kexec_load": 246,
    "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176, "open_by_handle_at": 304,
    "name_to_handle_at": 303, "fanotify_init": 300, "swapon": 167, "swapoff": 168, "reboot": 169, "syslog": 103,
    "acct": 163, "quotactl": 179, "quotactl_fd": 443, "lookup_dcookie": 212, "vhangup": 153, "sethostname": 170,
    "setdomainname": 171, "settimeofday": 164, "clock_settime": 227, "adjtimex": 159, "clock_adjtime": 305,
    "clone": 56, "clone3": 435,
}  # fmt: skip
_GENERIC = {
    "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438, "kcmp": 272, "bpf": 280,
    "perf_event_open": 241, "userfaultfd": 282, "keyctl": 219, "add_key": 217, "request_key": 218,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "kexec_load": 104,
    "kexec_file_load": 294, "init_module": 105, "finit_module": 273, "delete_module": 106, "open_by_handle_at": 265,
    "name_to_handle_at": 264, "fanotify_init": 262, "swapon": 224, "swapoff": 225, "reboot": 142, "syslog": 116,
    "acct": 89, "quotactl": 60, "quotactl_fd": 443, "lookup_dcookie": 18, "vhangup": 58, "sethostname": 161,
    "setdomainname": 162, "settimeofday": 170, "clock_settime": 112, "adjtimex": 171, "clock_adjtime": 266,
    "clone": 220, "clone3": 435,
}  # fmt: skip
ARCHES = {"x86_64": (0xC000003E, _X86_64), "aarch64": (0xC00000B7, _GENERIC)}  # machine -> (AUDIT_ARCH_*, numbers)


def supported(machine: str | None = None) -> bool:
    return (machine or os.uname().machine) in ARCHES


@functools.cache
def program(machine: str | None = None) -> tuple[tuple[int, int, int, int], ...]:
    """The filter for ``machine`` (default: this one) as ``(code, jt, jf, k)`` instructions (made once per
    process: a batch's zygote makes it before it forks the programs' processes)."""
    arch, nr = ARCHES[machine or os.uname().machine]
    # (code, jump-if-true label, jump-if-false label, k); labels are resolved below
    asm: list = [
        (LD_W_ABS, None, None, OFF_ARCH),
        (JEQ_K, None, "kill", arch),
        (LD_W_ABS, None, None, OFF_NR),
    ]
    if arch == ARCHES["x86_64"][0]:
        asm.append((JGE_K, "eperm", None, X32_BIT))
    asm += [(JEQ_K, "eperm", None, nr[name]) for name in DENIED]
    asm += [
        (JEQ_K, "enosys", None, nr["clone3"]),
        (JEQ_K, None, "allow", nr["clone"]),
        (LD_W_ABS, None, None, OFF_ARG0_LOW),  # clone's flags (all the CLONE_NEW* bits are in the low half)
        (JSET_K, "eperm", None, CLONE_NEW_FLAGS),
        ("allow", RET_K, RET_ALLOW),
        ("eperm", RET_K, RET_ERRNO | EPERM),
        ("enosys", RET_K, RET_ERRNO | ENOSYS),
        ("kill", RET_K, RET_KILL_PROCESS),
    ]
    labels = {ins[0]: i for i, ins in enumerate(asm) if isinstance(ins[0], str)}
    out = []
    for i, ins in enumerate(asm):
        if isinstance(ins[0], str):
            out.append((ins[1], 0, 0, ins[2]))
            continue
        code, jt, jf, k = ins
        offset = [0 if x is None else labels[x] - i - 1 for x in (jt, jf)]
        if not all(0 <= d <= 255 for d in offset):
            raise ValueError(f"seccomp filter: jump out of range at instruction {i}")
        out.append((code, offset[0], offset[1], k))
    return tuple(out)


class _Filter(ctypes.Structure):
    _fields_ = (("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32))


class _Prog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter)))


def install() -> None:
    """Install the filter in this process (which must have set ``PR_SET_NO_NEW_PRIVS`` or be privileged); OSError
    if the kernel refuses it."""
    ins = program()
    table = (_Filter * len(ins))(*(_Filter(*x) for x in ins))
    prog = _Prog(len(ins), table)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"installing the seccomp filter: {os.strerror(err)}")
