"""Tools a multi-turn rollout may call, and the worker processes that run them.

Two ways to declare a tool (``rollout.multi_turn``):

- ``tool_config_path``: veRL's tool-config YAML. Each entry names a class (``class_name``), its
  ``config`` and an OpenAI function schema (``tool_schema``). The class follows veRL's ``BaseTool``
  shape: ``cls(config, tool_schema)``, then ``create(instance_id, **create_kwargs)``,
  ``execute(instance_id, parameters) -> (response, reward, metrics)``, ``release(instance_id)``;
  the methods may be ``async`` (veRL's are). veRL's builtin class paths (``verl.tools.*``) resolve
  to kfrl's equivalents, since veRL itself is not installed.
- ``tools``: plain functions with type hints and a Google-style docstring (TRL's way); the schema is
  derived from the signature, and the function is called with the model's arguments.

A rollout sample gets its own instance of every tool (``create`` with the row's
``extra_info.tools_kwargs[name].create_kwargs``), released when its conversation ends.

Calls run in ``tool_workers`` worker interpreters (``python -m kfrl.agent.tools``), started with the pool: a tool that crashes the interpreter,
leaks memory or hangs cannot take the trainer with it. A call past ``tool_timeout_s`` kills its
worker (a fresh one replaces it and re-creates the instances it held); a call that raises, names an
unknown tool, passes arguments the tool rejects or returns something that cannot be shown to the
model comes back as an error text. Errors are counted, never fatal.
"""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

WORKER_START_TIMEOUT_S = 120.0

# veRL's builtin tools, by the class path a veRL tool config names, and kfrl's equivalent.
VERL_TOOL_CLASSES = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "kfrl.agent.builtin_tools:Gsm8kTool",
}


class ToolConfigError(ValueError):
    """A tool declaration that cannot be loaded: names the file or entry and what is wrong."""


@dataclass(frozen=True)
class ToolSpec:
    """How to build one tool in a worker: a class (veRL style) or a function (TRL style)."""
    name: str
    schema: dict                      # OpenAI function-tool schema: {"type": "function", "function": {...}}
    target: str                       # "module:attr" or "file.py:attr"
    kind: str                         # "class" or "function"
    config: dict = field(default_factory=dict)

    def as_json(self) -> str:
        return json.dumps({"name": self.name, "schema": self.schema, "target": self.target, "kind": self.kind,
                           "config": self.config}, sort_keys=True, default=str)


def import_target(target: str) -> Any:
    """The object a "package.module:attr", "package.module.attr" or "path/file.py:attr" names."""
    if ":" in target:
        module_name, _, attr = target.rpartition(":")
    else:
        module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise ToolConfigError(f"tool {target!r}: write it as 'package.module:name' or 'path/to/file.py:name'")
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise ToolConfigError(f"tool {target!r}: no file {path}")
        spec = importlib.util.spec_from_file_location(f"kfrl_user_tools_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ToolConfigError(f"tool {target!r}: cannot import {module_name} ({err})") from err
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ToolConfigError(f"tool {target!r}: {module_name} has no {attr!r}") from None


def function_schema(function) -> dict:
    """The OpenAI function schema of a typed, documented Python function (transformers' reading of
    type hints and a Google-style docstring, as TRL uses it)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as err:  # transformers raises its own DocstringParsingException / TypeHintParsingException
        raise ToolConfigError(f"tool function {getattr(function, '__qualname__', function)!r}: {err}. A tool function "
                              "needs type hints on every argument and a docstring with an Args: section") from err


def load_tool_specs(multi_turn) -> list[ToolSpec]:
    """The tools ``rollout.multi_turn`` declares (YAML file and functions), checked and named uniquely."""
    specs: list[ToolSpec] = []
    if multi_turn.tool_config_path:
        specs += specs_from_yaml(multi_turn.tool_config_path)
    for target in multi_turn.tools:
        function = import_target(target)
        if not callable(function):
            raise ToolConfigError(f"tool {target!r} is not callable")
        schema = function_schema(function)
        specs.append(ToolSpec(schema["function"]["name"], schema, target, "function"))
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ToolConfigError(f"two tools are named {', '.join(duplicates)}; tool names must be unique")
    if not specs:
        raise ToolConfigError("rollout.multi_turn.enable=true declares no tools: set rollout.multi_turn.tool_config_path "
                              "(veRL's tool YAML) or rollout.multi_turn.tools (Python functions)")
    return specs


def specs_from_yaml(path: str) -> list[ToolSpec]:
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise ToolConfigError(f"rollout.multi_turn.tool_config_path: no file {file}")
    document = yaml.safe_load(file.read_text()) or {}
    entries = document.get("tools") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ToolConfigError(f"{file}: expected a top-level 'tools:' list (veRL's tool-config format)")
    specs = []
    for index, entry in enumerate(entries):
        where = f"{file} tools[{index}]"
        if not isinstance(entry, dict) or "class_name" not in entry or "tool_schema" not in entry:
            raise ToolConfigError(f"{where}: each tool needs class_name and tool_schema")
        schema = entry["tool_schema"]
        name = (schema.get("function") or {}).get("name") if isinstance(schema, dict) else None
        if schema.get("type") != "function" or not name:
            raise ToolConfigError(f"{where}: tool_schema must be an OpenAI function schema "
                                  "({type: function, function: {name: ..., parameters: ...}})")
        class_name = str(entry["class_name"])
        config = dict(entry.get("config") or {})
        if config.get("type", "native") != "native":
            raise ToolConfigError(f"{where}: config.type={config['type']!r}; kfrl runs native tools only (no MCP)")
        specs.append(ToolSpec(name, schema, VERL_TOOL_CLASSES.get(class_name, class_name), "class", config))
    return specs


# --- inside a worker process -----------------------------------------------------------------------

def _run(value):
    return asyncio.run(value) if inspect.isawaitable(value) else value


def _response_text(response) -> str:
    """What the model reads back: a string, veRL's ToolResponse (.text) or a dict with "text", else JSON."""
    if response is None:
        return ""
    if isinstance(response, str):
        return response
    text = getattr(response, "text", None)
    if isinstance(response, dict):
        text = response.get("text")
    if isinstance(text, str):
        return text
    return json.dumps(response, default=str) if isinstance(response, (dict, list, int, float, bool)) else str(response)


class _WorkerTools:
    """The tools and per-sample instances one worker holds."""

    def __init__(self, specs: list[dict]):
        self.specs = {s["name"]: s for s in specs}
        self.objects: dict[str, Any] = {}
        self.instances: dict[tuple[str, str], bool] = {}

    def tool(self, name: str):
        if name not in self.objects:
            spec = self.specs[name]
            target = import_target(spec["target"])
            self.objects[name] = target(spec["config"], spec["schema"]) if spec["kind"] == "class" else target
        return self.objects[name]

    def call(self, name: str, instance_id: str, arguments: dict, create_kwargs: dict) -> tuple[str, float, dict]:
        spec, tool = self.specs[name], self.tool(name)
        if spec["kind"] == "function":
            return _response_text(tool(**arguments)), 0.0, {}
        if (name, instance_id) not in self.instances:
            _run(tool.create(instance_id, **create_kwargs))
            self.instances[(name, instance_id)] = True
        result = _run(tool.execute(instance_id, arguments))
        if isinstance(result, tuple):
            response, reward, metrics = (list(result) + [0.0, {}])[:3]
        else:
            response, reward, metrics = result, 0.0, {}
        return _response_text(response), float(reward or 0.0), dict(metrics or {})

    def release(self, instance_id: str) -> None:
        for name, held in list(self.instances):
            if held == instance_id:
                del self.instances[(name, held)]
                release = getattr(self.objects.get(name), "release", None)
                if release is not None:
                    _run(release(instance_id))


class _Duplex:
    """A reading and a writing pipe end as one connection."""

    def __init__(self, reader: Connection, writer: Connection):
        self.reader, self.writer = reader, writer

    def send(self, message) -> None:
        self.writer.send(message)

    def recv(self):
        return self.reader.recv()

    def poll(self, timeout: float) -> bool:
        return self.reader.poll(timeout)

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


def _worker_main(connection) -> None:
    tools = _WorkerTools(connection.recv())
    connection.send("ready")
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        op = message[0]
        if op == "stop":
            return
        if op == "release":
            try:
                tools.release(message[1])
            except Exception:  # a tool's release failing must not stop the worker
                pass
            continue
        _, name, instance_id, arguments, create_kwargs = message
        try:
            connection.send(("ok", *tools.call(name, instance_id, arguments, create_kwargs)))
        except Exception as err:
            connection.send(("error", f"{type(err).__name__}: {err}", traceback.format_exc(limit=3)))


# --- in the trainer ------------------------------------------------------------------------------

@dataclass
class ToolResult:
    text: str                 # what the model reads (an error message when ok is False)
    ok: bool
    seconds: float
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)
    error: str = ""           # "timeout", "exception", "unknown_tool", "bad_arguments", "crash"


class _Lane:
    """One worker process and the thread that talks to it (calls for an instance always use its lane)."""

    def __init__(self, pool: "ToolPool", index: int):
        self.pool, self.index = pool, index
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"kfrl-tool-{index}")
        self.process = None
        self.connection = None

    def start(self) -> None:
        """A fresh interpreter (``python -m kfrl.agent.tools``), not a fork of the trainer: no copy of its
        models, threads or CUDA state, and no re-run of the caller's main module (as ``spawn`` would)."""
        worker_reads, parent_writes = os.pipe()
        parent_reads, worker_writes = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kfrl.agent.tools", str(worker_reads), str(worker_writes)],
            pass_fds=(worker_reads, worker_writes), env=env, stdin=subprocess.DEVNULL)
        os.close(worker_reads)
        os.close(worker_writes)
        self.connection = _Duplex(Connection(parent_reads, writable=False), Connection(parent_writes, readable=False))
        self.connection.send([json.loads(s.as_json()) for s in self.pool.specs])
        if not self.connection.poll(WORKER_START_TIMEOUT_S) or self.connection.recv() != "ready":
            self.kill()
            raise RuntimeError(f"a tool worker did not start within {WORKER_START_TIMEOUT_S} s")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=5)
        if self.connection is not None:
            self.connection.close()
        self.process = self.connection = None

    def call(self, name: str, instance_id: str, arguments: dict, create_kwargs: dict) -> ToolResult:
        if not self.alive():
            self.kill()
            try:
                self.start()
            except Exception as err:  # noqa: BLE001 - a worker that cannot start is a tool error, not a dead run
                return ToolResult(f"Error: tool {name} could not start ({err})", False, 0.0, error="crash")
        started = time.perf_counter()
        self.connection.send(("call", name, instance_id, arguments, create_kwargs))
        if not self.connection.poll(self.pool.timeout_s):
            self.kill()  # the next call starts a fresh worker; it re-creates the instances it is asked for
            return ToolResult(f"Error: tool {name} did not answer within {self.pool.timeout_s:g} s", False,
                              time.perf_counter() - started, error="timeout")
        try:
            reply = self.connection.recv()
        except (EOFError, OSError):
            self.kill()
            return ToolResult(f"Error: tool {name} crashed", False, time.perf_counter() - started, error="crash")
        seconds = time.perf_counter() - started
        if reply[0] == "error":
            kind = "bad_arguments" if reply[1].startswith("TypeError") else "exception"
            return ToolResult(f"Error: {reply[1]}", False, seconds, error=kind)
        _, text, reward, metrics = reply
        return ToolResult(text, True, seconds, reward, metrics)

    def release(self, instance_id: str) -> None:
        if self.alive():
            try:
                self.connection.send(("release", instance_id))
            except (OSError, BrokenPipeError):
                self.kill()


class ToolPool:
    """Runs tool calls in worker processes; ``submit`` returns a Future of a ``ToolResult`` at once, so
    the caller keeps decoding while tools run."""

    def __init__(self, specs: list[ToolSpec], *, workers: int = 4, timeout_s: float = 30.0):
        self.specs = list(specs)
        self.by_name = {s.name: s for s in specs}
        self.timeout_s = timeout_s
        self.lanes = [_Lane(self, i) for i in range(workers)]
        for lane in self.lanes:  # started side by side, before the first call needs them
            lane.executor.submit(lane.start)

    @property
    def schemas(self) -> list[dict]:
        return [s.schema for s in self.specs]

    def _lane(self, instance_id: str) -> _Lane:
        return self.lanes[hash(instance_id) % len(self.lanes)]

    def submit(self, name: str, instance_id: str, arguments: Any, create_kwargs: dict | None = None) -> Future:
        if name not in self.by_name:
            future: Future = Future()
            future.set_result(ToolResult(f"Error: no tool named {name!r}; the tools are {', '.join(self.by_name)}",
                                         False, 0.0, error="unknown_tool"))
            return future
        if not isinstance(arguments, dict):
            future = Future()
            future.set_result(ToolResult(f"Error: the arguments of {name} must be a JSON object", False, 0.0,
                                         error="bad_arguments"))
            return future
        lane = self._lane(instance_id)
        return lane.executor.submit(lane.call, name, instance_id, arguments, dict(create_kwargs or {}))

    def release(self, instance_id: str) -> None:
        lane = self._lane(instance_id)
        lane.executor.submit(lane.release, instance_id)

    def close(self) -> None:
        for lane in self.lanes:
            lane.executor.shutdown(wait=True)
            if lane.connection is not None:
                try:
                    lane.connection.send(("stop",))
                except OSError:
                    pass
            lane.kill()


_POOLS: dict[str, ToolPool] = {}


def tool_pool(multi_turn) -> ToolPool:
    """The process's pool for these tool settings (kept across iterations: workers start and user tool
    files are imported once, not per rollout)."""
    key = json.dumps([multi_turn.model_dump(mode="json"), os.getcwd()], sort_keys=True)
    if key not in _POOLS:
        close_pools()
        _POOLS[key] = ToolPool(load_tool_specs(multi_turn), workers=multi_turn.tool_workers,
                               timeout_s=multi_turn.tool_timeout_s)
    return _POOLS[key]


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


if __name__ == "__main__":  # a tool worker: python -m kfrl.agent.tools <read fd> <write fd>
    _worker_main(_Duplex(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)))
