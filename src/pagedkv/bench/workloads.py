"""Seeded prefix-heavy workloads: chat, agent, agent-reasoning, shared-prefix, restart.

A workload is a fixed sequence of steps. Each step names a session (a
conversation) and the messages appended to that session's history before the
request is sent. The assistant's answers are not part of the workload: the
runner appends the answer the model really gave, so a conversation is
generated online and its prompts are whatever the chat template makes of the
real history. Everything here is a pure function of (name, size, seed); text
comes from a built-in word list, so nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

Message = dict[str, str]

SIZES = ("tiny", "quick", "full")


@dataclass(frozen=True, slots=True)
class Step:
    """One request: append `messages` to session `session`'s history, then generate.

    `turn` counts the steps of that session from 0.
    """

    session: int
    turn: int
    messages: tuple[Message, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Workload:
    """Steps in the order they are sent.

    `restart_at`: steps from this index on are served by a new engine over the
    same SSD directory with an empty RAM tier (the restart workload); only those
    steps are measured. `ram_cache_tokens`: the RAM tier, in tokens of KV, that
    the runner uses when the user gives no `--ram-cache`, chosen so that the
    interleaved sessions do not all fit and eviction matters; None = the default.
    """

    name: str
    size: str
    seed: int
    steps: tuple[Step, ...]
    description: str
    restart_at: int | None = None
    ram_cache_tokens: int | None = None
    # The chat template the runner serves the model under (None: the model's own), and
    # whether the ideal also holds each turn in the next request's form (a template
    # that strips reasoning re-renders earlier turns; see `bench.ideal`).
    chat_template: str | None = None
    ideal_next_form: bool = False

    @property
    def measured_steps(self) -> range:
        return range(self.restart_at or 0, len(self.steps))

    @property
    def num_sessions(self) -> int:
        return len({s.session for s in self.steps})


@dataclass(frozen=True, slots=True)
class Shape:
    sessions: int
    turns: int
    prefix_words: int  # shared system prompt, tool definitions or document
    message_words: tuple[int, int]  # min, max words of each new message
    max_tokens: int
    restart_after: int = 0  # restart: turns of every session served before the restart
    ram_cache_tokens: int | None = None


# Sized for the bundled model on CPU (~350 tokens/s cold prefill on 2 cores): a
# quick workload prefills a few thousand prompt tokens cold, so that both passes
# finish in well under 3 minutes; tiny is for tests on random tiny models.
# fmt: off
SHAPES: dict[str, dict[str, Shape]] = {
    # sessions, turns, prefix words, words per message, max_tokens, ...
    "chat": {
        "tiny": Shape(2, 3, 12, (4, 10), 6),
        "quick": Shape(4, 4, 500, (15, 30), 16),
        "full": Shape(12, 8, 600, (40, 100), 48, ram_cache_tokens=8192),
    },
    "agent": {
        "tiny": Shape(2, 3, 40, (6, 12), 6),
        "quick": Shape(2, 4, 150, (30, 50), 16),
        "full": Shape(4, 10, 600, (60, 150), 48),
    },
    # steps per session: a task, then TOOL_STEPS tool results, then the next task...
    "agent-reasoning": {
        "tiny": Shape(2, 6, 40, (6, 12), 6),
        "quick": Shape(2, 8, 150, (20, 40), 24),
        "full": Shape(4, 12, 600, (60, 150), 48),
    },
    "shared-prefix": {
        "tiny": Shape(3, 1, 60, (4, 10), 6),
        "quick": Shape(5, 1, 600, (10, 25), 16),
        "full": Shape(24, 1, 2400, (10, 30), 48),
    },
    "restart": {
        "tiny": Shape(2, 3, 12, (4, 10), 6, restart_after=1),
        "quick": Shape(3, 4, 500, (15, 30), 16, restart_after=2),
        "full": Shape(8, 6, 600, (40, 100), 48, restart_after=3),
    },
}
# fmt: on

WORKLOADS = tuple(SHAPES)
# What `pagedkv bench` runs when no --workload is given: agent-reasoning serves the model
# under a template of ours and is asked for by name.
DEFAULT_WORKLOADS = tuple(w for w in WORKLOADS if w != "agent-reasoning")

_WORD_TEXT = """
the of and to in is that for it as with was on be by at this from have or an are not
but had they which one you were all we her she there would their will when who him
been has more if no out so said what up its about into than them can only other new
some could time these two may then do first any my now such like our over man me
even most made after also did many before must through back years where much your
way well down should because each just those people how too little state good very
make world still own see men work long get here between both life being under never
day same another know while last might us great old year off come since against go
came right used take three small large system water river stone bridge garden market
number light window paper engine signal cache memory block token prefix model graph
vector matrix server client request answer question report budget plan schedule city
north south east west morning evening winter summer music letter story history
science energy power field forest mountain island harbor station train ticket coffee
bread kitchen table chair doctor teacher student office project design release
version update network packet socket thread process queue worker storage disk file
folder record index value price order customer invoice payment account balance
weather cloud rain wind storm temperature sensor device battery screen keyboard
"""
_WORDS = tuple(_WORD_TEXT.split())

_TOOL_VERBS = ("search", "get", "create", "update", "delete", "list", "fetch", "send", "compute")
_TOOL_NOUNS = (
    "weather",
    "file",
    "invoice",
    "order",
    "account",
    "ticket",
    "email",
    "report",
    "user",
)


def _sentence(rng: random.Random, n: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(max(1, n))]
    return " ".join(words).capitalize() + "."


def _text(rng: random.Random, n_words: int) -> str:
    """About `n_words` words in sentences of 6 to 14 words."""
    out: list[str] = []
    left = n_words
    while left > 0:
        n = min(left, rng.randint(6, 14))
        out.append(_sentence(rng, n))
        left -= n
    return " ".join(out)


def _words_between(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(*bounds)


def _interleave(rng: random.Random, turns: dict[int, range]) -> list[tuple[int, int]]:
    """(session, turn) pairs in a random order that keeps each session's turns in order."""
    nxt = {s: r.start for s, r in turns.items()}
    order: list[tuple[int, int]] = []
    while True:
        open_ = [s for s in sorted(nxt) if nxt[s] < turns[s].stop]
        if not open_:
            return order
        s = rng.choice(open_)
        order.append((s, nxt[s]))
        nxt[s] += 1


def _chat_steps(rng: random.Random, shape: Shape, restart_after: int) -> list[Step]:
    system = {
        "role": "system",
        "content": "You are a helpful assistant. " + _text(rng, shape.prefix_words),
    }
    phases = (
        [range(0, restart_after), range(restart_after, shape.turns)]
        if restart_after
        else [range(0, shape.turns)]
    )
    steps: list[Step] = []
    for turns in phases:
        for session, turn in _interleave(rng, dict.fromkeys(range(shape.sessions), turns)):
            user = {
                "role": "user",
                "content": _text(rng, _words_between(rng, shape.message_words)) + " Why?",
            }
            messages = (system, user) if turn == 0 else (user,)
            steps.append(Step(session, turn, messages, shape.max_tokens))
    return steps


def _tool_definitions(rng: random.Random, n_words: int) -> str:
    tools: list[str] = []
    used = 0
    i = 0
    while used < n_words:
        nv, nn = len(_TOOL_VERBS), len(_TOOL_NOUNS)
        name = f"{_TOOL_VERBS[i % nv]}_{_TOOL_NOUNS[(i // nv + i) % nn]}"  # unique for i < 81
        desc = _text(rng, rng.randint(10, 24))
        params = {
            rng.choice(_WORDS) + f"_{j}": {
                "type": rng.choice(["string", "integer"]),
                "description": _sentence(rng, rng.randint(4, 9)),
            }
            for j in range(rng.randint(1, 3))
        }
        spec = {
            "name": name,
            "description": desc,
            "parameters": {"type": "object", "properties": params, "required": list(params)},
        }
        tools.append(json.dumps(spec))
        used += len(json.dumps(spec).split())
        i += 1
    return "\n".join(tools)


def _agent_steps(rng: random.Random, shape: Shape) -> list[Step]:
    system = {
        "role": "system",
        "content": (
            "You are an agent that solves tasks with tools. To call a tool, answer with one JSON "
            'object {"tool": NAME, "arguments": {...}} and nothing else. Available tools:\n'
            + _tool_definitions(rng, shape.prefix_words)
        ),
    }
    steps: list[Step] = []
    for session, turn in _interleave(rng, dict.fromkeys(range(shape.sessions), range(shape.turns))):
        if turn == 0:
            task = {"role": "user", "content": "Task: " + _text(rng, rng.randint(15, 30))}
            steps.append(Step(session, turn, (system, task), shape.max_tokens))
            continue
        fields = {rng.choice(_WORDS): _text(rng, rng.randint(3, 8)) for _ in range(3)}
        fields["status"] = rng.choice(["ok", "partial", "error"])
        fields["rows"] = str(rng.randint(0, 500))
        body = json.dumps(fields) + "\n" + _text(rng, _words_between(rng, shape.message_words))
        name = f"{rng.choice(_TOOL_VERBS)}_{rng.choice(_TOOL_NOUNS)}"
        # A user message, not role "tool": every chat template accepts it.
        result = {"role": "user", "content": f"Tool result from {name}:\n{body}"}
        steps.append(Step(session, turn, (result,), shape.max_tokens))
    return steps


TOOL_STEPS = 2  # agent-reasoning: tool results between two tasks of a session


def _agent_reasoning_steps(rng: random.Random, shape: Shape) -> list[Step]:
    """A reasoning agent: each task (a user message) is followed by TOOL_STEPS tool
    results (role "tool"); the template keeps the reasoning of the current task's turns
    and strips it from earlier tasks' turns once the next task arrives."""
    system = {
        "role": "system",
        "content": (
            "You are an agent that reasons, then solves tasks with tools. Think inside "
            "<think></think>, then call one tool as JSON. Available tools:\n"
            + _tool_definitions(rng, shape.prefix_words)
        ),
    }
    steps: list[Step] = []
    for session, turn in _interleave(rng, dict.fromkeys(range(shape.sessions), range(shape.turns))):
        if turn % (TOOL_STEPS + 1) == 0:
            task = {"role": "user", "content": "Task: " + _text(rng, rng.randint(15, 30))}
            messages = (system, task) if turn == 0 else (task,)
            steps.append(Step(session, turn, messages, shape.max_tokens))
            continue
        fields = {rng.choice(_WORDS): _text(rng, rng.randint(3, 8)) for _ in range(3)}
        body = json.dumps(fields) + "\n" + _text(rng, _words_between(rng, shape.message_words))
        result = {"role": "tool", "content": body, "tool_call_id": f"call_{turn}"}
        steps.append(Step(session, turn, (result,), shape.max_tokens))
    return steps


def _shared_prefix_steps(rng: random.Random, shape: Shape) -> list[Step]:
    document = _text(rng, shape.prefix_words)
    system = {
        "role": "system",
        "content": (
            "Answer the question about the document below in one short paragraph.\n\n"
            f"Document:\n{document}"
        ),
    }
    steps: list[Step] = []
    for session in range(shape.sessions):
        question = _sentence(rng, _words_between(rng, shape.message_words)).rstrip(".") + "?"
        steps.append(
            Step(session, 0, (system, {"role": "user", "content": question}), shape.max_tokens)
        )
    return steps


def build_workload(name: str, size: str = "quick", seed: int = 0) -> Workload:
    """The workload `name` (one of `WORKLOADS`) at `size` ("tiny", "quick", "full");
    equal arguments give equal workloads."""
    if name not in SHAPES:
        raise ValueError(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: choose one of {', '.join(SIZES)}")
    shape = SHAPES[name][size]
    rng = random.Random(f"pagedkv-bench:{name}:{size}:{seed}")
    restart_at: int | None = None
    if name == "chat":
        steps = _chat_steps(rng, shape, 0)
        desc = (
            f"{shape.sessions} conversations x {shape.turns} turns, interleaved at random; "
            "each turn = history + real previous answer + a new user message"
        )
    elif name == "restart":
        steps = _chat_steps(rng, shape, shape.restart_after)
        restart_at = shape.sessions * shape.restart_after
        desc = (
            f"chat, {shape.sessions} conversations: {shape.restart_after} turns each, then a "
            f"new engine over the same SSD directory (empty RAM) serves the other "
            f"{shape.turns - shape.restart_after}; those are measured"
        )
    elif name == "agent":
        steps = _agent_steps(rng, shape)
        desc = (
            f"{shape.sessions} sessions x {shape.turns} steps over one ~{shape.prefix_words}-"
            "word system prompt of tool definitions; each step appends the real answer and "
            "a tool result"
        )
    elif name == "agent-reasoning":
        from pagedkv.bench.reasoning_template import REASONING_CHAT_TEMPLATE

        steps = _agent_reasoning_steps(rng, shape)
        desc = (
            f"{shape.sessions} reasoning-agent sessions x {shape.turns} steps (a task, then "
            f"{TOOL_STEPS} tool results) under a template that strips earlier tasks' "
            "reasoning, Qwen3-style; the ideal holds each turn in the next request's form"
        )
        return Workload(
            name, size, seed, tuple(steps), desc, None, shape.ram_cache_tokens,
            chat_template=REASONING_CHAT_TEMPLATE, ideal_next_form=True,
        )  # fmt: skip
    else:
        steps = _shared_prefix_steps(rng, shape)
        desc = f"{shape.sessions} different questions over one ~{shape.prefix_words}-word document"
    return Workload(name, size, seed, tuple(steps), desc, restart_at, shape.ram_cache_tokens)
