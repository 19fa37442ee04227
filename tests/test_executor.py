"""The executor contract (`portside.executor`): every executor is an `Executor` that implements
the abstract methods, the base's defaults behave as documented, and the engine and the server
know only the base. The executors themselves run in the engine tests (test_tensor_parallel,
test_pipeline_parallel, test_data_parallel, test_ray_executor and every single-rank test)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import portside.executor
from portside.executor import Executor
from portside.executor.launched import LaunchedExecutor
from portside.executor.multiproc import MultiprocExecutor
from portside.executor.ray import RayExecutor
from portside.executor.uniproc import UniProcExecutor
from portside.executor.workers import WORKER_TIMEOUT_S, WorkerExecutor, no_reply, protocol_error
from portside.sched.output import ModelRunnerOutput, SchedulerOutput

ROOT = Path(__file__).resolve().parents[1]
CONCRETE = {UniProcExecutor, MultiprocExecutor, RayExecutor, LaunchedExecutor}


def _package_classes() -> set[type]:
    """Every class defined in a module of portside.executor."""
    found = set()
    for info in pkgutil.iter_modules(portside.executor.__path__, "portside.executor."):
        module = importlib.import_module(info.name)
        found |= {c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == info.name}
    return found


def test_every_executor_implements_the_base():
    executors = {c for c in _package_classes() if c.__name__.endswith("Executor")}
    assert executors == CONCRETE | {Executor, WorkerExecutor}, "a new executor belongs in CONCRETE"
    for cls in CONCRETE:
        assert issubclass(cls, Executor), cls
        assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} abstract"
    assert Executor.__abstractmethods__ == {"determine_num_blocks", "initialize_kv_cache", "execute_model", "shutdown"}
    assert WorkerExecutor.__abstractmethods__ == {"initialize_kv_cache", "submit", "_stop_ranks"}
    # every method of the contract is documented
    for name, member in vars(Executor).items():
        if not name.startswith("_") and callable(getattr(member, "fget", member)):
            assert inspect.getdoc(member), f"Executor.{name} has no docstring"


class _Counting(Executor):
    """An executor that answers with a fixed output and counts its steps."""

    def __init__(self) -> None:
        self.vocab_size, self.weight_bytes, self.steps, self.closed = 32, 0, 0, False

    def determine_num_blocks(self) -> int:
        return 4

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        return ModelRunnerOutput(req_ids=["r"], sampled_token_ids={"r": [self.steps]})

    def shutdown(self) -> None:
        self.closed = True


def test_base_defaults():
    """`submit` runs the step at once (its call only hands the output over); one step in flight;
    nothing to check while idle; no local worker processes."""
    ex = _Counting()
    result = ex.submit(SchedulerOutput())
    assert ex.steps == 1
    assert result().sampled_token_ids == {"r": [1]} and result().sampled_token_ids == {"r": [1]}
    assert ex.steps == 1
    assert ex.max_concurrent_batches == 1 and ex.pids == []
    ex.check_health()
    with pytest.raises(TypeError, match="abstract"):
        type("Partial", (Executor,), {"shutdown": lambda self: None})()


def test_failure_messages():
    assert no_reply({3, 1}, "running a step") == (
        f"rank(s) [1, 3] gave no reply within {WORKER_TIMEOUT_S:.0f} s while running a step (raise "
        "PORTSIDE_WORKER_TIMEOUT if that is expected)")
    assert protocol_error(2, ModelRunnerOutput(req_ids=[], sampled_token_ids={}), "allocating its KV cache") == (
        "protocol error: rank 2 sent ModelRunnerOutput while allocating its KV cache")


def test_engine_knows_only_the_base():
    """The engine and the server import no executor module but the package (`Executor`,
    `make_executor`), and never ask which executor they hold."""
    bad = []
    for path in sorted((ROOT / "core" / "engine").glob("*.py")) + sorted((ROOT / "core" / "server").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("portside.executor"):
                if node.module != "portside.executor":
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "isinstance", "hasattr", "getattr", "type") and node.args:
                if "executor" in ast.unparse(node.args[0]):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "\n".join(bad)
