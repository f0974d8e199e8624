"""Running a program's tests so that the program cannot reach what decides the verdict (stdlib only).

This file is copied into the sandbox and run as ``python -I code_rpc.py ROLE``
(the checker: by the sandbox launcher, in a fork of itself that has dropped into
the sandbox, ``sandbox.run_with_checker``):

``functional`` (the program's process, untrusted): reads ``{"fn_name", "cases"}``
(the arguments only) on stdin *before* the program runs, loads ``solution.py``, calls the
function once per case and writes one JSON line per case on a private copy of
fd 1 (the program's own prints go to stderr). The host compares those values
with the expected outputs, which never enter the sandbox. A group's programs
are run the same way by :func:`batch_functional`, each in a process of its own
forked from a zygote that loaded this module (``sandbox.run_each``).

``repl`` (a tool call, untrusted; ``episodes/tool.py``): runs the code read on
stdin like a REPL line, its output on stdout. A batch of calls runs the same
way through :func:`batch_repl`, each call in a process and under a user id of
its own (``sandbox.run_each``).

``candidate`` (the program's process, untrusted): loads ``solution.py``, says
``ready`` on fd 4 and then answers requests read on fd 3: fetch a global name,
call an object, read an attribute. Values travel as plain data (below); any
other object stays in this process and travels as a numbered handle.

``checker`` (trusted, its own process and, where the sandbox can, its own user
id): reads ``job.json`` from its private work folder, builds the test
namespace from trusted text only (the imports, the LeetCode helpers, the
problem's prefix), installs the test's entry points, the only names it takes
from the program (values or handles fetched from the candidate), runs the test
code, and writes the
verdict as one JSON line on a private copy of its fd 1. Whatever the candidate
sends is decoded into exact built-in types (or instances of the trusted
helper classes), so the test code compares plain data: no ``__eq__`` of the
program's, no patched builtins, no shared frames. A malformed or missing answer
ends the checker at once with a failing verdict; it is never an exception the
test code could catch.

Value encoding (JSON): ``null``, booleans, strings, ints up to ``BIG_INT``,
finite floats and lists as themselves; anything else as a one-key object:
``{"tuple": [...]}``, ``{"dict": [[k, v], ...]}``, ``{"set": [...]}``,
``{"frozenset": [...]}``, ``{"bytes": hex}``, ``{"int": hex}``,
``{"float": "nan"|"inf"|"-inf"}``, ``{"complex": [re, im]}``,
``{"obj": n}`` (entry n of the message's ``objs`` table:
``[class name, {attribute: value}]``, for the helper classes such as ListNode,
shared and cyclic structure kept; no handles inside) and ``{"handle": n}`` (an
object that stays in the candidate process).
"""

import builtins
import json
import math
import os
import sys

BIG_INT = 1 << 12000  # ints beyond this travel as hex: JSON decimals over 4300 digits are refused by Python
MAX_DEPTH = 200  # nesting of a decoded value
MAX_MESSAGE = 16 * 2**20  # bytes of one message; the job may lower it

# The imports programs and tests take for granted (LeetCode solutions use them without importing).
IMPORTS = (
    "import sys, math, heapq, bisect, itertools, functools, collections, string, re, operator, random\n"
    "from typing import *\n"
    "from collections import *\n"
    "from heapq import *\n"
    "from bisect import *\n"
    "from itertools import *\n"
    "from functools import *\n"
    "from math import *\n"
    "from string import *\n"
)
# LeetCode's node classes: defined for the program (its solutions use them undeclared) and for the checker.
NODE_CLASSES = """
class ListNode:
    def __init__(self, val=0, next=None):
        self.val = val
        self.next = next


class TreeNode:
    def __init__(self, val=0, left=None, right=None):
        self.val = val
        self.left = left
        self.right = right
"""
# LeetCode's test helpers (LeetCodeDataset): trusted, in the checker only, never taken from the program.
HELPERS = (
    NODE_CLASSES
    + """

def list_node(values):
    if not values:
        return None
    head = ListNode(values[0])
    p = head
    for val in values[1:]:
        p.next = ListNode(val)
        p = p.next
    return head


def is_same_list(p1, p2):
    while p1 is not None and p2 is not None:
        if p1.val != p2.val:
            return False
        p1, p2 = p1.next, p2.next
    return p1 is None and p2 is None


def tree_node(values):
    if not values:
        return None
    from collections import deque

    root = TreeNode(values[0])
    i, queue = 1, deque([root])
    while queue:
        node = queue.popleft()
        if i < len(values) and values[i] is not None:
            node.left = TreeNode(values[i])
            queue.append(node.left)
        i += 1
        if i < len(values) and values[i] is not None:
            node.right = TreeNode(values[i])
            queue.append(node.right)
        i += 1
    return root


def is_same_tree(p, q):
    if not p and not q:
        return True
    if not p or not q or p.val != q.val:
        return False
    return is_same_tree(p.left, q.left) and is_same_tree(p.right, q.right)
"""
)
NODE_CLASS_NAMES = ("ListNode", "TreeNode")
_PLAIN_BASES = (bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset)


class ProtocolError(Exception):
    """A malformed message."""


class Encoder:
    """Encodes one message's values; ``other(x)`` handles what is not plain data."""

    def __init__(self, other):
        self.other = other
        self.objs = []
        self._memo = {}
        self._pending = []

    def enc(self, x):
        t = type(x)
        if x is None or t is bool or t is str:
            return x
        if t is int:
            return x if -BIG_INT < x < BIG_INT else {"int": format(x, "x")}
        if t is float:
            return x if math.isfinite(x) else {"float": repr(x)}
        if t is list:
            return [self.enc(v) for v in x]
        if t is tuple:
            return {"tuple": [self.enc(v) for v in x]}
        if t is dict:
            return {"dict": [[self.enc(k), self.enc(v)] for k, v in x.items()]}
        if t is set or t is frozenset:
            return {t.__name__: [self.enc(v) for v in x]}
        if t is bytes or t is bytearray:
            return {"bytes": bytes(x).hex()}
        if t is complex:
            return {"complex": [self.enc(x.real), self.enc(x.imag)]}
        return self.other(x)

    def obj(self, x):
        """``x`` by value: its class name and attributes, filled in by :meth:`message` (iteratively, so a long
        linked list does not recurse; shared and cyclic structure kept)."""
        key = id(x)
        if key not in self._memo:
            self._memo[key] = len(self.objs)
            self.objs.append([type(x).__name__, {}])
            self._pending.append(x)
        return {"obj": self._memo[key]}

    def message(self, value, **fields):
        fields["v"] = self.enc(value)
        while self._pending:
            x = self._pending.pop()
            self.objs[self._memo[id(x)]][1] = {name: self.enc(v) for name, v in vars(x).items()}
        fields["objs"] = self.objs
        return fields


def _as_base(x):
    """A plain-type subclass instance as its base type (Counter -> dict, IntEnum -> int), else None."""
    for base in _PLAIN_BASES:
        if isinstance(x, base):
            return base(x)
    return None


class Decoder:
    """Decodes one message into exact built-in types, helper objects (``make_obj``) and handles (``handle``)."""

    def __init__(self, make_obj, handle):
        self.make_obj = make_obj
        self.handle = handle
        self.objs = []

    def message(self, msg):
        table = msg.get("objs", [])
        if type(table) is not list:
            raise ProtocolError("objs is not a list")
        for entry in table:
            if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not str or type(entry[1]) is not dict:
                raise ProtocolError("malformed objs entry")
            self.objs.append(self.make_obj(entry[0]))
        for obj, (_, attrs) in zip(self.objs, table):
            fields = vars(obj)
            for name, v in attrs.items():
                if not name.isidentifier() or name.startswith("__"):
                    raise ProtocolError(f"bad attribute name {name[:50]!r}")
                # no handles inside objects: an instance attribute can shadow a method of the (trusted) class,
                # and only a handle could make that attribute callable into the other process
                fields[name] = self.dec(v, 0, handles=False)
        return self.dec(msg.get("v"), 0)

    def dec(self, v, depth, handles=True):
        if depth > MAX_DEPTH:
            raise ProtocolError("value nested too deeply")
        t = type(v)
        if v is None or t is bool or t is str or t is int or t is float:
            return v
        if t is list:
            return [self.dec(x, depth + 1, handles) for x in v]
        if t is not dict or len(v) != 1:
            raise ProtocolError(f"malformed value of type {t.__name__}")
        ((tag, body),) = v.items()
        if tag in ("tuple", "set", "frozenset", "dict", "complex"):
            if type(body) is not list:
                raise ProtocolError(f"{tag}: not a list")
            items = [self.dec(x, depth + 1, handles) for x in body]
            try:
                if tag == "tuple":
                    return tuple(items)
                if tag == "set":
                    return set(items)
                if tag == "frozenset":
                    return frozenset(items)
                if tag == "dict":
                    if not all(type(p) is list and len(p) == 2 for p in items):
                        raise ProtocolError("dict: items are not pairs")
                    return dict(items)
                if len(items) != 2 or not all(type(x) in (int, float) for x in items):
                    raise ProtocolError("complex: not two numbers")
                return complex(items[0], items[1])
            except TypeError as e:  # an unhashable key or member
                raise ProtocolError(f"{tag}: {e}") from None
        if type(body) is str:
            try:
                if tag == "bytes":
                    return bytes.fromhex(body)
                if tag == "int" and len(body) <= 2 * BIG_INT.bit_length():
                    return int(body, 16)
            except ValueError as e:
                raise ProtocolError(f"{tag}: {e}") from None
            if tag == "float" and body in ("nan", "inf", "-inf"):
                return float(body)
        if type(body) is int and body >= 0:
            if tag == "obj" and body < len(self.objs):
                return self.objs[body]
            if tag == "handle" and handles:
                return self.handle(body)
        raise ProtocolError(f"malformed {tag[:20]!r} value")


def _builtin_class_name(e):
    """The nearest built-in class of exception ``e`` (``class E(ValueError)`` -> ValueError), as Python's
    ``except`` would see it."""
    for cls in type(e).__mro__:
        if getattr(builtins, cls.__name__, None) is cls:
            return cls.__name__
    return type(e).__name__


def _exec_program(src, path="solution.py"):
    """Execute the program's source as module ``solution``; its namespace."""
    ns = {"__name__": "solution", "__builtins__": builtins}
    exec(compile(src, path, "exec"), ns)
    return ns


def _load_program(path):
    """Execute the program file (``solution.py``) as module ``solution``; its namespace."""
    with open(path) as f:
        return _exec_program(f.read(), path)


# ----------------------------------------------------------------------------------------------------------------
# The program's side (untrusted once the program is loaded: the program can change anything here, and what it
# sends is only ever a claim about what its functions return).


def _functional(job, src, chan):
    """Load the program ``src`` and write one JSON line per case of ``job`` on ``chan`` (see the module
    docstring, role ``functional``); never returns."""

    def report(**fields):
        chan.write(json.dumps(fields) + "\n")
        chan.flush()

    name = job["fn_name"]
    try:
        ns = _exec_program(src)
        if "Solution" in ns:
            target = getattr(ns["Solution"](), name)
        elif name in ns:
            target = ns[name]
        else:
            report(error=f"no function {name!r} defined")
            os._exit(0)
    except BaseException as e:  # noqa: BLE001 - the program's failure is its verdict, reported to the host
        report(error="program failed to load: " + repr(e)[:300])
        os._exit(0)
    for i, case in enumerate(job["cases"]):
        try:
            args = [json.loads(line) for line in case.split("\n") if line.strip()]
            line = json.dumps({"i": i, "value": target(*args)})
        except BaseException as e:  # noqa: BLE001 - reported as this case's failure
            report(i=i, error=repr(e)[:300])
            break
        chan.write(line + "\n")
        chan.flush()
    os._exit(0)  # no atexit handlers or lingering threads of the program's


def functional_main():
    job = json.loads(sys.stdin.read())
    chan = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the program's prints go to stderr, not into the results
    with open("solution.py") as f:
        src = f.read()
    _functional(job, src, chan)


def batch_prepare():
    """The zygote of a batched run (``sandbox.run_each``), once: load what every program's preamble imports,
    so that each program's process, forked from it, starts with them."""
    exec(IMPORTS, {})


def batch_functional(job, fd):
    """One program of a batched run, in its own process (under a user id of its own, in the sandbox):
    ``job`` is ``{"source", "fn_name", "cases"}`` (JSON bytes); the result lines (the ``functional``
    role's) go to ``fd``. Never returns."""
    job = json.loads(job)
    _functional(job, job["source"], os.fdopen(fd, "w"))


def _repl(code):
    """Run ``code`` as a REPL line: what it prints, then the ``repr`` of a final expression's value; an
    exception prints its last traceback line."""
    import ast

    ns = {"__name__": "__main__"}
    try:
        tree = ast.parse(code, "<py>", "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<py>", "exec"), ns)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<py>", "eval"), ns)
            if value is not None:
                print(repr(value))
    except BaseException as e:  # noqa: BLE001 - the call's failure is its output
        print(f"{type(e).__name__}: {e}")


def repl_prepare():
    """The zygote of a batch of tool calls (``sandbox.run_each``): nothing to load."""


def batch_repl(job, fd):
    """One tool call of a batch (``episodes/tool.py``), in a process of its own under a user id of its own, in
    the sandbox: ``job`` is the code (UTF-8); what it prints (fds 1 and 2) and the ``repr`` of a final
    expression go to ``fd``, the call's own pipe (it can write no file). Never returns."""
    import resource

    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))  # no files: output reaches the launcher only by the pipe
    _repl(job.decode(errors="replace"))
    _flush_and_exit()


def repl_main():
    """One tool call in a sandbox run of its own: the code on stdin runs in a child that can write no file
    (:func:`batch_repl`, its output on a pipe); what comes through the pipe is copied to stdout."""
    code = sys.stdin.read().encode()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        batch_repl(code, w)
    os.close(w)
    while chunk := os.read(r, 1 << 16):
        try:
            os.write(1, chunk)
        except OSError:  # past the output's size limit: the rest is dropped
            break
    os.close(r)  # the call's next writes fail (a broken pipe): it ends
    os.waitpid(pid, 0)
    os._exit(0)


def _flush_and_exit():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken by the call: nothing more to write
            pass
    os._exit(0)


def candidate_main():
    requests = os.fdopen(3, "rb")
    responses = os.fdopen(4, "wb")
    handles = []
    byvalue = set(NODE_CLASS_NAMES)

    def send(msg):
        responses.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
        responses.flush()

    try:
        ns = _load_program("solution.py")
    except BaseException as e:  # noqa: BLE001 - the program's failure is its verdict
        send({"load_error": repr(e)[:300]})
        os._exit(0)
    send({"ready": True})

    def other(x):
        if type(x).__name__ in byvalue and hasattr(x, "__dict__"):
            return enc.obj(x)
        base = _as_base(x)
        if base is not None:
            return enc.enc(base)
        handles.append(x)
        return {"handle": len(handles) - 1}

    def make_obj(name):
        cls = ns.get(name)
        if not isinstance(cls, type):
            raise ProtocolError(f"no class {name!r}")
        return object.__new__(cls)

    def handle(n):
        if n >= len(handles):
            raise ProtocolError(f"no handle {n}")
        return handles[n]

    while True:
        line = requests.readline(MAX_MESSAGE + 1)
        if not line:
            os._exit(0)
        try:
            req = json.loads(line)
            op = req["op"]
            if op == "setup":
                byvalue = set(req["byvalue"])
                result = None
            elif op == "global":
                if req["name"] not in ns:
                    raise NameError(f"name {req['name']!r} is not defined")
                result = ns[req["name"]]
            elif op == "getattr":
                result = getattr(handle(req["ref"]), req["name"])
            elif op == "call":
                args, kwargs = Decoder(make_obj, handle).message(req)
                result = handle(req["ref"])(*args, **kwargs)
            else:
                raise ProtocolError(f"unknown op {op!r}")
            enc = Encoder(other)
            msg = enc.message(result)
        except BaseException as e:  # noqa: BLE001 - the program's exception is the call's outcome
            msg = {"raise": [_builtin_class_name(e), str(e)[:300]]}
        send(msg)


# ----------------------------------------------------------------------------------------------------------------
# The checker (trusted: nothing of the program's runs here; only decoded plain data comes in).


class CandidateError(Exception):
    """The program raised an exception that is not one of the built-in ``Exception`` classes."""


class _Checker:
    def __init__(self, verdict_fd, max_message):
        self.verdict_fd = verdict_fd
        self.max_message = max_message
        self.buf = bytearray()
        self.scanned = 0
        self.calls = 0
        self.byvalue = {}

    def finish(self, verdict):
        """Write the verdict and end the process: nothing after this can change it."""
        data = (json.dumps(verdict) + "\n").encode()
        while data:
            data = data[os.write(self.verdict_fd, data) :]
        os._exit(0)

    def fatal(self, reason):
        self.finish({"error": reason, "calls": self.calls})

    def recv(self):
        """The candidate's next message (one JSON line)."""
        while True:
            end = self.buf.find(b"\n", self.scanned)
            if end >= 0:
                break
            self.scanned = len(self.buf)
            if self.scanned > self.max_message:
                self.fatal("protocol: message too large")
            try:
                chunk = os.read(4, 1 << 16)
            except OSError as e:
                self.fatal(f"protocol: reading the program's answer failed: {e}")
            if not chunk:
                self.fatal("the program's process ended before the tests finished")
            self.buf += chunk
        line = bytes(self.buf[:end])
        del self.buf[: end + 1]
        self.scanned = 0
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError, MemoryError) as e:
            self.fatal(f"protocol: unreadable answer: {e!r}"[:300])
        if type(msg) is not dict:
            self.fatal("protocol: answer is not an object")
        return msg

    def send(self, msg):
        data = (json.dumps(msg, separators=(",", ":"), allow_nan=False) + "\n").encode()
        try:
            while data:
                data = data[os.write(3, data) :]
        except OSError as e:
            self.fatal(f"the program's process ended before the tests finished ({e.strerror})")

    def request(self, msg):
        """Send a request; the decoded answer, or the program's exception raised here."""
        self.calls += 1
        self.send(msg)
        ans = self.recv()
        if "raise" in ans:
            err = ans["raise"]
            if type(err) is not list or len(err) != 2 or not all(type(s) is str for s in err):
                self.fatal("protocol: malformed exception")
            raise _exception(err[0], err[1])
        try:
            return Decoder(self._make_obj, _Remote).message(ans)
        except Exception as e:  # noqa: BLE001 - any malformed answer (ProtocolError, RecursionError, MemoryError,
            # ...) fails the run here and now, never as an exception the test code could catch
            self.fatal(f"protocol: {e!r}"[:300])

    def _make_obj(self, name):
        cls = self.byvalue.get(name)
        if cls is None:
            raise ProtocolError(f"no helper class {name[:50]!r}")
        return object.__new__(cls)

    def encode(self, value):
        def other(x):
            if type(x) is _Remote:
                return {"handle": x._ref}
            if type(x) in self.byvalue.values():
                return enc.obj(x)
            base = _as_base(x)
            if base is None:
                raise TypeError(f"a {type(x).__name__} cannot be passed to the program under test")
            return enc.enc(base)

        enc = Encoder(other)
        return enc.message(value)


# exceptions with a meaning to the interpreter's control flow: a StopIteration out of the program's function
# would end the test's map(), zip() or iteration early (``all(map(check, cases))`` true), so they never reach
# the test code as themselves
CONTROL_FLOW = frozenset({"StopIteration", "StopAsyncIteration", "GeneratorExit", "SystemExit", "KeyboardInterrupt"})


def _exception(type_name, message):
    """The checker's copy of an exception the program raised: a built-in ``Exception`` class of that name, else
    (a control-flow exception, a ``SystemExit``, anything not built in) :class:`CandidateError`, an ordinary
    failure."""
    cls = getattr(builtins, type_name, None)
    if type_name not in CONTROL_FLOW and isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except TypeError:  # e.g. UnicodeDecodeError takes five arguments
            pass
    return CandidateError(f"{type_name[:100]}: {message}")


_CHECKER = None


class _Remote:
    """An object that stays in the program's process: it can be called and its attributes read."""

    __slots__ = ("_ref",)

    def __init__(self, ref):
        object.__setattr__(self, "_ref", ref)

    def __call__(self, *args, **kwargs):
        msg = _CHECKER.encode([list(args), kwargs])
        msg.update(op="call", ref=self._ref)
        return _CHECKER.request(msg)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _CHECKER.request({"op": "getattr", "ref": self._ref, "name": name})

    def __setattr__(self, name, value):
        raise AttributeError("objects of the program under test are read-only here")

    def __repr__(self):
        return f"<object of the program under test #{self._ref}>"


def checker_main():
    global _CHECKER
    verdict_fd = os.dup(1)
    os.dup2(2, 1)  # the test code's prints go to stderr; fd 1's copy carries only the verdict
    with open("job.json") as f:
        job = json.load(f)
    chk = _CHECKER = _Checker(verdict_fd, job.get("max_message", MAX_MESSAGE))
    hello = chk.recv()
    if "load_error" in hello:
        chk.finish({"error": "program failed to load: " + str(hello["load_error"])[:300], "calls": 0})
    if hello != {"ready": True}:
        chk.fatal("protocol: no ready message")
    ns = {"__name__": "solution", "__builtins__": builtins}
    if job["imports"]:
        exec(compile(IMPORTS, "imports.py", "exec"), ns)
    exec(compile(HELPERS, "helpers.py", "exec"), ns)
    exec(compile(job["prefix"], "prefix.py", "exec"), ns)
    for name in job["byvalue"]:
        if isinstance(ns.get(name), type):
            chk.byvalue[name] = ns[name]
    try:
        chk.request({"op": "setup", "byvalue": sorted(chk.byvalue)})
    except Exception as e:  # noqa: BLE001 - the program's process refused the setup:
        # nothing it says can be trusted to mean more
        chk.fatal(f"protocol: setup refused: {e!r}"[:300])
    # the names the tests take from the program: their entry points, nothing else
    for name in job["entry_points"]:
        try:
            ns[name] = chk.request({"op": "global", "name": name})
        except Exception:  # noqa: BLE001 - not provided by the program: a test that needs it fails on a NameError
            ns.pop(name, None)
    results = []
    for i, code in enumerate(job["cases"]):
        try:
            exec(compile(code, f"test_{i}.py", "exec"), ns)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the test failed: this is the verdict
            results.append({"ok": False, "error": repr(e)[:300]})
            break
        results.append({"ok": True})
    chk.finish({"results": results, "calls": chk.calls})


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "checker":
        checker_main()
    elif role == "candidate":
        candidate_main()
    elif role == "functional":
        functional_main()
    elif role == "repl":
        repl_main()
    else:
        sys.exit(f"unknown role {role!r}")
