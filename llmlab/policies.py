"""Scheduling policies: every decision the scheduler leaves open, as the methods of one object.

`llmlab/scheduler.py` plans each step in four phases (decodes, running prefills, swapped,
waiting) and asks its `SchedulingPolicy` at every choice:

  key(request, now)                  the order of the queues, smaller = more important: who
                                     is admitted and comes back from swap first, who is
                                     preempted last (default: arrival time, FCFS)
  admit(request, now) -> bool        admission control: may this waiting request start now?
                                     False defers it to a later step, and the requests behind
                                     it are asked in turn; True lets it in if the budget, a
                                     slot and blocks allow (a recomputed victim waits here
                                     too; it may be asked twice in a step) (default: True)
  prefill_budget(num_decode_tokens, token_budget, now) -> int
                                     tokens for prompt chunks (and requests swapped back in)
                                     this step, beside its decodes (default: all that is left,
                                     token_budget - num_decode_tokens: SARATHI §4)
  preempt_victim(running, now)       the running request to preempt when KV blocks run out;
                                     `running` is ordered by key, most important first
                                     (default: running[-1], the least important)
  preempts_on_arrival(request, now) -> bool
                                     may a waiting request that finds no free slot or blocks
                                     preempt a running one? It does only if it outranks the
                                     victim (a smaller key): else the two could take turns
                                     preempting each other forever (default: False). That
                                     holds for a key that stays put while they wait; a key
                                     that moves with `now` or with the tokens served can
                                     still make requests take turns (measure preemptions)
  on_step(outcome, now)              sees every step's StepOutcome (llmlab/plan.py: requests
                                     that got a token, finished, blocks freed) for a policy
                                     that adapts; it observes, it plans nothing (default: nothing)

What the scheduler is carrying is `self.view` (a SchedulerView, set at the start of every step):
`num_running`, `num_waiting`, `num_swapped`, `num_free_blocks`, `num_device_blocks`,
`token_budget`, `max_num_seqs`, and copies of the `running` and `waiting` queues, so that a
decision can depend on the load ("defer long prompts while more than 8 run or blocks are
short") in an engine, a server and `simulate()` alike.

`now` is seconds since the experiment started, on one clock for the engine, the simulator
and the server, and `request.arrival_time` is on the same clock: in `run()` both count from
the workload's t = 0 on the wall clock, in `simulate()` both are the simulated time, and an
engine or a server counts from when its engine was built (`Scheduler.now()`). So a policy
that ages requests (`now - request.arrival_time`) decides the same in all of them.

A hook that raises, or returns what it may not (admit or preempts_on_arrival anything but
a bool, prefill_budget anything but an int, a key whose values do not compare, a victim not
in `running`), is a PolicyError naming the policy and the hook. `running` is a copy: editing
it changes nothing. When on_step raises, the step's bookkeeping is done first: its finished
requests are finished, and the error carries the step's outputs (`PolicyError.outputs`).

The scheduler keeps two rules whatever the policy says, so that no policy can stall an
engine: `admit` is asked only while some request runs (with nothing running a deferral would
only leave the device idle), and a step with no decode gets the whole budget left when
`prefill_budget` gives less than one token. The budget never exceeds what the decodes left.

The built-ins, by name (POLICIES; each also a class here):

  fcfs                    arrival order (vLLM's default; Orca's iteration-level FCFS)
  shortest_prompt_first   fewest prompt tokens first: short prompts stop queueing behind
                          long prefills, at the price of the long ones' tail latency
  shortest_output_first   fewest output tokens first: shortest-job-first with an oracle
                          that knows output lengths (the best a length predictor could do)
  priority                the workload's `priority` field (lower = more important), then
                          arrival: under memory pressure the least important running request
                          is preempted first, and a newcomer that outranks a running request
                          preempts it when no slot or blocks are free (vLLM's priority
                          scheduling). On a server, a request's `priority` field (vLLM's).

Writing one: subclass SchedulingPolicy and override what you decide; the rest stays FCFS.

    from llmlab.policies import SchedulingPolicy

    class Paced(SchedulingPolicy):
        # at most `chunk` prompt tokens a step (a steadier time between tokens), and a prompt
        # longer than `long` waits up to `hold` seconds while the short ones go first
        def __init__(self, chunk=64, long=256, hold=2.0):
            self.chunk, self.long, self.hold = chunk, long, hold

        def prefill_budget(self, num_decode_tokens, token_budget, now):
            return min(self.chunk, token_budget - num_decode_tokens)

        def admit(self, request, now):
            return len(request.prompt_token_ids) <= self.long or now - request.arrival_time >= self.hold

A plain key function of a Request (smaller = more important) still works: it is wrapped as
a policy whose `key` ignores `now`. Wherever a policy is taken, `resolve_policy` accepts a
name above, a SchedulingPolicy (or its class), a key function, or "module:Name" (Name in an
importable module, or "path/to/file.py:Name"):
`Scheduler(..., policy=)`, `LLMEngine(config, policy=)`, `experiments.run(workload, engine,
policy=)`, `experiments.simulate(..., policy=)`, `LLM(policy=)`, `llmlab serve --policy module:Name`,
`llmlab bench simulate --policy module:Name` and `llmlab bench calibrate --policy` (both runs
and the simulation it checks the cost model with). A policy object keeps its state between runs:
give each run a new one if it adapts.
"""
from __future__ import annotations

import importlib
import importlib.util
import numbers
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from llmlab.request import Request

if TYPE_CHECKING:   # only annotations: the scheduler's layer does not import experiments
    from llmlab.experiments.workload import Workload
    from llmlab.plan import StepOutcome

POLICIES = ("fcfs", "shortest_prompt_first", "shortest_output_first", "priority")


class SchedulingPolicy:
    """The scheduler's decisions (module docstring); each default is FCFS as llmlab always did."""

    @property
    def name(self) -> str:
        """How results and traces name the policy: the class's name unless it says otherwise."""
        return type(self).__name__

    # read like a key function's name (run() records it; notebooks check engine.scheduler.policy.__name__)
    __name__ = property(lambda self: self.name)

    view: SchedulerView | None = None   # the load (SchedulerView), set by the scheduler every step

    def key(self, request: Request, now: float):
        return request.arrival_time

    def admit(self, request: Request, now: float) -> bool:
        return True

    def prefill_budget(self, num_decode_tokens: int, token_budget: int, now: float) -> int:
        return token_budget - num_decode_tokens

    def preempt_victim(self, running: list[Request], now: float) -> Request:
        return running[-1]

    def preempts_on_arrival(self, request: Request, now: float) -> bool:
        return False

    def on_step(self, outcome: StepOutcome, now: float) -> None:
        pass


class SchedulerView:
    """What a policy may read of the scheduler that asks it, live and read-only: the load behind
    a decision (`policy.view`, set by the scheduler at the start of every step; None before the
    first). The same in an engine, a server and `simulate()`."""

    def __init__(self, scheduler):
        self._scheduler = scheduler

    num_running = property(lambda self: len(self._scheduler.running))
    num_waiting = property(lambda self: len(self._scheduler.waiting))
    num_swapped = property(lambda self: len(self._scheduler.swapped))
    num_free_blocks = property(lambda self: self._scheduler.blocks.num_free_blocks)      # evictable ones count
    num_device_blocks = property(lambda self: self._scheduler.blocks.num_device_blocks)
    block_size = property(lambda self: self._scheduler.config.block_size)
    token_budget = property(lambda self: self._scheduler.token_budget)                   # tokens a step
    max_num_seqs = property(lambda self: self._scheduler.config.max_num_seqs)
    running = property(lambda self: tuple(self._scheduler.running))    # copies: a policy changes no queue
    waiting = property(lambda self: tuple(self._scheduler.waiting))


class FCFS(SchedulingPolicy):
    """First come, first served: the base class's decisions, unchanged."""
    name = "fcfs"


class ShortestPromptFirst(SchedulingPolicy):
    name = "shortest_prompt_first"

    def key(self, request, now):
        return (len(request.prompt_token_ids), request.arrival_time)


class ShortestOutputFirst(SchedulingPolicy):
    name = "shortest_output_first"

    def key(self, request, now):
        return (request.params.max_tokens, request.arrival_time)


class Priority(SchedulingPolicy):
    """`priorities`: request id -> priority (lower = more important); a request not listed has
    its own, `request.params.priority` (SamplingParams; a server request's `priority` field;
    default 0)."""
    name = "priority"

    def __init__(self, priorities: dict[str, int] | None = None):
        self.priorities = dict(priorities or {})

    def key(self, request, now):
        return (self.priorities.get(request.request_id, request.params.priority), request.arrival_time)

    def preempts_on_arrival(self, request, now):
        return True


class KeyFunction(SchedulingPolicy):
    """A plain key function of a Request as a policy: FCFS's decisions in its order."""

    def __init__(self, function):
        self.function = function

    @property
    def name(self) -> str:
        return getattr(self.function, "__name__", type(self.function).__name__)

    def key(self, request, now):
        return self.function(request)


# the stateless built-ins as objects: LLMEngine(config, policy=llmlab.policies.shortest_prompt_first)
fcfs = FCFS()
shortest_prompt_first = ShortestPromptFirst()
shortest_output_first = ShortestOutputFirst()


class PolicyError(RuntimeError):
    """A policy's hook raised, or returned what it may not: the message names the policy and
    the hook (a researcher's bug, not the engine's). `outputs`: what the step that failed had
    finished (its bookkeeping is done: nothing is lost but the return value)."""
    outputs: list = []


# what a hook must return, where a wrong type would otherwise go unnoticed (admit returning
# None defers everything) or fail far from the policy (a float budget in the block manager)
_RETURNS = {
    "admit": (lambda v: isinstance(v, bool) or type(v).__name__ == "bool_", "True or False"),
    "preempts_on_arrival": (lambda v: isinstance(v, bool) or type(v).__name__ == "bool_", "True or False"),
    "prefill_budget": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an int"),
}
_ARGS = {"key": "(request, now)", "admit": "(request, now)", "preempts_on_arrival": "(request, now)",
         "prefill_budget": "(num_decode_tokens, token_budget, now)", "preempt_victim": "(running, now)",
         "on_step": "(outcome, now)"}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def ask(policy: SchedulingPolicy, hook: str, *args):
    """policy.<hook>(*args), with a PolicyError naming the policy and the hook when it raises or
    returns what the hook may not (the scheduler asks every hook through this)."""
    try:
        value = getattr(policy, hook)(*args)
    except PolicyError:
        raise
    except Exception as err:   # noqa: BLE001 -- a policy's own bug: say whose
        raise PolicyError(f"policy {policy.name!r}: {hook}{_ARGS[hook]} raised {type(err).__name__}: {err}") from err
    check = _RETURNS.get(hook)
    if check is not None and not check[0](value):
        raise PolicyError(f"policy {policy.name!r}: {hook}{_ARGS[hook]} returned {_short(value)}; it must return "
                          f"{check[1]}")
    return value


def observe(policy: SchedulingPolicy, outcome: StepOutcome, now: float) -> PolicyError | None:
    """policy.on_step(outcome, now); its PolicyError returned, not raised: the step's bookkeeping
    goes on, and whoever finishes the step raises it (StepOutcome.checked), so nothing is lost."""
    try:
        ask(policy, "on_step", outcome, now)
    except PolicyError as err:
        return err
    return None


def sort_by_policy(policy: SchedulingPolicy, queue: list[Request], now: float) -> None:
    """Sort `queue` in place by the policy's key at `now` (smaller = more important); a key
    that raises, or whose values do not compare, is a PolicyError naming the policy. (The key
    is called directly, not through `ask`: this runs every step over every running request.)"""
    key = policy.key
    try:
        queue.sort(key=lambda request: key(request, now))
    except Exception as err:   # noqa: BLE001 -- the key's own error, or its values' comparison
        if isinstance(err, TypeError) and "not supported between" in str(err):
            raise PolicyError(f"policy {policy.name!r}: key(request, now) returned values that do not compare with "
                              f"each other ({err}); return numbers, or tuples of them") from err
        raise PolicyError(f"policy {policy.name!r}: key(request, now) raised {type(err).__name__}: {err}") from err


def resolve_policy(policy, workload: Workload | None = None) -> SchedulingPolicy:
    """The SchedulingPolicy for `policy`: a name in POLICIES ("priority" reads the workload's
    priorities), a SchedulingPolicy or its class, "module:Name", or a key function."""
    if isinstance(policy, SchedulingPolicy):
        return policy
    if isinstance(policy, type) and issubclass(policy, SchedulingPolicy):
        try:
            return policy()
        except TypeError as err:
            raise ValueError(f"policy class {policy.__name__} cannot be made without arguments ({err}): pass an "
                             f"instance (module:name of an object made at import works too)") from None
    if isinstance(policy, type):
        raise ValueError(f"policy class {policy.__name__} is not a SchedulingPolicy: subclass "
                         f"llmlab.policies.SchedulingPolicy (or pass a key function of a Request)")
    if callable(policy):
        return KeyFunction(policy)
    if isinstance(policy, str) and ":" in policy:
        return resolve_policy(load_policy(policy), workload)
    if policy == "priority":
        return Priority({r.request_id: r.priority for r in workload} if workload is not None else None)
    builtins = {"fcfs": FCFS, "shortest_prompt_first": ShortestPromptFirst, "shortest_output_first": ShortestOutputFirst}
    if policy in builtins:
        return builtins[policy]()
    raise ValueError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}, a SchedulingPolicy, "
                     f"'module:Name' or a key function of a Request")


def load_policy(spec: str):
    """What "module:Name" names: Name in an importable module, or in a file ("dir/file.py:Name")."""
    module_name, _, attribute = spec.rpartition(":")   # (a Windows path has a colon of its own)
    if not module_name or not attribute:
        raise ValueError(f"policy {spec!r}: write module:Name (or path/to/file.py:Name)")
    if module_name.endswith(".py"):
        module = _module_from_file(Path(module_name), spec)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name.split(".")[0] and err.name != module_name:
                raise      # the module was found, and itself imports something missing
            raise ValueError(f"policy {spec!r}: no module {module_name!r} on the Python path "
                             f"(set PYTHONPATH, or give the file: path/to/{module_name.split('.')[-1]}.py:{attribute})") from None
    if not hasattr(module, attribute):
        raise ValueError(f"policy {spec!r}: {module_name} has no {attribute!r}")
    found = getattr(module, attribute)
    if not (isinstance(found, SchedulingPolicy) or callable(found)):
        raise ValueError(f"policy {spec!r} is a {type(found).__name__}, not a SchedulingPolicy or a key function")
    return found


def _module_from_file(path: Path, spec: str):
    """The module of a .py file: the one already imported from it if there is one (its classes
    are then the ones its importer has), else the file run once under a name of its own."""
    if not path.is_file():
        raise ValueError(f"policy {spec!r}: no file {path}")
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) and Path(module.__file__).resolve() == path.resolve():
            return module
    name = f"llmlab_policy_file_{path.stem}"   # not the stem: a file named json.py must not replace json
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module    # registered before it runs, as an import would be (dataclasses look it up)
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]     # a fixed file loads afresh next time
        raise
    return module
