"""Programs against the grader's verdicts, the kernel and the limits on an answer's processes together, shared by
tests/e2e/test_grader_hostile.py (every program through the batched path, the single path, the Dask reward service
and, where it applies, the tool episode, in every sandbox mode) and docs/EVALUATION.md's table.

The problem is "square a number" (tests/e2e/test_sandbox_hostile.py's STYLES, and two assert styles of this
module's); no program computes the right answers, so each must be graded failed with no test passed, and its
grading must end in a verdict (never an exception out of the grader, never a batch graded again one by one). Each
program has a class (the docs' rows):

* ``value``: answers no comparison may choke on or accept (an int no float holds, a float within the old
  tolerance of an integer, strings and nesting past every limit, cycles, unserialisable objects, NaN, lone
  surrogates in what it claims);
* ``exit``: any exit code (126 is what a sandbox setup failure exits with), killing its own process group, the
  launcher's group;
* ``control_flow``: StopIteration and its kin out of the function, which would end a test's ``map()`` early;
* ``entry_point``: supplying a name the test code uses that nothing trusted defines;
* ``kernel``: system calls the seccomp filter refuses; each probe returns (and prints) what the call gave, so the
  test reads it from the verdict's details;
* ``aggregate``: memory spread over many processes, each within its own limit.
"""

from __future__ import annotations

import os

from areal_core.reward import sandbox_seccomp

CONTROL = "def square(x):\n    return x * x\n"
# assert tests that the control passes: a check through map() (what a StopIteration would end early) and one
# that uses a helper nothing trusted defines (a data set's slip: no program may supply it)
ASSERT_MAP = [
    {
        "testtype": "assert",
        "code": "def check(candidate):\n    assert all(map(lambda case: candidate(case[0]) == case[1], "
        "[(7, 49), (12, 144), (-3, 9)]))\n\n\ncheck(square)\n",
        "entry_point": "square",
    }
]
ASSERT_FREE_NAME = [
    {
        "testtype": "assert",
        "code": "def check(candidate):\n    for x in (7, 12):\n        assert candidate(x) == expected(x)\n\n\ncheck(square)\n",
        "entry_point": "square",
    }
]

# probes: _RESULT is what the call gave ("ok" or the errno's name); the program prints it and returns it
PROBE = (
    "import ctypes, errno, os\n_libc = ctypes.CDLL(None, use_errno=True)\n"
    "def _res(r):\n    return 'ok' if r != -1 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))\n"
    "def _sys(nr, *args):  # integers as longs: the kernel reads whole registers\n    ctypes.set_errno(0)\n"
    "    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in (nr, *args)]\n"
    "    return _res(_libc.syscall(*args))\n"
)
PROBE_END = "print(_RESULT)\ndef square(x):\n    return _RESULT\n"
_NR = sandbox_seccomp.ARCHES.get(os.uname().machine, (0, {}))[1]  # this machine's system call numbers
KERNEL_CALLS = {
    "unshare_user_namespace": "_RESULT = _sys({unshare}, 0x10000000)\n",
    "unshare_mount_namespace": "_RESULT = _sys({unshare}, 0x00020000)\n",
    "mount_tmpfs": "_RESULT = _sys({mount}, b'none', b'/tmp', b'tmpfs', 0, None)\n",
    "clone_new_namespaces": (
        "ctypes.set_errno(0)\n_l = ctypes.c_long\n_r = _libc.syscall(_l({clone}), _l(0x10000000 | 0x20000000 | 17), _l(0), _l(0), _l(0), _l(0))\n"
        "if _r == 0:\n    os._exit(0)\nif _r > 0:\n    os.waitpid(_r, 0)\n_RESULT = _res(_r)\n"
    ),
    "clone3": "_RESULT = _sys({clone3}, 0, 0)\n",
    "setns": "_fd = os.open('/proc/self/ns/uts', os.O_RDONLY)\n_RESULT = _sys({setns}, _fd, 0)\n",
    "ptrace_traceme": "_RESULT = _sys({ptrace}, 0, 0, 0, 0)\n",
    "bpf_map_create": "_attr = ctypes.create_string_buffer(128)\n_RESULT = _sys({bpf}, 0, _attr, 128)\n",
    "keyctl_join_session": "_RESULT = _sys({keyctl}, 1, 0)\n",
    "io_uring_setup": "_params = ctypes.create_string_buffer(120)\n_RESULT = _sys({io_uring_setup}, 4, _params)\n",
    "userfaultfd": "_RESULT = _sys({userfaultfd}, 1)\n",
    "process_vm_readv_self": (
        "_buf = ctypes.create_string_buffer(8)\n_src = ctypes.create_string_buffer(b'abcdefgh')\n"
        "class _Iov(ctypes.Structure):\n    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]\n"
        "_l, _r = _Iov(ctypes.addressof(_buf), 8), _Iov(ctypes.addressof(_src), 8)\n"
        "_RESULT = _sys({process_vm_readv}, os.getpid(), ctypes.byref(_l), 1, ctypes.byref(_r), 1, 0)\n"
    ),
}
# what the filter answers each (clone3: ENOSYS, so that the C library falls back to clone)
KERNEL_REFUSED = {name: "ENOSYS" if name == "clone3" else "EPERM" for name in KERNEL_CALLS}


def kernel_probe(name: str) -> str:
    """The probe ``name`` alone: sets ``_RESULT`` to what its call gave."""
    return PROBE + KERNEL_CALLS[name].format(**_NR)


FORK_MEMORY = (
    "import {module}, os, time\nfor _ in range(12):\n    if os.fork() == 0:\n        {alloc}\n"
    "        for i in range(0, len(b), 4096):\n            b[i] = 1\n        time.sleep(30)\n        os._exit(0)\n"
    "time.sleep(30)\ndef square(x):\n    return 0\n"
)
FORGED_SURROGATES = (
    "import os\nline = b'{\"i\": 0, \"error\": \"\\\\ud800' + b'\\\\udfff' * 2000 + b'\"}\\n'\n"
    "for fd in range(1, 16):\n    try:\n        os.write(fd, line)\n    except OSError:\n        pass\nos._exit(0)\n"
)

# name -> (class, program, styles)
ATTACKS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "return_10_pow_400": ("value", "def square(x):\n    return 10**400\n", ("functional", "assert")),
    "return_10_pow_5000": ("value", "def square(x):\n    return 10**5000\n", ("functional", "assert")),
    "return_near_integer_float": ("value", "def square(x):\n    return x * x * (1 + 4e-7)\n", ("functional",)),
    "print_near_integer_float": ("value", "print(int(input()) ** 2 * (1 + 4e-7))\n", ("stdin",)),
    "return_huge_string": ("value", "def square(x):\n    return 'x' * (8 * 2**20)\n", ("functional", "assert")),
    "return_deep_nesting": (
        "value",
        "def square(x):\n    a = []\n    for _ in range(200000):\n        a = [a]\n    return a\n",
        ("functional", "assert"),
    ),
    "return_cycle": ("value", "def square(x):\n    a = []\n    a.append(a)\n    return a\n", ("functional", "assert")),
    "return_unpicklable": (
        "value",
        "import threading\ndef square(x):\n    return (threading.Lock(), (i for i in ()), lambda: 0)\n",
        ("functional", "assert"),
    ),
    "return_nan": ("value", "def square(x):\n    return float('nan')\n", ("functional", "assert")),
    "forged_lone_surrogates": ("value", FORGED_SURROGATES, ("functional",)),
    "raise_huge_message": (
        "value",
        "def square(x):\n    raise ValueError('\\ud800' * 10**6)\n",
        ("functional", "assert"),
    ),
    "exit_126_at_load": ("exit", "import os\nos._exit(126)\n", ("functional", "stdin", "assert")),
    "exit_126_in_call": ("exit", "import os\ndef square(x):\n    os._exit(126)\n", ("functional", "assert")),
    "exit_137_in_call": ("exit", "import os\ndef square(x):\n    os._exit(137)\n", ("functional", "assert")),
    "kill_own_process_group": ("exit", "import os\nos.killpg(0, 9)\n", ("functional", "stdin", "assert")),
    "kill_own_group_in_call": (
        "exit",
        "import os, signal\ndef square(x):\n    os.kill(0, signal.SIGKILL)\n",
        ("functional", "assert"),
    ),
    "kill_launcher_group": (
        "exit",
        (
            "import os\ntry:\n    os.killpg(os.getpgid(os.getppid()), 9)\nexcept OSError:\n    pass\ndef square(x):\n    return 0\n"
        ),
        ("functional", "stdin", "assert"),
    ),
    "raise_stop_iteration": ("control_flow", "def square(x):\n    raise StopIteration\n", ("functional", "assert_map")),
    "raise_stop_iteration_subclass": (
        "control_flow",
        "class Done(StopIteration):\n    pass\ndef square(x):\n    raise Done(x * 0)\n",
        ("functional", "assert_map"),
    ),
    "raise_stop_async_iteration": (
        "control_flow",
        "def square(x):\n    raise StopAsyncIteration\n",
        ("functional", "assert_map"),
    ),
    "raise_generator_exit": ("control_flow", "def square(x):\n    raise GeneratorExit\n", ("functional", "assert_map")),
    "supply_free_name": (
        "entry_point",
        "def expected(x):\n    return 0\ndef square(x):\n    return 0\n",
        ("assert_free_name",),
    ),
    **{name: ("kernel", kernel_probe(name) + PROBE_END, ("functional",)) for name in KERNEL_CALLS if _NR},
    "fork_memory_bomb": (
        "aggregate",
        FORK_MEMORY.format(module="sys", alloc="b = bytearray(120 * 2**20)"),
        ("functional", "stdin", "assert"),
    ),
    "fork_shared_memory_bomb": (
        "aggregate",
        FORK_MEMORY.format(module="mmap", alloc="b = mmap.mmap(-1, 120 * 2**20, flags=mmap.MAP_SHARED)"),
        ("functional",),
    ),
}
# programs that run as tool calls too (the tool runs code like a REPL line: what it prints is its output)
TOOL = [n for n, (cls, _, _) in ATTACKS.items() if cls in ("exit", "kernel", "aggregate")]
# tool calls against the calls before and after them in the same batch; a secret of the call before
TOOL_SECRET = "tool-secret-81f2"
TOOL_CROSS = {
    "leave_a_killer": (
        "import os, time\nspare = (os.getppid(), os.getpid())\nif os.fork() == 0:\n    os.setsid()\n"
        "    end = time.time() + 3\n    while time.time() < end:\n        for p in os.listdir('/proc'):\n"
        "            if p.isdigit() and int(p) not in spare and int(p) != os.getpid():\n                try:\n"
        "                    os.kill(int(p), 9)\n                except OSError:\n                    pass\n"
        "    os._exit(0)\ntime.sleep(0.3)\n"
    ),
    # scans as it reads (never holds the files): /tmp on a busy host can hold more than the sandbox's memory;
    # regular files only (a FIFO would block its open), of up to 1 KB (the secret's file is a few bytes): a
    # host /tmp after a test suite holds tens of thousands of files, which it still walks
    "read_the_call_before": (
        "import os, stat\n"
        f"secret = ({TOOL_SECRET[:5]!r} + {TOOL_SECRET[5:]!r}).encode()\n"
        "def holds(path):\n    try:\n        st = os.stat(path)\n"
        "        if not stat.S_ISREG(st.st_mode) or st.st_size > 1024:\n            return False\n"
        "        with open(path, 'rb') as f:\n            return secret in f.read()\n"
        "    except OSError:\n        return False\n"
        "def places():\n    for top in ('/tmp', '.', '/dev/shm'):\n"
        "        for root, _, files in os.walk(top):\n            yield from (os.path.join(root, n) for n in files)\n"
        "    for p in os.listdir('/proc'):\n        yield from (f'/proc/{p}/cmdline', f'/proc/{p}/environ')\n"
        "print('leaked' if any(holds(p) for p in places()) else 'nothing')\n"
    ),
}
# the call before them: leaves its secret in its /tmp and its command
TOOL_LEAVES_SECRET = f"open('/tmp/secret', 'w').write({TOOL_SECRET!r})\nprint('left it')\n"


def classes() -> dict[str, list[str]]:
    """Attack class -> its programs' names."""
    out: dict[str, list[str]] = {}
    for name, (cls, _, _) in ATTACKS.items():
        out.setdefault(cls, []).append(name)
    return out
